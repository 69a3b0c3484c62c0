"""A bad peaks cache (audit, issue 32) is treated as absent: the job runs, the probe measures
again and the cache is rewritten whole; given peaks never read it."""

import json
from types import SimpleNamespace

import pytest
from helpers import EAGER, prompts, run_cli, run_job, write_parquet

import batchgen.stats.probe
from batchgen.data.writer import REPORT_FILE, STATS_FILE
from batchgen.stats.peaks import NO_PROBE_ENV
from batchgen.stats.probe import Ceilings

FLOPS, BANDWIDTH = 3e10, 2e10  # what the stand-in probe measures


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """peaks.json under a fresh XDG_CACHE_HOME, with the probe on; the probe is a stand-in
    that counts its calls (the real one takes a second)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(NO_PROBE_ENV)
    calls = []

    def measure(device, dtype, **kw):
        calls.append(dtype)
        return Ceilings(str(device), str(dtype), BANDWIDTH, FLOPS, 1, 1)

    monkeypatch.setattr(batchgen.stats.probe, "measure", measure)
    path = tmp_path / "xdg" / "batchgen" / "peaks.json"
    path.parent.mkdir(parents=True)
    return SimpleNamespace(path=path, calls=calls)


def read_stats(out):
    return json.loads((out / STATS_FILE).read_text())


def _key(path):
    return next(iter(json.loads(path.read_text())))


def _entry(**kw):
    return {"matmul_flops": 5e10, "bandwidth_Bps": 1e10, **kw}


BAD = {
    "a list": [1, 2],
    "a string": "peaks",
    "an entry without flops": None,  # filled in below: the real key, a missing field
    "zero flops": _entry(matmul_flops=0),
    "negative bandwidth": _entry(bandwidth_Bps=-1.0),
    "absurd flops": _entry(matmul_flops=300.0),  # MFU 441,309,057
    "infinite flops": _entry(matmul_flops=float("inf")),
    "a flops string": _entry(matmul_flops="5e10"),
    "a bool": _entry(bandwidth_Bps=True),
    "a huge integer": _entry(matmul_flops=10**400),
}


@pytest.fixture
def job(tmp_path):
    return write_parquet(tmp_path / "in.parquet", {"prompt": prompts(2)})


def _write_bad(cache, case, job, model, tmp_path):
    """The cache with `case` under this machine's key (found from a first, good run)."""
    run_job(job, tmp_path / "first", model, "--max-new-tokens", 1)
    key = _key(cache.path)
    bad = BAD[case]
    if case == "an entry without flops":
        bad = {key: {"bandwidth_Bps": 1e10}}
    elif isinstance(bad, dict):
        bad = {key: bad}
    cache.path.write_text(json.dumps(bad))  # Python's json writes Infinity and 10**400 as they are
    cache.calls.clear()


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_cache_is_probed_again_and_rewritten(cache, job, model, tmp_path, case):
    _write_bad(cache, case, job, model, tmp_path)
    out = tmp_path / "out"
    run_job(job, out, model, "--max-new-tokens", 1)
    stats = read_stats(out)
    assert len(cache.calls) == 1 and "measured now" in stats["peak_source"]
    assert stats["peak_flops"] == FLOPS and stats["peak_bandwidth"] == BANDWIDTH
    rewritten = json.loads(cache.path.read_text())
    assert isinstance(rewritten, dict)
    (entry,) = [v for k, v in rewritten.items() if k == _key(cache.path)]
    assert (entry["matmul_flops"], entry["bandwidth_Bps"]) == (FLOPS, BANDWIDTH)
    # The next run takes the rewritten cache.
    run_job(job, tmp_path / "again", model, "--max-new-tokens", 1)
    assert len(cache.calls) == 1 and "cached" in read_stats(tmp_path / "again")["peak_source"]


def test_a_partial_given_peak_gets_around_a_bad_cache(cache, job, model, tmp_path):
    cache.path.write_text("[1, 2]")
    run_job(job, tmp_path / "out", model, "--max-new-tokens", 1, "--peak-tflops", 2)
    stats = read_stats(tmp_path / "out")
    assert stats["peak_flops"] == 2e12 and stats["peak_bandwidth"] == BANDWIDTH


def test_given_peaks_never_read_the_cache(cache, job, model, tmp_path):
    cache.path.write_text("[1, 2]")
    flags = ("--peak-tflops", 2, "--peak-bandwidth-gbs", 10)
    run_job(job, tmp_path / "out", model, "--max-new-tokens", 1, *flags)
    stats = read_stats(tmp_path / "out")
    assert (stats["peak_flops"], stats["peak_bandwidth"]) == (2e12, 10e9)
    assert cache.calls == [] and cache.path.read_text() == "[1, 2]"


@pytest.mark.parametrize("load", [10.0, 0.1])
def test_peaks_probed_under_load_give_no_mfu_figure(cache, job, model, tmp_path, monkeypatch, load):
    """A probe taken with the load average above half the CPUs reads low, so an MFU over it
    reads high (76% was printed as a figure): the table and the report say why there is none;
    stats.json keeps the numbers and `peak_under_load`. A quiet probe's MFU is printed."""
    import re

    import batchgen.stats.peaks

    monkeypatch.setattr(batchgen.stats.peaks, "_load", lambda: (load, 2))
    out = tmp_path / "out"
    r = run_cli("run", job, "-o", out, "--model", model, *EAGER, "--max-new-tokens", 2)
    row = next(line for line in r.stdout.splitlines() if "MFU / MBU" in line)
    run_cli("report", out)
    page = (out / REPORT_FILE).read_text()
    mfu = re.search(r"<th>MFU</th><td class=v>([^<]*)</td>", page)[1]
    assert read_stats(out)["peak_under_load"] is (load > 1)
    if load > 1:
        assert "- / - (the CPU peaks were probed under load" in row and "%" not in row
        assert mfu.startswith("- (the CPU peaks were probed under load") and "%" not in mfu
    else:
        assert re.search(r"MFU / MBU\s+[\d.]+% / [\d.]+%", row) and mfu.endswith("%")
