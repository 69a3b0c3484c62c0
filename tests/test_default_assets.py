"""The shipped default model and sample datasets (built by scripts/make_default_model.py) load
offline with plain transformers / pyarrow and have the documented shape."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

ASSETS = Path(__file__).resolve().parents[1] / "batchgen" / "assets"
MODEL_DIR = ASSETS / "default-model"
SAMPLES = ASSETS / "samples"
EOS = "<|endoftext|>"

SAMPLE_SCHEMAS = {
    # file: (columns, rows, id prefix)
    "reviews.parquet": (["id", "text", "label", "summary"], 200, "r"),
    "topics.parquet": (["id", "text", "label"], 100, "t"),
    "prompts.parquet": (["id", "prompt"], 64, "p"),
}
LABELS = {
    "reviews.parquet": {"positive", "negative", "neutral"},
    "topics.parquet": {"sports", "tech", "food", "travel"},
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()


def test_model_dir_is_small_and_complete():
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert "README.md" in names
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir())
    assert total < 6 * 2**20, total


def test_tokenizer_is_the_saved_fast_tokenizer(tokenizer):
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == EOS
    # The same tokenizer.json loaded directly must tokenize identically (no class rebuilt from
    # the vocab with a different pre-tokenizer, as AutoTokenizer does for some model types).
    direct = PreTrainedTokenizerFast(tokenizer_file=str(MODEL_DIR / "tokenizer.json"))
    text = "Review: The plot of this film is superb.\nSentiment: positive"
    assert tokenizer(text)["input_ids"] == direct(text)["input_ids"]


@pytest.mark.parametrize(
    "text",
    [
        "Review: The battery life of this laptop is awful.\nSentiment:",
        "  leading spaces, tabs\tand\nnewlines  ",
        "unicode: héllo wörld, 日本語, emoji 🙂",
        f"two docs{EOS}joined",
    ],
)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_chat_template_renders(tokenizer):
    messages = [{"role": "user", "content": "Is this good?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "user: Is this good?\nassistant:"


def test_model_loads_and_matches_tokenizer(model, tokenizer):
    assert model.config.model_type == "gpt2"
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_model_answers_sample_sentiments(model, tokenizer):
    # Greedy answers on a few held-out sample rows: the checkpoint learned the demo format.
    rows = pq.read_table(SAMPLES / "reviews.parquet").slice(0, 12).to_pylist()
    hits = 0
    with torch.no_grad():
        for row in rows:
            enc = tokenizer(f"Review: {row['text']}\nSentiment:", return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=2, do_sample=False)
            new = out[0, enc["input_ids"].shape[1] :]
            answer = tokenizer.decode(new, skip_special_tokens=True).split()
            hits += answer[:1] == [row["label"]]
    assert hits >= 10, hits


@pytest.mark.parametrize("name", sorted(SAMPLE_SCHEMAS))
def test_sample_files(name):
    columns, rows, prefix = SAMPLE_SCHEMAS[name]
    table = pq.read_table(SAMPLES / name)
    assert table.column_names == columns
    assert table.num_rows == rows
    ids = table.column("id").to_pylist()
    assert len(set(ids)) == rows and all(i.startswith(prefix) for i in ids)
    for col in columns:
        values = table.column(col).to_pylist()
        assert all(isinstance(v, str) and v for v in values), col
    if name in LABELS:
        assert set(table.column("label").to_pylist()) == LABELS[name]


def test_prompt_lengths_spread(tokenizer):
    prompts = pq.read_table(SAMPLES / "prompts.parquet").column("prompt").to_pylist()
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert min(lengths) <= 10 and 180 <= max(lengths) <= 200
    assert len({n // 32 for n in lengths}) >= 6  # several length buckets are populated


def test_samples_are_small():
    assert sum(p.stat().st_size for p in SAMPLES.iterdir()) < 300 * 2**10
