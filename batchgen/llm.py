"""The Python API: `LLM(model_dir).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from batchgen.engine.engine import Engine
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.sequence import Completion, Request, SamplingParams
from batchgen.job.model_spec import ModelSpec
from batchgen.model.loader import load_model
from batchgen.model.lora import merge_lora
from batchgen.quant import quantize_model


class LLM:
    """A model loaded and an engine over it."""

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        """model: a local save_pretrained directory (None: the embedded default model).
        options, resolved as `batchgen run` resolves its flags (ModelSpec.resolve, where
        their defaults are): dtype, device, compile, engine (an EngineConfig), allow_pickle,
        quantize, quant_backend, quant_group_size, lora."""
        self._load(ModelSpec.resolve(model, **options))

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> LLM:
        """Build from a spec already resolved (open_job's)."""
        llm = cls.__new__(cls)
        llm._load(spec)
        return llm

    def _load(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.tokenizer, self.device, self.dtype = spec.tokenizer, spec.device, spec.dtype
        self.compile, self.config = spec.compile, spec.engine
        # When quantizing, load on the host: the pass moves one block at a time to the
        # device and quantizes it there, so the device never holds the float model.
        load_device = torch.device("cpu") if spec.quant.enabled else spec.device
        self.model = load_model(
            spec.model_dir, spec.dtype, load_device, spec.allow_pickle, cfg=spec.model_cfg
        )
        # Merged before quantizing, into the float weights.
        self.lora = merge_lora(self.model, spec.lora) if spec.lora is not None else None
        self.quant = quantize_model(self.model, spec.quant, spec.device)
        self.runner = ModelRunner(
            self.model, block_size=spec.engine.block_size, compile=spec.compile
        )
        # Grammars are compiled (xgrammar imported) only when a constrained row comes.
        self.engine = Engine(self.runner, spec.engine, self.detokenize, spec.eos_ids, spec.grammars)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Generate for each prompt (text, or token ids); results in prompt order."""
        params = params or SamplingParams()
        per_row = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        requests = []
        for i, (p, sp) in enumerate(zip(prompts, per_row, strict=True)):
            ids = p if isinstance(p, list) else self.tokenizer(p)["input_ids"]
            requests.append(Request(i, list(ids), sp))
        return self._run(requests)

    def score(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        candidates: Sequence[str | list[int]] | Sequence[Sequence[str | list[int]]],
    ) -> list[Completion]:
        """log P(candidate | prompt) of each candidate continuation (text, tokenized
        without special tokens, or token ids), in `Completion.scores`; one candidate list
        for all prompts or one per prompt. Nothing is sampled."""
        per_row = [candidates] * len(prompts) if _is_candidate_list(candidates) else candidates
        requests = []
        for i, (p, cands) in enumerate(zip(prompts, per_row, strict=True)):
            ids = p if isinstance(p, list) else self.tokenizer(p)["input_ids"]
            conts = tuple(tuple(self._candidate_ids(c)) for c in cands)
            requests.append(Request(i, list(ids), candidates=conts))
        return self._run(requests)

    def _candidate_ids(self, c: str | list[int]) -> list[int]:
        return (
            c if isinstance(c, list) else self.tokenizer(c, add_special_tokens=False)["input_ids"]
        )

    def _run(self, requests: list[Request]) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        for report in self.engine.generate(requests):
            for c in report.finished:
                results[c.index] = c
        return results  # type: ignore[return-value]


def _is_candidate_list(x: Sequence) -> bool:
    """One list of candidates (texts or id lists), rather than one list per prompt?"""
    return all(
        isinstance(c, str) or (isinstance(c, list) and all(isinstance(t, int) for t in c))
        for c in x
    )
