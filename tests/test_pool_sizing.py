"""The CPU KV pool is sized from the whole job, not its first read-ahead window (issue 22): a
row's output never depends on where it sits in the input."""

from helpers import prompts, read_stats, rows_by_id, run_cli, write_parquet

# Auto-sized pool (no --kv-cache-tokens), a small window and few sequences in flight, so the
# first window's rows alone would size the pool far below the long row.
FLAGS = ("--device", "cpu", "--no-compile", "--quiet", "--window-rows", 4, "--max-num-seqs", 4)
FLAGS += ("--max-prompt-len", 4096, "--max-new-tokens", 8)


def _long_prompt() -> str:
    return " ".join(["the quick brown fox jumps over the lazy dog."] * 160)


def _run(tmp_path, long_model, texts, name, *flags):
    src = write_parquet(tmp_path / f"{name}.parquet", {"prompt": texts})
    out = tmp_path / name
    r = run_cli("run", src, "-o", out, "--model", long_model, *FLAGS, *flags)
    return r, rows_by_id(out), read_stats(out)


def test_a_long_row_after_a_window_of_short_rows_runs(tmp_path, long_model):
    texts = [*prompts(8), _long_prompt()]
    r, rows, stats = _run(tmp_path, long_model, texts, "last")
    assert rows[8]["prompt_tokens"] > 1000
    assert rows[8]["error"] is None and rows[8]["finish_reason"] == "length"
    assert stats["rows_error"] == 0
    assert stats["kv_cache_tokens"] >= 4 * (rows[8]["prompt_tokens"] + 8)
    # the same rows with the long one first: the same outputs
    _, first, _ = _run(tmp_path, long_model, [texts[-1], *texts[:-1]], "first")
    assert first[0]["generated_text"] == rows[8]["generated_text"]
    assert [first[i + 1]["generated_text"] for i in range(8)] == [
        rows[i]["generated_text"] for i in range(8)
    ]


def test_quiet_summary_counts_errors(tmp_path, long_model):
    texts = [*prompts(3), "x " * 5000]  # the last one is longer than --max-prompt-len
    r, rows, _ = _run(tmp_path, long_model, texts, "errors", "--max-error-rate", 1)
    assert rows[3]["finish_reason"] == "error"
    assert "4 rows (1 error)" in r.stdout, r.stdout


def test_a_measured_pool_is_sized_after_the_warm_up(model, monkeypatch):
    """A GPU's order (vLLM's), faked on the CPU: the warm-up runs on a pool of two blocks, then
    the pool takes the budget the warm-up left (ModelRunner.kv_budget_bytes), replacing the
    small one; the tokens are those of a pool sized up front."""
    import torch

    from batchgen.engine.model_runner import ModelRunner
    from batchgen.engine.sequence import SamplingParams
    from batchgen.llm import LLM

    rows = [list(range(2, 2 + n)) for n in (3, 17, 40)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = [c.token_ids for c in LLM(model, dtype="float32", device="cpu").generate(rows, params)]
    seen = []

    def budget(self, utilization):
        seen.append((self.num_blocks, utilization))  # asked after the warm-up, on 2 blocks
        return 40 * self.kv_bytes_per_block()

    monkeypatch.setattr(ModelRunner, "measures_memory", property(lambda self: True))
    monkeypatch.setattr(ModelRunner, "kv_budget_bytes", budget)
    llm = LLM(model, dtype="float32", device="cpu")
    warmed = []
    real = ModelRunner.warm_up
    monkeypatch.setattr(
        ModelRunner,
        "warm_up",
        lambda self, *a: warmed.append(self.num_blocks) or real(self, *a),
    )
    assert [c.token_ids for c in llm.generate(rows, params)] == want
    assert warmed == [2] and seen == [(2, 0.9)]
    assert llm.engine.kv_pool.num_blocks == 40 == llm.runner.num_blocks
    assert llm.runner.model.kv_caches[0].k.shape[0] == 40 * llm.runner.block_size
    assert torch.count_nonzero(llm.runner.model.kv_caches[0].k) > 0  # the new pool was used
