"""INT4 weight-only checkpoints as their quantization_config declares them: compressed-tensors
`pack-quantized` (W4A16), GPTQ and AWQ (GEMM). Read before any weight is; a variant this
module does not describe (3-bit GPTQ, AWQ GEMV or Marlin, a quantized lm_head, ...) gives
None, and model/checkpoint/format.py refuses the checkpoint in one line.

Every one of them stores, for each decoder linear, 4-bit integers q, a zero point z and a scale
s per group of `group` input columns (or one per output row), and means w = (q - z) * s. What
differs is how q and z are packed into int32 words (int4_tensors.py unpacks them):
- compressed-tensors: q signed (-8..7, stored +8), eight a word along the input columns of
  `weight_packed` (out, in/8); z, where asymmetric, signed and packed along the output rows of
  `weight_zero_point` (out/8, groups); symmetric: z = 0.
- GPTQ (AutoGPTQ's QuantLinear.pack): `qweight` (in/8, out), eight input rows a word, the
  first in the lowest nibble; `qzeros` (groups, out/8) along output columns; `scales` (groups,
  out); `g_idx` (in,) each input column's group, out of order under act-order (desc_act). The
  original (v1) format stores z - 1 (AutoGPTQ: `zeros -= 1` when packing, `+ 1` in forward);
  `checkpoint_format: gptq_v2` (GPTQModel) stores z.
- AWQ GEMM (AutoAWQ): `qweight` (in, out/8) and `qzeros` (groups, out/8) packed along output
  columns in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (the word's nibble i holds column
  8c + ORDER[i]); `scales` (groups, out); no offset on z.
"""

from __future__ import annotations

from dataclasses import dataclass

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble i holds column ORDER[i]


@dataclass(frozen=True, slots=True)
class Int4Layout:
    """How one INT4 format packs a linear layer, read from its quantization_config."""

    kind: str  # "compressed-tensors" | "gptq" | "awq"
    source: str  # for messages and stats: "gptq (v1 zero points)"
    group: int | None  # input columns that share a scale; None: one scale per output row
    symmetric: bool  # compressed-tensors only: no zero points stored
    act_order: bool = False  # GPTQ desc_act: g_idx out of order, dequantized at load
    zero_offset: int = 0  # added to a stored zero point: 1 for GPTQ v1

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensor names (after the module's) a layer is stored as."""
        if self.kind == "compressed-tensors":
            return ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
        return ("qweight", "qzeros", "scales", "g_idx")

    @property
    def required(self) -> tuple[str, ...]:
        """The parts every layer must have (a GPTQ g_idx in order may be left out)."""
        if self.kind == "compressed-tensors":
            return self.parts[:3] + (() if self.symmetric else self.parts[3:])
        return self.parts[:3] + (("g_idx",) if self.act_order else ())

    @property
    def granularity(self) -> str:
        per = f"groups of {self.group}" if self.group else "per channel"
        return per + (", act-order" if self.act_order else "")


def _group(size: object) -> int | None | bool:
    """A config's group size: an int > 0, None for -1 (per channel), False if neither."""
    if size == -1:
        return None
    return size if isinstance(size, int) and size > 0 and size % 8 == 0 else False


def compressed_tensors_int4(q: dict) -> Int4Layout | None:
    """compressed-tensors pack-quantized W4A16, group or channel, symmetric or not; the
    activation ordering that stores no g_idx ("weight"/"static") only."""
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    if len(groups) != 1 or q.get("kv_cache_scheme") or q.get("sparsity_config"):
        return None
    (g,) = groups
    w = g.get("weights") or {}
    if (g.get("format") or q.get("format")) != "pack-quantized" or q.get("transform_config"):
        return None
    if g.get("input_activations") or g.get("output_activations") or g.get("targets") != ["Linear"]:
        return None
    if w.get("num_bits") != 4 or w.get("type") != "int" or w.get("dynamic"):
        return None
    if w.get("actorder") not in (None, "weight", "static"):
        return None
    strategy = w.get("strategy")
    size = _group(w.get("group_size")) if strategy == "group" else None
    if strategy not in ("group", "channel") or size is False or (strategy == "group" and not size):
        return None
    sym = bool(w.get("symmetric", True))
    name = "compressed-tensors pack-quantized" + ("" if sym else " (zero points)")
    return Int4Layout("compressed-tensors", name, size, sym)


def gptq_int4(q: dict) -> Int4Layout | None:
    """GPTQ, 4 bits, v1 or v2 zero points, with or without act-order; not Marlin's repacking,
    not a quantized lm_head."""
    fmt = q.get("checkpoint_format", "gptq")
    if q.get("bits") != 4 or fmt not in ("gptq", "gptq_v2") or q.get("is_marlin_format"):
        return None
    if q.get("lm_head") or q.get("dynamic"):
        return None
    size = _group(q.get("group_size", 128))
    if size is False:
        return None
    act_order = bool(q.get("desc_act"))
    v1 = fmt == "gptq"
    name = f"gptq ({'v1' if v1 else 'v2'} zero points{', act-order' if act_order else ''})"
    return Int4Layout("gptq", name, size, False, act_order, 1 if v1 else 0)


def awq_int4(q: dict) -> Int4Layout | None:
    """AWQ's GEMM layout, 4 bits, with zero points; not GEMV, Marlin or the exllama repack."""
    if q.get("bits", q.get("w_bit")) != 4 or str(q.get("version", "gemm")).lower() != "gemm":
        return None
    if not q.get("zero_point", True):
        return None
    size = _group(q.get("group_size", q.get("q_group_size", 128)))
    if size is False:
        return None
    return Int4Layout("awq", "awq (GEMM)", size, False)


def int4_layout(q: dict) -> Int4Layout | None:
    """The INT4 layout a quantization_config declares, if batchgen loads it; None otherwise."""
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return compressed_tensors_int4(q)
    if method == "gptq":
        return gptq_int4(q)
    if method == "awq":
        return awq_int4(q)
    return None
