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
from batchgen.model.tensor_parallel import TPShard
from batchgen.model.tp_layers import CollectiveClock
from batchgen.parallel.rank_model import RankSpec, load_rank_model
from batchgen.parallel.ranks import RankedRunner, Ranks
from batchgen.quant import weight_bytes


class LLM:
    """A model loaded and an engine over it."""

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        """model: a local save_pretrained directory (None: the embedded default model).
        options, resolved as `batchgen run` resolves its flags (ModelSpec.resolve, where
        their defaults are): dtype, device, compile, engine (an EngineConfig), allow_pickle,
        quantize, quant_backend, quant_group_size, lora, tensor_parallel_size (ranks to split
        the model over: processes started here, ended by `close()`)."""
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
        rank_spec = RankSpec.of(spec)
        n = spec.tensor_parallel_size
        self.ranks: Ranks | None = None
        clock = None
        if n > 1:  # start ranks 1..n-1; this process is rank 0
            if spec.device.type == "cpu":  # the cores, shared between the ranks
                torch.set_num_threads(max(1, torch.get_num_threads() // n))
                clock = CollectiveClock()  # gloo's collectives block: their time is measured
            self.ranks = Ranks(rank_spec, threads=torch.get_num_threads())
        try:
            tp = TPShard(0, n)
            part = load_rank_model(rank_spec, tp, self.ranks and self.ranks.group.data, clock)
            if self.ranks is not None:
                self.ranks.loaded()
        except BaseException:
            self.close()
            raise
        self.model, self.lora, self.quant = part.model, part.lora, part.quant
        block_size = spec.engine.block_size
        if self.ranks is not None:
            self.runner = RankedRunner(
                self.model, self.ranks, block_size=block_size, compile=spec.compile, clock=clock
            )
        else:
            self.runner = ModelRunner(self.model, block_size=block_size, compile=spec.compile)
        # Grammars are compiled (xgrammar imported) only when a constrained row comes.
        self.engine = Engine(self.runner, spec.engine, self.detokenize, spec.eos_ids, spec.grammars)

    @property
    def weights_bytes_per_rank(self) -> int:
        """Bytes of the parameters this process holds, at their stored precision."""
        return weight_bytes(self.model)

    def close(self) -> None:
        """End the other tensor-parallel ranks (nothing to do with one). An LLM is also a
        context manager that closes on exit."""
        if getattr(self, "ranks", None) is not None:
            self.ranks.close()
            self.ranks = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        self.engine.reserve(max((r.longest_tokens for r in requests), default=1))
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
