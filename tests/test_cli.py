"""`batchgen run` and `batchgen plan` end to end: the real CLI on real files with tiny models."""

import json
import os

import datasets
import pyarrow as pa
import pytest
import torch
from helpers import (
    BASE_COLUMNS,
    FAST,
    assert_one_line_error,
    prompts,
    read_job,
    read_output,
    read_stats,
    rows_by_id,
    run_cli,
    run_job,
    run_plan,
    success,
    write_jsonl,
    write_parquet,
)
from transformers import AutoTokenizer

from batchgen.engine.sequence import SamplingParams
from batchgen.job.config import RunConfig
from batchgen.job.open import open_job
from batchgen.llm import LLM

N = 12


@pytest.fixture(scope="module")
def tok(model):
    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """A plain Parquet run of prompts(N) that the other input formats must reproduce."""
    d = tmp_path_factory.mktemp("reference")
    src = write_parquet(d / "in.parquet", {"prompt": prompts(N), "k": list(range(N))})
    run_job(src, d / "out", model, "--max-new-tokens", 8)
    return rows_by_id(d / "out")


def test_parquet_end_to_end(tmp_path, model, tok):
    tags = [f"t{i}" if i % 3 else None for i in range(N)]
    src = write_parquet(
        tmp_path / "in.parquet",
        {"prompt": prompts(N), "k": list(range(N)), "tag": tags},
        row_group_size=5,
    )
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 8, "--with-token-ids", "--with-logprobs")

    table = read_output(out)
    assert table.schema.names == [
        "id",
        "prompt",
        "k",
        "tag",
        *BASE_COLUMNS,
        "token_ids",
        "logprobs",
    ]
    assert table.schema.field("id").type == pa.int64()
    assert table.schema.field("k").type == pa.int64()
    assert table.schema.field("token_ids").type == pa.list_(pa.int32())
    rows = rows_by_id(out)
    assert sorted(rows) == list(range(N))
    for i, r in rows.items():
        assert (r["prompt"], r["k"], r["tag"]) == (prompts(N)[i], i, tags[i])
        assert r["error"] is None
        assert r["finish_reason"] in ("stop", "length")
        assert 1 <= r["completion_tokens"] <= 8
        assert (r["finish_reason"] == "length") == (r["completion_tokens"] == 8)
        assert len(r["token_ids"]) == len(r["logprobs"]) == r["completion_tokens"]
        assert all(lp <= 0 for lp in r["logprobs"])
        assert r["generated_text"] == tok.decode(r["token_ids"], skip_special_tokens=True)
        assert r["prompt_tokens"] == len(tok(prompts(N)[i])["input_ids"])
    assert success(out)
    assert read_job(out)["max_new_tokens"] == 8


def test_output_files_follow_the_umask(tmp_path, model):
    """Results go to shared storage: files are created like any other, not owner-only."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3)})
    run_job(src, tmp_path / "out", model, "--max-new-tokens", 2)
    umask = os.umask(0)
    os.umask(umask)
    for f in (tmp_path / "out").rglob("*"):  # the parts, and .batchgen/ with what it holds
        mode = 0o777 if f.is_dir() else 0o666
        assert f.stat().st_mode & 0o777 == mode & ~umask, f.name


def _jsonl(d, n):
    return write_jsonl(d / "in.jsonl", [{"prompt": p, "k": i} for i, p in enumerate(prompts(n))])


def _datasets(d, n):
    datasets.Dataset.from_dict({"prompt": prompts(n), "k": list(range(n))}).save_to_disk(d / "ds")
    return d / "ds"


def _glob(d, n):
    (d / "parts").mkdir()
    cut = [0, 3, 4, n]  # uneven files; ids run on across them in sorted file order
    for j, (a, b) in enumerate(zip(cut, cut[1:], strict=False)):
        cols = {"prompt": prompts(n)[a:b], "k": list(range(a, b))}
        write_parquet(d / "parts" / f"f{j}.parquet", cols)
    return f"{d}/parts/*.parquet"


@pytest.mark.parametrize("make", [_jsonl, _datasets, _glob], ids=["jsonl", "datasets", "glob"])
def test_other_inputs_give_the_same_results(tmp_path, model, reference, make):
    src = make(tmp_path, N)
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 8)
    rows = rows_by_id(out)
    assert sorted(rows) == list(range(N))
    for i, r in rows.items():
        assert (r["prompt"], r["k"]) == (prompts(N)[i], i)
        assert r["generated_text"] == reference[i]["generated_text"]
        assert r["completion_tokens"] == reference[i]["completion_tokens"]


def test_template_over_columns_equals_the_rendered_prompt(tmp_path, model, tok, caplog):
    """A template over `text` and `lang` renders per row; the result equals running the
    rendered strings as plain prompts."""
    texts, langs = prompts(6), ["en", "fr"] * 3
    rendered = [f"Review ({lang}): {t}\nSentiment:" for t, lang in zip(texts, langs, strict=True)]
    src = write_parquet(tmp_path / "in.parquet", {"text": texts, "lang": langs})
    out = tmp_path / "out"
    tmpl = "Review ({{ lang }}): {{ text }}\nSentiment:"
    run_job(src, out, model, "-t", tmpl, "--max-new-tokens", 6)
    plain = write_parquet(tmp_path / "plain.parquet", {"prompt": rendered})
    run_job(plain, tmp_path / "plain", model, "--max-new-tokens", 6)

    got, want = rows_by_id(out), rows_by_id(tmp_path / "plain")
    # the input's usual `text` column keeps its name: the output's own is generated_text
    assert read_output(out).schema.names == ["id", "text", "lang", *BASE_COLUMNS]
    assert "under another name" not in caplog.text
    for i in range(6):
        assert (got[i]["lang"], got[i]["text"]) == (langs[i], texts[i])
        assert got[i]["prompt_tokens"] == len(tok(rendered[i])["input_ids"])
        assert (got[i]["generated_text"], got[i]["error"]) == (want[i]["generated_text"], None)


def test_messages_column_uses_the_chat_template(tmp_path, model, tok):
    chats = [
        [
            {"role": "system", "content": "label the sentiment"},
            {"role": "user", "content": "great"},
        ],
        [{"role": "user", "content": "the quick brown fox"}],
        None,
        [],
        [{"role": "user", "content": "summarise the text in one sentence."}],
    ]
    src = write_parquet(tmp_path / "in.parquet", {"messages": chats})
    out = tmp_path / "out"
    run_job(src, out, model, "--messages-column", "messages", "--max-new-tokens", 6)
    rendered = {
        i: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        for i, m in enumerate(chats)
        if m
    }
    plain = write_parquet(tmp_path / "plain.parquet", {"prompt": list(rendered.values())})
    run_job(plain, tmp_path / "plain", model, "--max-new-tokens", 6)

    rows, plain_rows = rows_by_id(out), rows_by_id(tmp_path / "plain")
    want = [plain_rows[j] for j in sorted(plain_rows)]
    assert sorted(rows) == list(range(len(chats)))
    for (i, text), ref in zip(rendered.items(), want, strict=True):
        assert rows[i]["error"] is None
        assert rows[i]["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])
        assert rows[i]["generated_text"] == ref["generated_text"]
    for i in (2, 3):
        assert rows[i]["finish_reason"] == "error"
        assert "messages" in rows[i]["error"]


def test_id_column_keeps_its_name(tmp_path, model):
    """--id-column row_id: string ids in any order come back once each under `row_id`, with
    their own row, and no `id`; an input column named `id` beside it is just passed through."""
    ids = [f"r{(i * 7) % N:02d}" for i in range(N)]
    others = [f"other-{i}" for i in range(N)]
    for cols in (
        {"row_id": ids, "prompt": prompts(N)},
        {"row_id": ids, "id": others, "prompt": prompts(N)},
    ):
        src = write_parquet(tmp_path / "in.parquet", cols)
        out = tmp_path / f"out-{len(cols)}"
        run_job(src, out, model, "--id-column", "row_id", "--max-new-tokens", 4)
        table = read_output(out)
        assert table.schema.names == [*cols, *BASE_COLUMNS]
        assert table.schema.field("row_id").type == pa.string()
        meta = json.loads(table.schema.metadata[b"batchgen"])
        assert meta["id_column"] == "row_id"
        rows = rows_by_id(out, "row_id")
        assert sorted(rows) == sorted(ids)
        for i, rid in enumerate(ids):
            assert rows[rid]["prompt"] == prompts(N)[i]
            assert rows[rid].get("id", others[i]) == others[i]


def test_an_input_id_column_is_the_default_id(tmp_path, model, caplog):
    """Without --id-column, an input column named `id` holds the ids (kept, no warning, no row
    numbers), and the run is the same job as one with --id-column id; without such a column
    the ids are the row numbers, as `id`."""
    ids = [f"r{(i * 7) % N:02d}" for i in range(N)]
    src = write_parquet(tmp_path / "in.parquet", {"id": ids, "prompt": prompts(N)})
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 4)
    assert "another name" not in caplog.text
    table = read_output(out)
    assert table.schema.names == ["id", "prompt", *BASE_COLUMNS]
    rows = rows_by_id(out)
    assert sorted(rows) == sorted(ids)
    assert all(rows[rid]["prompt"] == prompts(N)[i] for i, rid in enumerate(ids))
    parts = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    run_job(src, out, model, "--max-new-tokens", 4, "--id-column", "id")
    assert "already holds this job's complete results" in caplog.text
    assert {p.name: p.read_bytes() for p in out.glob("part-*.parquet")} == parts

    plain = write_parquet(tmp_path / "plain.parquet", {"prompt": prompts(N)})
    run_job(plain, tmp_path / "plain", model, "--max-new-tokens", 4)
    assert read_output(tmp_path / "plain").schema.field("id").type == pa.int64()
    assert sorted(rows_by_id(tmp_path / "plain")) == list(range(N))


def test_id_column_named_like_an_output_column_is_refused(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"error": prompts(3), "prompt": prompts(3)})
    r = run_job(src, tmp_path / "out", model, "--id-column", "error", exit_code=2)
    assert_one_line_error(r, "id column 'error'", "output column", "rename it")
    assert not (tmp_path / "out").exists()


def test_duplicate_ids_fail_with_a_fix(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"uid": [1, 2, 1], "prompt": prompts(3)})
    r = run_job(src, tmp_path / "out", model, "--id-column", "uid", exit_code=2)
    assert "twice" in r.stderr and "--id-column" in r.stderr


def test_per_row_max_new_tokens(tmp_path, model):
    limits = [1, 5, 12, None, 3, 20]
    src = write_parquet(
        tmp_path / "in.parquet", {"prompt": prompts(6), "max_new_tokens": pa.array(limits)}
    )
    out = tmp_path / "out"
    run_job(src, out, model, "--ignore-eos", "--max-new-tokens", 4)
    rows = rows_by_id(out)
    for i, want in enumerate(limits):
        assert rows[i]["completion_tokens"] == (want or 4), i
        assert rows[i]["finish_reason"] == "length"
        assert rows[i]["max_new_tokens"] == want  # override columns also pass through


def test_per_row_sampling_columns(tmp_path, model):
    """temperature and top_p columns act like the same values given as flags; a seed column
    sets the row's seed (a --seed flag is the job's seed, from which rows derive their own)."""
    n = 4
    groups = {  # (temperature, top_p, seed) per group of n rows
        "greedy": (0.0, 1.0, 0),
        "top_p_tiny": (1.0, 1e-6, 0),  # nucleus of one token: greedy
        "seed3": (1.0, 1.0, 3),
        "seed4": (1.0, 1.0, 4),
    }
    cols = {"prompt": [], "temperature": [], "top_p": [], "seed": []}
    for t, p, s in groups.values():
        cols["prompt"] += prompts(n)
        cols["temperature"] += [t] * n
        cols["top_p"] += [p] * n
        cols["seed"] += [s] * n
    src = write_parquet(tmp_path / "in.parquet", cols)
    run_job(src, tmp_path / "mixed", model, "--max-new-tokens", 8)
    plain = write_parquet(tmp_path / "plain.parquet", {"prompt": prompts(n)})
    seeded = write_parquet(tmp_path / "seeded.parquet", {"prompt": prompts(n), "seed": [3] * n})

    def flags_run(name, *flags, src=plain):
        run_job(src, tmp_path / name, model, "--max-new-tokens", 8, *flags)
        rows = rows_by_id(tmp_path / name)
        return [rows[i]["generated_text"] for i in sorted(rows)]

    rows = rows_by_id(tmp_path / "mixed")
    mixed = [rows[i]["generated_text"] for i in sorted(rows)]
    by_group = {g: mixed[j * n : (j + 1) * n] for j, g in enumerate(groups)}
    greedy = flags_run("greedy")
    assert by_group["greedy"] == greedy
    assert by_group["top_p_tiny"] == greedy
    assert by_group["seed3"] == flags_run("seed3", "--temperature", 1.0, src=seeded)
    assert by_group["seed3"] != by_group["seed4"]
    assert by_group["seed3"] != greedy


def test_bad_per_row_sampling_value_is_a_row_error(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(3), "top_p": [1.0, 0.0, None]})
    run_job(src, tmp_path / "out", model, "--max-new-tokens", 2)
    rows = rows_by_id(tmp_path / "out")
    assert rows[1]["finish_reason"] == "error" and "top_p" in rows[1]["error"]
    assert rows[0]["error"] is None and rows[2]["error"] is None


def test_limit(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(N)})
    run_job(src, tmp_path / "out", model, "--limit", 5, "--max-new-tokens", 2)
    assert sorted(rows_by_id(tmp_path / "out")) == [0, 1, 2, 3, 4]
    plan = json.loads(run_plan(src, model, "--limit", 5, "--json").stdout)
    assert plan["rows"] == 5


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_cli_equals_the_python_api(tmp_path, tiny_dirs, family):
    model = tiny_dirs[family]
    texts = prompts(N)
    src = write_parquet(tmp_path / "in.parquet", {"prompt": texts})
    out = tmp_path / "out"
    run_job(src, out, model, "--max-new-tokens", 10, "--with-token-ids")
    # the engine the CLI builds from the same flags
    job = open_job(
        RunConfig(
            input=str(src),
            output=str(out),
            model=str(model),
            device="cpu",
            kv_cache_tokens=4096,
            max_new_tokens=10,
        )
    )
    assert job.spec.engine.kv_cache_tokens == 4096
    llm = LLM(model, device="cpu", compile=False, engine=job.spec.engine)
    want = llm.generate(texts, SamplingParams(max_new_tokens=10))
    rows = rows_by_id(out)
    for i, c in enumerate(want):
        assert rows[i]["token_ids"] == c.token_ids
        assert rows[i]["generated_text"] == c.text
        assert rows[i]["finish_reason"] == c.finish_reason.value


def test_overwrite(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4)})
    out = tmp_path / "out"
    args = ("run", src, "-o", out, "--model", model, *FAST, "--ignore-eos")
    run_cli(*args, "--max-new-tokens", 3)
    r = run_cli(*args, "--max-new-tokens", 5, exit_code=2)
    assert "another job" in r.stderr and "--overwrite" in r.stderr
    assert {r["completion_tokens"] for r in rows_by_id(out).values()} == {3}
    run_cli(*args, "--max-new-tokens", 5, "--overwrite")
    rows = rows_by_id(out)
    assert sorted(rows) == [0, 1, 2, 3]
    assert {r["completion_tokens"] for r in rows.values()} == {5}


def test_refuses_a_directory_it_did_not_write(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    r = run_job(src, tmp_path / "out", model, "--overwrite", exit_code=2)
    assert "not written by batchgen" in r.stderr
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_run_help_mentions_the_main_options():
    text = run_cli("run", "--help").stdout
    for opt in (
        "--output",
        "--model",
        "--prompt-column",
        "--messages-column",
        "--template",
        "--id-column",
        "--max-new-tokens",
        "--truncate",
        "--temperature",
        "--seed",
        "--rows-per-part",
        "--overwrite",
        "--quiet",
        "--no-compile",
        "--limit",
        "job spec",
        "resume",
    ):
        assert opt in text, opt
    assert "plan" in run_cli("--help").stdout


def test_device_without_a_gpu_is_a_clear_error(tmp_path, model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    r = run_cli(
        "run", src, "-o", tmp_path / "out", "--model", model, "--device", "cuda", exit_code=2
    )
    assert "--device cpu" in r.stderr
    assert not (tmp_path / "out").exists()


# --- plan ---


def test_plan_text(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(40)})
    text = run_plan(
        src, model, "--max-num-seqs", 8, "--max-num-batched-tokens", 512, "--kv-cache-tokens", 4096
    ).stdout
    for part in (
        "prompt length histogram",
        "rows    40",
        "up to 8 sequences",
        "512 tokens a step",
        "prefix caching on",
        "KV cache 256 blocks of 16 tokens",
    ):
        assert part in text, part
    off = run_plan(src, model, "--no-prefix-caching").stdout
    assert "prefix caching off" in off


def test_plan_json(tmp_path, model, tok):
    texts = prompts(40) + ["the quick brown fox " * 30, None]
    src = write_parquet(tmp_path / "in.parquet", {"prompt": texts})
    report = json.loads(
        run_plan(
            src,
            model,
            "--max-num-seqs",
            8,
            "--max-num-batched-tokens",
            256,
            "--block-size",
            8,
            "--max-prompt-len",
            32,
            "--max-new-tokens",
            5,
            "--json",
        ).stdout
    )
    assert report["rows"] == len(texts)
    assert report["rows_error"] == 2  # too long (skip) and null
    assert sum(report["length_histogram"].values()) == len(texts) - 2
    assert all(int(edge) <= 32 for edge in report["length_histogram"])
    lens = [len(tok(t)["input_ids"]) for t in texts[:40]]
    assert report["prompt_tokens"] == sum(lens)
    assert report["max_output_tokens"] == 5 * 40
    assert report["longest_row_tokens"] == max(lens) + 5
    assert (report["max_num_seqs"], report["max_num_batched_tokens"], report["block_size"]) == (
        8,
        256,
        8,
    )
    assert report["prefix_caching"] is True
    if torch.cuda.is_available():  # sized from free memory when the job starts
        assert report["kv_cache_blocks"] is None and report["kv_cache_bytes"] is None
    else:  # the longest row at full concurrency, plus the scratch block
        assert report["kv_cache_blocks"] == 1 + 8 * -(-report["longest_row_tokens"] // 8)
        assert report["kv_cache_bytes"] > 0
    flagged = json.loads(
        run_plan(src, model, "--kv-cache-tokens", 1000, "--block-size", 8, "--json").stdout
    )
    assert flagged["kv_cache_blocks"] == 125  # the flag wins, on any device
    # the tiny llama: 2 layers x (k, v) x 2 kv heads x 8 dims per token, bf16 on a GPU
    itemsize = 2 if torch.cuda.is_available() else 4
    assert flagged["kv_cache_bytes"] == 125 * 8 * (2 * 2 * 2 * 8 * itemsize)
    assert flagged["kv_cache_bytes_per_rank"] == flagged["kv_cache_bytes"]
    # the weights the loaded model holds, within its norms (the plan leaves them out)
    held = LLM(model, device="cpu").weights_bytes_per_rank * itemsize // 4
    assert 0.95 * held <= flagged["weights_bytes_per_rank"] <= held
    # Two ranks: each holds one of the 2 KV heads and about half the weights.
    two_ranks = ("--kv-cache-tokens", 1000, "--block-size", 8, "-tp", 2)
    split = run_plan(src, model, *two_ranks)
    two = json.loads(run_plan(src, model, *two_ranks, "--json").stdout)
    assert two["tensor_parallel_size"] == 2
    assert two["kv_cache_bytes_per_rank"] * 2 == two["kv_cache_bytes"] == flagged["kv_cache_bytes"]
    assert two["weights_bytes_per_rank"] < 0.6 * flagged["weights_bytes_per_rank"]
    assert "per rank, 2 tensor-parallel ranks" in split.stdout


def test_plan_loads_no_weights(tmp_path, model, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("plan loaded the model")

    monkeypatch.setattr("batchgen.parallel.rank_model.load_model", boom)
    monkeypatch.setattr("batchgen.runner.run.LLM", boom)
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(5)})
    assert json.loads(run_plan(src, model, "--json").stdout)["rows"] == 5


@pytest.mark.slow
def test_compiled_run_equals_eager(tmp_path, model):
    """The compiled path end to end (--compile; the CPU default is eager): same results as
    --no-compile, shapes compiled."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(4)})
    common = (
        "--model",
        model,
        "--device",
        "cpu",
        "--kv-cache-tokens",
        4096,
        "--quiet",
        "--max-new-tokens",
        6,
        "--with-token-ids",
    )
    run_cli("run", src, "-o", tmp_path / "compiled", *common, "--compile")
    run_cli("run", src, "-o", tmp_path / "eager", *common, "--no-compile")
    compiled, eager = rows_by_id(tmp_path / "compiled"), rows_by_id(tmp_path / "eager")
    assert sorted(compiled) == [0, 1, 2, 3]
    for i in range(4):
        assert compiled[i]["token_ids"] == eager[i]["token_ids"]
        assert compiled[i]["generated_text"] == eager[i]["generated_text"]
    stats = read_stats(tmp_path / "compiled")
    assert stats["compiled"] is True
    assert stats["compiled_shapes"] == 0  # every compile in the warm-up, none after it
    assert stats["compile_s"] > 0 and stats["compile_cache"] in ("hit", "miss")
