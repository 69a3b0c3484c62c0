"""Which implementation runs a model (`--model-impl`), and whether the transformers backend
(model/hf/backend.py) can serve it exactly: decided from config.json and the modeling class,
before any weight loads.

The backend replaces one thing in a transformers model, its attention function, so it serves
exactly the models whose every layer is softmax attention called through transformers'
`AttentionInterface` (the class says so with `_supports_attention_backend`), full, with a
sliding window, or chunked (Llama 4's local layers: model/attention/windows.py). Refused, naming
why: recurrent or linear-attention layers (Mamba state, Gated DeltaNet: Qwen3-Next, Granite 4
hybrids, Jamba), encoder-decoders and pre-quantized checkpoints other than MXFP4 and those
transformers decompresses at load (refusal.quant_refusal: compressed-tensors, block FP8).

Llama 4's NoPE layers scale their queries by a "temperature" of the position, which
transformers computes from the cache length plus an arange over the forward's tokens, not from
position_ids; in a packed step that is the step's token index. It is 1 (no scaling) below
`floor_scale` (8192) positions, so the backend serves such a model up to floor_scale - 1
positions (its max_position_embeddings as batchgen sees it), where every row's and every
packed step's (max_num_batched_tokens is far below it) is exact.

Two kinds of checkpoint load as something other than their config.json's class:
- a multimodal wrapper of model/checkpoint/multimodal.py's table (Gemma 3) loads its text model
alone,
  the class of its text_config with the wrapper's weights renamed (the vision tower is not read);
- gpt-oss's MXFP4 experts (blocks of 4-bit values with a shared power-of-two scale) are
  dequantized at load by transformers (`Mxfp4Config(dequantize=True)`, which needs no kernel
  and runs on the CPU): they take the --dtype's bytes, which is what memory is sized by.
A compressed-tensors or block FP8 checkpoint loads through transformers' own quantizer, its
weights decompressed to the --dtype at load (backend.load_hf_model; block FP8 with
`dequantize`), so they too take the --dtype's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchgen.choices import ModelImpl
from batchgen.errors import ModelLoadError
from batchgen.model.checkpoint.multimodal import KEY_MAPPING, TEXT_MODEL_WRAPPERS
from batchgen.model.config import ModelConfig
from batchgen.model.families.hf_config import (
    SUPPORTED_FAMILIES,
    UnsupportedModelError,
    read_hf_config,
)
from batchgen.model.hf.refusal import encoder_refusal, quant_method, refusal
from batchgen.model.quiet_import import quiet_torchao

# The attention-interface kwargs and mask hooks the backend uses are transformers 5's.
TESTED_MAJOR, TESTED_ON = 5, "5.25"


def resolve_impl(choice: ModelImpl | str, model_type: str | None) -> ModelImpl:
    """auto: native where batchgen has the family, else transformers."""
    choice = ModelImpl(choice)
    native = model_type in SUPPORTED_FAMILIES
    if choice is ModelImpl.AUTO:
        return ModelImpl.NATIVE if native else ModelImpl.TRANSFORMERS
    if choice is ModelImpl.NATIVE and not native:
        raise UnsupportedModelError(
            f"model_type {model_type!r} has no native implementation (native: "
            f"{', '.join(SUPPORTED_FAMILIES)}); use --model-impl auto or transformers"
        )
    return choice


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """How transformers loads the model in a directory: from_pretrained's class, config and
    extra arguments (a text model's key renames, MXFP4's dequantization)."""

    cls: type
    config: Any
    options: dict[str, Any]
    model_type: str  # config.json's (a wrapper's, where config is its text model's)


def load_plan(path: Path) -> LoadPlan:
    """The LoadPlan of the model in path; UnsupportedModelError if transformers has no causal LM
    for its config.json, or the backend cannot serve that model exactly."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = _auto_config(path)
    try:
        options: dict[str, Any] = {}
        model_type = config.model_type
        if config.model_type in TEXT_MODEL_WRAPPERS:
            if quant_method(config) is not None:  # the text model loads without its config
                raise UnsupportedModelError(
                    f"{path}: a pre-quantized ({quant_method(config)}) {model_type} checkpoint "
                    "cannot run on the transformers backend, which loads its text model alone"
                )
            text = config.get_text_config()
            # The wrapper's tie decides (transformers 5 ties a wrapper's head by it), not the
            # text_config's own default: Mistral's is False, and a head saved tied is absent.
            text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
            config, options = text, {"key_mapping": dict(KEY_MAPPING)}
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (ValueError, KeyError, OSError) as e:
        raise UnsupportedModelError(
            f"{path}: transformers has no causal LM for this config.json ({e})"
        ) from None
    encoder = encoder_refusal(config)
    if encoder is not None:
        raise UnsupportedModelError(encoder)
    why = refusal(config, cls)
    if why is not None:
        raise UnsupportedModelError(
            f"model_type {config.model_type!r} cannot run on the transformers backend: {why}"
        )
    if quant_method(config) == "mxfp4":
        from transformers import Mxfp4Config

        # without dequantize, transformers fetches a Triton kernel from the Hub
        options["quantization_config"] = Mxfp4Config(dequantize=True)
    if quant_method(config) == "fp8":
        # block FP8 dequantized at load on any device, as transformers does without an fp8
        # GPU and as the native implementation computes it (activations in float); on an
        # sm89+ GPU transformers would quantize the activations per block instead
        q = config.quantization_config
        config.quantization_config = {**(q if isinstance(q, dict) else q.to_dict())}
        config.quantization_config["dequantize"] = True
    return LoadPlan(cls, config, options, model_type)


def _auto_config(path: Path):
    """transformers' config of path's config.json, the checkpoint's own code never run;
    ModelLoadError for one transformers refuses (a LongRoPE factor list of the wrong length
    fails its class's validation) or that needs code of the checkpoint's own (`auto_map`)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (StrictDataclassError, ValueError, TypeError, KeyError, OSError) as e:
        why = " ".join(str(e).split())
    if "auto_map" in read_hf_config(path, native=False):
        why = "it names a class of the checkpoint's own code (auto_map), which batchgen never runs"
    raise ModelLoadError(f"{path / 'config.json'}: transformers cannot build its config ({why})")


def _get(config, name: str):
    """config.name, or None: absent, or (a heterogeneous config, Gemma 4's) different per
    layer, where transformers refuses a global read (RuntimeError) and the modules say."""
    try:
        return getattr(config, name, None)
    except RuntimeError:
        return None


def _head_dim(text) -> int:
    """The pool's head size: the larger of the keys' and the values' (DeepSeek's MLA: keys
    of qk_nope + qk_rope, values of v_head_dim; the smaller is zero-padded in the pool)."""
    qk = _get(text, "qk_nope_head_dim"), _get(text, "qk_rope_head_dim")
    if None not in qk:
        return max(qk[0] + qk[1], _get(text, "v_head_dim") or 0)
    return _get(text, "head_dim") or text.hidden_size // text.num_attention_heads


def backend_config(path: Path) -> ModelConfig:
    """The sizes the engine and stats read of the model in path, as the transformers backend
    runs it; UnsupportedModelError (before weights load) for one it cannot serve exactly."""
    with quiet_torchao():  # some families' modeling code imports torchao
        return _backend_config(path)


def _backend_config(path: Path) -> ModelConfig:
    import transformers

    if int(transformers.__version__.split(".")[0]) != TESTED_MAJOR:
        raise UnsupportedModelError(
            f"the transformers backend runs on transformers {TESTED_MAJOR}.x (tested on "
            f"{TESTED_ON}); this is {transformers.__version__}"
        )
    plan = load_plan(path)
    config = plan.config
    skeleton = meta_model(plan)
    params = sum(p.numel() for p in skeleton.parameters())
    text = config.get_text_config()
    heads = text.num_attention_heads
    layer_types = getattr(text, "layer_types", None) or ()
    window = _get(text, "sliding_window")
    if any(t != "sliding_attention" for t in layer_types):
        window = None  # some layer sees the whole context
    dim = text.hidden_size
    n_kv = _get(text, "num_key_value_heads") or heads
    layer_kv = _layer_kv(skeleton, text.num_hidden_layers, (n_kv, _head_dim(text)))
    return ModelConfig(
        family=None,
        vocab_size=text.vocab_size,
        dim=dim,
        n_layers=text.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=n_kv,
        head_dim=max(d for _, d in layer_kv),
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * dim,
        max_position_embeddings=_max_positions(text),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=window,
        impl=ModelImpl.TRANSFORMERS,
        model_type=plan.model_type,
        param_count=params,
        layer_kv=layer_kv if len(set(layer_kv)) > 1 else (),
    )


def meta_model(plan: LoadPlan) -> nn.Module:
    """The model plan loads, built on the meta device: its sizes, no memory, no init. A
    pre-quantized checkpoint's skeleton holds float parameters: what dequantizing gives."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(plan.config)


# RoPE types whose frequencies transformers picks per forward from the largest position in it:
# in a packed step one long row would switch every row's. Below the original context they
# do not switch.
SWITCHING_ROPE = ("longrope", "dynamic")


def _max_positions(text) -> int:
    """The positions the backend serves exactly: below Llama 4's temperature floor (module
    doc), and below the original context of a RoPE whose factors switch (SWITCHING_ROPE)."""
    positions = getattr(text, "max_position_embeddings", None) or 4096
    if getattr(text, "attn_temperature_tuning", False) and 0 in (text.no_rope_layers or ()):
        positions = min(positions, int(text.floor_scale) - 1)
    for rope in _rope_parameters(text):
        original = rope.get("original_max_position_embeddings") or getattr(
            text, "original_max_position_embeddings", None
        )
        if rope.get("rope_type") in SWITCHING_ROPE and original:
            positions = min(positions, int(original))
    return positions


def _rope_parameters(text) -> list[dict]:
    """Each RoPE's parameters of a config (one, or one per layer type: Gemma 3's)."""
    rope = _get(text, "rope_parameters") or _get(text, "rope_scaling") or {}
    if not isinstance(rope, dict):
        return []
    if "rope_type" in rope or "type" in rope:
        return [{**rope, "rope_type": rope.get("rope_type", rope.get("type"))}]
    return [r for r in rope.values() if isinstance(r, dict)]


def _layer_kv(model: nn.Module, n_layers: int, default: tuple[int, int]):
    """(kv heads, head size) of each layer's cache, read off the attention modules (those with
    a layer_idx, a head_dim and separate k_proj/v_proj); a layer not found takes default (the
    config's: fused projections, MLA)."""
    found = {}
    for m in model.modules():
        k, v, d = (getattr(m, n, None) for n in ("k_proj", "v_proj", "head_dim"))
        if getattr(m, "layer_idx", None) is None or not isinstance(k, nn.Linear):
            continue
        if not isinstance(d, int):
            continue
        n_kv = k.out_features // d
        v_dim = v.out_features // n_kv if isinstance(v, nn.Linear) else d
        found[m.layer_idx] = (n_kv, max(d, v_dim))
    return tuple(found.get(i, default) for i in range(n_layers))
