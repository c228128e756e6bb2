"""PEFT adapters and checkpoint folders: which family's links a checkpoint follows, and a
portable checkpoint read with a PEFT adapter merged in (``--adapter`` on eval and generate).

The family of a checkpoint is decided as ``to-hf`` decides it (:func:`composer.convert.api.
to_hf`): the architecture recorded in ``hf/conversion.json`` (with its expert layout and on-disk
split), else the one of ``hf/config.json``, else the first family that writes the config.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from composer.config import ConfigError, ModelConfig
from composer.convert.api import CONVERSION_FILE, HF_DIR
from composer.convert.base import Adapter, load_hf_config
from composer.convert.infer import adapter_for_architecture, infer_adapter, recorded_family
from composer.convert.peft import LinkMap, LoRATensors, link_map, load_peft, write_peft
from composer.export import Saved, export
from composer.portable import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD,
    TensorSource,
    bytes_to_tensor,
    is_training_checkpoint,
    tensor_bytes,
)

RECIPE_FILE = "recipe.yaml"
"""``composer.train.recipe.RECIPE_FILE``, not imported: ``composer.train`` sits above us."""


def hf_metadata(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The HF ``config.json`` and ``conversion.json`` a checkpoint keeps (``{}`` when absent):
    a portable checkpoint's ``hf/``, or a Hugging Face folder itself."""
    hf_dir = folder / HF_DIR if (folder / CONFIG_FILE).exists() else folder
    base = load_hf_config(hf_dir / "config.json") if (hf_dir / "config.json").exists() else {}
    path = hf_dir / CONVERSION_FILE
    info = json.loads(path.read_text()) if path.exists() else {}
    return base, info


def family_map(cfg: ModelConfig, hf_config: dict[str, Any], conversion: dict[str, Any],
               folder: Path | None = None) -> tuple[Adapter, LinkMap]:
    """The family adapter and the link map of ``cfg``, from what the checkpoint records."""
    arch = conversion.get("architecture") or next(iter(hf_config.get("architectures") or []),
                                                  None)
    if arch:
        adapter = adapter_for_architecture(arch)
    else:
        adapter = infer_adapter(cfg, recorded_family(folder, hf_config) if folder else None)
    fused = conversion.get("fused_experts", adapter.save_fused_experts)
    return adapter, link_map(adapter, cfg, fused, conversion.get("layout", {}))


def checkpoint_map(folder: str | Path) -> tuple[ModelConfig, Adapter, LinkMap]:
    """The config, family adapter and link map of a portable checkpoint."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).exists():
        raise ConfigError(f"{folder}: no {CONFIG_FILE}; not a composer checkpoint")
    cfg = ModelConfig.load(folder / CONFIG_FILE).validate()
    base, info = hf_metadata(folder)
    adapter, lmap = family_map(cfg, base, info, folder)
    return cfg, adapter, lmap


class MergedSource(TensorSource):
    """A portable checkpoint's tensors with ``W + s B A`` in place of each adapted weight,
    merged when first read (one merged tensor held at a time: loaders read a tensor's slices
    one after the other)."""

    def __init__(self, folder: Path, lora: LoRATensors) -> None:
        super().__init__(folder)
        self.lora = lora
        self._weights = {base + ".weight": base for base in lora.bases()}
        missing = sorted(set(self._weights) - set(self.tensors))
        if missing:
            raise ConfigError(f"{folder}: no tensor {missing[0]!r} for the adapter to merge into")
        self._cached: tuple[str, memoryview] | None = None

    def _merged(self, name: str) -> memoryview:
        if self._cached is None or self._cached[0] != name:
            info = self.tensors[name]
            raw = bytearray(info.nbytes)
            super().read_into(name, 0, memoryview(raw))
            w = bytes_to_tensor(raw, info.torch_dtype, info.shape)
            base = self._weights[name]
            delta = self.lora.b(base).float() @ self.lora.a(base).float()
            merged = (w.float() + self.lora.scalings[base] * delta).to(w.dtype)
            self._cached = (name, tensor_bytes(merged))
        return self._cached[1]

    def locate(self, name: str) -> tuple[Path, int] | None:
        return None if name in self._weights else super().locate(name)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        if name not in self._weights:
            super().read_into(name, offset, out)
            return
        out[:] = self._merged(name)[offset:offset + out.nbytes]


def merged_source(folder: str | Path, adapter_dir: str | Path) -> MergedSource:
    """The portable checkpoint ``folder`` read with the PEFT adapter ``adapter_dir`` merged."""
    _, adapter, lmap = checkpoint_map(folder)
    lora = load_peft(adapter_dir, lmap, adapter)
    return MergedSource(Path(folder), lora)



def training_start(source: str | Path, adapter_dir: str | Path) -> LoRATensors:
    """The PEFT adapter ``adapter_dir`` as our adapter tensors (per-module ranks and
    scalings) for the portable checkpoint or Hugging Face folder ``source`` that ``train``
    starts from (:func:`adapter_lora_config` gives the adapters' layout)."""
    source = Path(source)
    if (source / CONFIG_FILE).exists():
        _, adapter, lmap = checkpoint_map(source)
    else:  # a Hugging Face folder: its own config.json says the family
        hf_config, conversion = hf_metadata(source)
        adapter = adapter_for_architecture(next(iter(hf_config.get("architectures") or []),
                                                ""))
        lmap = link_map(adapter, adapter.config_from_hf(hf_config))
    return load_peft(adapter_dir, lmap, adapter)


# ---------------------------------------------------------------- runs


def _recipe(run: Path) -> dict[str, Any]:
    """The recipe a run saved (``{}`` without one); read here as YAML, not through
    ``composer.train`` (which sits above this module)."""
    path = run / RECIPE_FILE
    if not path.exists():
        return {}
    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else {}


def adapter_lora_config(start: LoRATensors, dropout: float = 0.0) -> Any:
    """The :class:`composer.lora.LoRAConfig` that gives a model exactly the adapters of
    ``start`` (an imported PEFT adapter): its modules, per-module ranks and scalings."""
    from composer.lora import ALL, LoRAConfig

    ranks = start.ranks()
    if not ranks:
        raise ConfigError("the PEFT adapter adapts no projection")
    return LoRAConfig(rank=max(ranks.values()), dropout=dropout, targets=(ALL,), ranks=ranks,
                      scalings=dict(start.scalings), paths=tuple(start.bases()))


def run_lora_config(run: Path) -> Any:
    """The LoRA adapters the run ``run`` trains (``composer.lora.LoRAConfig``), or None: its
    recipe's ``lora_*`` fields, or the PEFT ``adapter`` it started from (read again for its
    modules, ranks and scalings; the weights are the run's)."""
    from composer.lora import LoRAConfig

    recipe = _recipe(run)
    dropout = float(recipe.get("lora_dropout") or 0.0)
    if recipe.get("adapter"):
        _, folder, _, _ = run_origin(run)
        if folder is None:
            raise ConfigError(f"{run}: started from the adapter {recipe['adapter']}, but what "
                              "it adapted is not a folder any more")
        return adapter_lora_config(training_start(folder, recipe["adapter"]), dropout)
    rank = int(recipe.get("lora_rank") or 0)
    if not rank:
        return None
    return LoRAConfig(rank=rank, alpha=recipe.get("lora_alpha"), dropout=dropout,
                      targets=tuple(recipe.get("lora_targets") or ["all"]))


def lora_modules(model: torch.nn.Module, run: Path) -> dict[str, float]:
    """Add to the meta ``model`` the LoRA modules the run ``run`` trained
    (:func:`run_lora_config`), so that their saved tensors are found under the names and fused
    layout of ``<base>.lora.A.weight`` / ``.lora.B.weight``; returns each adapted base's
    scaling."""
    from composer.lora import adapter_modules, add_lora

    cfg = run_lora_config(run)
    if cfg is None:
        raise ConfigError(f"{run}: its checkpoint holds LoRA adapters, but its recipe.yaml has "
                          "no lora_rank or adapter")
    add_lora(model, cfg)
    return {name.removesuffix(".lora"): float(module.scaling)
            for name, module in adapter_modules(model) if hasattr(module, "scaling")}


def run_origin(run: Path, depth: int = 0
               ) -> tuple[str | None, Path | None, dict[str, Any], dict[str, Any]]:
    """What a run was trained from (its recipe's ``model``): the name or path, the folder (None:
    a preset), the HF ``config.json`` and ``conversion.json`` it keeps (``{}`` when none). A run
    started from another run asks that one."""
    recipe = _recipe(run)
    model = recipe.get("origin") or recipe.get("model")  # origin: kept across resumes
    if not isinstance(model, str):
        return None, None, {}, {}
    folder = Path(model)
    if folder.is_dir() and is_training_checkpoint(folder) and depth < 8 \
            and folder.resolve() != run.resolve():  # a resumed run names itself
        return run_origin(folder, depth + 1)
    if not folder.is_dir():
        return model, None, {}, {}  # a preset name or a hub id
    hf_config, conversion = hf_metadata(folder)
    name = model if (folder / "config.json").exists() else hf_config.get("_name_or_path") or model
    return name, folder, hf_config, conversion


def export_adapter(run: str | Path, out: str | Path, base: str | None = None,
                   force: bool = False) -> Path:
    """Write the adapters of the LoRA run ``run`` (its newest step) as a PEFT adapter folder at
    ``out``, through the converter of the family it was trained from; ``base`` overrides
    ``base_model_name_or_path`` (default: what the run was trained from)."""
    run = Path(run)
    saved = Saved(run, lora_modules)
    if not saved.lora:
        raise ConfigError(f"{run}: not a LoRA run (no adapter tensors); `composer export` "
                          "writes its weights")
    name, folder, hf_config, conversion = run_origin(run)
    _, lmap = family_map(saved.cfg, hf_config, conversion, folder)
    lora = LoRATensors(*saved.adapters())
    return write_peft(out, lmap, lora, base if base is not None else name, force,
                      dropout=float(_recipe(run).get("lora_dropout") or 0.0))


def export_merged(run: str | Path, out: str | Path, force: bool = False,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD,
                  progress: Callable[[int], None] | None = None) -> Path:
    """``composer export --merge``: the run as a portable checkpoint, its adapters (if any)
    merged into the weights."""
    return export(run, out, force, max_shard_bytes, progress, install=lora_modules)
