"""Building a model for a layout, and evaluation, the same code for one process and any layout.

Data: a ``.npy`` array of token ids (read with ``allow_pickle=False``). A 2-D array is one sequence
per row (a ``seq_len`` that matches neither the rows' length nor the tokens they predict is
refused); a 1-D array is cut into ``seq_len`` pieces (the last may be shorter). The global batch
and its order depend only on the data, the batch size and the seed, never on the layout: every
data-parallel rank takes its contiguous share of each global batch, tensor-parallel ranks take the
same rows. Losses are next-token cross-entropy, averaged over every predicted token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from composer.blocks.model import HybridModel
from composer.build.builder import (
    adopt_dtypes,
    build_model,
    cast_model,
    check_buildable,
    check_model,
    open_portable,
)
from composer.build.init import check_source, init_weights, load_weights
from composer.config import ConfigError, ModelConfig
from composer.lora import LoRAConfig, is_adapter
from composer.parallel.checkpoint import is_training_checkpoint, latest_step, load_checkpoint
from composer.parallel.data import reshard
from composer.parallel.mesh import ParallelConfig, ParallelDims, build_parallel_dims
from composer.parallel.parallelize import parallelize
from composer.portable import CONFIG_FILE, TensorSource


def load_tokens(path: str | Path, seq_len: int | None) -> list[np.ndarray]:
    """Rows of token ids from a ``.npy`` file (no pickles)."""
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read tokens ({str(exc).splitlines()[0]})") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"{path}: token ids must be integers, got {arr.dtype}")
    if arr.ndim == 2:
        if seq_len and seq_len not in (arr.shape[1], arr.shape[1] - 1):
            raise ConfigError(f"{path} is 2-D: its rows are the sequences ({arr.shape[1]} "
                              f"tokens, predicting {arr.shape[1] - 1}); --seq-len {seq_len} "
                              f"does not match them (drop it, or cut the array yourself)")
        rows = list(arr)
    elif arr.ndim == 1:
        if not seq_len:
            raise ConfigError(f"{path} is 1-D: give --seq-len to cut it into sequences")
        rows = [arr[i:i + seq_len] for i in range(0, len(arr), seq_len)]
    else:
        raise ConfigError(f"{path}: expected a 1-D or 2-D array, got {arr.ndim}-D")
    rows = [r for r in rows if len(r) >= 2]
    if not rows:
        raise ConfigError(f"{path}: no sequence of at least 2 tokens")
    return rows


def check_vocab(rows: list[np.ndarray], cfg: ModelConfig, path: str | Path) -> None:
    top = max(int(r.max()) for r in rows)
    low = min(int(r.min()) for r in rows)
    if low < 0 or top >= cfg.vocab_size:
        raise ConfigError(f"{path}: token ids span [{low}, {top}], the model's vocabulary is "
                          f"{cfg.vocab_size}")


def prepare(source: str, pc: ParallelConfig, seed: int = 0,
            optimizer_lr: float | None = None, device: str | None = None,
            lora: LoRAConfig | None = None, adapter: str | None = None
            ) -> tuple[HybridModel, ParallelDims, torch.optim.Optimizer | None, int]:
    """Model (portable checkpoint, training checkpoint or preset), layout, optimizer, step.

    Shard-local: the model is built and parallelised on the meta device, then this rank
    allocates its shards on its device and initialises them (a preset: layout-independent, from
    ``seed``), reads its slices (a portable checkpoint) or loads its shards (a training
    checkpoint, without initialising first). ``lora``: LoRA adapters (a LoRA run's own, from
    its recipe, when not given). ``adapter``: a PEFT adapter folder merged into the weights as
    they are read (eval and generate: the same logits as the adapted model)."""
    from composer.zoo import get_preset, presets

    if adapter is not None:
        return _prepare_with_adapter(source, pc, adapter, device)
    folder = Path(source)
    training = folder.is_dir() and is_training_checkpoint(folder)
    tensors = None
    if training:
        cfg = ModelConfig.load(folder / CONFIG_FILE)
    elif folder.is_dir():
        cfg, tensors = open_portable(folder)
    elif source in presets():
        cfg = get_preset(source).config()
    else:
        raise ConfigError(f"{source}: not a checkpoint folder or a preset name")
    if training and lora is None and has_adapters(folder):
        from composer.convert.peft_folders import run_lora_config

        lora = run_lora_config(folder)  # the adapters as the run trained them
    dims = build_parallel_dims(pc, device)
    try:
        model = build_sharded(cfg, dims, seed=None if training else seed, tensors=tensors,
                              lora=lora)
    finally:
        if tensors is not None:
            tensors.close()
    opt = None
    if optimizer_lr is not None:
        opt = torch.optim.AdamW(model.parameters(), lr=optimizer_lr)
    step = load_checkpoint(folder, model, opt) if training else 0
    return model, dims, opt, step


def has_adapters(folder: Path) -> bool:
    """Whether the latest step of run ``folder`` holds LoRA adapters."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(latest_step(folder))).read_metadata().state_dict_metadata
    return any(is_adapter(k) for k in saved)


def _prepare_with_adapter(source: str, pc: ParallelConfig, adapter: str, device: str | None
                          ) -> tuple[HybridModel, ParallelDims, None, int]:
    """:func:`prepare` of a portable checkpoint (a run: exported first, into a temporary folder,
    its own adapters merged) read with the PEFT ``adapter`` merged into its weights."""
    import tempfile

    from composer.convert.peft_folders import export_merged, merged_source

    folder = Path(source)
    if not folder.is_dir():
        raise ConfigError(f"{source}: --adapter needs a checkpoint folder (the adapter's base)")
    with tempfile.TemporaryDirectory(prefix="composer-adapter-") as tmp:
        if is_training_checkpoint(folder):
            folder = export_merged(folder, Path(tmp) / "portable")
        tensors = merged_source(folder, adapter)
        cfg = ModelConfig.load(folder / CONFIG_FILE)
        dims = build_parallel_dims(pc, device)
        try:
            model = build_sharded(cfg, dims, seed=0, tensors=tensors)
        finally:
            tensors.close()
    return model, dims, None, 0


def build_sharded(cfg: ModelConfig, dims: ParallelDims, seed: int | None = 0,
                  tensors: TensorSource | None = None, dtype: torch.dtype | None = None,
                  transform: Callable[[HybridModel], None] | None = None,
                  lora: LoRAConfig | None = None, allocate: bool = True) -> HybridModel:
    """Build on meta, parallelise there (:func:`build_meta`), allocate this rank's shards on its
    device and fill them: from a portable checkpoint's ``tensors``, from ``seed``, or not at all
    (``seed=None``: a training checkpoint loads next). ``lora``: a portable checkpoint holds the
    base only, the adapters are initialised from ``seed``. ``allocate=False``: the model stays
    on meta, nothing is read (``composer train --dry-run``: :mod:`composer.plan.dry_run`)."""
    model = build_meta(cfg, dims, tensors=tensors, dtype=dtype, transform=transform, lora=lora)
    if not allocate:
        return model
    model.to_empty(device=dims.device)
    if tensors is not None:
        skip = is_adapter if lora is not None else None
        load_weights(model, tensors, strict=model.pipeline is None, skip=skip)
        if lora is not None and seed is not None:
            init_weights(model, seed, only=is_adapter)
    elif seed is not None:
        init_weights(model, seed)
    return model


def build_meta(cfg: ModelConfig, dims: ParallelDims, tensors: TensorSource | None = None,
               dtype: torch.dtype | None = None,
               transform: Callable[[HybridModel], None] | None = None,
               lora: LoRAConfig | None = None) -> HybridModel:
    """This rank's model, built and parallelised on the meta device: what training allocates
    (:func:`build_sharded`) and what ``composer plan`` measures (:mod:`composer.plan`), one path.
    With ``pp > 1`` only this rank's stages (``model.pipeline``, else None). Tensors take
    ``dtype`` (fp32 masters for training; kept names stay at least fp32) or, without it, the
    checkpoint's dtypes (fp32 for a seed). ``transform`` changes the model on meta before it is
    parallelised (float8 linears). ``lora``: LoRA adapters on the projections, the base frozen
    (:mod:`composer.lora`)."""
    check_buildable(cfg)
    check_model(dims, cfg)
    pipeline = None
    if dims.pp > 1:  # this rank's stages only (composer.parallel.pipeline)
        from composer.build.stages import build_pipeline_model
        from composer.parallel.pipeline import Pipeline

        if tensors is not None:
            check_source(build_model(cfg, device="meta"), tensors)
        model, groups = build_pipeline_model(cfg, dims)
        pipeline = Pipeline(model, dims, groups)
    else:
        model = build_model(cfg, device="meta")
    if dtype is not None:
        cast_model(model, dtype)
    elif tensors is not None:
        adopt_dtypes(model, tensors)
    if transform is not None:
        transform(model)
    parallelize(model, dims, roots=None if pipeline is None else pipeline.views, lora=lora)
    model.pipeline = pipeline
    return model


def _dp_sum(values: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    if dims.dp > 1:
        dist.all_reduce(values, group=dims.dp_mesh.get_group())
    return values


@torch.no_grad()
def evaluate(model: HybridModel, dims: ParallelDims, rows: list[np.ndarray],
             batch_size: int = 8, doc_ids: list[np.ndarray] | None = None) -> tuple[float, int]:
    """Mean next-token cross-entropy over every predicted token, and their number. With
    ``doc_ids`` (one array per row), documents are isolated: nothing is predicted across a
    boundary and nothing is seen across one."""
    model.eval()
    width = len(rows[0])
    order = list(range(len(rows)))
    full = [i for i in order if len(rows[i]) == width]
    tail = [i for i in order if len(rows[i]) != width]  # the short last piece of a 1-D array
    mine = full[dims.dp_rank()::dims.dp]
    n_batches = math.ceil(math.ceil(len(full) / dims.dp) / batch_size)
    totals = torch.zeros(2, dtype=torch.float64, device=dims.device)

    def add(batch: list[int], weight: float) -> None:
        ids = torch.from_numpy(np.stack([rows[i] for i in batch])).long().to(dims.device)
        kwargs, n = {}, ids.shape[0] * (ids.shape[1] - 1)
        if doc_ids is not None:
            docs = np.stack([doc_ids[i] for i in batch])
            kwargs["doc_ids"] = torch.from_numpy(docs).to(dims.device)
            n = int((docs[:, 1:] == docs[:, :-1]).sum())
        if n == 0:
            return
        if getattr(model, "pipeline", None) is not None:  # every pipeline rank gets the loss
            ce = model.pipeline.loss(ids, kwargs.get("doc_ids"))[0]
        else:
            out = model(ids, ids, **kwargs)
            ce = (out.loss - out.aux_loss - out.mtp_loss).double()
        totals[0] += ce * (n * weight)
        totals[1] += n * weight

    for b in range(n_batches):
        batch = mine[b * batch_size:(b + 1) * batch_size]
        # every rank runs the same forwards (they hold collectives); a padding batch counts 0
        add(batch or full[:1], 1.0 if batch else 0.0)
    for i in tail:  # run everywhere, counted once
        add([i], 1.0 if dims.dp_rank() == 0 else 0.0)
    totals = _dp_sum(totals, dims)
    reshard(model)  # the forwards left the FSDP roots' own weights gathered
    return float(totals[0] / totals[1]), int(totals[1])
