"""Audit 2, item 14: NVML samples the GPU torch runs on, found by UUID (NVML's indices ignore
CUDA_VISIBLE_DEVICES), and lets NVML go when that GPU cannot be found. A fake pynvml stands
in for the driver."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from batchgen.stats.nvml import NvmlSampler

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
    assert s.samples is None and s.stop() is None
    assert fake_nvml == ["init", "shutdown"]
