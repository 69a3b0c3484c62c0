"""open_job(config): one job resolved and checked, without loading the weights."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from batchgen.choices import OutputFormat, Task
from batchgen.data import InputFormat, InputSource, open_input
from batchgen.data.reader import OpenAIBatchSource
from batchgen.engine.constraints import ConstraintError
from batchgen.errors import ConfigError
from batchgen.job.config import RunConfig
from batchgen.job.embedding import pooled_task
from batchgen.job.generation import KEYS as GENERATION_KEYS
from batchgen.job.generation import GenerationDefaults
from batchgen.job.ids import check_unique_ids
from batchgen.job.model_spec import ModelSpec
from batchgen.job.precheck import check_input_outside_output
from batchgen.job.prepare import Preparer
from batchgen.model.memory import check_allocation
from batchgen.model.parallel.sharding import TPShard, local_config, weight_bytes

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Job:
    """A job opened and checked: its options as they apply (cfg), its model resolved (the
    engine is built from spec), its input open, its rows' preparation set up."""

    cfg: RunConfig  # its generation options resolved (generation)
    spec: ModelSpec
    source: InputSource
    prep: Preparer
    generation: GenerationDefaults  # where cfg's max_new_tokens, temperature, ... came from
    max_model_len: int  # prompt + output, in tokens
    max_prompt_len: int


def open_job(cfg: RunConfig) -> Job:
    """Check everything that can fail before the model loads: model config, adapter,
    quantization, input file and columns, prompt template, length limits, the job's
    constraint."""
    spec = ModelSpec.resolve(
        cfg.model,
        dtype=cfg.dtype,
        model_impl=cfg.model_impl,
        device=cfg.device,
        compile=cfg.compile,
        compile_cache=cfg.compile_cache,
        engine={
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "block_size": cfg.block_size,
            "kv_cache_tokens": cfg.kv_cache_tokens,
            "prefix_caching": cfg.prefix_caching,
            "read_ahead": cfg.window_rows,
        },
        allow_pickle=cfg.allow_pickle,
        quantize=cfg.quantize,
        quant_backend=cfg.quant_backend,
        lora=cfg.lora,
        quant_group_size=cfg.quant_group_size,
        tensor_parallel_size=cfg.tensor_parallel_size,
    )
    source = open_input(cfg.input)
    check_input_outside_output(source, cfg.output)
    generation = GenerationDefaults.resolve(
        {k: getattr(cfg, k) for k in GENERATION_KEYS}, spec.generation_config
    )
    cfg = dataclasses.replace(cfg, **generation.values)
    if cfg.n > 1 and cfg.temperature == 0 and "temperature" not in source.columns:
        log.warning(
            "--n %d with --temperature 0 (greedy) writes %d identical completions per row; "
            "pass --temperature above 0 (e.g. 0.8) to sample different ones",
            cfg.n,
            cfg.n,
        )
    if cfg.output_format is OutputFormat.OPENAI and not isinstance(source, OpenAIBatchSource):
        raise ConfigError(
            f"--output-format openai writes OpenAI batch output lines, and {cfg.input} is "
            "not an OpenAI batch request file (lines with custom_id and body)"
        )
    if isinstance(source, OpenAIBatchSource):
        check_openai_task(cfg.task, source.requests.column("embeddings").to_pylist())
    if isinstance(source, OpenAIBatchSource) and source.asks_logprobs:
        # The lines that ask get each token's logprob: the parts keep them whatever the output
        # format, so a rerun that adds --output-format openai is the same job and can write them.
        cfg = dataclasses.replace(cfg, with_token_ids=True, with_logprobs=True)
    model_len, max_prompt, limit = prompt_limits(cfg, spec.model_cfg.max_position_embeddings)
    check_weights(spec)  # a config.json's sizes, before a grammar is built over its vocabulary
    vocab = spec.model_cfg.vocab_size
    if any(t >= vocab for t in cfg.logit_bias):  # a row's own: an error row (engine/admission.py)
        raise ConfigError(
            f"logit_bias: token id {max(cfg.logit_bias)} is not in the model's vocabulary (0 to "
            f"{vocab - 1}); bias this model's token ids (its tokenizer's)"
        )
    if cfg.kv_cache_tokens:  # an explicit size is checked against memory before allocating
        rank = local_config(spec.model_cfg, TPShard(0, spec.tensor_parallel_size))
        per_token = rank.kv_bytes_per_token(spec.dtype.itemsize)  # each rank holds its KV heads
        what = f"a KV cache of {cfg.kv_cache_tokens} tokens"
        check_allocation(cfg.kv_cache_tokens * per_token, what, "--kv-cache-tokens", spec.device)
    pooled = pooled_task(cfg, spec)  # task embed / classify (None: neither)
    prep = Preparer(cfg, source, spec.tokenizer, max_prompt, limit, pooled)
    if prep.id_column and source.format is not InputFormat.OPENAI:  # custom_ids: when parsed
        check_unique_ids(source, prep.id_column, cfg.limit)
    if (
        prep.options.defaults.constraint is not None
    ):  # a job's grammar that cannot compile: before loading
        try:  # compiled into spec.grammars' cache, which the engine then uses
            spec.grammars.compile(prep.options.defaults.constraint)
        except ConstraintError as e:
            raise ConfigError(str(e)) from None
    return Job(cfg, spec, source, prep, generation, model_len, max_prompt)


def prompt_limits(cfg: RunConfig, positions: int) -> tuple[int, int, str]:
    """(max_model_len, max_prompt_len, what bounds the prompt: named in its rows' errors).
    The prompt gets what --max-model-len (default: the model's positions) leaves after the
    new tokens (a score job: its labels, checked per row later; a prompt-logprobs job: none), or
    --max-prompt-len if lower."""
    if cfg.max_model_len is not None and cfg.max_model_len > positions:
        raise ConfigError(
            f"max_model_len {cfg.max_model_len} exceeds the model's {positions} positions "
            "(max_position_embeddings); pass at most that"
        )
    model_len = cfg.max_model_len or positions
    # a prompt-logprobs, embed or classify row is its prompt alone
    room = {Task.GENERATE: cfg.max_new_tokens, Task.SCORE: 1}.get(cfg.task, 0)
    if model_len - room < 1:
        where = (
            f"--max-model-len {model_len}"
            if cfg.max_model_len
            else f"the model's {positions} positions"
        )
        raise ConfigError(
            f"max_new_tokens {cfg.max_new_tokens} leaves no room for a prompt in {where}"
        )
    if cfg.max_prompt_len is not None and cfg.max_prompt_len <= model_len - room:
        return model_len, cfg.max_prompt_len, "--max-prompt-len"
    what = f"--max-model-len {model_len}" if cfg.max_model_len else f"the model's {positions}"
    return model_len, model_len - room, f"{what} less {room} new token{'s' * (room != 1)}"


def check_weights(spec: ModelSpec) -> None:
    """The weights config.json implies (a rank's share, at the load dtype: what the loader
    checks again with exact shapes) against free memory, before anything is built from the
    config: a vocab_size of 10**9 would first cost a long grammar compile, then a MemoryError.
    On the CPU only: resolving a job touches no GPU (the loader checks a GPU before loading)."""
    if spec.device.type != "cpu":
        return
    mc = spec.model_cfg
    check_allocation(
        weight_bytes(mc, spec.dtype.itemsize, spec.tensor_parallel_size),
        f"the weights config.json describes ({mc.num_params:,} parameters; vocab_size "
        f"{mc.vocab_size}, hidden size {mc.dim}, {mc.n_layers} layers)",
        f"the sizes in {spec.model_dir / 'config.json'} (or use --tensor-parallel-size, "
        "--quantize or --dtype)",
        spec.device,
    )


def check_openai_task(task: Task, embeddings: list[bool | None]) -> None:
    """An OpenAI batch file's lines (embeddings: each line's, None for a malformed one) and
    the job's task agree where all its lines are of one kind: /v1/embeddings lines are a --task
    embed job's, and only they are. In a mixed file the other kind's lines are error rows
    (job/embedding.py's line_error)."""
    kinds = {e for e in embeddings if e is not None}
    if kinds == {True} and task is not Task.EMBED:
        raise ConfigError("the batch file has /v1/embeddings lines: run it with --task embed")
    if task is Task.EMBED and kinds == {False}:
        raise ConfigError(
            "task embed runs /v1/embeddings lines, and the batch file has completion lines "
            "only; run it without --task embed"
        )
