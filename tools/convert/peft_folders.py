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
from composer.parallel.checkpoint import is_training_checkpoint
from composer.portable import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD,
    TensorSource,
    bytes_to_tensor,
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
    starts from: what :func:`attach_for_training` installs."""
    source = Path(source)
    if (source / CONFIG_FILE).exists():
        _, adapter, lmap = checkpoint_map(source)
    else:  # a Hugging Face folder: its own config.json says the family
        hf_config, conversion = hf_metadata(source)
        adapter = adapter_for_architecture(next(iter(hf_config.get("architectures") or []),
                                                ""))
        lmap = link_map(adapter, adapter.config_from_hf(hf_config))
    return load_peft(adapter_dir, lmap, adapter)


def attach_for_training(model: Any, lora: LoRATensors, lora_config: Any) -> None:
    """GLUE (the lead connects it to ``composer.lora``; call it on the meta model, before
    parallelisation): the adapters of ``lora`` become the model's trainable LoRA modules, with
    their per-module ranks and scalings (``lora_config`` gives dropout and the rest). After the
    model is allocated, copy ``lora.tensors`` into them (each ``<base>.lora.A.weight`` /
    ``.lora.B.weight`` by state-dict name; B fused like its base), e.g. with
    ``composer.build.init.load_weights`` from a source of these tensors."""
    from composer.lora import add_lora  # the lora helper's API

    missing = [b for b in lora.bases() if b + ".weight" not in model.state_dict()]
    if missing:
        raise ConfigError(f"the adapter adapts {missing[0]!r}, which this model does not have")
    add_lora(model, lora_config, ranks=lora.ranks(), scalings=dict(lora.scalings))


# ---------------------------------------------------------------- runs


def _recipe(run: Path) -> dict[str, Any]:
    """The recipe a run saved (``{}`` without one); read here as YAML, not through
    ``composer.train`` (which sits above this module)."""
    path = run / RECIPE_FILE
    if not path.exists():
        return {}
    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else {}


def lora_modules(model: torch.nn.Module, run: Path) -> dict[str, float]:
    """GLUE (the lead connects it to ``composer.lora``): add to the meta ``model`` the LoRA
    modules the run ``run`` trained (ranks, targets and per-module scalings as its recipe says:
    ``lora_*`` fields, or the PEFT ``adapter`` it started from), so that their saved tensors are
    found under the names and fused layout of ``<base>.lora.A.weight`` / ``.lora.B.weight``;
    returns each adapted base's scaling."""
    try:
        import composer.lora as lora_api
    except ImportError:
        raise ConfigError(f"{run}: a LoRA run, but this build has no composer.lora to read its "
                          "adapters") from None
    recipe = _recipe(run)
    rank = int(recipe.get("lora_rank") or 0)
    alpha = recipe.get("lora_alpha") or rank
    cfg = lora_api.LoRAConfig(rank=rank, alpha=alpha, dropout=0.0,
                              targets=recipe.get("lora_targets") or ["all"])
    ranks = scalings = None
    if recipe.get("adapter"):  # per-module ranks and scalings of the adapter it started from
        _, folder, hf_config, conversion = run_origin(run)
        adapter, lmap = family_map(ModelConfig.load(run / CONFIG_FILE).validate(), hf_config,
                                   conversion, folder)
        start = load_peft(recipe["adapter"], lmap, adapter)
        ranks, scalings = start.ranks(), start.scalings
    lora_api.add_lora(model, cfg, ranks=ranks, scalings=scalings)
    out = {}
    for name, child in model.named_modules():
        if name.endswith(".lora"):  # the scaling lives on the adapter or on its base module
            base = name.removesuffix(".lora")
            holder = child if hasattr(child, "scaling") else model.get_submodule(base)
            out[base] = float(holder.scaling)
    return out


def run_origin(run: Path, depth: int = 0
               ) -> tuple[str | None, Path | None, dict[str, Any], dict[str, Any]]:
    """What a run was trained from (its recipe's ``model``): the name or path, the folder (None:
    a preset), the HF ``config.json`` and ``conversion.json`` it keeps (``{}`` when none). A run
    started from another run asks that one."""
    model = _recipe(run).get("model")
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
