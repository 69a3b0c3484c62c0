"""What each `run`/`plan` option says in `--help`, by its RunConfig name (cli/options.py
declares the options; their defaults, ranges and choices come from RunConfig)."""

HELP: dict[str, str] = {
    "input": (
        "Input data; overrides a job spec's input (builtin:samples/... for the shipped samples)."
    ),
    "model": (
        "Local model directory (config.json + *.safetensors). Default: the embedded demo model."
    ),
    "messages_column": (
        "Input column of chat messages [{role, content}], rendered with the tokenizer's chat "
        "template."
    ),
    "template": (
        'Jinja prompt template over input columns, e.g. "Label the sentiment of: {{ text '
        '}}". On the command line \\n, \\t and \\\\ are read as a newline, a tab and a backslash.'
    ),
    "max_new_tokens": (
        "Tokens to generate per row (a max_new_tokens column overrides per row). Default: "
        "the model's generation_config.json max_new_tokens, else 64."
    ),
    "max_prompt_len": ("Longest prompt in tokens. Default: --max-model-len less --max-new-tokens."),
    "max_model_len": (
        "Most tokens of a row, prompt and output (vLLM's name). Default: the model's "
        "max_position_embeddings."
    ),
    "truncate": (
        "Prompts over the limit (--max-prompt-len, --max-model-len): skip (error record), "
        "error (stop the job), left/right (cut)."
    ),
    "block_size": ("KV cache block size in tokens (the paging and prefix-caching unit)."),
    "prefix_caching": (
        "Reuse the KV cache blocks of prompt prefixes already computed (shared instructions, "
        "few-shot examples, templates)."
    ),
    "window_rows": (
        "Rows read and tokenized ahead of the engine; it admits the longest of them first."
    ),
    "output": ("Output directory of Parquet part files (required, or from the job spec)."),
    "temperature": (
        "0 = greedy (a temperature column overrides per row). Default: the model's "
        "generation_config.json (do_sample false: 0), else 0."
    ),
    "top_k": (
        "Sample from the k most likely tokens (0 = off). Default: the model's "
        "generation_config.json, else 0."
    ),
    "top_p": (
        "Nucleus sampling mass (1 = off; a top_p column overrides per row). Default: the "
        "model's generation_config.json, else 1."
    ),
    "seed": (
        "Job sampling seed: each row samples with its own seed, derived from this and its "
        "id, so rows are independent and a row's output does not depend on its batch, order "
        "or --limit (a seed column sets a row's seed itself)."
    ),
    "stop": (
        "Stop string (repeatable). On the command line \\n, \\t and \\\\ are read as a newline, "
        "a tab and a backslash."
    ),
    "repetition_penalty": (
        "vLLM's: logits of tokens already in the prompt or output divided by it (> 1 "
        "discourages repeats; 1 = off; a column of the name overrides per row)."
    ),
    "presence_penalty": (
        "OpenAI's: subtracted from the logit of each token already in the output, in [-2, 2] "
        "(0 = off; a column of the name overrides per row)."
    ),
    "frequency_penalty": (
        "OpenAI's: x the times a token is already in the output, subtracted from its logit, "
        "in [-2, 2] (0 = off; a column of the name overrides per row)."
    ),
    "logit_bias": (
        "OpenAI's: JSON {\"token id\": bias} added to those tokens' logits, e.g. "
        "'{\"42\": -100}' bans token 42; each bias clamped to [-100, 100] (a logit_bias column "
        "overrides per row)."
    ),
    "task": (
        "generate: sample a completion per row. score: the probability of each --choice "
        "label (or choice column) given the prompt, in `scores` and `label` columns; nothing "
        "is sampled. prompt-logprobs: each prompt token's log-probability given the tokens "
        "before it, in `prompt_logprobs`, `prompt_nll` and `perplexity` columns; nothing is "
        "sampled. embed: the prompt's final hidden states pooled (--pooling) into an "
        "`embedding` column. classify: a *ForSequenceClassification checkpoint's head on the "
        "last token, in `label` and `probs` columns (a one-label reward head: `score`)."
    ),
    "pooling": (
        "With --task embed: last (the last token's hidden state), mean or cls (the first "
        "token's), after the final norm. Default: the sentence-transformers checkpoint's own "
        "(modules.json, 1_Pooling/config.json), else last."
    ),
    "normalize": (
        "With --task embed: L2-normalize each embedding. Default: where the checkpoint has a "
        "sentence-transformers Normalize module."
    ),
    "dimensions": (
        "With --task embed: keep each embedding's first N values (Matryoshka), then normalize "
        "where asked."
    ),
    "embedding_dtype": "With --task embed: the embedding column's floats (float32 or float16).",
    "prompt_logprobs": (
        "With --task prompt-logprobs: also keep each prompt position's K likeliest tokens, "
        "in a `prompt_top_logprobs` column (0-20; 0 = none)."
    ),
    "n": (
        "Sampled completions per row (an n column overrides per row): one output row each, "
        "keyed by (id, sample_index), each with its own seed; use with --temperature > 0."
    ),
    "n_as_list": (
        "With --n: one output row per input row, its samples' text, finish_reason, "
        "completion_tokens (token_ids, logprobs) as lists in sample order."
    ),
    "choice": (
        "Structured output: the output is one of these comma-separated labels, e.g. "
        '"positive,negative,neutral" (a choice list column overrides per row). After a '
        'prompt ending in a word ("Sentiment:"), a label also matches its space-prefixed '
        'form (" positive", as tokenizers write it); the output is the label as written.'
    ),
    "regex": (
        "Structured output: the output matches this regular expression (a regex column "
        "overrides per row)."
    ),
    "json_schema": (
        "Structured output: a JSON schema the output must match, inline ('{\"type\": ...}': it "
        "starts with {) or a file (a json_schema column of schema text overrides per row)."
    ),
    "json_any_whitespace": (
        "JSON outputs may put any whitespace between tokens. Default: compact (one space "
        "after each , and :), so a model cannot loop on newlines."
    ),
    "model_impl": (
        "Which code runs the model: native (batchgen's decoder: gpt2, llama, mistral, qwen2, "
        "qwen3, qwen3_moe, mixtral, gemma2, gemma3_text, phi3), transformers (transformers' "
        "modeling code with batchgen's paged attention: other causal LMs), or auto (native "
        "where it has the family)."
    ),
    "compile": (
        "torch.compile the decode steps (as CUDA graphs on a GPU; prefill runs eagerly): one "
        "compile of the model, then a CUDA graph per batch size, before the first row. "
        "Default: on with a GPU, off on the CPU (measured no faster there)."
    ),
    "compile_cache": (
        "Where compiled graphs are kept across jobs (a shared filesystem lets a Slurm "
        "array's tasks share them); 'off' for none. Default: $BATCHGEN_COMPILE_CACHE, else "
        "~/.cache/batchgen/compile."
    ),
    "lora": (
        "PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors), "
        "merged into the model's weights at load, before --quantize."
    ),
    "quant_group_size": (
        "int4: the largest group of input channels (32, 64, 128, 256); a layer it does not "
        "divide gets the largest one that does. Default: 128."
    ),
    "max_error_rate": (
        "Exit 1, after writing every row, when more than this share of the job's rows are "
        "error rows (a constrained row cut short counts; the reasons are listed at the end; "
        "a rerun of the complete job checks again). A few bad rows (a null, an "
        "outlier past --max-prompt-len) are normal in real data; more than 1 in 10 almost "
        "always means a wrong template, column or limit. 1.0: never."
    ),
    "progress_seconds": (
        "When stderr is not a terminal (a Slurm log, a pipe), print a progress line this "
        "often: rows done/total, output tok/s, ETA, errors (also under --quiet). 0: never."
    ),
    "with_timings": (
        "Add queued_s, ttft_s, latency_s and tpot_s columns: each row's (each sample's) "
        "seconds from entering the engine's queue to its first and last token, and per "
        "output token after the first."
    ),
    "peak_tflops": (
        "The device's peak TFLOP/s for MFU in .batchgen/stats.json. Default: a table of "
        "known GPUs (x --tensor-parallel-size), measured once on the CPU."
    ),
    "peak_bandwidth_gbs": (
        "The device's peak memory bandwidth in GB/s for MBU. Default: as --peak-tflops."
    ),
    "output_format": (
        "openai: also write OUTPUT/.batchgen/results.jsonl, OpenAI batch output lines in "
        "input order (OpenAI batch input only)."
    ),
    "allow_pickle": ("Allow loading pytorch_model.bin pickle checkpoints (can run code)."),
    "threads": (
        "CPU threads for torch. Default: the CPUs this process may use (its affinity mask, "
        "capped by a cgroup CPU quota), one fewer for each CPU other processes keep busy while "
        "the job runs (given back when they stop). A count given here stays fixed."
    ),
    "shard": (
        "Run only shard I/N of the rows (by id hash), into OUTPUT/shard-IIIII-of-NNNNN/. "
        "Default in a Slurm array task: SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT."
    ),
    "workers": (
        "auto or N: N processes (auto: one per visible GPU, or per group of "
        "--tensor-parallel-size GPUs) over shards of the input, then merged into "
        "OUTPUT/.batchgen/merged.pq."
    ),
    "tensor_parallel_size": (
        "Split the model over N GPUs of this node (N processes, started by batchgen; NCCL), "
        "for a model larger than one GPU. On the CPU N processes over gloo: a test and "
        "debugging mode."
    ),
}
