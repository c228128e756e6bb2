"""``composer export RUN OUT``: a training checkpoint (DCP, any layout) -> a portable checkpoint.

Streams: the model is built on the meta device only for its keys, shapes and the layout of its
fused tensors; tensors are read from the newest step with DCP in groups of at most
``GROUP_BYTES`` (DCP reassembles each from whatever shards the saving layout wrote), fused where
the portable format fuses them (Mamba's ``in_proj``/``conv1d`` parts), and written one after the
other through the portable writer into a temporary folder renamed into place when complete.
Memory stays bounded by a group plus one tensor, never the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from composer.blocks.plan import named_state
from composer.build.builder import build_model, write_portable
from composer.build.init import stored_as
from composer.config import ConfigError, ModelConfig
from composer.convert.peft import LoRATensors
from composer.data.tokenizer import TOKENIZER_DIR
from composer.parallel.checkpoint import is_training_checkpoint, latest_step
from composer.portable import CONFIG_FILE, DEFAULT_MAX_SHARD

GROUP_BYTES = 256 * 2**20
LORA_MARK = ".lora."
"""Adapter tensors (``<base>.lora.A.weight``, ``.lora.B.weight``) have this in their names."""


class _Saved:
    """The newest step of a run: its config, meta model (with its LoRA modules when it has
    adapters), and where each state-dict key's parts are saved."""

    def __init__(self, run: Path, adapters: bool) -> None:
        """``adapters``: whether the caller reads a LoRA run's adapters (a plain export
        would drop them: refused)."""
        if not is_training_checkpoint(run):
            raise ConfigError(f"{run}: not a training checkpoint folder (no 'latest' file); "
                              "`composer train --save` writes one")
        self.run, self.step_dir = run, latest_step(run)
        self.cfg = ModelConfig.load(run / CONFIG_FILE).validate()
        self.meta = FileSystemReader(str(self.step_dir)).read_metadata().state_dict_metadata
        self.lora = any(LORA_MARK in k for k in self.meta)
        if self.lora and not adapters:
            raise ConfigError(f"{run}: a LoRA run; a plain export would drop its adapters: use "
                              "--adapter (a PEFT adapter folder) or --merge (merged weights)")
        self.model = build_model(self.cfg, device="meta")
        self.scalings: dict[str, float] = {}
        if self.lora:
            self.scalings = lora_modules(self.model, run)
        self.parts: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for name, t in named_state(self.model):
            key, _ = stored_as(self.model, name)
            if f"model.{name}" not in self.meta:
                raise ConfigError(f"{self.step_dir}: no tensor {name!r}; the checkpoint does not "
                                  f"match {run / CONFIG_FILE}")
            self.parts.setdefault(key, []).append((name, tuple(t.shape)))
        self.dtypes = {key: self.meta[f"model.{names[0][0]}"].properties.dtype
                       for key, names in self.parts.items()}
        self.shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}

    def keys(self, adapters: bool) -> list[str]:
        """The state-dict keys of the base model, or of its adapters."""
        return [k for k in self.shapes if (LORA_MARK in k) == adapters]

    def stream(self, keys: list[str], progress: Callable[[int], None] | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each key's tensor, read with DCP in groups of at most ``GROUP_BYTES``."""
        group: list[str] = []
        size = 0
        for i, key in enumerate(keys):
            group.append(key)
            size += self.dtypes[key].itemsize * torch.Size(self.shapes[key]).numel()
            if size < GROUP_BYTES and i + 1 < len(keys):
                continue
            wanted = {name: torch.empty(shape, dtype=self.dtypes[k])
                      for k in group for name, shape in self.parts[k]}
            dcp.load({"model": wanted}, checkpoint_id=str(self.step_dir))  # one process
            for k in group:
                pieces = [wanted.pop(name) for name, _ in self.parts[k]]
                t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
                if progress is not None:
                    progress(t.numel() * t.element_size())
                yield k, t
            group, size = [], 0

    def adapters(self) -> LoRATensors:
        return LoRATensors(dict(self.stream(self.keys(adapters=True))), dict(self.scalings))


def lora_modules(model: torch.nn.Module, run: Path) -> dict[str, float]:
    """GLUE (the lead connects it to ``composer.lora``): add to the meta ``model`` the LoRA
    modules the run ``run`` trained (ranks, targets and per-module scalings as its recipe says:
    ``lora_*`` fields, or the PEFT ``adapter`` it started from), so that their saved tensors are
    found under the names and fused layout of ``<base>.lora.A.weight`` / ``.lora.B.weight``;
    returns each adapted base's scaling."""
    try:
        from composer import lora as lora_api
    except ImportError:
        raise ConfigError(f"{run}: a LoRA run, but this build has no composer.lora to read its "
                          "adapters") from None
    from composer.train.recipe import RECIPE_FILE, read_recipe

    recipe = read_recipe(run / RECIPE_FILE) if (run / RECIPE_FILE).exists() else {}
    rank = int(recipe.get("lora_rank") or 0)
    alpha = recipe.get("lora_alpha") or rank
    cfg = lora_api.LoRAConfig(rank=rank, alpha=alpha, dropout=0.0,
                              targets=recipe.get("lora_targets") or ["all"])
    ranks = scalings = None
    if recipe.get("adapter"):  # per-module ranks and scalings of the adapter it started from
        from composer.convert.peft import load_peft
        from composer.convert.peft_folders import family_map

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


def export(run: str | Path, out: str | Path, force: bool = False,
           max_shard_bytes: int = DEFAULT_MAX_SHARD,
           progress: Callable[[int], None] | None = None, merge: bool = False) -> Path:
    """Write the newest step of the training checkpoint folder ``run`` as a portable checkpoint
    at ``out`` (``config.yaml`` + ``model.safetensors``, sharded with an index when large), with
    the run's ``tokenizer/`` when it has one. A LoRA run needs ``merge``: each adapted weight
    is written as ``W + s B A`` (in fp32, cast back), without adapter tensors."""
    run = Path(run)
    saved = _Saved(run, adapters=merge)
    keys = saved.keys(adapters=False)
    plan = [(key, saved.dtypes[key], saved.shapes[key]) for key in keys]
    lora = saved.adapters() if saved.lora else LoRATensors({}, {})
    adapted = {base + ".weight": base for base in lora.bases()}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key, t in saved.stream(keys, progress):
            if key in adapted:
                base = adapted[key]
                delta = lora.b(base).float() @ lora.a(base).float()
                t = (t.float() + lora.scalings[base] * delta).to(t.dtype)
            yield key, t

    extra = {TOKENIZER_DIR: run / TOKENIZER_DIR} if (run / TOKENIZER_DIR).is_dir() else None
    return write_portable(out, saved.cfg, plan, tensors(), force, max_shard_bytes,
                          extra_dirs=extra)


def run_origin(run: Path, depth: int = 0
               ) -> tuple[str | None, Path | None, dict[str, Any], dict[str, Any]]:
    """What a run was trained from (its recipe's ``model``): the name or path, the folder (None:
    a preset), the HF ``config.json`` and ``conversion.json`` it keeps (``{}`` when none). A run
    started from another run asks that one."""
    from composer.convert.peft_folders import hf_metadata
    from composer.train.recipe import RECIPE_FILE, read_recipe

    recipe = read_recipe(run / RECIPE_FILE) if (run / RECIPE_FILE).exists() else {}
    model = recipe.get("model")
    if not isinstance(model, str):
        return None, None, {}, {}
    folder = Path(model)
    if folder.is_dir() and is_training_checkpoint(folder) and depth < 8:
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
    from composer.convert.peft import write_peft
    from composer.convert.peft_folders import family_map

    run = Path(run)
    saved = _Saved(run, adapters=True)
    if not saved.lora:
        raise ConfigError(f"{run}: not a LoRA run (no adapter tensors); `composer export` "
                          "writes its weights")
    from composer.train.recipe import RECIPE_FILE, read_recipe

    name, folder, hf_config, conversion = run_origin(run)
    _, lmap = family_map(saved.cfg, hf_config, conversion, folder)
    recipe = read_recipe(run / RECIPE_FILE) if (run / RECIPE_FILE).exists() else {}
    return write_peft(out, lmap, saved.adapters(), base if base is not None else name, force,
                      dropout=float(recipe.get("lora_dropout") or 0.0))
