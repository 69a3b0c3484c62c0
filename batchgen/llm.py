"""The Python API: `LLM(model_dir).generate(prompts, SamplingParams(...))`, named as in vLLM.

`SamplingParams` (job/sampling.py) takes vLLM's names (max_tokens, n, stop as a string or a
list, logprobs, ...) beside batchgen's, and `generate`/`chat` return one `RequestOutput` per
prompt with its `n` completions in `.outputs`, as vLLM does. docs/coming-from-vllm.md lists
the names.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from batchgen.choices import ModelImpl
from batchgen.data.prompts import PromptBuilder
from batchgen.engine import sequence
from batchgen.engine.completions import error_completion
from batchgen.engine.engine import Engine
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.sequence import Completion, Request
from batchgen.errors import RowError
from batchgen.job.model_spec import ModelSpec
from batchgen.job.sampling import RequestOutput, SamplingParams, is_candidate_list, is_token_ids
from batchgen.model.host_malloc import release_freed_memory
from batchgen.model.tensor_parallel import TPShard
from batchgen.model.tp_layers import CollectiveClock
from batchgen.parallel.rank_model import RankSpec, load_hf_rank_model, load_rank_model
from batchgen.parallel.ranks import RankedRunner, Ranks
from batchgen.quant import weight_bytes

log = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or vLLM's {"prompt": ...} form
Message = dict[str, Any]  # {"role": ..., "content": ...}


class LLM:
    """A model loaded and an engine over it."""

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        """model: a local save_pretrained directory (None: the embedded default model).
        options, resolved as `batchgen run` resolves its flags (ModelSpec.resolve, where
        their defaults are): dtype, device, compile, engine (an EngineConfig), allow_pickle,
        quantize, quant_backend, quant_group_size, lora, tensor_parallel_size (ranks to split
        the model over: processes started here, ended by `close()`), model_impl (auto|native|
        transformers: batchgen's decoder or transformers' modeling code)."""
        self._load(ModelSpec.resolve(model, **options), resumable=False)

    @classmethod
    def from_spec(cls, spec: ModelSpec, resumable: bool = True) -> LLM:
        """Build from a spec already resolved (open_job's). resumable: a failed rank's
        advice is a job's (run the same command again), else the API's (a new LLM)."""
        llm = cls.__new__(cls)
        llm._load(spec, resumable)
        return llm

    def _load(self, spec: ModelSpec, resumable: bool) -> None:
        self.spec = spec
        self.tokenizer, self.device, self.dtype = spec.tokenizer, spec.device, spec.dtype
        self.compile, self.config = spec.compile, spec.engine
        rank_spec = RankSpec.of(spec)
        n = spec.tensor_parallel_size
        self.ranks: Ranks | None = None
        # What this LLM changed in the process, put back by close() (docs/architecture.md)
        self._threads_before: int | None = None
        self._holds_malloc_tuning = False
        clock = None
        if n > 1:  # start ranks 1..n-1; this process is rank 0
            if spec.device.type == "cpu":  # the cores, shared between the ranks
                self._threads_before = torch.get_num_threads()
                torch.set_num_threads(max(1, self._threads_before // n))
                clock = CollectiveClock()  # gloo's collectives block: their time is measured
            self.ranks = Ranks(rank_spec, threads=torch.get_num_threads(), resumable=resumable)
        try:
            tp = TPShard(0, n)
            if spec.model_cfg.impl is ModelImpl.TRANSFORMERS:  # one rank
                part = load_hf_rank_model(rank_spec)
            else:
                part = load_rank_model(rank_spec, tp, self.ranks and self.ranks.group.data, clock)
            self._holds_malloc_tuning = part.holds_malloc_tuning
            if self.ranks is not None:
                self.ranks.loaded()
        except BaseException:
            self.close()
            raise
        self.model, self.lora, self.quant = part.model, part.lora, part.quant
        block_size = spec.engine.block_size
        if self.ranks is not None:
            self.runner = RankedRunner(
                self.model,
                self.ranks,
                block_size=block_size,
                compile=spec.compile,
                clock=clock,
                compile_cache=rank_spec.compile_caches[0],
            )
        else:
            cache = spec.compile_cache_for(self.quant, self.lora) if spec.compile else None
            self.runner = ModelRunner(
                self.model, block_size=block_size, compile=spec.compile, compile_cache=cache
            )
        # Grammars are compiled (xgrammar imported) only when a constrained row comes.
        self.engine = Engine(self.runner, spec.engine, self.detokenize, spec.eos_ids, spec.grammars)

    @property
    def weights_bytes_per_rank(self) -> int:
        """Bytes of the parameters this process holds, at their stored precision."""
        return weight_bytes(self.model)

    def close(self) -> None:
        """End the other tensor-parallel ranks, and put back what loading changed in the
        process: torch's thread count (tensor parallelism on the CPU halves it) and, once the
        last CPU model closes, glibc malloc's thresholds (model/host_malloc.py). An LLM is
        also a context manager that closes on exit."""
        if getattr(self, "ranks", None) is not None:
            self.ranks.close()
            self.ranks = None
        if getattr(self, "_threads_before", None) is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        if getattr(self, "_holds_malloc_tuning", False):
            self._holds_malloc_tuning = False
            release_freed_memory()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's generation_config.json defaults; generate's when given none."""
        return SamplingParams.from_model(self.spec.model_dir, self.spec.generation_config)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: sequence.SamplingParams | Sequence[sequence.SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        params: sequence.SamplingParams | Sequence[sequence.SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or {"prompt": ...} /
        {"prompt_token_ids": ...}; one string is one prompt); one RequestOutput per prompt, in
        prompt order. sampling_params (or params, batchgen's earlier name): one for all
        prompts or one each; None: get_default_sampling_params(). use_tqdm: a progress bar."""
        if isinstance(prompts, str | dict) or is_token_ids(prompts):
            prompts = [prompts]
        texts, ids, errors = [], [], []
        for p in prompts:
            if isinstance(p, dict):
                p = p.get("prompt_token_ids", p.get("prompt"))
            texts.append(p if isinstance(p, str) else None)
            p_ids, error = self._prompt_ids(p)
            ids.append(p_ids)
            errors.append(error)
        return self._generate(texts, ids, sampling_params or params, use_tqdm, errors)

    def _prompt_ids(self, p: str | Sequence[int]) -> tuple[list[int], str | None]:
        """A prompt's token ids, and why it cannot run (None: it can). Such a prompt gets an
        error result, as the command line writes an error row, and never reaches the engine:
        an empty or out-of-vocabulary prompt there fails the call and leaves the engine's
        queue holding it."""
        if isinstance(p, str):
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate, which no tokenizer takes
                return [], f"prompt is not valid Unicode text ({e.reason} at character {e.start})"
            ids = self.tokenizer(p)["input_ids"]
        else:
            ids = list(p)
        if not ids:
            return ids, "prompt tokenized to zero tokens"
        vocab = self.spec.model_cfg.vocab_size
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            return ids, f"token id {bad!r} is not in the model's vocabulary (0 to {vocab - 1})"
        return ids, None

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: sequence.SamplingParams | Sequence[sequence.SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {role, content} messages) or to each of a list
        of them, through the tokenizer's chat template as `--messages-column` renders rows."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template; render the prompt yourself and "
                "call generate()"
            )
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        builder = PromptBuilder(None, "messages", None, self._chat_text)
        try:
            texts = [builder.render({"messages": list(c)}) for c in convs]
        except RowError as e:
            raise ValueError(str(e)) from None
        # the template already holds the model's special tokens (BOS)
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return self._generate(texts, ids, sampling_params, use_tqdm)

    def _chat_text(self, messages: list[Message]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def _generate(
        self,
        texts: list[str | None],
        ids: list[list[int]],
        params: sequence.SamplingParams | Sequence[sequence.SamplingParams] | None,
        use_tqdm: bool,
        errors: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        params = params or self.get_default_sampling_params()
        per_row = [params] * len(ids) if isinstance(params, sequence.SamplingParams) else params
        if len(per_row) != len(ids):
            raise ValueError(f"{len(per_row)} sampling params for {len(ids)} prompts")
        for sp in per_row:  # the engine's own class takes a NaN temperature
            if not (math.isfinite(sp.temperature) and math.isfinite(sp.top_p)):
                raise ValueError(f"temperature and top_p must be finite numbers, got {sp}")
        errors = errors or [None] * len(ids)
        requests, owner, failed = [], [], []  # owner: each request's (prompt, sample)
        for i, (p, sp, error) in enumerate(zip(ids, per_row, errors, strict=True)):
            n = getattr(sp, "n", 1)
            for k in range(n):
                r = Request(len(requests), p, sp.sample(k) if n > 1 else sp)
                if error is None:
                    requests.append(r)
                    owner.append((i, k))
                else:
                    failed.append(((i, k), error_completion(r, error)))
        if any(getattr(sp, "n", 1) > 1 and sp.greedy for sp in per_row):
            _warn_greedy_samples()
        done = self._run(requests, use_tqdm) if requests else []
        outs = [RequestOutput(i, t, p, []) for i, (t, p) in enumerate(zip(texts, ids, strict=True))]
        for (i, k), c in [*zip(owner, done, strict=True), *failed]:
            c.index = k
            outs[i].outputs.append(c)
        for o in outs:
            o.outputs.sort(key=lambda c: c.index)
        return outs

    def score(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        candidates: Sequence[str | list[int]] | Sequence[Sequence[str | list[int]]],
    ) -> list[Completion]:
        """log P(candidate | prompt) of each candidate continuation (text, tokenized
        without special tokens, or token ids), in `Completion.scores`; one candidate list
        for all prompts or one per prompt. Nothing is sampled."""
        per_row = [candidates] * len(prompts) if is_candidate_list(candidates) else candidates
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

    def _run(self, requests: list[Request], use_tqdm: bool = False) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        self.engine.reserve(max((r.longest_tokens for r in requests), default=1))
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="generating", unit="completion")
        try:
            for report in self.engine.generate(requests):
                for c in report.finished:
                    results[c.index] = c
                if bar is not None:
                    bar.update(len(report.finished))
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]


@functools.cache
def _warn_greedy_samples() -> None:
    log.warning(
        "n > 1 with temperature 0 (greedy) gives n identical completions; pass a temperature "
        "above 0 (e.g. temperature=0.8) to sample different ones (warned once)"
    )
