"""Classifier and reward scores (task classify, `LLM.classify`): a *ForSequenceClassification
checkpoint's `score` head on the last prompt token's hidden state, equal to transformers'
softmax probabilities (atol 1e-5, float32) on the sharpened tiny Llama and Qwen2 for mixed
lengths and a chunked prompt; the labels from config.json's id2label; a one-label reward head's
raw logit in a `score` column."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import transformers
from helpers import cpu_llm, read_output, rows_by_id, run_job, write_parquet

from batchgen.errors import RequestError

TEXTS = [
    "the quick brown fox",
    "a",
    "hello world and all the people in it " * 6,  # chunked at 16 tokens a step
    "the quick brown fox jumps over the lazy dog",
]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def save_classifier(causal_dir: Path, out: Path, num_labels: int) -> Path:
    """causal_dir's decoder with a random classifier head of num_labels, saved as
    transformers saves a *ForSequenceClassification."""
    torch.manual_seed(1)
    labels = LABELS if num_labels == 3 else {0: "reward"}
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        causal_dir,
        num_labels=num_labels,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    with torch.no_grad():  # logits far enough apart that the probabilities are not all ~1/3
        model.score.weight.mul_(8)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(causal_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def classifiers(sharp_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cls")
    return {
        "llama": save_classifier(sharp_dirs["llama"], root / "llama", 3),
        "qwen2": save_classifier(sharp_dirs["qwen2"], root / "qwen2", 3),
        "reward": save_classifier(sharp_dirs["llama"], root / "reward", 1),
    }


def hf_logits(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """transformers' classifier logits, one prompt at a time (no padding)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        return torch.cat([model(**tok(t, return_tensors="pt")).logits for t in texts])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_classify_equals_transformers_probabilities(classifiers, family):
    d = classifiers[family]
    want = hf_logits(d, TEXTS).softmax(-1)
    with cpu_llm(d, max_num_batched_tokens=16, block_size=4) as llm:
        out = llm.classify(TEXTS)
    assert max(len(o.prompt_token_ids) for o in out) > 16  # one prompt ran in chunks
    got = torch.tensor([o.outputs.probs for o in out])
    assert torch.allclose(got, want, atol=1e-5)
    assert want.max(-1).values.min() < 0.99  # the probabilities say something
    assert [o.outputs.label for o in out] == [LABELS[i] for i in want.argmax(-1).tolist()]
    assert {o.outputs.num_classes for o in out} == {3}


def test_reward_head_score_is_its_raw_logit(classifiers):
    d = classifiers["reward"]
    want = hf_logits(d, TEXTS)[:, 0]
    with cpu_llm(d) as llm:
        out = llm.classify(TEXTS)
    assert torch.allclose(torch.tensor([o.outputs.score for o in out]), want, atol=1e-5)


def test_classify_needs_a_classifier_head(sharp_dirs):
    with cpu_llm(sharp_dirs["llama"]) as llm, pytest.raises(RequestError, match="classifier head"):
        llm.classify(TEXTS)


def test_cli_classify_columns(classifiers, tmp_path):
    """`batchgen run --task classify`: label and probs (float32 list); a reward head: score."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": TEXTS})
    run_job(src, tmp_path / "out", classifiers["llama"], "--task", "classify")
    table = read_output(tmp_path / "out")
    assert table.schema.field("probs").type == pa.list_(pa.float32())
    assert "generated_text" not in table.schema.names
    rows = rows_by_id(tmp_path / "out")
    want = hf_logits(classifiers["llama"], TEXTS).softmax(-1)
    got = np.array([rows[i]["probs"] for i in range(4)])
    assert np.allclose(got, want.numpy(), atol=1e-5)
    assert [rows[i]["label"] for i in range(4)] == [LABELS[i] for i in want.argmax(-1).tolist()]

    run_job(src, tmp_path / "reward", classifiers["reward"], "--task", "classify")
    rows = rows_by_id(tmp_path / "reward")
    want = hf_logits(classifiers["reward"], TEXTS)[:, 0]
    assert np.allclose([rows[i]["score"] for i in range(4)], want.numpy(), atol=1e-5)
    assert "label" not in read_output(tmp_path / "reward").schema.names
