"""LoRA adapters merged into a loaded model's weights, before quantization.

An adapter is a PEFT directory: `adapter_config.json`, read with peft's own config classes, and
`adapter_model.safetensors`, holding for each adapted linear layer X of the base checkpoint
`base_model.model.X.lora_A.weight` (r, in) and `base_model.model.X.lora_B.weight` (out, r).
Merging adds (B @ A) * scaling to X's weight, with scaling = alpha / r (alpha / sqrt(r) under
rsLoRA), which is what peft's `merge_and_unload` computes. The merged model is an ordinary one:
the engine, compilation and quantization know nothing of adapters.

The checkpoint names map onto our parameters as the loader maps them (`weight_slot`): q/k/v
land in row slices of the fused `wqkv`, gate/up in row slices of `w_in`. GPT-2's Conv1D layers
store their weight as (in, out), which is what peft's `fan_in_fan_out` is about, but their A and
B are (r, in) and (out, r) like a Linear's, and we store every weight as (out, in), so B @ A adds
straight on. An adapter is checked against the model's config (tensor shapes from the file's
header, parameter shapes from a meta-device model) before any weights load: one for another
base model fails fast, naming the mismatch (`pair_scaling`, shared with the transformers backend).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchgen.errors import ModelLoadError
from batchgen.model.checkpoint.names import weight_slot
from batchgen.model.config import Family, ModelConfig
from batchgen.model.parallel.sharding import SINGLE, TPShard
from batchgen.model.quiet_import import quiet_torchao

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
# Our parameters an adapter may change: the attention and MLP matrices of the layers.
_TARGETABLE = re.compile(r"layers\.\d+\.(attn\.wqkv|attn\.wo|mlp\.w_in|mlp\.w_out)\.weight")
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# init_lora_weights methods that change the base weights, which a plain merge would not redo.
_MUTATING_INITS = ("pissa", "olora", "corda", "loftq")


class LoraError(ModelLoadError):
    pass


@dataclass(frozen=True, slots=True)
class LoraMerge:
    """One adapted layer: add (B @ A) * scaling to rows `rows` of parameter `target`."""

    module: str  # the checkpoint's module, e.g. "model.layers.0.self_attn.q_proj"
    target: str  # our parameter, e.g. "layers.0.attn.wqkv.weight"
    rows: slice | None
    scaling: float


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    path: Path
    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    targets: tuple[str, ...]  # the adapted module kinds, e.g. ("q_proj", "v_proj")
    sha256: str  # of adapter_model.safetensors
    merges: tuple[LoraMerge, ...]

    @classmethod
    def of(cls, path: Path, config, merges: list[LoraMerge], kinds: set[str]) -> LoraAdapter:
        """The adapter at path: its config's settings, and the merges checked against a model."""
        patterns = dict(config.rank_pattern or {}), dict(config.alpha_pattern or {})
        settings = (config.r, config.lora_alpha, bool(config.use_rslora), *patterns)
        return cls(path, *settings, tuple(sorted(kinds)), adapter_sha256(path), tuple(merges))

    def to_dict(self) -> dict[str, Any]:
        out = {
            "path": str(self.path.resolve()),
            "r": self.r,
            "alpha": self.alpha,
            "use_rslora": self.use_rslora,
            "targets": list(self.targets),
            "layers_adapted": len(self.merges),
            "sha256": self.sha256,
        }
        patterns = {"rank_pattern": self.rank_pattern, "alpha_pattern": self.alpha_pattern}
        return out | {k: dict(v) for k, v in patterns.items() if v}


def adapter_sha256(path: str | Path) -> str:
    """SHA-256 of the adapter's weights file: two adapters with one hash are the same adapter."""
    f = _weights_file(Path(path))
    st = f.stat()
    return _file_sha256(str(f.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _file_sha256(file: str, size: int, mtime_ns: int) -> str:
    # Keyed on size and mtime too: a rewritten file is hashed again.
    h = hashlib.sha256()
    with open(file, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _weights_file(path: Path) -> Path:
    if not path.is_dir():
        raise LoraError(
            f"LoRA adapter {path} does not exist; pass --lora a PEFT adapter directory "
            f"({CONFIG_FILE} + {WEIGHTS_FILE}, as save_pretrained writes it)"
        )
    f = path / WEIGHTS_FILE
    if f.is_file():
        return f
    if (path / "adapter_model.bin").is_file():
        raise LoraError(
            f"LoRA adapter {path} holds only adapter_model.bin, a pickle file that can run code "
            f"when loaded; save the adapter with safe_serialization=True to get {WEIGHTS_FILE}"
        )
    raise LoraError(f"LoRA adapter {path} has no {WEIGHTS_FILE}")


def _read_config(path: Path):
    if not (path / CONFIG_FILE).is_file():
        raise LoraError(f"LoRA adapter {path} has no {CONFIG_FILE}")
    with quiet_torchao():  # peft imports torchao where it is installed
        from peft import LoraConfig, PeftConfig

    try:
        config = PeftConfig.from_pretrained(str(path))
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise LoraError(f"LoRA adapter {path}: cannot read {CONFIG_FILE}: {e}") from None
    kind = getattr(config.peft_type, "value", config.peft_type)
    if kind != "LORA" or not isinstance(config, LoraConfig):
        raise LoraError(f"{path} is a {kind} adapter; only LoRA adapters can be merged")
    init = config.init_lora_weights
    unsupported = {
        "DoRA (use_dora)": config.use_dora,
        f"trained biases (bias={config.bias!r})": config.bias != "none",
        "LoRA biases (lora_bias)": getattr(config, "lora_bias", False),
        f"fully trained modules (modules_to_save={config.modules_to_save})": config.modules_to_save,
        "trainable tokens (trainable_token_indices)": getattr(
            config, "trainable_token_indices", None
        ),
        "layer replication (layer_replication)": getattr(config, "layer_replication", None),
        "parameter targets (target_parameters)": getattr(config, "target_parameters", None),
        "aLoRA (alora_invocation_tokens)": getattr(config, "alora_invocation_tokens", None),
        "QALoRA (use_qalora)": getattr(config, "use_qalora", False),
        "block-diagonal LoRA (use_bdlora)": getattr(config, "use_bdlora", None),
        "Megatron layers (megatron_config)": getattr(config, "megatron_config", None),
        f"an init that changes the base weights (init_lora_weights={init!r}; convert it with "
        "save_pretrained(path_initial_model_for_weight_conversion=...))": isinstance(init, str)
        and init.lower().startswith(_MUTATING_INITS),
    }
    used = [what for what, on in unsupported.items() if on]
    if used:
        raise LoraError(f"LoRA adapter {path} uses {used[0]}, which cannot be merged")
    return config


def pair_scaling(path: Path, config: Any, module: str, ab: dict, want: tuple[int, int]) -> float:
    """The merge scaling of module's lora_A/lora_B pair (ab: "A"/"B" -> shape), after checking
    that both are there, that B @ A is want (out, in) and that their rank is the config's."""
    if set(ab) != {"A", "B"}:
        (have,) = ab
        raise LoraError(
            f"LoRA adapter {path} has lora_{have} but no lora_{'AB'.replace(have, '')} for {module}"
        )
    (r_a, n_in), (n_out, r_b) = ab["A"], ab["B"]
    if (n_out, n_in) != want:
        trained_on = config.base_model_name_or_path
        raise LoraError(
            f"LoRA adapter {path} does not fit this model: its {module} update is "
            f"{n_out}x{n_in} (out x in), the model's is {want[0]}x{want[1]}; the adapter was "
            "trained for another base model" + (f" ({trained_on})" if trained_on else "")
        )
    r = _pattern_value(config.rank_pattern, module, config.r)
    alpha = _pattern_value(config.alpha_pattern, module, config.lora_alpha)
    if r_a != r or r_b != r:
        raise LoraError(
            f"LoRA adapter {path}: {module} has rank {r_a} (A) and {r_b} (B), but its "
            f"{CONFIG_FILE} says r={r}"
        )
    return alpha / math.sqrt(r) if config.use_rslora else alpha / r


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft's rank_pattern/alpha_pattern lookup: the first key matching the module's name end."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def _tensor_shapes(path: Path, file: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:
        raise LoraError(f"LoRA adapter {path}: cannot read {file.name}: {e}") from e


@functools.lru_cache(maxsize=4)
def _param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from batchgen.model.families.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_adapter(path: str | Path, cfg: ModelConfig) -> LoraAdapter:
    """Read an adapter's config and tensor shapes (not its weights) and check that it fits a
    model of `cfg`; raises LoraError naming the adapter and the first mismatch."""
    path = Path(path)
    file = _weights_file(path)
    config = _read_config(path)
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    others: dict[str, tuple[int, ...]] = {}  # refused once the targets are checked
    for key, shape in _tensor_shapes(path, file).items():
        m = _KEY.fullmatch(key)
        if m and len(shape) == 2:
            modules.setdefault(m.group(1), {})[m.group(2)] = shape
        else:
            others[key] = shape
    supported = GPT2_TARGETS if cfg.family == Family.GPT2 else LLAMA_TARGETS
    params = _param_shapes(cfg)
    merges, kinds = [], set()
    for module, ab in sorted(modules.items()):
        slot = weight_slot(cfg, module + ".weight")
        if slot is None or not _TARGETABLE.fullmatch(slot.name):
            raise LoraError(
                f"LoRA adapter {path} adapts {module}, which batchgen cannot merge into a "
                f"{cfg.family.value} model; supported target modules: {', '.join(supported)}"
            )
        if slot.name not in params:
            raise LoraError(
                f"LoRA adapter {path} adapts {module}, but the model has {cfg.n_layers} layers; "
                "the adapter was trained for another base model"
            )
        out, cols = params[slot.name]
        out = out if slot.rows is None else slot.rows.stop - slot.rows.start
        scaling = pair_scaling(path, config, module, ab, (out, cols))
        merges.append(LoraMerge(module, slot.name, slot.rows, scaling))
        kinds.add(module.rsplit(".", 1)[-1])
    if others:
        key, shape = next(iter(others.items()))
        raise LoraError(
            f"LoRA adapter {path} holds {key} {list(shape)}, which is not the A or B matrix "
            "of a LoRA linear layer; only those can be merged"
        )
    if not merges:
        raise LoraError(f"LoRA adapter {path} holds no LoRA weights")
    return LoraAdapter.of(path, config, merges, kinds)


@torch.no_grad()
def merge_lora(
    model: torch.nn.Module,
    adapter: str | Path | LoraAdapter,
    cfg: ModelConfig | None = None,
    tp: TPShard = SINGLE,
) -> LoraAdapter:
    """Add the adapter (a directory, or one check_adapter returned) into `model`'s weights,
    in place; returns what was merged. A tensor-parallel rank (tp, with cfg the whole
    model's config) adds its slice of each update: B's rows of its output rows, or A's
    columns of its input columns, so (B @ A) is never formed whole."""
    from safetensors import safe_open

    cfg = cfg or model.cfg
    if not isinstance(adapter, LoraAdapter):
        adapter = check_adapter(adapter, cfg)
    params = dict(model.named_parameters())
    with safe_open(str(adapter.path / WEIGHTS_FILE), framework="pt", device="cpu") as f:
        for m in adapter.merges:
            w = params[m.target]  # (out, in), this rank's part
            a = f.get_tensor(f"base_model.model.{m.module}.lora_A.weight")  # (r, in)
            b = f.get_tensor(f"base_model.model.{m.module}.lora_B.weight")  # (out_rows, r)
            a, b = a.to(w.device, torch.float32), b.to(w.device, torch.float32)
            for c in weight_slot(cfg, m.module + ".weight", tp).copies:
                if c.src is None:
                    delta = b @ a
                elif c.dim == 0:  # column-parallel: this rank's output rows
                    delta = b[c.src] @ a
                else:  # row-parallel: this rank's input columns
                    delta = b @ a[:, c.src]
                rows = w if c.dst is None else w[c.dst]  # a view: the fused matrix's slice
                # Summed in float32, then rounded once: a bf16 weight loses no more than it must.
                rows.copy_((rows.float() + delta * m.scaling).to(w.dtype))
    return adapter
