"""Structured outputs (--choice, --regex, --json-schema and their per-row columns) on a tiny
random model, whose unconstrained output is noise: every constrained row must still be valid."""

import json
import re

import pytest
import torch
from helpers import (
    assert_one_line_error,
    prompt_file,
    prompts,
    read_stats,
    rows_by_id,
    run_job,
    write_parquet,
)

from batchgen.engine.config import EngineConfig
from batchgen.engine.constraints import (
    Constraint,
    ConstraintError,
    ConstraintKind,
    parse_choices,
)
from batchgen.engine.decode_mask import apply_words
from batchgen.engine.sequence import FinishReason, SamplingParams
from batchgen.llm import LLM

LABELS = ["positive", "negative", "neutral"]
SAMPLED = ("--temperature", 1.0, "--max-new-tokens", 24)


def test_the_decode_mask_keeps_exactly_the_set_bits():
    vocab = 70  # three words, the last one partly past the vocabulary
    allowed = [{0, 31, 32, 69}, set(range(vocab))]
    mask = torch.zeros(2, 3, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            word = int(mask[row, t // 32]) | (1 << (t % 32))
            mask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 wrap
    out = torch.zeros(2, vocab)
    apply_words(out, mask)  # in place
    for row, tokens in enumerate(allowed):
        assert {i for i in range(vocab) if out[row, i] == 0} == tokens
        assert all(out[row, i] == float("-inf") for i in range(vocab) if i not in tokens)


@pytest.mark.parametrize(
    "value, why",
    [("", "at least one"), (" , ", "at least one"), ("a,b,a", "twice"), ([], "at least one")],
)
def test_bad_choice_lists_are_refused(value, why):
    with pytest.raises(ConstraintError, match=why):
        parse_choices(value)


def test_choice_flag_gives_only_labels_even_sampling_noise(tmp_path, model):
    src = prompt_file(tmp_path, 12)
    out = tmp_path / "out"
    run_job(src, out, model, *SAMPLED, "--choice", ",".join(LABELS))
    rows = rows_by_id(out)
    assert len(rows) == 12
    assert all(
        r["generated_text"] in LABELS and r["finish_reason"] == "stop" for r in rows.values()
    )
    assert len({r["generated_text"] for r in rows.values()}) > 1  # sampled, not one forced label
    assert read_stats(out)["rows_error"] == 0


def test_unconstrained_rows_are_unaffected_by_constrained_neighbours(tmp_path, model):
    texts = prompts(8)
    plain = write_parquet(tmp_path / "plain.parquet", {"prompt": texts})
    run_job(plain, tmp_path / "a", model, "--max-new-tokens", 12)
    # The same rows, half of them now constrained per row; greedy, in one job.
    regex = [r"[a-c]{2}-[0-9]+" if i % 2 else None for i in range(8)]
    mixed = write_parquet(tmp_path / "mixed.parquet", {"prompt": texts, "regex": regex})
    run_job(mixed, tmp_path / "b", model, "--max-new-tokens", 12)
    a, b = rows_by_id(tmp_path / "a"), rows_by_id(tmp_path / "b")
    for i in range(8):
        if regex[i] is None:
            assert b[i]["generated_text"] == a[i]["generated_text"]
        elif b[i]["finish_reason"] == "stop":
            assert re.fullmatch(regex[i], b[i]["generated_text"]), b[i]["generated_text"]
        else:  # the grammar allows digits forever; it may run out of tokens, never of form
            assert re.fullmatch(r"[a-c]{2}-[0-9]*", b[i]["generated_text"]), b[i]["generated_text"]


def test_json_schema_file_gives_valid_json(tmp_path, model):
    schema = {
        "type": "object",
        "properties": {"label": {"enum": LABELS}, "score": {"type": "integer"}},
        "required": ["label", "score"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    src = prompt_file(tmp_path, 6)
    out = tmp_path / "out"
    run_job(
        src, out, model, *SAMPLED, "--max-new-tokens", 96, "--json-schema", path, "--ignore-eos"
    )
    for r in rows_by_id(out).values():
        assert r["finish_reason"] == "stop", r  # the grammar ends the row, EOS ignored or not
        obj = json.loads(r["generated_text"])
        assert set(obj) == {"label", "score"} and obj["label"] in LABELS
        assert isinstance(obj["score"], int)


def test_per_row_choice_lists_and_a_bad_row_regex(tmp_path, model):
    src = prompt_file(
        tmp_path,
        4,
        choice=[["yes", "no"], None, ["red", "green", "blue"], None],
        regex=[None, "[0-9]{4}", None, "[a-"],
    )
    out = tmp_path / "out"
    run_job(src, out, model, *SAMPLED)
    rows = rows_by_id(out)
    assert rows[0]["generated_text"] in ("yes", "no")
    assert re.fullmatch("[0-9]{4}", rows[1]["generated_text"])
    assert rows[2]["generated_text"] in ("red", "green", "blue")
    assert rows[3]["finish_reason"] == "error" and "does not compile" in rows[3]["error"]
    assert "\n" not in rows[3]["error"]


def test_a_row_with_two_constraints_is_an_error_record(tmp_path, model):
    src = prompt_file(tmp_path, 2, choice=[["a", "b"], ["a", "b"]], regex=["x+", None])
    out = tmp_path / "out"
    run_job(src, out, model, *SAMPLED)
    rows = rows_by_id(out)
    assert "give one constraint" in rows[0]["error"]
    assert rows[1]["generated_text"] in ("a", "b")


@pytest.mark.parametrize(
    "flags, words",
    [
        (("--regex", "[a-"), ("--regex", "does not compile")),
        (("--choice", ","), ("choice", "at least one")),
        (("--choice", "a", "--regex", "b"), ("choice and regex",)),
        (("--json-schema", "missing.json"), ("json_schema", "cannot read")),
    ],
)
def test_bad_job_constraints_fail_before_the_model_loads(tmp_path, model, flags, words):
    src = prompt_file(tmp_path, 2)
    out = tmp_path / "out"
    r = run_job(src, out, model, *flags, exit_code=2)
    assert_one_line_error(r, *words)
    assert not out.exists() or not any(out.glob("part-*"))


def test_constrained_rows_survive_preemption(model):
    """A pool too small for all rows at once: sequences are preempted and recomputed with
    their grammar state kept; outputs stay valid and equal to an unpreempted run."""
    c = Constraint(ConstraintKind.REGEX, "[a-z]{6,9}")
    params = [
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=i, constraint=c) for i in range(6)
    ]
    big = LLM(model, device="cpu", compile=False).generate(prompts(6), params)
    small = LLM(
        model, device="cpu", compile=False, engine=EngineConfig(block_size=4, kv_cache_tokens=48)
    )
    out = small.generate(prompts(6), params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out] == [o.token_ids for o in big]
    assert all(
        re.fullmatch("[a-z]{6,9}", o.text) and o.finish_reason is FinishReason.STOP for o in out
    )


def test_each_row_gets_its_own_mask_when_decodes_are_packed_by_width(model, monkeypatch):
    """The runner packs decodes by table width, not in plan order; the decode mask is built in
    the packed order (engine/decode_mask.py): each constrained row is held to its own grammar,
    and the free rows between them decode as they do alone."""
    import batchgen.engine.model_runner as model_runner

    real, reordered = model_runner.pack_step, []

    def spy(*a, **k):
        packed = real(*a, **k)
        reordered.append(packed.decode_order != sorted(packed.decode_order))
        return packed

    monkeypatch.setattr(model_runner, "pack_step", spy)
    rows = [list(range(2, 2 + n)) for n in (40, 3, 25, 9, 60, 17)]
    regex = [f"{ch}{{3,5}}" if i % 2 == 0 else None for i, ch in enumerate("abcdef")]
    params = [
        SamplingParams(
            max_new_tokens=8,
            constraint=Constraint(ConstraintKind.REGEX, r) if r else None,
        )
        for r in regex
    ]
    engine = EngineConfig(block_size=4)
    llm = LLM(model, dtype="float32", device="cpu", compile=False, engine=engine)
    out = llm.generate(rows, params)
    assert any(reordered)
    free = LLM(model, dtype="float32", device="cpu", compile=False, engine=engine)
    alone = free.generate(rows, SamplingParams(max_new_tokens=8))
    for i, r in enumerate(regex):
        if r is None:
            assert out[i].token_ids == alone[i].token_ids
        else:
            assert re.fullmatch(r, out[i].text) and out[i].finish_reason is FinishReason.STOP


@pytest.mark.slow
def test_compiled_constrained_decode_equals_eager(model):
    c = Constraint(ConstraintKind.CHOICE, tuple(LABELS))
    params = [
        SamplingParams(max_new_tokens=8, temperature=1.0, seed=i, constraint=c if i % 2 else None)
        for i in range(5)
    ]
    eager = LLM(model, device="cpu", compile=False).generate(prompts(5), params)
    compiled = LLM(model, device="cpu", compile=True).generate(prompts(5), params)
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    assert all(o.text in LABELS for o in compiled[1::2])


def test_a_token_the_grammar_refuses_fails_only_its_row(model, monkeypatch):
    """xgrammar can allow a token its matcher then refuses (scripts/bench_grammars.py found
    one): that row becomes an error completion; the others finish as usual."""
    from batchgen.engine.constraints import Grammars

    make = Grammars.matcher

    class Refusing:  # refuses the second token of its row
        def __init__(self, m):
            self.m, self.n = m, 0

        def __getattr__(self, name):
            return getattr(self.m, name)

        def accept_token(self, t):
            self.n += 1
            return self.n < 2 and self.m.accept_token(t)

    c = Constraint(ConstraintKind.REGEX, "[a-z]{6,9}")
    d = Constraint(ConstraintKind.REGEX, "[a-z]{4,5}")
    monkeypatch.setattr(
        Grammars, "matcher", lambda self, k: Refusing(make(self, k)) if k == c else make(self, k)
    )
    params = [
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=i, constraint=c if i == 1 else d)
        for i in range(3)
    ]
    out = LLM(model, device="cpu", compile=False).generate(prompts(3), params)
    assert out[1].finish_reason is FinishReason.ERROR and "refused token" in out[1].error
    assert all(re.fullmatch("[a-z]{4,5}", o.text) for o in (out[0], out[2]))
