"""What loading a checkpoint leaves out or changes, said by `batchgen plan` before any weight is
read: from config.json and the safetensors headers (8 bytes of length, then a JSON table of
each tensor's dtype, shape and byte offsets), so it costs a few reads of kilobytes.

- a multimodal wrapper run as its text model (multimodal.py): the tensors left unread (the
  vision tower, the projector), how many and their bytes;
- an MXFP4 checkpoint (gpt-oss) on the transformers backend: its experts are dequantized at
  load, so the weights take the --dtype's bytes per parameter, several times the file's;
- a stored format dequantized at load where no kernel takes it (dequantized.py: fp8 on the
  CPU, a MoE model's experts), in the line the load logs.
"""

from __future__ import annotations

from pathlib import Path

from batchgen.model.checkpoint.dequantized import note
from batchgen.model.checkpoint.files import safetensors_header
from batchgen.model.checkpoint.multimodal import TEXT_MODEL_WRAPPERS, is_language_model
from batchgen.model.checkpoint.prequantized import StoredScheme
from batchgen.model.memory import format_bytes


def _headers(path: Path) -> dict[str, dict]:
    """Every tensor's header entry, over the checkpoint's safetensors files."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(safetensors_header(f))
    return out


def _nbytes(entry: dict) -> int:
    start, end = entry["data_offsets"]
    return end - start


def unloaded_tensors(path: Path) -> tuple[int, int, list[str]]:
    """What a text load of the wrapper checkpoint in path leaves unread: (tensors, bytes, the
    parts they belong to, e.g. ["multi_modal_projector", "vision_tower"])."""
    left = {k: v for k, v in _headers(path).items() if not is_language_model(k)}
    parts = {k.removeprefix("model.").split(".")[0] for k in left}
    return len(left), sum(map(_nbytes, left.values())), sorted(parts)


def load_notes(
    path: Path,
    hf: dict,
    weights_bytes: int,
    dtype: str,
    stored: StoredScheme | None = None,
    moe: bool = False,
    device: str = "cpu",
) -> list[str]:
    """plan's notes on how the model in path (config.json: hf) loads; weights_bytes: what its
    weights take loaded at dtype; stored: its stored scheme on device, moe: it has experts."""
    notes = []
    if stored is not None and (line := note(stored, moe, dtype, weights_bytes, device)):
        notes.append(line)
    if hf.get("model_type") in TEXT_MODEL_WRAPPERS:
        n, nbytes, parts = unloaded_tensors(path)
        notes.append(
            f"text model only: {n} tensors of {', '.join(parts)} ({format_bytes(nbytes)}) are "
            f"not loaded ({hf['model_type']}'s language model and LM head run text jobs)"
        )
    if (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        stored = sum(map(_nbytes, _headers(path).values()))
        notes.append(
            f"MXFP4 experts dequantized at load: the weights take {format_bytes(weights_bytes)} "
            f"at {dtype}, the checkpoint {format_bytes(stored)} (a smaller --dtype, bfloat16, "
            "halves float32's)"
        )
    return notes
