"""The transformers backend: a transformers causal LM on batchgen's engine (vLLM's
Transformers backend, small).

The seam is transformers' `AttentionInterface`: the model is loaded with
`attn_implementation="batchgen"`, and every layer's attention calls `_attention` below with
its q, k, v and its own scale, soft-cap, sinks and sliding window. That function runs
batchgen's step attention (model/attention/step.py): the keys/values written at the step's cache
slots, decodes over their gathered blocks, each prefill span over its own. Everything else
(embeddings, norms, RoPE variants, MoE, the LM head's soft-cap or scaling) is transformers'
own code, unchanged.

A step is one packed run, batch 1 x T tokens with explicit position_ids; transformers builds
no mask (the "batchgen" mask function returns None: the step's masks are batchgen's). The
step's description reaches the attention as a forward kwarg, `batchgen_step`, which
transformers hands down to every layer's attention call; each layer finds its cache by
`module.layer_idx`. The LM head runs on the step's sampled rows only (`logits_to_keep` as an
index tensor).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.errors import ModelLoadError
from batchgen.model.attention.kv_cache import PagedKVCache
from batchgen.model.attention.sdpa import AttnParams
from batchgen.model.attention.step import StepAttention, step_attention
from batchgen.model.checkpoint.lora import LoraAdapter
from batchgen.model.config import ModelConfig
from batchgen.model.hf.lora import merge_hf_lora
from batchgen.model.hf.support import load_plan
from batchgen.model.memory import check_allocation
from batchgen.model.quiet_import import quiet_torchao

ATTN_IMPLEMENTATION = "batchgen"
log = logging.getLogger(__name__)


@dataclass(slots=True)
class BackendStep:
    """One forward's attention context, shared by its layers: the step, the caches, and the
    step's masks per sliding window (built once per window value, at its first layer)."""

    step: StepAttention
    caches: list[PagedKVCache]
    max_positions: int
    queries: int  # query heads per kv head
    _masks: dict[int | None, StepAttention] = field(default_factory=dict)

    def masked(self, window: int | None) -> StepAttention:
        if window not in self._masks:
            self._masks[window] = self.step.with_masks(
                window, self.caches[0], self.queries, self.max_positions
            )
        return self._masks[window]


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (1, H, T, D), key, value (1, Hkv, T, D) of one layer -> (1, T, H, Dv)."""
    ctx: BackendStep | None = kwargs.get("batchgen_step")
    if ctx is None:
        raise RuntimeError(
            f"{type(module).__name__} was called without batchgen's step: this model's layers "
            "do not pass their forward kwargs to attention"
        )
    # The layer's window: a kwarg where the layer passes it (None on a full layer), else its
    # attribute.
    window = (
        kwargs["sliding_window"]
        if "sliding_window" in kwargs
        else getattr(module, "sliding_window", None)
    )
    config = getattr(module, "config", None)
    if window is None and _layer_type(config, module.layer_idx) == "chunked_attention":
        window = -config.attention_chunk_size  # Llama 4's local layers (model/attention/windows.py)
    params = AttnParams(scaling, kwargs.get("softcap"), kwargs.get("s_aux"))
    cache = ctx.caches[module.layer_idx]
    dv = value.shape[-1]
    query, key, value = _pad_heads(query, key, value, cache.k.shape[-1])
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, D)
    y = step_attention(q, k, v, cache, ctx.masked(window), params)
    return y[None, ..., :dv], None


def _layer_type(config, layer_idx: int) -> str | None:
    types = getattr(config, "layer_types", None)
    return types[layer_idx] if types else None


def _pad_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, size: int):
    """q, k and v zero-padded to the pool's head size: keys and values of different sizes
    (DeepSeek's MLA: 192 and 128) share one pool. Zeros add nothing to q.k (the scale is the
    layer's own, not from the padded size) and give output columns that are cut off."""
    if k.shape[-1] < size:
        q, k = (F.pad(x, (0, size - x.shape[-1])) for x in (q, k))
    if v.shape[-1] < size:
        v = F.pad(v, (0, size - v.shape[-1]))
    return q, k, v


def _no_mask(*args, **kwargs) -> None:
    """transformers' mask for the "batchgen" implementation: none (the step's are used)."""
    return None


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


class HFModel(nn.Module):
    """A transformers causal LM behind the interface the engine expects of Transformer:
    forward(tokens, positions, step, logits_index), setup_caches, kv_caches, cfg, embed."""

    def __init__(self, hf: nn.Module, cfg: ModelConfig) -> None:
        super().__init__()
        self.hf, self.cfg = hf, cfg
        self.caches: list[PagedKVCache] = []

    @property
    def embed(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    def setup_caches(self, num_blocks: int, block_size: int) -> None:
        w, cfg = self.embed.weight, self.cfg
        shapes = cfg.layer_kv or [(cfg.n_kv_heads, cfg.head_dim)] * cfg.n_layers
        self.caches = [
            PagedKVCache(num_blocks, block_size, h, d, w.dtype, w.device) for h, d in shapes
        ]

    @property
    def kv_caches(self) -> list[PagedKVCache]:
        return self.caches

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        step: StepAttention,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        """As Transformer.forward: (T,) packed tokens and positions -> float32 logits (S,
        vocab) of the rows at logits_index."""
        cfg = self.cfg
        ctx = BackendStep(
            step, self.caches, cfg.max_position_embeddings, cfg.n_heads // cfg.n_kv_heads
        )
        out = self.hf(
            input_ids=tokens[None],
            position_ids=positions[None],
            logits_to_keep=logits_index,
            use_cache=False,
            batchgen_step=ctx,
        )
        return out.logits[0].float()


def warn_compile_eager() -> None:
    """--compile on this backend: one line that it runs eagerly (its forward is
    transformers' own, with no `hidden` seam for engine/compiled_forward.py to compile;
    the stats' compiled_token_share is 0)."""
    log.warning(
        "--compile: the transformers backend (--model-impl transformers) runs eagerly, "
        "uncompiled (compiled_token_share 0); a native family compiles"
    )


@contextlib.contextmanager
def _unexpected_keys_unreported(on: bool) -> Iterator[None]:
    """transformers' load report (a warning listing every checkpoint tensor the model has no
    place for) left out while a wrapper's text model loads: its vision tower is left unread on
    purpose. Missing weights are still refused (load_hf_model), mismatched ones raise."""
    # A filter, not a level: transformers checks this logger's level for other warnings too.
    logger = logging.getLogger("transformers.modeling_utils")
    drop = logging.Filter("transformers.modeling_utils.never")  # passes no record of logger
    if on:
        logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def load_hf_model(
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    lora: LoraAdapter | None = None,
) -> HFModel:
    """The model in path, loaded by transformers (offline) with batchgen's attention, as
    hf.support.load_plan says (a wrapper's text model, MXFP4 dequantized, compressed-tensors and
    block FP8 decompressed); lora: a checked adapter, merged into the weights
    (model/hf/lora.py)."""
    from transformers.utils import logging as hf_logging

    register()
    nbytes = cfg.num_params * dtype.itemsize
    check_allocation(nbytes, f"the weights ({path})", "--dtype", torch.device(device))
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # batchgen's own progress is the run's
    try:
        with quiet_torchao():  # some families' modeling code imports torchao
            plan = load_plan(Path(path))
        with quiet_torchao(), _unexpected_keys_unreported("key_mapping" in plan.options):
            hf, info = plan.cls.from_pretrained(
                str(path),
                config=plan.config,
                dtype=dtype,
                attn_implementation=ATTN_IMPLEMENTATION,
                local_files_only=True,
                output_loading_info=True,
                **plan.options,
            )
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"transformers could not load {path}: {e}") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if info["missing_keys"]:  # transformers would run them as initialised: random
        missing = sorted(info["missing_keys"])
        raise ModelLoadError(
            f"the checkpoint in {path} has no {', '.join(missing[:3])}"
            + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
            + "; the weights and config.json must come from the same model"
        )
    _refuse_extra_layers(path, hf, cfg.n_layers, info["unexpected_keys"])
    _decompress(hf)
    if lora is not None:
        hf = merge_hf_lora(hf, lora, plan.options.get("key_mapping"))
    hf = hf.to(device).eval().requires_grad_(False)
    return HFModel(hf, cfg)


def _decompress(hf: nn.Module) -> None:
    """A compressed-tensors checkpoint's weights decompressed to the model dtype now, as
    transformers' load leaves them for a hook to do at the first forward (compressed-tensors'
    `decompress_model`, without its progress bar): the layers keep their input quantization."""
    compressor = getattr(getattr(hf, "hf_quantizer", None), "compressor", None)
    if compressor is None:
        return
    from compressed_tensors.compressors.base import decompress_module
    from compressed_tensors.quantization.utils.helpers import is_module_quantized

    for module in [m for m in hf.modules() if is_module_quantized(m)]:
        decompress_module(module, compressor.force_compression_format)
    compressor.remove_decompression_hook(hf)


def _refuse_extra_layers(path: str | Path, hf: nn.Module, n_layers: int, unexpected) -> None:
    """A tensor of a decoder layer past config.json's count, which transformers leaves unread
    with a warning: refused, as the native loader refuses it (the weights and config disagree).
    The decoder's layer list is found by its length; a vision tower's layers are not its."""
    lists = [
        n for n, m in hf.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers
    ]
    for name in sorted(unexpected):
        for prefix in lists:
            index = name.removeprefix(f"{prefix}.").split(".")[0]
            if name.startswith(f"{prefix}.") and index.isdigit() and int(index) >= n_layers:
                raise ModelLoadError(
                    f"the checkpoint's {name} in {path} has no place in the {n_layers}-layer "
                    "model its config.json describes; the weights and config.json must come "
                    "from the same model"
                )
