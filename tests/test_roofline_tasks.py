"""The roofline's FLOPs of prefill-only jobs, read from stats.json of real small runs on the
tiny Llama and compared with a count from its config.json: an embed job runs no head (no LM
head FLOPs at all), a classify job its classifier head (labels x dim) once a row, a
prompt-logprobs job the LM head over every prompt token but the last (the logits of token p
score token p + 1). The decoder's part: 2 * layer matrices per token, and attention's
4 * layers * heads * head_dim per key attended (no prefix-cache hits: every prompt whole)."""

import json

import pytest
from helpers import read_stats, rows_by_id, run_job, write_parquet
from test_classify import save_classifier

# First tokens all different, so no prompt shares a cached block with another.
TEXTS = [
    "the quick brown fox",
    "a",
    "hello world and all the people in it " * 3,  # chunked at 16 tokens a step
    "jumps over the lazy dog",
]


@pytest.fixture(scope="module")
def classifier(model, tmp_path_factory):
    return save_classifier(model, tmp_path_factory.mktemp("cls") / "c", 3)


def decoder_flops(model_dir, lengths: list[int]) -> tuple[int, int]:
    """(decoder FLOPs of prompts of these lengths run whole, the LM head's FLOPs a row)."""
    c = json.loads((model_dir / "config.json").read_text())
    dim, layers, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    hd = c.get("head_dim") or dim // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layer = layers * (dim * (q + 2 * kv) + q * dim + 3 * dim * inter)
    attended = sum(n * (n + 1) // 2 for n in lengths)
    tokens = sum(lengths)
    return 2 * layer * tokens + 4 * layers * q * attended, 2 * c["vocab_size"] * dim


@pytest.mark.parametrize("task", ["embed", "classify", "prompt-logprobs"])
def test_prefill_only_flops_count_the_head_the_task_runs(model, classifier, tmp_path, task):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": TEXTS})
    d = classifier if task == "classify" else model
    flags = ("--task", task, "--max-num-batched-tokens", "16", "--no-prefix-caching")
    run_job(src, tmp_path / "out", d, *flags, "--peak-tflops", "1")
    stats = read_stats(tmp_path / "out")
    rows = rows_by_id(tmp_path / "out")
    lengths = [rows[i]["prompt_tokens"] for i in range(len(TEXTS))]
    assert max(lengths) > 16 and stats["cached_prompt_tokens"] == 0
    decoder, lm_row = decoder_flops(d, lengths)
    head_flops = {
        "embed": 0,
        "classify": 2 * 3 * 32 * len(TEXTS),  # 3 labels x dim 32, once a row
        "prompt-logprobs": lm_row * sum(n - 1 for n in lengths),
    }[task]
    assert stats["model_flops"] == decoder + head_flops
    head = {"embed": "none", "classify": "classifier", "prompt-logprobs": "lm"}[task]
    assert stats["head"] == head
    assert stats["head_on_every_prompt_token"] == (task == "prompt-logprobs")
    assert stats["head_flops_per_row"] == {"embed": 0, "classify": 2 * 3 * 32}.get(task, lm_row)
    assert stats["mfu"] == pytest.approx(stats["model_flops"] / stats["model_flops_s"] / 1e12)
