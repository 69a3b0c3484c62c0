"""Memory checks before the allocations that would fail (issue 22): the automatically sized CPU
KV pool, a config.json whose sizes imply more weights than the machine has (checked before any
grammar is built over its vocabulary), and `batchgen plan`'s warning."""

import json
import shutil

from helpers import EAGER, assert_one_line_error, prompts, run_cli, write_parquet

from batchgen.model.memory import format_bytes, host_available_bytes

# 64 rows (engine/config.py CPU_POOL_ROWS) of 2**24 tokens: ~280 GB of KV pool
HUGE_ROWS = ("--max-new-tokens", 2**24 - 64)


def test_an_automatic_cpu_kv_pool_beyond_free_memory_is_refused(tmp_path, long_context_model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    flags = ("--device", "cpu", "--no-compile", "--quiet", *HUGE_ROWS)
    out = tmp_path / "out"
    r = run_cli("run", src, "-o", out, "--model", long_context_model, *flags, exit_code=2)
    assert_one_line_error(r, "KV cache", "--max-num-seqs", "--kv-cache-tokens")


def _huge_vocab(tmp_path, model):
    path = shutil.copytree(model, tmp_path / "huge-vocab")
    cfg = json.loads((path / "config.json").read_text())
    cfg["vocab_size"] = 10**9
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_a_huge_vocabulary_is_refused_before_any_grammar_is_built(tmp_path, model, monkeypatch):
    def no_grammar(*_):
        raise AssertionError("a grammar was built for a model that cannot load")

    monkeypatch.setattr("batchgen.engine.constraints.Grammars.compile", no_grammar)
    big = _huge_vocab(tmp_path, model)
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    args = ("run", src, "-o", tmp_path / "out", "--model", big, *EAGER, "--choice", "yes,no")
    r = run_cli(*args, exit_code=2)
    assert_one_line_error(r, "weights", "vocab_size 1000000000")


def test_plan_warns_when_the_kv_cache_exceeds_memory(tmp_path, long_context_model):
    src = write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})
    r = run_cli("plan", src, "--model", long_context_model, *HUGE_ROWS)
    free = format_bytes(host_available_bytes())
    assert "warning: the KV cache" in r.stdout, r.stdout
    assert f"{free} free" in r.stdout
    r = run_cli("plan", src, "--model", long_context_model, *HUGE_ROWS, "--json")
    assert any("KV cache" in w for w in json.loads(r.stdout)["warnings"])
    small = run_cli("plan", src, "--model", long_context_model)
    assert "warning" not in small.stdout
