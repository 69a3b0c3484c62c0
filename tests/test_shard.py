"""Shards: every row in exactly one of N shards, the same shard in every process."""

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import success

from batchgen.cli import main
from batchgen.errors import ConfigError
from batchgen.job.config import RunConfig
from batchgen.job.fingerprint import options_fingerprint
from batchgen.job.shard import Shard, ShardError, shard_from_env, shard_of
from batchgen.runner.run import run

STRING_IDS = [f"r{i:04d}" for i in range(1000)]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("ids", [list(range(1000)), STRING_IDS], ids=["ints", "strings"])
def test_shards_cover_every_id_exactly_once(n, ids):
    shards = [Shard(i, n) for i in range(n)]
    owners = [[s.index for s in shards if s.mask([x]) == [True]] for x in ids]
    assert all(len(o) == 1 for o in owners)
    # a mask over all ids agrees with the ids one at a time, and the split is roughly even
    counts = Counter(o[0] for o in owners)
    for s in shards:
        assert sum(s.mask(ids)) == counts[s.index]
        assert abs(counts[s.index] - len(ids) / n) < 0.25 * len(ids) / n + 10


def test_shard_of_is_stable():
    # Fixed values: a change of hash would scatter resumed and merged shards of stored outputs.
    assert [shard_of(i, 7) for i in range(12)] == [4, 2, 1, 6, 5, 5, 2, 3, 2, 5, 6, 4]
    assert [shard_of(s, 7) for s in ["r0001", "r0002", "a", "b", "c"]] == [4, 4, 2, 5, 3]
    # and the same in another interpreter, whatever its hash seed
    code = "from batchgen.job.shard import shard_of; print([shard_of(i, 7) for i in range(12)])"
    env = {"PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip().splitlines()[-1] == "[4, 2, 1, 6, 5, 5, 2, 3, 2, 5, 6, 4]"


def test_int_and_string_ids_are_different_ids():
    assert [shard_of(i, 1000) for i in range(20)] != [shard_of(str(i), 1000) for i in range(20)]


def test_parse_dirname_and_errors():
    s = Shard.parse(" 2 / 5 ")
    assert (s.index, s.count, str(s), s.dirname) == (2, 5, "2/5", "shard-00002-of-00005")
    assert Shard.from_dirname(s.dirname) == s
    assert Shard.from_dirname("shard-2-of-5") is None
    for bad in ("5/5", "-1/3", "1/0", "a/b", "3"):
        with pytest.raises(ShardError):
            Shard.parse(bad)
    with pytest.raises(ShardError, match="boolean"):
        shard_of(True, 2)


def test_shard_from_slurm_env():
    assert shard_from_env({}) is None
    assert shard_from_env({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "4"}) == Shard(
        1, 4
    )
    with pytest.raises(ShardError, match="--array=0-3"):
        shard_from_env({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"})


def test_config_shard_fields():
    cfg = RunConfig(input="in.parquet", output="out", shard="1/3")
    assert cfg.shard == Shard(1, 3)
    assert cfg.output_dir.endswith("out/shard-00001-of-00003")
    assert options_fingerprint(cfg)["shard"] == "1/3"
    plain = RunConfig(input="in.parquet", output="out")
    assert plain.output_dir == "out" and "shard" not in options_fingerprint(plain)
    assert RunConfig(input="i", output="o", workers="3").workers == 3
    for bad in (
        {"shard": "3/3"},
        {"workers": "0"},
        {"workers": "many"},
        {"shard": "0/2", "workers": 2},
    ):
        with pytest.raises(ConfigError):
            RunConfig(input="i", output="o", **bad)
    with pytest.raises(ConfigError, match="shard"):
        RunConfig.from_mapping({"input": "i", "output": "o", "shard": "x"}, "job.yaml")


@pytest.fixture()
def captured_config(monkeypatch):
    """`batchgen run` with run() replaced by a recorder of its RunConfig (and its checks of
    paths before torch loads by nothing: the inputs named here are not written)."""
    seen = []

    def fake_run(cfg):
        seen.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr("batchgen.runner.run.run", fake_run)
    monkeypatch.setattr(sys.modules["batchgen.cli.main"], "precheck", lambda cfg: None)
    return seen


def test_cli_shard_flag_spec_and_slurm_env(tmp_path, captured_config, monkeypatch):
    spec = tmp_path / "job.yaml"
    spec.write_text("input: in.parquet\noutput: out\nshard: 2/4\n")
    runner = CliRunner()
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    runner.invoke(main, ["run", "in.parquet", "-o", "out"])
    runner.invoke(main, ["run", "in.parquet", "-o", "out", "--shard", "0/5"])
    runner.invoke(main, ["run", str(spec)])
    assert [str(c.shard) for c in captured_config] == ["1/3", "0/5", "2/4"]
    r = runner.invoke(main, ["run", "in.parquet", "-o", "out", "--workers", "2"])
    assert r.exit_code == 2 and "Slurm array task" in r.output
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    runner.invoke(main, ["run", "in.parquet", "-o", "out"])
    assert captured_config[-1].shard is None
    # --input overrides a spec's input, and conflicts with a data SOURCE
    runner.invoke(main, ["run", str(spec), "--input", "builtin:samples/reviews.parquet"])
    assert captured_config[-1].input.endswith("assets/samples/reviews.parquet")
    r = runner.invoke(main, ["run", "in.parquet", "--input", "x.parquet", "-o", "out"])
    assert r.exit_code == 2 and "pass one of them" in r.output


@pytest.mark.parametrize("id_column", [None, "key"])
def test_sharded_runs_write_every_row_once(tmp_path, gpt2, id_column):
    n_rows, n = 23, 3
    data = tmp_path / "in.parquet"
    keys = [f"k{(i * 7919) % 1000:03d}" for i in range(n_rows)]
    pq.write_table(pa.table({"key": keys, "prompt": [f"the fox {i}" for i in range(n_rows)]}), data)
    base = dict(
        input=str(data),
        output=str(tmp_path / "out"),
        model=str(gpt2),
        id_column=id_column,
        max_new_tokens=3,
        device="cpu",
        compile=False,
        window_rows=5,
        quiet=True,
    )
    ids = []
    for i in range(n):
        cfg = RunConfig(**base, shard=f"{i}/{n}")
        stats = run(cfg)
        shard_ids = _ids(cfg.output_dir, id_column or "id")
        assert stats.rows == len(shard_ids)
        assert all(shard_of(x, n) == i for x in shard_ids)
        ids += shard_ids
    expected = keys if id_column else list(range(n_rows))
    assert sorted(ids) == sorted(expected)  # each row exactly once over the shards
    # with a limit, the shards split the first `limit` rows
    # (with string keys, shard 0 gets none of them: an empty shard still completes)
    limited = []
    for i in range(n):
        cfg = RunConfig(**{**base, "output": str(tmp_path / "lim")}, shard=f"{i}/{n}", limit=10)
        run(cfg)
        assert success(tmp_path / "lim" / Shard(i, n).dirname)
        limited += _ids(cfg.output_dir, id_column or "id")
    assert sorted(limited) == sorted(expected[:10])


def _ids(directory, id_column: str = "id") -> list:
    return [
        x
        for p in sorted(Path(directory).glob("part-*.parquet"))
        for x in pq.read_table(p, columns=[id_column]).column(id_column).to_pylist()
    ]
