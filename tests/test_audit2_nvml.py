"""Audit 2, item 14: NVML samples the GPU torch runs on, found by UUID (NVML's indices ignore
CUDA_VISIBLE_DEVICES), and lets NVML go when that GPU cannot be found. A fake pynvml stands
in for the driver."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from batchgen.stats.nvml import NvmlSampler, gpu_rows

# Three GPUs in the machine, by NVML's (physical) index; this process sees only the last.
GPUS = [("GPU-aaaa", "GPU A"), ("GPU-bbbb", "GPU B"), ("GPU-cccc", "GPU C")]


@pytest.fixture
def fake_nvml(monkeypatch):
    calls = []
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: calls.append("init")
    nvml.nvmlShutdown = lambda: calls.append("shutdown")
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    by_uuid = {u: i for i, (u, _) in enumerate(GPUS)}

    def get_by_uuid(uuid):
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        if uuid not in by_uuid:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return by_uuid[uuid]

    nvml.nvmlDeviceGetHandleByUUID = get_by_uuid
    nvml.nvmlDeviceGetName = lambda h: GPUS[h][1]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=(h + 1) << 30, used=h << 20)
    nvml.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=50, memory=10)
    nvml.nvmlDeviceGetPowerUsage = lambda h: 100_000
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return calls


def _visible(monkeypatch, uuid: str) -> None:
    """torch's cuda:0 is the GPU of this UUID (torch prints it without the "GPU-")."""
    props = SimpleNamespace(uuid=uuid.removeprefix("GPU-"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)


def test_the_sampled_gpu_is_torchs_not_nvmls_index_0(fake_nvml, monkeypatch):
    _visible(monkeypatch, "GPU-cccc")  # CUDA_VISIBLE_DEVICES=2
    s = NvmlSampler(0, interval=0.01).start()
    summary = s.stop()
    assert summary["gpu_name"] == "GPU C" and summary["gpu_mem_total_bytes"] == 3 << 30
    assert fake_nvml == ["init", "shutdown"]


def test_a_gpu_nvml_cannot_find_shuts_nvml_down(fake_nvml, monkeypatch):
    _visible(monkeypatch, "GPU-dddd")
    s = NvmlSampler(0).start()
    assert s.samples == [] and s.stop() is None
    assert fake_nvml == ["init", "shutdown"]


def test_a_tensor_parallel_job_samples_every_ranks_gpu(fake_nvml, monkeypatch):
    """Item 14.2: rank r runs on cuda:r; with CUDA_VISIBLE_DEVICES=1,2 those are NVML's GPUs
    B and C, and both are sampled: memory is the fuller one's, power the sum."""
    visible = ["bbbb", "cccc"]
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=visible[i])
    )
    summary = NvmlSampler(range(2), interval=0.01).start().stop()
    assert summary["gpu_count"] == 2
    assert [g["gpu_name"] for g in summary["gpus"]] == ["GPU B", "GPU C"]
    assert summary["gpu_mem_total_bytes"] == 2 << 30  # the first's, as each GPU's own
    assert summary["gpu_mem_used_max_bytes"] == 2 << 20  # GPU C's, the fuller
    assert summary["gpu_power_mean_w"] == 200.0  # 100 W each
    assert fake_nvml == ["init", "shutdown"]
    rows = dict(gpu_rows(summary))
    assert rows["GPUs sampled"].startswith("2 ")


def test_one_missing_gpu_of_several_shuts_nvml_down(fake_nvml, monkeypatch):
    visible = ["bbbb", "dddd"]
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=visible[i])
    )
    s = NvmlSampler([0, 1]).start()
    assert s.samples == [] and s.stop() is None
    assert fake_nvml == ["init", "shutdown"]
