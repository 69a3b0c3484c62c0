"""MFU and MBU under CPU tensor parallelism: the FLOPs and bytes are summed over the ranks, and
the probe measures one rank's share of the cores, so the peaks are the probe's times the ranks
(as the GPU table's are times the GPUs)."""

import torch

from batchgen.stats import peaks


def test_cpu_peaks_scale_with_the_ranks(monkeypatch):
    monkeypatch.setattr(peaks, "cpu_peaks", lambda dtype: (1e9, 2e9, "probe"))
    cpu = torch.device("cpu")
    two = peaks.resolve_peaks(cpu, torch.float32, tensor_parallel_size=2)
    assert (two.flops, two.bandwidth) == (2e9, 4e9)
    assert two.source == "probe x 2 ranks"
    one = peaks.resolve_peaks(cpu, torch.float32)
    assert (one.flops, one.bandwidth, one.source) == (1e9, 2e9, "probe")


def test_given_peaks_are_not_scaled(monkeypatch):
    monkeypatch.setattr(peaks, "cpu_peaks", lambda dtype: (1e9, 2e9, "probe"))
    p = peaks.resolve_peaks(torch.device("cpu"), torch.float32, 3.0, 4.0, tensor_parallel_size=2)
    assert (p.flops, p.bandwidth) == (3e12, 4e9)
