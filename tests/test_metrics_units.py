"""The metrics' parts on plain values: the latency histogram's percentiles and merge, the
attention-context count, the GPU peak table, the CPU probe's cache, and the NVML sampler
against a fake pynvml module (no GPU needed)."""

import json
import math
import random
import sys
import threading
import time
import types

import pytest
import torch

from batchgen.engine.sequence import Request, Scheduled, SeqState, StepPlan
from batchgen.engine.step_cost import attended, context_tokens
from batchgen.stats.latency import Latencies, LogHistogram
from batchgen.stats.nvml import NvmlSampler, gpu_rows
from batchgen.stats.peaks import NO_PROBE_ENV, gpu_peaks, resolve_peaks


def test_histogram_percentiles_are_within_a_bucket_of_the_exact_ones():
    rng = random.Random(0)
    xs = [rng.lognormvariate(-3, 1.5) for _ in range(5000)]
    h = LogHistogram()
    for x in xs:
        h.add(x)
    xs.sort()
    for q in (0.01, 0.5, 0.9, 0.99, 1.0):
        exact = xs[math.ceil(q * len(xs)) - 1]
        assert h.quantile(q) == pytest.approx(exact, rel=0.006)
    s = h.summary()
    assert s["p50"] <= s["p90"] <= s["p99"] <= s["max"] == xs[-1]
    assert s["mean"] == pytest.approx(sum(xs) / len(xs))
    assert LogHistogram().summary() == dict.fromkeys(("p50", "p90", "p99", "mean", "max"))


def test_histograms_merge_as_if_one_and_round_trip_through_json():
    rng = random.Random(1)
    a, b, both = LogHistogram(), LogHistogram(), LogHistogram()
    for i in range(300):
        x = rng.expovariate(10)
        (a if i % 3 else b).add(x)
        both.add(x)
    a.merge(LogHistogram.from_dict(json.loads(json.dumps(b.to_dict()))))
    assert a.counts == both.counts and a.summary() == pytest.approx(both.summary())
    lat = Latencies()
    again = Latencies.from_dict(json.loads(json.dumps(lat.to_dict())))
    assert again.summary() == lat.summary()


def test_attended_keys_match_a_count_position_by_position():
    def brute(start, n, w):
        return sum(min(p + 1, w) if w else p + 1 for p in range(start, start + n))

    for start in range(0, 20):
        for n in range(1, 20):
            for w in (None, 1, 4, 7, 16):
                assert attended(start, n, w) == brute(start, n, w), (start, n, w)


@pytest.mark.parametrize("window", [None, 3, 30])
def test_a_steps_context_is_its_chunks_and_decodes(window):
    seqs = [SeqState(Request(i, list(range(40))), i) for i in range(4)]
    decodes = [Scheduled(s, 20 + 3 * i, 1, True) for i, s in enumerate(seqs[:3])]
    plan = StepPlan(decodes=decodes, prefills=[Scheduled(seqs[3], 8, 32, True)])
    keys = [min(p + 1, window or p + 1) for p in (20, 23, 26, *range(8, 40))]
    assert context_tokens(plan, window) == sum(keys)


@pytest.mark.parametrize(
    "name, label",
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
        ("NVIDIA H200", "NVIDIA H200 SXM"),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB"),
        ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 40GB"),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB SXM"),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB PCIe"),
        ("NVIDIA L4", "NVIDIA L4"),
        ("NVIDIA L40S", "NVIDIA L40S"),
        ("NVIDIA A10G", "NVIDIA A10G"),
        ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"),
        ("NVIDIA L40", None),  # not an L4
        ("Tesla T4", None),
    ],
)
def test_gpu_peak_table_by_device_name(name, label):
    found = gpu_peaks(name)
    assert (found[2] if found else None) == label
    if found:
        assert 50e12 < found[0] < 1000e12 and 300e9 <= found[1] <= 4800e9


def test_given_peaks_win_and_the_cpu_probe_is_cached(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    given = resolve_peaks(cpu, torch.float32, 2.0, 50.0)
    assert (given.flops, given.bandwidth) == (2e12, 50e9) and "--peak-tflops" in given.source
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert resolve_peaks(cpu, torch.float32).flops is None  # probe off (conftest), none cached
    monkeypatch.delenv(NO_PROBE_ENV)
    measured = resolve_peaks(cpu, torch.float32)  # about a second
    assert measured.flops > 0 and measured.bandwidth > 0 and "measured now" in measured.source
    cached = json.loads((tmp_path / "batchgen" / "peaks.json").read_text())
    assert len(cached) == 1
    again = resolve_peaks(cpu, torch.float32, bandwidth_gbs=7.0)
    assert again.flops == measured.flops and again.bandwidth == 7e9
    assert "cached" in again.source and "--peak" in again.source


class _FakeNvml(types.ModuleType):
    """pynvml's calls the sampler makes, with readings that alternate between two values."""

    def __init__(self, power: bool) -> None:
        super().__init__("pynvml")
        self.power, self.calls = power, 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("handle", uuid)

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, handle):
        self.calls += 1
        return types.SimpleNamespace(total=80 * 2**30, used=(40 + self.calls % 2 * 20) * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=90 + self.calls % 2 * 10, memory=60 + self.calls % 2 * 20)

    def nvmlDeviceGetPowerUsage(self, handle):
        if not self.power:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 350_000 + self.calls % 2 * 100_000


@pytest.mark.parametrize("power", [True, False])
def test_nvml_sampler_with_a_fake_pynvml(monkeypatch, power):
    fake = _FakeNvml(power)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    props = types.SimpleNamespace(uuid="0000-1111")  # the GPU is found by torch's UUID
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    sampler = NvmlSampler(0, interval=0.001).start()
    assert len(sampler.samples) == 1
    deadline = time.monotonic() + 30
    while len(sampler.samples[0].util_pct) < 4:  # the thread samples; wait for a few
        assert time.monotonic() < deadline, "the sampler took no 4 samples in 30 s"
        threading.Event().wait(0.001)
    s = sampler.stop()
    assert fake.shut and s["gpu_name"] == "NVIDIA H100 80GB HBM3" and s["gpu_samples"] >= 4
    assert s["gpu_mem_total_bytes"] == 80 * 2**30
    assert s["gpu_util_max_pct"] == 100 and 90 <= s["gpu_util_mean_pct"] <= 100
    assert s["gpu_mem_used_max_bytes"] == 60 * 2**30
    assert 40 * 2**30 <= s["gpu_mem_used_mean_bytes"] <= 60 * 2**30
    assert s["gpu_mem_util_max_pct"] == 80 and 60 <= s["gpu_mem_util_mean_pct"] <= 80
    rows = dict(gpu_rows(s))
    assert rows["GPU memory max"] == "60.00 GiB (75% of 80.0 GiB)"
    if power:
        assert s["gpu_power_max_w"] == 450 and 350 <= s["gpu_power_mean_w"] <= 450
        assert rows["GPU power mean/max"].endswith("/ 450 W")
    else:
        assert s["gpu_power_mean_w"] is None and "GPU power mean/max" not in rows


def test_nvml_sampler_without_pynvml_does_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    sampler = NvmlSampler().start()
    assert sampler.samples == [] and sampler.stop() is None
