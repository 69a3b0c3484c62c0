"""The Python API: `LLM(model_dir).generate(prompts, SamplingParams(...))`, named as in vLLM.

`LLM(...)` takes vLLM's engine arguments (api/engine_args.py), `SamplingParams`
(api/sampling.py) vLLM's names and defaults, and `generate`/`chat` return one `RequestOutput`
per prompt with its `n` samples in `.outputs` (api/outputs.py), as vLLM does. Calls run one at
a time, and a failed or interrupted call leaves nothing behind. docs/coming-from-vllm.md lists
what differs from vLLM and why.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from batchgen.api.engine_args import parse_engine_args
from batchgen.api.outputs import RequestOutput, completion_output
from batchgen.api.pooled import PoolingCalls
from batchgen.api.prompts import (
    Message,
    Prompt,
    PromptChecker,
    as_prompt_list,
    chat_texts,
    is_candidate_list,
    is_token_ids,
)
from batchgen.api.sampling import SamplingParams, sample_requests
from batchgen.choices import ModelImpl
from batchgen.engine.engine import Engine
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.params import DecodeParams
from batchgen.engine.sequence import Completion, Request
from batchgen.errors import RequestError
from batchgen.job.model_spec import ModelSpec
from batchgen.job.seeds import SEED_RANGE
from batchgen.job.threads import ThreadGovernor, governable
from batchgen.model.host_malloc import release_freed_memory
from batchgen.model.parallel.collectives import CollectiveClock
from batchgen.model.parallel.sharding import TPShard
from batchgen.parallel.rank_model import RankSpec, load_hf_rank_model, load_rank_model
from batchgen.parallel.ranks import RankedRunner, Ranks
from batchgen.quant import weight_bytes


class LLM(PoolingCalls):
    """A model loaded and an engine over it (`embed`, `classify`: api/pooled.py)."""

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        """model: a local save_pretrained directory or a `builtin:` one (None: the embedded
        default model). options: vLLM's engine arguments (max_model_len, max_num_seqs,
        max_num_batched_tokens, enable_prefix_caching, gpu_memory_utilization, block_size,
        enforce_eager, seed, tensor_parallel_size, dtype, quantization) and batchgen's,
        resolved as `batchgen run` resolves its flags (ModelSpec.resolve, where their defaults
        are): device, compile, engine (an EngineConfig), allow_pickle, quantize,
        quant_backend, quant_group_size, lora, model_impl (auto|native|transformers),
        compile_cache, kv_cache_tokens. tensor_parallel_size: ranks to split the model over,
        processes started here and ended by `close()`. seed: the generator of the seeds of
        requests that ask for none. An unknown name is refused (ConfigError)."""
        args = parse_engine_args(type(self).__name__, model, options)
        spec = ModelSpec.resolve(args.model, **args.spec)
        self._limits(spec, args.max_model_len, args.seed)
        self._load(spec, resumable=False)
        if governable(spec):  # as a job's (runner/run.py)
            self._threads_before = torch.get_num_threads()  # put back by close()
            self._governor = ThreadGovernor(self._threads_before, torch.set_num_threads)

    @classmethod
    def from_spec(cls, spec: ModelSpec, resumable: bool = True) -> LLM:
        """Build from a spec already resolved (open_job's). resumable: a failed rank's
        advice is a job's (run the same command again), else the API's (a new LLM)."""
        llm = cls.__new__(cls)
        llm._limits(spec, None, 0)
        llm._load(spec, resumable)
        return llm

    def _limits(self, spec: ModelSpec, max_model_len: int | None, seed: int | None) -> None:
        self._checker = PromptChecker.of(spec.tokenizer, spec.model_cfg, max_model_len)
        self.max_model_len = self._checker.max_model_len
        self._rng = random.Random(seed)  # None: seeded from the OS
        self._lock = threading.Lock()
        self._governor: ThreadGovernor | None = None  # threads that give up CPUs others use

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
        """vLLM's: the model's generation_config.json values over SamplingParams' defaults;
        generate's when given none."""
        return SamplingParams.from_model(self.spec.generation_config)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (transformers'), as vLLM's `LLM.get_tokenizer()`."""
        return self.tokenizer

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: DecodeParams | Sequence[DecodeParams] | None = None,
        use_tqdm: bool = False,
        *,
        params: DecodeParams | Sequence[DecodeParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or {"prompt": ...} /
        {"prompt_token_ids": ...}; one string is one prompt); one RequestOutput per prompt, in
        prompt order. sampling_params (or params, batchgen's earlier name): one for all
        prompts or one each; None: get_default_sampling_params(). use_tqdm: a progress bar.
        RequestError, before anything runs, for a prompt that cannot run (empty, outside the
        vocabulary, no room left under max_model_len)."""
        checked = [self._checker.prompt(i, p) for i, p in enumerate(as_prompt_list(prompts))]
        texts, ids = [t for t, _ in checked], [x for _, x in checked]
        return self._generate(texts, ids, sampling_params or params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: DecodeParams | Sequence[DecodeParams] | None = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {role, content} messages) or to each of a list
        of them, through the tokenizer's chat template (or chat_template, a Jinja text) as
        `--messages-column` renders rows; chat_template_kwargs go to the template."""
        texts = chat_texts(
            self.tokenizer,
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            **(chat_template_kwargs or {}),
        )
        # the template already holds the model's special tokens (BOS)
        ids = [self._checker.text_ids(f"conversation {i}", t, False) for i, t in enumerate(texts)]
        return self._generate(texts, ids, sampling_params, use_tqdm)

    def _generate(
        self,
        texts: list[str | None],
        ids: list[list[int]],
        params: DecodeParams | Sequence[DecodeParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        params = params or self.get_default_sampling_params()
        requests, owner = sample_requests(ids, params, self._seed, self.max_model_len)
        done = self._run(requests, use_tqdm)
        outs = [RequestOutput(i, t, p, []) for i, (t, p) in enumerate(zip(texts, ids, strict=True))]
        for (i, k, sp), c in zip(owner, done, strict=True):
            outs[i].outputs.append(completion_output(c, k, sp, self._decode))
        return outs

    def _seed(self) -> int:
        """A seed for a request that asked for none: the LLM's generator's next."""
        return self._rng.randrange(SEED_RANGE)

    def candidate_logprobs(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        candidates: Sequence[str | list[int]] | Sequence[Sequence[str | list[int]]],
    ) -> list[Completion]:
        """log P(candidate | prompt) of each candidate continuation (text, tokenized
        without special tokens, or token ids), in `Completion.scores`; one candidate list
        for all prompts or one per prompt; one string is one prompt. Nothing is sampled."""
        prompts = [prompts] if isinstance(prompts, str) or is_token_ids(prompts) else prompts
        per_row = [candidates] * len(prompts) if is_candidate_list(candidates) else candidates
        if len(per_row) != len(prompts):
            raise RequestError(f"{len(per_row)} candidate lists for {len(prompts)} prompts")
        requests = []
        for i, (p, cands) in enumerate(zip(prompts, per_row, strict=True)):
            _, ids = self._checker.prompt(i, p)
            requests.append(
                Request(i, ids, candidates=self._checker.candidates(i, len(ids), cands))
            )
        return self._run(requests)

    def score(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's `LLM.score` is a cross-encoder or embedding similarity, which batchgen does
        not compute; refused, naming `candidate_logprobs` (log P(candidate | prompt))."""
        raise RequestError(
            "LLM.score is vLLM's cross-encoder / embedding similarity, which batchgen does not "
            "compute; for log P(candidate | prompt) call LLM.candidate_logprobs(prompts, "
            "candidates)"
        )

    def _run(self, requests: list[Request], use_tqdm: bool = False) -> list[Completion]:
        """Run the requests to their completions, one call at a time (calls from other
        threads wait). Any failure, Ctrl-C included, drops what is in flight, so no later
        call returns this one's completions or finds its requests queued."""
        with self._lock:
            try:
                return self._drain(requests, use_tqdm)
            except BaseException:
                self.engine.abort()
                raise

    def _drain(self, requests: list[Request], use_tqdm: bool) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        if not requests:
            return []
        self.engine.reserve(max(r.longest_tokens for r in requests))
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
                if self._governor is not None:
                    self._governor.tick()
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]
