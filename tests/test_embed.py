"""Embeddings (task embed, `LLM.embed`): a prompt's final hidden states (after the final norm)
pooled last / mean / cls, equal to sentence-transformers' `encode` of the same checkpoint
(cosine >= 0.99999, float32) on the sharpened tiny Llama and Qwen2 saved as base models
(`LlamaModel`, no `model.` prefix, no LM head, as embedding models ship), for mixed lengths,
chunked prompts and a prefix-cache hit; the pooling read from the checkpoint's own
modules.json; Matryoshka dimensions truncated then normalized; and `batchgen run --task
embed`'s fixed-size float32 `embedding` column, read back with DuckDB."""

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import transformers
from helpers import (
    assert_one_line_error,
    cpu_llm,
    read_output,
    rows_by_id,
    run_cli,
    run_job,
    write_parquet,
)

from batchgen.errors import ConfigError, ModelLoadError
from batchgen.report import plots, tables
from batchgen.report.load import load

FAMILIES = ("llama", "qwen2")
MODES = {"last": "lasttoken", "mean": "mean", "cls": "cls"}
TEXTS = [
    "the quick brown fox",
    "a",
    "hello world and all the people in it " * 6,  # chunked at 16 tokens a step
    "the quick brown fox jumps over the lazy dog",
]


def save_base_model(causal_dir: Path, out: Path) -> Path:
    """causal_dir's decoder saved alone (transformers' AutoModel), with its tokenizer less
    its chat template (sentence-transformers 5 would wrap each text in it)."""
    transformers.AutoModel.from_pretrained(causal_dir).save_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(causal_dir)
    tok.chat_template = None
    tok.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def save_st_model(base: Path, out: Path, mode: str, normalize: bool = True) -> Path:
    """A sentence-transformers checkpoint around base: Transformer, Pooling(mode), Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    t = Transformer(str(base))
    mods = [t, Pooling(t.get_embedding_dimension(), pooling_mode=mode)]
    st = SentenceTransformer(modules=mods + [Normalize()] * normalize, device="cpu")
    st.save(str(out))
    return out


@pytest.fixture(scope="module")
def bases(sharp_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("base")
    return {f: save_base_model(sharp_dirs[f], root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def st_dirs(bases, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("st")
    return {
        (f, m): save_st_model(bases[f], root / f"{f}-{m}", st)
        for f in FAMILIES
        for m, st in MODES.items()
    }


def st_encode(model_dir: Path, texts: list[str], **kw) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu").encode(texts, **kw)


def assert_same_directions(got, want) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.99999, cos


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_embed_equals_sentence_transformers(st_dirs, family, mode):
    """Mixed lengths, a prompt chunked over several steps: the pooling and the normalization
    come from the checkpoint's modules.json and 1_Pooling/config.json."""
    d = st_dirs[family, mode]
    with cpu_llm(d, max_num_batched_tokens=16, block_size=4) as llm:
        out = llm.embed(TEXTS)
    assert [o.index for o in out] == list(range(len(TEXTS)))
    assert max(len(o.prompt_token_ids) for o in out) > 16  # one prompt ran in chunks
    got = np.array([o.outputs.embedding for o in out])
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # its Normalize module
    assert_same_directions(got, st_encode(d, TEXTS))


def test_embed_equals_automodel_pooled_hidden_states_with_a_prefix_cache_hit(bases):
    """Last-token pooling reads the last token only: a row whose prefix is in the cache runs
    its tail and is still equal to transformers' AutoModel; flags choose the pooling."""
    prefix = "the quick brown fox jumps over the lazy dog " * 3
    texts = [prefix + "and runs", prefix + "then sleeps all day"]
    model = transformers.AutoModel.from_pretrained(bases["llama"], dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(bases["llama"])
    with torch.no_grad():
        want = [model(**tok(t, return_tensors="pt")).last_hidden_state[0] for t in texts]
    with cpu_llm(bases["llama"], block_size=4) as llm:
        first = llm.embed(texts[:1], pooling="last")
        second = llm.embed(texts[1:], pooling="last")
        mean = llm.embed(texts[1:], pooling="mean")  # reads every token: no hit
    assert second[0].completion.cached_tokens > 0
    assert mean[0].completion.cached_tokens == 0
    got = [o.outputs.embedding for o in first + second]
    assert_same_directions(got, [h[-1].numpy() for h in want])
    assert_same_directions([mean[0].outputs.embedding], [want[1].mean(0).numpy()])
    # no Normalize module, none asked for: the raw pooled state
    assert np.allclose(got[0], want[0][-1].numpy(), atol=1e-4)


def test_matryoshka_dimensions_truncate_then_normalize(st_dirs):
    d = st_dirs["llama", "mean"]
    want = st_encode(d, TEXTS, normalize_embeddings=False)[:, :8]
    want = want / np.linalg.norm(want, axis=1, keepdims=True)
    with cpu_llm(d) as llm:
        out = llm.embed(TEXTS, dimensions=8)
        raw = llm.embed(TEXTS, normalize=False)
        with pytest.raises(ConfigError, match="dimensions"):
            llm.embed(TEXTS, dimensions=33)
        with pytest.raises(ConfigError, match="pooling"):
            llm.embed(TEXTS, pooling="max")
    got = np.array([o.outputs.embedding for o in out])
    assert got.shape == (len(TEXTS), 8)
    assert_same_directions(got, want)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # normalize=False overrides the checkpoint's Normalize module: mean pooling's own norm
    assert not np.allclose(np.linalg.norm([o.outputs.embedding for o in raw], axis=1), 1.0)


def test_a_pooling_batchgen_does_not_run_is_refused(bases, tmp_path):
    """Max pooling (unless a flag chooses another) and a Dense projection are refused."""
    d = save_st_model(bases["llama"], tmp_path / "st-max", "max")
    with cpu_llm(d) as llm:
        with pytest.raises(ModelLoadError, match="max"):
            llm.embed(TEXTS)
        assert len(llm.embed(TEXTS, pooling="last")) == len(TEXTS)  # a flag overrides it
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense

    st = SentenceTransformer(str(save_st_model(bases["llama"], tmp_path / "st", "lasttoken")))
    st.append(Dense(32, 8))  # a projection after the pooling: not run by batchgen
    st.save(str(tmp_path / "st-dense"))
    with cpu_llm(tmp_path / "st-dense") as llm, pytest.raises(ModelLoadError, match="Dense"):
        llm.embed(TEXTS, pooling="last")


def test_cli_embed_column_read_back_with_duckdb(st_dirs, tmp_path):
    """`batchgen run --task embed`: a fixed-size float32 list column, equal to
    sentence-transformers' encode (its pooling and Normalize read from the checkpoint), in
    pyarrow, pandas, datasets and DuckDB; a row without a prompt an error record with a null
    embedding; --dimensions and --embedding-dtype float16."""
    import duckdb

    d = st_dirs["qwen2", "mean"]
    columns = {"prompt": [*TEXTS, None], "topic": list("abcde")}
    src = write_parquet(tmp_path / "in.parquet", columns)
    flags = ("--task", "embed", "--max-num-batched-tokens", "16", "--max-error-rate", "1")
    run_job(src, tmp_path / "out", d, *flags)
    table = read_output(tmp_path / "out")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    rows = rows_by_id(tmp_path / "out")
    assert [rows[i]["topic"] for i in range(5)] == list("abcde")
    assert [rows[i]["finish_reason"] for i in range(5)] == ["stop"] * 4 + ["error"]
    assert rows[4]["embedding"] is None and rows[4]["error"]
    assert_same_directions([rows[i]["embedding"] for i in range(4)], st_encode(d, TEXTS))
    frame = table.to_pandas().set_index("id")
    assert len(frame.loc[0, "embedding"]) == 32 and frame.loc[4, "embedding"] is None
    parts = str(tmp_path / "out" / "*.parquet")
    query = f"SELECT id, embedding FROM read_parquet('{parts}') WHERE error IS NULL ORDER BY id"
    got = duckdb.sql(query).fetchall()
    assert [i for i, _ in got] == [0, 1, 2, 3]
    assert_same_directions([e for _, e in got], st_encode(d, TEXTS))
    import datasets

    ds = datasets.Dataset.from_parquet(parts, cache_dir=str(tmp_path / "hf-cache"))
    assert ds.features["embedding"].length == 32  # a fixed-size Sequence of float32
    lens = [0 if e is None else len(e) for e in ds.to_pandas().sort_values("id")["embedding"]]
    assert lens == [32] * 4 + [0]

    run_job(
        src,
        tmp_path / "f16",
        d,
        "--task",
        "embed",
        "--dimensions",
        "8",
        "--embedding-dtype",
        "float16",
        "--pooling",
        "last",
        "--no-normalize",
    )
    f16 = read_output(tmp_path / "f16")
    assert f16.schema.field("embedding").type == pa.list_(pa.float16(), 8)
    with cpu_llm(d) as llm:
        want = [o.outputs.embedding for o in llm.embed(TEXTS, pooling="last", normalize=False)]
    got16 = rows_by_id(tmp_path / "f16")
    for i in range(4):
        assert np.allclose(got16[i]["embedding"], want[i][:8], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--dimensions", "4"), ("--dimensions", "--task embed")),
        (("--task", "embed", "--n", "2"), ("samples nothing", "--n")),
        (("--task", "embed", "--dimensions", "999"), ("dimensions", "32")),
        (("--task", "classify"), ("classifier head",)),
    ],
)
def test_cli_embed_refuses_options_that_mean_nothing(st_dirs, tmp_path, flags, words):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": TEXTS})
    r = run_job(src, tmp_path / "out", st_dirs["llama", "last"], *flags, exit_code=None)
    assert r.exit_code != 0
    assert_one_line_error(r, *words)


def embeddings_line(cid: str, text, **body) -> str:
    line = {"custom_id": cid, "method": "POST", "url": "/v1/embeddings"}
    return json.dumps({**line, "body": {"model": "emb", "input": text, **body}}) + "\n"


def test_openai_embeddings_lines(st_dirs, tmp_path):
    """/v1/embeddings request lines (`vllm run-batch`'s): OpenAI's embeddings responses, each
    equal to sentence-transformers' encode; a list input is its line's error; completion
    lines are refused in an embed job, and embeddings lines outside one."""
    d = st_dirs["llama", "last"]
    lines = [embeddings_line(f"r{i}", t) for i, t in enumerate(TEXTS)]
    lines.insert(2, embeddings_line("many", ["a", "b"]))
    src = tmp_path / "req.jsonl"
    src.write_text("".join(lines))
    out = tmp_path / "out"
    run_job(src, out, d, "--task", "embed", "--output-format", "openai")
    got = [json.loads(x) for x in (out / ".batchgen" / "results.jsonl").read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["r0", "r1", "many", "r2", "r3"]
    bad = got.pop(2)
    assert bad["response"]["status_code"] == 400 and "input is a list" in bad["error"]["message"]
    want = st_encode(d, TEXTS)
    for g, w in zip(got, want, strict=True):
        body = g["response"]["body"]
        assert g["response"]["status_code"] == 200 and g["error"] is None
        assert body["object"] == "list" and body["model"] == "emb"
        (data,) = body["data"]
        assert data["object"] == "embedding" and data["index"] == 0
        assert_same_directions([data["embedding"]], [w])
        usage = body["usage"]
        assert usage["prompt_tokens"] == usage["total_tokens"] > 0

    r = run_job(src, tmp_path / "gen", d, exit_code=None)
    assert_one_line_error(r, "/v1/embeddings", "--task embed")
    completion = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "hi"}}
    completions = tmp_path / "completions.jsonl"
    completions.write_text(json.dumps(completion) + "\n")
    r = run_job(completions, tmp_path / "c", d, "--task", "embed", exit_code=None)
    assert_one_line_error(r, "completion lines")
    mixed = tmp_path / "mixed.jsonl"  # the other kind's lines: error rows
    mixed.write_text(lines[0] + json.dumps(completion) + "\n")
    run_job(mixed, tmp_path / "mixed", d, "--task", "embed", "--max-error-rate", "1")
    rows = rows_by_id(tmp_path / "mixed", "custom_id")
    assert rows["r0"]["error"] is None and len(rows["r0"]["embedding"]) == 32
    assert "runs /v1/embeddings lines only" in rows["c"]["error"]


def openai_embeddings(out: Path) -> dict[str, dict]:
    lines = (out / ".batchgen" / "results.jsonl").read_text().splitlines()
    return {g["custom_id"]: g for g in map(json.loads, lines)}


def line_embedding(line: dict) -> np.ndarray:
    """An output line's one embedding: a float list, or base64 of little-endian float32."""
    assert line["error"] is None and line["response"]["status_code"] == 200, line
    (data,) = line["response"]["body"]["data"]
    e = data["embedding"]
    if isinstance(e, str):
        return np.frombuffer(base64.b64decode(e), dtype="<f4")
    return np.asarray(e, dtype=np.float32)


@pytest.mark.parametrize("normalize", ["--normalize", "--no-normalize"])
def test_openai_embeddings_dimensions_and_base64_equal_the_cli(st_dirs, tmp_path, normalize):
    """A line's `dimensions` equals `--dimensions N` (cut, then normalized again where the
    job normalizes; without, the same floats); `encoding_format` base64 is the float list's
    little-endian float32 bytes; a bad value is its line's error, the job goes on."""
    d = st_dirs["llama", "last"]
    lines = [
        embeddings_line("r0", TEXTS[0], dimensions=8),
        embeddings_line("r1", TEXTS[1], dimensions=8, encoding_format="base64"),
        embeddings_line("r2", TEXTS[2], encoding_format="base64"),
        embeddings_line("r2f", TEXTS[2], encoding_format="float"),
        embeddings_line("r3", TEXTS[3], dimensions=32),
        embeddings_line("big", TEXTS[0], dimensions=33),
        embeddings_line("zero", TEXTS[0], dimensions=0),
        embeddings_line("text", TEXTS[0], dimensions="8"),
        embeddings_line("hex", TEXTS[0], encoding_format="hex"),
    ]
    src = tmp_path / "req.jsonl"
    src.write_text("".join(lines))
    flags = ("--task", "embed", normalize, "--max-num-batched-tokens", "16")
    run_job(src, tmp_path / "out", d, *flags, "--output-format", "openai", "--max-error-rate", "1")
    got = openai_embeddings(tmp_path / "out")
    cli = tmp_path / "in.parquet"
    write_parquet(cli, {"prompt": TEXTS})
    run_job(cli, tmp_path / "cli8", d, *flags, "--dimensions", "8")
    run_job(cli, tmp_path / "cli", d, *flags)
    rows8, rows = rows_by_id(tmp_path / "cli8"), rows_by_id(tmp_path / "cli")
    want8 = [np.asarray(rows8[i]["embedding"], dtype=np.float32) for i in range(4)]
    want = [np.asarray(rows[i]["embedding"], dtype=np.float32) for i in range(4)]
    for cid, i in (("r0", 0), ("r1", 1)):
        e = line_embedding(got[cid])
        assert e.shape == (8,)
        if normalize == "--no-normalize":
            assert np.array_equal(e, want8[i])  # a cut alone
        else:  # a cut of the normalized vector normalized again: within rounding
            np.testing.assert_allclose(e, want8[i], rtol=1e-6, atol=1e-7)
    assert np.array_equal(line_embedding(got["r2"]), line_embedding(got["r2f"]))
    assert np.array_equal(line_embedding(got["r2f"]), want[2])
    np.testing.assert_allclose(line_embedding(got["r3"]), want[3], rtol=1e-6, atol=1e-7)
    messages = {
        "big": "above this job's embedding size, 32",
        "zero": "dimensions is 0, below 1",
        "text": "dimensions is '8', not an integer",
        "hex": "encoding_format 'hex' is not one of float, base64",
    }
    for cid, words in messages.items():
        assert got[cid]["response"]["status_code"] == 400, got[cid]
        assert words in got[cid]["error"]["message"]


def test_report_of_an_embed_job_has_no_decode_plots(st_dirs, tmp_path):
    """A prefill-only job's page: prompt tokens/s, its latency alone, no decoding rows, TPOT
    or decode ceiling (nothing was decoded)."""
    src = write_parquet(tmp_path / "in.parquet", {"prompt": TEXTS * 3})
    out = tmp_path / "out"
    run_job(src, out, st_dirs["llama", "last"], "--task", "embed")
    run_cli("report", out)
    assert (out / ".batchgen" / "report.html").stat().st_size > 0
    data = load(out)
    s = data.stats
    assert tables.prefill_only(s) and s["prompt_tokens"] > 0
    names = [k for k, _ in tables.stats_rows(s)]
    assert "prompt tokens / s" in names and "output tokens / s" not in names
    assert not any(k.startswith(("TPOT", "TTFT", "MBU")) for k in names)

    def labels(fig) -> list[str]:
        return [x for ax in fig.axes for x in ax.get_legend_handles_labels()[1]]

    assert labels(plots.throughput(data.steps, s)) == ["prompt tokens/s computed"]
    assert "decoding rows" not in labels(plots.occupancy(data.steps, decodes=False))
    assert [a.get_title() for a in plots.distributions(s).axes] == ["latency"]
    assert not any("decode" in x for x in labels(plots.roofline(data.steps, s)))


def test_default_prompt_of_a_sentence_transformers_checkpoint(st_dirs, tmp_path):
    """config_sentence_transformers.json's default prompt goes before each text, as encode
    puts it (an instruction-tuned embedding model's query prefix)."""
    d = tmp_path / "prompted"
    shutil.copytree(st_dirs["llama", "mean"], d)
    cfg_path = d / "config_sentence_transformers.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(prompts={"query": "query: the ", "document": ""}, default_prompt_name="query")
    cfg_path.write_text(json.dumps(cfg))
    with cpu_llm(d) as llm:
        got = [o.outputs.embedding for o in llm.embed(TEXTS)]
    assert_same_directions(got, st_encode(d, TEXTS))
    with cpu_llm(st_dirs["llama", "mean"]) as llm:  # without the prompt: other embeddings
        plain = [o.outputs.embedding for o in llm.embed(TEXTS)]
    assert not np.allclose(got, plain, atol=1e-3)


def test_embed_at_two_tensor_parallel_ranks(st_dirs):
    """Two ranks over gloo (this process rank 0): rank 0 pools the reduced hidden states, and
    runs the LM head's all-gather with the other rank (it would wait for it otherwise)."""
    d = st_dirs["llama", "last"]
    with cpu_llm(d, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        got = [o.outputs.embedding for o in llm.embed(TEXTS)]
    assert_same_directions(got, st_encode(d, TEXTS))


def test_job_spec_keys_and_plan_of_an_embed_job(st_dirs, tmp_path):
    """`task: embed` with pooling, normalize, dimensions and embedding_dtype as job-spec keys;
    `batchgen plan` counts no output tokens."""
    d = st_dirs["llama", "last"]
    src = write_parquet(tmp_path / "in.parquet", {"prompt": TEXTS})
    out = tmp_path / "out"
    spec = tmp_path / "job.yaml"
    keys = "task: embed\npooling: mean\nnormalize: true\ndimensions: 8\nembedding_dtype: float32\n"
    spec.write_text(f"input: {src}\noutput: {out}\nmodel: {d}\n{keys}")
    plan = json.loads(run_cli("plan", spec, "--json").stdout)
    assert plan["max_output_tokens"] == 0
    run_cli("run", spec, "--quiet")
    rows = rows_by_id(out)
    want = st_encode(st_dirs["llama", "mean"], TEXTS, normalize_embeddings=False)[:, :8]
    assert_same_directions([rows[i]["embedding"] for i in range(4)], want)
    assert np.allclose(np.linalg.norm([rows[i]["embedding"] for i in range(4)], axis=1), 1.0)
