"""Hugging Face `config.json` -> ModelConfig: the keys of each family, their defaults, RoPE
scaling and activation names. The one module that reads config.json's layout; the weights'
layout is model/checkpoint/loader.py's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from batchgen.errors import ModelLoadError
from batchgen.model.config import (
    GEMMA_FAMILIES,
    Family,
    ModelConfig,
    NormKind,
    PositionKind,
    RopeScaling,
)
from batchgen.model.families.classifier_head import classifier_labels
from batchgen.model.families.gemma_config import gemma_config
from batchgen.model.families.phi3_config import longrope_scaling, partial_rotary_factor

SUPPORTED_FAMILIES = tuple(f.value for f in Family)


class UnsupportedModelError(ModelLoadError):
    pass


def require_model_dir(path: Path) -> Path:
    """path's config.json; ModelLoadError naming the fix where there is none."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(
            f"{path} is not a model directory: no config.json. Pass --model a local directory "
            "saved with save_pretrained (config.json + *.safetensors); hub names are not fetched."
        )
    return cfg_file


def read_json_object(path: Path) -> dict:
    """A checkpoint's JSON file (config.json, tokenizer_config.json) as a dict; ModelLoadError
    for one that is not JSON, too deeply nested for the parser, or not an object."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, OSError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ModelLoadError(
            f"{path} is not readable JSON ({e}); restore it from the model's source"
        ) from None
    except RecursionError:
        raise ModelLoadError(
            f"{path} is not readable JSON (nested too deeply to parse); restore it from the "
            "model's source"
        ) from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object; restore it from the model's source")
    return value


def read_hf_config(path: Path, native: bool = True) -> dict:
    """config.json as a dict; native: checked to describe a model batchgen's own decoder
    builds (config_from_hf; the transformers backend checks its own, model/hf/support.py)."""
    cfg_file = require_model_dir(path)
    hf = read_json_object(cfg_file)
    if native:
        native_config(path, hf)
    return hf


def native_config(path: Path, hf: dict) -> ModelConfig:
    """config_from_hf(hf), its errors naming path's config.json."""
    try:
        return config_from_hf(hf)
    except ModelLoadError as e:
        raise type(e)(f"{path / 'config.json'}: {e}") from None


def _rope(hf: dict) -> tuple[float, RopeScaling]:
    # transformers 5 writes `rope_parameters`; 4.x wrote `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("su", "yarn") and hf.get("model_type") == "phi3":
        kind = "longrope"  # Phi-3's earlier names for it, as Phi3Config reads them
    if kind == "longrope":
        return theta, longrope_scaling(hf)
    if kind == "default":
        return theta, RopeScaling()
    if kind not in RopeScaling.SUPPORTED:
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported; supported: {', '.join(RopeScaling.SUPPORTED)}"
        )
    return theta, RopeScaling(
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )


def _activation(name: str) -> str:
    table = {
        "silu": "silu",
        "swish": "silu",
        "gelu_new": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh",
        "gelu": "gelu",
    }
    if name not in table:
        raise UnsupportedModelError(
            f"activation {name!r} is not supported; supported: {', '.join(table)}"
        )
    return table[name]


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a config.json; ModelLoadError for a missing or malformed entry."""
    try:
        cfg = _config_from_hf(hf)
    except KeyError as e:
        raise ModelLoadError(
            f"no {e.args[0]!r}, which a {hf.get('model_type')} config.json needs; "
            "restore the file from the model's source"
        ) from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(
            f"not a valid {hf.get('model_type')} config ({e}); restore it from the model's source"
        ) from None
    labels = classifier_labels(hf)  # a *ForSequenceClassification checkpoint's head
    return cfg if labels is None else dataclasses.replace(cfg, labels=labels)


def _config_from_hf(hf: dict) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported. Supported families: "
            f"{', '.join(SUPPORTED_FAMILIES)}."
        )
    family = Family(model_type)
    if family == Family.GPT2:
        dim, n_heads = hf["n_embd"], hf["n_head"]
        return ModelConfig(
            family=family,
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            dim=dim,
            n_layers=hf["n_layer"],
            n_heads=n_heads,
            n_kv_heads=n_heads,
            head_dim=dim // n_heads,
            intermediate_size=hf.get("n_inner") or 4 * dim,
            max_position_embeddings=hf["n_positions"],
            norm=NormKind.LAYER,
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            position=PositionKind.LEARNED,
            activation=_activation(hf.get("activation_function", "gelu_new")),
            gated_mlp=False,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),  # transformers' default
        )
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        raise UnsupportedModelError("GPT-2 attention variants are not supported")
    if family in GEMMA_FAMILIES:
        return gemma_config(hf, family)
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    theta, scaling = _rope(hf)
    attn_bias = bool(hf.get("attention_bias", False))
    sliding = hf.get("sliding_window")
    qwen = (Family.QWEN2, Family.QWEN3, Family.QWEN3_MOE)
    if family in qwen and not hf.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        family=family,
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        activation=_activation(hf.get("hidden_act", "silu")),
        qkv_bias=True if family == Family.QWEN2 else attn_bias,
        o_bias=attn_bias if family in (Family.LLAMA, Family.QWEN3, Family.QWEN3_MOE) else False,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family in (Family.QWEN3, Family.QWEN3_MOE),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=sliding,
        partial_rotary_factor=partial_rotary_factor(hf) if family == Family.PHI3 else 1.0,
        **_experts(hf, family),
    )


def _experts(hf: dict, family: Family) -> dict:
    """A MoE family's ModelConfig fields. Qwen3-MoE: num_experts (num_local_experts as
    transformers 5 saves it), a dense MLP in mlp_only_layers and in layers not a multiple of
    decoder_sparse_step; Mixtral: every layer's, intermediate_size wide, always renormalised."""
    if family not in (Family.QWEN3_MOE, Family.MIXTRAL):
        return {}
    n = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
    if not n:  # Qwen3-MoE without experts: dense
        return {}
    if family == Family.MIXTRAL:
        width, renorm, dense = hf["intermediate_size"], True, ()
    else:
        width, renorm = hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob", False))
        step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        layers = range(hf["num_hidden_layers"])
        dense = tuple(i for i in layers if i in only or (i + 1) % step)
    return dict(
        n_experts=n,
        experts_per_token=hf["num_experts_per_tok"],
        moe_intermediate_size=width,
        norm_topk_prob=renorm,
        dense_layers=dense,
    )
