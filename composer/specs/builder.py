"""Config -> model: build on the meta device, materialise, seed, count, save and load.

``build_model`` validates the config, builds every block on the meta device (no memory, any size),
and, unless ``device="meta"``, allocates the weights on ``device`` and initialises them from
``seed``. Parameter and FLOP counts work on the meta model, so a 56B preset is counted in
seconds. The portable checkpoint is a folder with ``config.yaml`` and ``model.safetensors``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from composer.blocks.model import HybridModel
from composer.config import ConfigError, ModelConfig
from composer.specs.registry import REGISTRY, layer_kind, mixer_class

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def check_buildable(cfg: ModelConfig) -> None:
    """Validate ``cfg`` and check that every symbol of its pattern has a block."""
    cfg.validate()
    pattern = cfg.parsed
    for sym in dict.fromkeys(pattern.layers):
        layer_kind(sym)
    if pattern.mtp:
        raise ConfigError(f"multi-token-prediction parts ('/{pattern.mtp[0]}') are parsed but not "
                          "built yet; remove them from the pattern to build the main model")


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0,
                dtype: torch.dtype | None = None) -> HybridModel:
    """Build ``cfg``; on ``device="meta"`` no memory is allocated and nothing is initialised."""
    check_buildable(cfg)
    with torch.device("meta"):
        model = HybridModel(cfg)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    init_weights(model, seed)
    if dtype is not None:
        cast_model(model, dtype)
    return model


def init_weights(model: HybridModel, seed: int) -> None:
    """Seeded initialisation, module by module in a fixed order."""
    device = model.embed.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        model.reset_parameters(generator)
        for layer in model.layers.values():
            layer.norm.reset_parameters()
            layer.mixer.reset_parameters(generator)


def fp32_names(model: HybridModel) -> set[str]:
    """Names of parameters and buffers that stay fp32 whatever the model dtype (A_log, router)."""
    names = set()
    for prefix, layer in model.layers.items():
        for name in getattr(layer.mixer, "keep_fp32", ()):
            names.add(f"layers.{prefix}.mixer.{name}")
    return names


def cast_model(model: HybridModel, dtype: torch.dtype) -> HybridModel:
    """Cast floating tensors to ``dtype``, keeping :func:`fp32_names` in fp32."""
    keep = fp32_names(model)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point():
                t.data = t.data.to(torch.float32 if name in keep else dtype)
    return model


# ---------------------------------------------------------------- counts


@dataclass
class ModelStats:
    n_layers: int
    layer_counts: dict[str, int]
    params_by_kind: dict[str, int]
    n_params: int
    n_active_params: int
    flops_per_token: int
    """Training FLOPs per token (forward + backward = 3x forward) at ``seq_len``."""
    forward_flops_per_token: int
    seq_len: int

    @property
    def bf16_bytes(self) -> int:
        return 2 * self.n_params


def _inactive_expert_params(mixer: torch.nn.Module, cfg: ModelConfig) -> int:
    moe = cfg.moe
    if moe is None or not hasattr(mixer, "experts"):
        return 0
    routed = sum(p.numel() for p in mixer.experts.parameters())
    return routed * (moe.n_experts - moe.top_k) // moe.n_experts


def model_stats(model: HybridModel, seq_len: int = 4096) -> ModelStats:
    """Parameter counts (shared tensors once), active parameters and FLOPs per token."""
    cfg = model.config
    pattern = cfg.parsed
    by_kind: dict[str, int] = {"embedding": model.embed.weight.numel()}
    inactive = 0
    for layer in model.layers.values():
        name = f"{layer.symbol} {REGISTRY[layer.symbol].name}"
        by_kind[name] = by_kind.get(name, 0) + sum(p.numel() for p in layer.parameters())
        inactive += _inactive_expert_params(layer.mixer, cfg)
    by_kind["final norm"] = model.final_norm.weight.numel()
    if not cfg.tie_embeddings:
        by_kind["lm head"] = model.lm_head.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    assert total == sum(by_kind.values()), "parameter accounting out of step with the model"
    forward = 2 * cfg.d_model * cfg.vocab_size
    forward += sum(mixer_class(s).flops_per_token(cfg, seq_len) for s in pattern.layers)
    return ModelStats(
        n_layers=pattern.n_layers,
        layer_counts=dict(pattern.counts()),
        params_by_kind=by_kind,
        n_params=total,
        n_active_params=total - inactive,
        flops_per_token=3 * forward,
        forward_flops_per_token=forward,
        seq_len=seq_len,
    )


# ---------------------------------------------------------------- portable checkpoints


def save(model: HybridModel, folder: str | Path, force: bool = False) -> Path:
    """Write ``config.yaml`` and ``model.safetensors`` atomically (temporary folder, rename)."""
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()) and not force:
        raise FileExistsError(f"{folder} is not empty; pass force=True (--force) to replace it")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        model.config.save(tmp / CONFIG_FILE)
        tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        # mkdtemp makes a private folder; give the result the usual permissions
        os.chmod(tmp, 0o777 & ~umask)
        for path in tmp.iterdir():
            os.chmod(path, 0o666 & ~umask)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in dict.fromkeys(weight_map.values())]
    if (folder / WEIGHTS_FILE).exists():
        return [folder / WEIGHTS_FILE]
    raise FileNotFoundError(f"{folder}: neither {WEIGHTS_FILE} nor {INDEX_FILE} found")


def load(folder: str | Path, device: str | torch.device = "cpu") -> HybridModel:
    """Load a portable checkpoint; every key must match the config, with the right shape."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{folder}: no {CONFIG_FILE}; not a composer checkpoint")
    cfg = ModelConfig.load(folder / CONFIG_FILE)
    model = build_model(cfg, device="meta")
    expected = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for key in f.keys():
                if key not in expected:
                    raise ValueError(f"{path.name}: unexpected tensor {key!r} for this config")
                tensor = f.get_tensor(key)
                if tensor.shape != expected[key].shape:
                    raise ValueError(f"{path.name}: tensor {key!r} has shape "
                                     f"{list(tensor.shape)}, the config needs "
                                     f"{list(expected[key].shape)}")
                loaded[key] = tensor
    missing = sorted(set(expected) - set(loaded))
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise ValueError(f"{folder}: missing tensors {missing[:5]}{more}")
    model.load_state_dict(loaded, strict=True, assign=True)
    return model
