"""LoRA adapters on the transformers backend: checked against the model built on the meta
device before any weight loads, then applied by peft to the loaded model and merged into its
weights (`merge_and_unload`). The engine then runs an ordinary model, the same one transformers
+ peft's merged model is, token for token; the adapter's hash keys the resume fingerprint and
the compile cache as a native adapter's does (checkpoint/lora.py's LoraAdapter).

Mergeable: LoRA on the model's linear layers (nn.Linear). Refused before loading, naming what:
an adapter on 3-D weights (peft's `target_parameters`, how MoE experts held as one tensor are
adapted: merging them is not implemented), on a module that is not a linear layer or not in
the model, of shapes or ranks that do not fit, and what checkpoint/lora.py refuses of any
adapter (DoRA, trained biases, ...). A multimodal wrapper's adapter (its modules named as the
wrapper's) is renamed as the weights are (checkpoint/multimodal.py); its vision tower's modules
are left out with it.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from batchgen.model.checkpoint.lora import (
    _KEY,
    CONFIG_FILE,
    LoraAdapter,
    LoraError,
    LoraMerge,
    _read_config,
    _tensor_shapes,
    _weights_file,
    pair_scaling,
)
from batchgen.model.checkpoint.multimodal import is_language_model, text_name
from batchgen.model.hf.support import load_plan, meta_model
from batchgen.model.quiet_import import quiet_torchao


def _refuse_parameter_targets(path: Path) -> None:
    """An adapter of 3-D parameters (peft's target_parameters), named as such:
    checkpoint/lora.py's generic refusal does not say what they are."""
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return  # checkpoint/lora.py's reading of it reports this
    targets = raw.get("target_parameters") if isinstance(raw, dict) else None
    if targets:
        raise LoraError(
            f"LoRA adapter {path} adapts parameters {targets} (target_parameters: 3-D weights "
            "such as MoE experts held as one tensor), which batchgen cannot merge; only "
            "adapters of linear layers (target_modules) can be merged"
        )


def check_hf_adapter(path: str | Path, model_dir: Path) -> LoraAdapter:
    """Read an adapter's config and tensor shapes (not its weights) and check that peft can
    merge it into the transformers model in model_dir; LoraError naming the first misfit."""
    path = Path(path)
    file = _weights_file(path)
    _refuse_parameter_targets(path)
    config = _read_config(path)
    plan = load_plan(model_dir)
    wrapper = "key_mapping" in plan.options
    modules = dict(meta_model(plan).named_modules())
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in _tensor_shapes(path, file).items():
        m = _KEY.fullmatch(key)
        if not m or len(shape) != 2:
            raise LoraError(
                f"LoRA adapter {path} holds {key} {list(shape)}, which is not the A or B "
                "matrix of a LoRA linear layer; only those can be merged"
            )
        pairs.setdefault(m.group(1), {})[m.group(2)] = shape
    merges, kinds = [], set()
    for module, ab in sorted(pairs.items()):
        if wrapper and not is_language_model(module):
            continue  # the vision tower's: not loaded for text jobs
        name = text_name(module) if wrapper else module
        merges.append(_merge(path, config, module, name, modules.get(name), ab))
        kinds.add(module.rsplit(".", 1)[-1])
    if not merges:
        raise LoraError(f"LoRA adapter {path} holds no LoRA weights of the language model")
    return LoraAdapter.of(path, config, merges, kinds)


def _merge(path: Path, config, module: str, name: str, layer, ab: dict) -> LoraMerge:
    """The merge of one adapted module, checked against the model's layer (None: absent)."""
    if layer is None:
        raise LoraError(
            f"LoRA adapter {path} adapts {module} (no such module in this model); the adapter "
            "was trained for another base model"
        )
    if not isinstance(layer, nn.Linear):
        raise LoraError(
            f"LoRA adapter {path} adapts {module}, of type {type(layer).__name__}; the "
            "transformers backend merges adapters of linear layers (nn.Linear) only"
        )
    want = (layer.out_features, layer.in_features)
    scaling = pair_scaling(path, config, module, ab, want)
    return LoraMerge(module, name + ".weight", None, scaling)


def merge_hf_lora(
    hf: nn.Module, adapter: LoraAdapter, key_mapping: dict[str, str] | None
) -> nn.Module:
    """hf with the adapter merged into its weights by peft (peft's own arithmetic: what its
    merged model computes). key_mapping: a wrapper's renames of the adapter's modules."""
    with quiet_torchao():  # peft imports torchao where it is installed
        from peft import PeftModel

    try:
        peft = PeftModel.from_pretrained(hf, str(adapter.path), key_mapping=key_mapping)
    except (ValueError, KeyError, RuntimeError) as e:
        raise LoraError(f"peft could not apply LoRA adapter {adapter.path}: {e}") from None
    adapted = sum(1 for m in peft.modules() if "default" in getattr(m, "lora_A", {}))
    if adapted != len(adapter.merges):  # target_modules that select other layers than the file
        raise LoraError(
            f"LoRA adapter {adapter.path}: peft adapted {adapted} layers of this model and the "
            f"adapter's file holds {len(adapter.merges)}; its target_modules do not name the "
            "layers its weights are for"
        )
    return peft.merge_and_unload()
