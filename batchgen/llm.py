"""The Python API: `LLM(model_dir).generate(prompts, params)`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.constraints import Grammars
from batchgen.engine.engine import Engine
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.sequence import Completion, Request, SamplingParams
from batchgen.model.loader import load_model
from batchgen.model.lora import merge_lora
from batchgen.quant import make_scheme, quantize_model

DEFAULT_MODEL = Path(__file__).parent / "assets" / "default-model"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device} asked for, but torch sees no CUDA GPU; use --device cpu"
        )
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_compile(compile: bool | None, device: torch.device) -> bool:
    """None: compile on a GPU, run eager on the CPU. Measured (docs/benchmarks.md): on the
    CPU, inductor's graphs decode no faster than eager for the models we ran, and each
    shape costs 10-70 s to compile; on a GPU, compiled decode runs as CUDA graphs."""
    return device.type == "cuda" if compile is None else compile


def eos_token_ids(model_dir: Path, tokenizer) -> list[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    for name in ("generation_config.json", "config.json"):
        f = model_dir / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        compile: bool | None = None,
        engine: EngineConfig | None = None,
        allow_pickle: bool = False,
        quantize: str = "none",
        quant_backend: str = "auto",
        lora: str | Path | None = None,
        quant_group_size: int | None = None,
    ) -> None:
        self.model_dir = Path(model) if model is not None else DEFAULT_MODEL
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.compile = resolve_compile(compile, self.device)
        self.tokenizer = load_tokenizer(self.model_dir)
        # Resolved and checked before loading, so an unavailable combination fails fast.
        self.quant = make_scheme(
            quantize, quant_backend, self.device, self.dtype, group_size=quant_group_size
        )
        # When quantizing, load on the host: the pass moves one block at a time to the
        # device and quantizes it there, so the device never holds the float model.
        load_device = torch.device("cpu") if self.quant.enabled else self.device
        self.model = load_model(self.model_dir, self.dtype, load_device, allow_pickle=allow_pickle)
        self.lora = merge_lora(self.model, lora) if lora is not None else None  # before quantizing
        self.quant = quantize_model(self.model, self.quant, self.device)
        self.config = engine or EngineConfig.for_device(self.device.type)
        self.runner = ModelRunner(
            self.model, block_size=self.config.block_size, compile=self.compile
        )
        eos = eos_token_ids(self.model_dir, self.tokenizer)
        # Grammars are compiled (xgrammar imported) only when a constrained row comes.
        grammars = Grammars(self.tokenizer, self.model.cfg.vocab_size, eos)
        self.engine = Engine(self.runner, self.config, self.detokenize, eos, grammars)

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
        return c if isinstance(c, list) else self.tokenizer(c, add_special_tokens=False)["input_ids"]  # fmt: skip

    def _run(self, requests: list[Request]) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        for report in self.engine.generate(requests):
            for c in report.finished:
                results[c.index] = c
        return results  # type: ignore[return-value]


def _is_candidate_list(x: Sequence) -> bool:
    """One list of candidates (texts or id lists), rather than one list per prompt?"""
    return all(isinstance(c, str) or (isinstance(c, list) and all(isinstance(t, int) for t in c)) for c in x)  # fmt: skip
