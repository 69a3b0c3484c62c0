"""Peak memory while an INT4 checkpoint loads: each linear is packed as soon as its parts are
read (model/checkpoint/stored_linears.py), its packed words are read with plain reads, not
through the file's memory map (files.WholeReads), and the heap is trimmed after each, so the
load's peak RSS stays near the weights' resident size. Measured in a fresh process
(scripts/bench_stored_int4.py `load`: VmHWM, reset once torch, torchao and batchgen are
imported and one small layer packed, above the RSS then), on a random Llama of 83 M
parameters (65 MiB as loaded): 1.2-1.3x here; the code before the change peaked at 3.0-3.2x
on it (1.9x at 334 M parameters, docs/quantization.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from int4_checkpoints import write_int4

ROOT = Path(__file__).resolve().parents[1]
BOUND = 1.5  # the issue's: peak above the runtime <= 1.5x the INT4 weights


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory) -> Path:
    """A random bf16 Llama whose linears (67 M weights) dominate its bytes once at 4 bits."""
    cfg = transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=8000,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("memory") / "bf16"
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.slow  # ~20 s a format: a subprocess loads 83 M parameters
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_peak_rss_of_an_int4_load_is_within_1_5x_its_weights(method, bf16_llama):
    d, _ = write_int4(bf16_llama, bf16_llama.with_name(method), method, group=128)
    script = ROOT / "scripts" / "bench_stored_int4.py"
    done = subprocess.run(
        [sys.executable, str(script), "load", str(d)], capture_output=True, text=True, check=True
    )
    m = json.loads(done.stdout.splitlines()[-1])
    assert 55 < m["weights_mib"] < 70, m  # half a byte a linear weight, bf16 embedding and head
    assert m["peak_mib"] <= BOUND * m["weights_mib"], m
