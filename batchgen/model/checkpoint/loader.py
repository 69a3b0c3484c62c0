"""Hugging Face checkpoint directories -> our Transformer.

With model/families/hf_config.py (config.json's keys per family), model/checkpoint/names.py
(each tensor's name and where it goes) and model/checkpoint/files.py (the weight files and their
tensors), the one place that knows file formats. The model is built on the meta device and each
tensor is cast and moved straight to its target, so a 16 GB checkpoint never has a float32 copy
in host memory. A tensor-parallel rank builds its part of the model
(parallel.sharding.local_config) and reads only its slices of each tensor: no rank ever holds
the whole model. A pre-quantized checkpoint's weights keep their stored dtype and come with
their scales (model/checkpoint/prequantized.py), or are dequantized at load where no kernel
takes them (model/checkpoint/dequantized.py: fp8 on the CPU, a MoE model's experts); one
batchgen does not load is refused before any weight is read (model/checkpoint/format.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from batchgen.errors import ModelLoadError
from batchgen.model.checkpoint.activation_quant import quantize_inputs
from batchgen.model.checkpoint.dequantized import (
    check_experts,
    moe_dequantized,
    note,
    on_device,
)
from batchgen.model.checkpoint.files import (
    WholeReads,
    checkpoint_files,
    iter_tensors,
    reading,
    shape_of,
    stored_dtype,
    take,
)
from batchgen.model.checkpoint.format import checkpoint_scheme
from batchgen.model.checkpoint.int4_tensors import unpacked
from batchgen.model.checkpoint.names import weight_slot
from batchgen.model.checkpoint.placing import Placing
from batchgen.model.checkpoint.prequantized import (
    INPUT_SCALE,
    StoredScheme,
    check_widths,
    stored_bytes,
)
from batchgen.model.checkpoint.stored_linears import StoredLinears
from batchgen.model.config import ModelConfig
from batchgen.model.families.classifier_head import add_classifier_head
from batchgen.model.families.gemma import decoder_class
from batchgen.model.families.hf_config import config_from_hf, read_hf_config
from batchgen.model.families.transformer import Transformer
from batchgen.model.memory import check_allocation, weight_bytes
from batchgen.model.parallel.sharding import SINGLE, TPShard, local_config

log = logging.getLogger(__name__)


def load_state_dict(
    cfg: ModelConfig,
    files: list[Path],
    dtype: torch.dtype,
    device: torch.device,
    tp: TPShard = SINGLE,
    shapes: dict[str, torch.Size] | None = None,
    stored: StoredScheme | None = None,
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Rank tp's parameters, read from the checkpoint files slice by slice and moved straight
    to device/dtype, and the names of those that are pre-quantized torchao tensors. shapes:
    the local parameters' shapes (needed for fused matrices and zero biases). stored: a
    pre-quantized checkpoint's scheme (model/checkpoint/prequantized.py): its stored weights
    keep their dtype, and each becomes a torchao tensor with its scales as soon as both are
    read whole (model/checkpoint/stored_linears.py)."""
    known = shapes is not None  # the model's parameters are known: a weight must have a place
    placing = Placing(shapes or {})
    linears = StoredLinears(cfg, tp, stored, dtype, device, placing) if stored else None
    inputs: dict[str, list[torch.Tensor]] = {}  # static input scales, by our weight's name
    int4 = stored.int4 if stored is not None else None  # INT4 layers come unpacked to int8
    tensors = unpacked(iter_tensors(files), int4, dtype)
    whole = WholeReads()  # tensors converted at once: read whole, not through the file's map
    if stored is not None:  # a MoE model's experts, dequantized one by one (dequantized.py)
        tensors = moe_dequantized(tensors, cfg, stored, dtype, whole)
    for name, tensor, file in tensors:
        if linears is not None and name.endswith(f".{stored.scale_suffix}"):
            linears.scale(name.removesuffix(stored.scale_suffix) + "weight", tensor, file)
            continue
        if stored is not None and stored.act == "static" and name.endswith(".input_scale"):
            slot = weight_slot(cfg, name.removesuffix("input_scale") + "weight", tp)
            if slot is not None:
                with reading(file):
                    inputs.setdefault(slot.name, []).append(tensor[...].float().reshape(()))
            continue
        slot = weight_slot(cfg, name, tp)
        if slot is None:
            continue
        if known and slot.name not in placing.shapes:  # a layer past n_layers, ...
            raise ModelLoadError(
                f"the checkpoint's {name} has no place in the {cfg.n_layers}-layer model its "
                "config.json describes; the weights and config.json must come from the same model"
            )
        keep = stored_dtype(tensor)
        if keep is not None and linears is None:  # a caller that skipped checkpoint_scheme
            raise ModelLoadError(
                f"{file}: {name} is stored as {keep} and no quantization scheme was read for "
                "it; load the model through LLM or batchgen run, which read the checkpoint's"
            )
        if keep is not None and stored.dequantized:  # converted at once: not via the map
            with reading(file):
                tensor = whole.read(file, name, tensor)
        for c in slot.copies:
            if c.zero:
                placing.out[slot.name] = torch.zeros(
                    placing.shapes[slot.name], device=device, dtype=dtype
                )
                continue
            with reading(file):
                t = take(tensor, c, slot.transposed).to(device=device, dtype=keep or dtype)
            placing.put(name, slot.name, c, t)
        if keep is not None:
            linears.weight(name, slot.name, shape_of(tensor))
    out = placing.out
    for key, pieces in inputs.items():  # q, k, v (gate, up) share one input, so one scale
        if any(not torch.equal(p, pieces[0]) for p in pieces):
            raise ModelLoadError(
                f"the checkpoint's static input scales of the layers fused into {key} differ "
                f"({', '.join(f'{p.item():g}' for p in pieces)}); batchgen runs them as one "
                "layer with one input scale; use the model's bf16 release"
            )
        out[key.removesuffix(".weight") + INPUT_SCALE] = pieces[0].to(device)
    missing = placing.missing()
    if missing:
        raise ModelLoadError(f"checkpoint is missing pieces of {missing}")
    return out, (linears.finish() if linears is not None else set())


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    allow_pickle: bool = False,
    cfg: ModelConfig | None = None,
    tp: TPShard = SINGLE,
    stored: StoredScheme | None = None,
) -> Transformer:
    """The model in path (rank tp's part of it); cfg: its config.json, already read
    (ModelSpec), with stored, the checkpoint's stored scheme ModelSpec found
    (model/checkpoint/format.py); else both read here."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(
            f"model directory {path} does not exist. Pass --model a local directory saved with "
            "save_pretrained; batchgen never downloads from a hub."
        )
    if cfg is None:
        hf = read_hf_config(path, native=False)
        cfg = config_from_hf(hf)
        # never read quantized weights as if they were float: loaded as stored, or refused
        stored = checkpoint_scheme(path, hf)
        stored = on_device(stored, device) if stored is not None else None
    if stored is not None:
        check_widths(local_config(cfg, tp), stored)
        check_experts(cfg, stored, path)
    device = torch.device(device)
    # The one table built from config.json alone, not read from the checkpoint: 10**9
    # positions would be a 16 GB allocation before any weight is read.
    check_allocation(
        cfg.rope_table_bytes,
        f"the RoPE tables for {cfg.max_position_embeddings} positions",
        f"max_position_embeddings in {path / 'config.json'}",
        device,
    )
    with torch.device("meta"):
        model = decoder_class(cfg)(local_config(cfg, tp))
        if cfg.labels is not None:  # a *ForSequenceClassification checkpoint's head
            add_classifier_head(model, len(cfg.labels))
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    nbytes = (
        sum(
            v.numel()
            for k, v in model.state_dict().items()
            if k != "lm_head.weight" or not cfg.tie_embeddings
        )
        * dtype.itemsize
    )
    if stored is not None:  # the decoder linears as stored, or dequantized
        nbytes = stored_bytes(local_config(cfg, tp), dtype.itemsize, stored)
    who = f"rank {tp.rank}'s share of the weights" if tp.size > 1 else "the weights"
    fix = "--tensor-parallel-size (more ranks), --quantize or --dtype"
    check_allocation(nbytes, f"{who} ({path})", fix, device)
    files = checkpoint_files(path, allow_pickle)
    sd, quantized = load_state_dict(cfg, files, dtype, device, tp, shapes, stored)
    static = {k.removesuffix(INPUT_SCALE): sd.pop(k) for k in list(sd) if k.endswith(INPUT_SCALE)}
    head = sd.get("lm_head.weight")
    if cfg.tie_embeddings and head is not None and not torch.equal(head, sd["embed.weight"]):
        # As transformers does: a checkpoint's own head that differs from the embedding is
        # used, whatever config.json's tie_word_embeddings says.
        cfg = replace(cfg, tie_embeddings=False)
        model.cfg = replace(model.cfg, tie_embeddings=False)
    if cfg.tie_embeddings or head is None:
        sd["lm_head.weight"] = sd["embed.weight"]
    elif device.type == "cpu" and dtype == torch.float32:
        # column-major, for the CPU's faster x @ W^T (transformer.LMHead); the row-major copy is
        # freed here. A head tied to the embedding stays row-major: the lookup reads rows.
        sd["lm_head.weight"] = sd["lm_head.weight"].t().contiguous().t()
    expected = set(model.state_dict())
    missing, unexpected = expected - set(sd), set(sd) - expected
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint in {path} does not match a {cfg.family.value} model: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    try:
        model.load_state_dict(sd, assign=True, strict=True)
    except RuntimeError as e:  # shapes that differ from config.json's
        lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
        shown = "; ".join(lines[:2]) + ("; ..." if len(lines) > 2 else "")
        raise ModelLoadError(
            f"the checkpoint in {path} does not match its config.json ({shown}); the weights "
            "and config.json must come from the same model"
        ) from None
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    if stored is not None:
        nbytes = weight_bytes(model)
        if line := note(stored, bool(cfg.n_experts), dtype, nbytes, device.type):
            log.warning("%s", line)
    # W8A8: inputs quantized as the format does (by the fp8 x fp8 GEMM's own Float8Tensor)
    if stored is not None and stored.act and not stored.fp8_gemm:
        layers = sorted(k.removesuffix(".weight") for k in quantized)
        missing = sorted(set(layers) - set(static)) if stored.act == "static" else []
        if missing:
            raise ModelLoadError(f"the checkpoint has no input_scale for {missing[0]}")
        quantize_inputs(model, layers, stored.weights, static if stored.act == "static" else None)
    return model.eval().requires_grad_(False)
