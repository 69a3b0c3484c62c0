"""Issue 31's numbers: bins of time for any job length, merged rates over the union of the
shards' run intervals, MFU/MBU that say why they are missing, the errors and finish reasons
on the page, and a cached CPU peak that states its age and load and is measured again when
stale."""

import json
import time
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import batchgen.stats.probe
from batchgen.data.layout import REPORT_FILE, STATS_FILE
from batchgen.report import tables, timebins
from batchgen.report.page import write_report
from batchgen.scaleout.merge_metrics import union_wall_s
from batchgen.stats import peaks
from batchgen.stats.probe import Ceilings


def _steps(t, dur, tokens, shard=None):
    d = {"t_s": np.array(t, float), "step_s": np.array(dur, float), "x": np.array(tokens, float)}
    if shard is not None:
        d["shard"] = np.array(shard)
    return d


@pytest.mark.parametrize("n_steps", [1, 2, 37, 5000])
def test_bins_of_time_keep_every_token_for_any_length(n_steps):
    t = np.cumsum(np.full(n_steps, 0.01)) + 0.5
    steps = _steps(t, np.full(n_steps, 0.01), np.arange(n_steps) + 1.0)
    centres, r = timebins.rates(steps, {"x": steps["x"]})
    assert len(centres) == min(200, max(60, n_steps))
    width = np.diff(timebins.edges(steps))
    assert (r["x"] * width).sum() == pytest.approx(steps["x"].sum())
    _, m = timebins.means(steps, {"x": np.full(n_steps, 7.0)})
    busy = m["x"][np.isfinite(m["x"])]
    assert len(busy) >= 2 and np.allclose(busy, 7.0)


def test_means_break_where_no_step_ran():
    steps = _steps([1.0, 9.0], [1.0, 1.0], [3.0, 5.0], shard=[0, 1])
    _, m = timebins.means(steps, {"x": steps["x"]}, n=9)
    assert m["x"][0] == pytest.approx(3.0) and m["x"][-1] == pytest.approx(5.0)
    assert np.isnan(m["x"][1:-1]).all()


def test_shards_side_by_side_add_their_rates():
    steps = _steps([1.0, 2.0, 1.0, 2.0], [1.0] * 4, [10, 10, 30, 30], shard=[0, 0, 1, 1])
    _, r = timebins.rates(steps, {"x": steps["x"]}, n=2)
    assert r["x"].tolist() == pytest.approx([40.0, 40.0])


def _shard(start, wall):
    return SimpleNamespace(stats={"started_unix": start, "wall_s": wall}, wall_s=wall)


def test_merged_wall_is_the_union_of_the_shards_intervals():
    assert union_wall_s([_shard(100.0, 3.0), _shard(105.0, 4.0)]) == 7.0  # one after the other
    assert union_wall_s([_shard(100.0, 3.0), _shard(101.0, 3.0)]) == 4.0  # overlapping
    assert union_wall_s([_shard(100.0, 5.0), _shard(101.0, 1.0)]) == 5.0  # inside
    old = SimpleNamespace(stats={"wall_s": 9.0}, wall_s=9.0)  # no started_unix: longest wall
    assert union_wall_s([_shard(100.0, 3.0), old]) == 9.0


def test_mfu_and_mbu_say_why_they_are_missing():
    assert "no peak known" in tables.utilisation({"mbu": None}, "mbu")
    known = tables.utilisation({"mbu": None, "peak_bandwidth": 1e10}, "mbu")
    assert "no peak known" not in known and "no decode steps" in known
    assert tables.utilisation({"mfu": 0.0123, "peak_flops": 1e12}, "mfu") == "1.23%"


def test_the_page_lists_finish_reasons_and_errors_with_examples(tmp_path):
    rows = {
        "id": [1, 2, 3, 4],
        "generated_text": ["a", None, None, "b"],
        "finish_reason": ["stop", "error", "error", "length"],
        "error": [None, "prompt of 2000 tokens > 1024", "prompt of 3000 tokens > 1024", None],
    }
    (tmp_path / ".batchgen").mkdir()
    pq.write_table(pa.table(rows), tmp_path / "part-00000.parquet")
    stats = {"rows": 4, "rows_error": 2, "wall_s": 2.0, "started_unix": 1.8e9, "load_s": 0.5}
    (tmp_path / STATS_FILE).write_text(json.dumps(stats))
    write_report(tmp_path)
    page = (tmp_path / REPORT_FILE).read_text()
    assert "2 x <code>prompt of N tokens &gt; N</code>" in page
    assert "row 2: <code>prompt of 2000 tokens &gt; 1024</code>" in page
    assert "error</th><td class=v>2 (50.0%)" in page and "stop</th>" in page
    assert "2027-01-15" in page  # started, in UTC
    assert "model load" in page


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """cpu_peaks with the probe on, a stand-in measurement, and a cache entry to age."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(peaks.NO_PROBE_ENV)
    calls = []

    def measure(device, dtype, **kw):
        calls.append(dtype)
        return Ceilings(str(device), str(dtype), 2e10, 3e10, 1, 1)

    monkeypatch.setattr(batchgen.stats.probe, "measure", measure)
    monkeypatch.setattr(peaks, "_load", lambda: (0.5, 16))  # a quiet machine now
    return SimpleNamespace(calls=calls, path=tmp_path / "batchgen" / "peaks.json")


def _age(probe, days, load=0.5):
    cache = json.loads(probe.path.read_text())
    for entry in cache.values():
        entry.update(measured_unix=time.time() - days * 86400, loadavg=load, cpus=16)
    probe.path.write_text(json.dumps(cache))


def test_a_cached_peak_states_its_age_and_load(probe):
    first = peaks.cpu_peaks(torch.float32)
    assert "measured now, load average 0.50 on 16 CPUs" in first[2]
    _age(probe, days=2)
    again = peaks.cpu_peaks(torch.float32)
    assert len(probe.calls) == 1 and "cached" in again[2]
    assert "2.0 days ago, load average 0.50 on 16 CPUs" in again[2]


def test_an_old_or_loaded_cached_peak_is_measured_again(probe):
    peaks.cpu_peaks(torch.float32)
    _age(probe, days=31)
    assert "measured now" in peaks.cpu_peaks(torch.float32)[2] and len(probe.calls) == 2
    _age(probe, days=0.01, load=12.0)  # under load, minutes ago: kept, with a warning
    kept = peaks.cpu_peaks(torch.float32)[2]
    assert len(probe.calls) == 2 and "measured under load, may read low" in kept
    _age(probe, days=0.5, load=12.0)  # hours ago, and quiet now: measured again
    assert "measured now" in peaks.cpu_peaks(torch.float32)[2] and len(probe.calls) == 3
