"""``from_hf`` and ``to_hf``: whole conversions, strict, streaming and atomic.

Our checkpoint after ``from_hf`` is a portable checkpoint (``config.yaml``, ``model.safetensors``)
plus ``hf/``: the source ``config.json``, the tokenizer and generation files, and
``conversion.json`` (architecture, each HF tensor's source dtype, the expert layout). ``to_hf``
uses ``hf/`` when present so that the export reproduces the source exactly: same keys, same
dtypes, same bytes; without it (a model from ``composer build``) it writes a fresh config.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer.config import ConfigError, ModelConfig
from composer.convert.base import (
    Adapter,
    encode_floats,
    is_mtp_tensor,
    load_hf_config,
    max_positions,
    without_mtp,
)
from composer.convert.infer import (
    adapter_for_architecture,
    infer_adapter,
    recorded_family,
    round_trip_problem,
)
from composer.convert.plan import (
    Link,
    Piece,
    Target,
    assembled_shape,
    build_targets,
    check_coverage,
    check_sources_tiled,
    execute,
    part,
    plan_tensors,
    whole_copies,
)
from composer.convert.sources import open_source, resolve_source
from composer.portable import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD,
    CheckpointError,
    PlannedTensor,
    ShardedWriter,
    TensorInfo,
    TensorSource,
    atomic_folder,
    check_destination,
    is_training_checkpoint,
    shard_header,
)
from composer.prefill import Prefill

if TYPE_CHECKING:
    import torch

HF_DIR = "hf"
CONVERSION_FILE = "conversion.json"
ASIDE_DIR = "aside"
"""Inside ``hf/``: source tensors the adapter keeps aside (:meth:`Adapter.aside`), by their HF
names and dtypes, to be written back unchanged on export."""


def _identity_targets(names: list[str], source: Any, dtype: torch.dtype | None = None) -> list:
    """Whole-tensor copies of ``names`` from ``source`` (in their dtype unless ``dtype``)."""
    from composer.portable import DTYPE_NAMES

    targets = []
    for name in names:
        info = source.tensors[name]
        shape = tuple(info.shape)
        numel = 1
        for d in shape:
            numel *= d
        out = DTYPE_NAMES[dtype] if dtype is not None and info.torch_dtype.is_floating_point \
            else info.dtype
        targets.append(Target(name, shape, [Piece(name, 0, numel, 0)], out))
    return targets


class _Union:
    """Two tensor sources read as one (the model's tensors and the ones kept aside)."""

    def __init__(self, *sources: Any) -> None:
        self._by_name = {n: s for s in sources for n in s.tensors}
        self.tensors = {n: s.tensors[n] for n, s in self._by_name.items()}

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._by_name[name].read_into(name, offset, out)

    def locate(self, name: str) -> tuple[Path, int] | None:
        return self._by_name[name].locate(name)

    def close(self) -> None:
        for source in {id(s): s for s in self._by_name.values()}.values():
            source.close()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
SKIP_FILES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}
Progress = Callable[[int], None]
Notify = Callable[[str], None]


def _architecture(hf: dict[str, Any], where: Path) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        raise ConfigError(f"{where}: config.json has no 'architectures' field")
    return archs[0]


def _extra_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
                  and p.name not in SKIP_FILES and not p.name.endswith(WEIGHT_SUFFIXES))


def _choose_layout(adapter: Adapter, cfg: ModelConfig, names: set[str]) -> tuple[bool, list[Link]]:
    """Per-expert or fused experts: the layout whose HF names the checkpoint holds."""
    per_expert = adapter.links(cfg, fused_experts=False)
    if not cfg.moe or all(link.hf in names for link in per_expert):
        return False, per_expert
    fused = adapter.links(cfg, fused_experts=True)
    miss_fused = sum(link.hf not in names for link in fused)
    miss_split = sum(link.hf not in names for link in per_expert)
    return (True, fused) if miss_fused < miss_split else (False, per_expert)


def _same_bytes(source: Any, a: str, b: str, chunk: int = 8 * 2**20) -> bool:
    """Whether two tensors hold the same bytes, compared chunk by chunk (bounded memory)."""
    ia, ib = source.tensors[a], source.tensors[b]
    if (ia.dtype, ia.shape) != (ib.dtype, ib.shape):
        return False
    for start in range(0, ia.nbytes, chunk):
        n = min(chunk, ia.nbytes - start)
        if source.read_bytes(a, start, n) != source.read_bytes(b, start, n):
            return False
    return True


def _lm_head_tied(source: Any, links: list[Link], cfg: ModelConfig) -> set[str]:
    """A tied model may still store ``lm_head.weight``: accept it only if it equals the
    embeddings byte for byte (docs/conversion.md), and then ignore it."""
    if not cfg.tie_embeddings or "lm_head.weight" not in source:
        return set()
    embed = next(link.hf for link in links if link.ours == "embed.weight")
    if embed not in source or not _same_bytes(source, "lm_head.weight", embed):
        raise CheckpointError("lm_head.weight differs from the input embeddings but the config "
                              "says tie_word_embeddings=true")
    return {"lm_head.weight"}


def _mtp_if_present(adapter: Adapter, cfg: ModelConfig, names: set[str]) -> ModelConfig:
    """``cfg`` as the config says it (MTP parts included) if the checkpoint holds every tensor
    those parts map (in either expert layout), else without them: a config that declares MTP
    layers the checkpoint lacks (or holds only in part) builds the main model, and whatever MTP
    tensors there are go aside (:meth:`Adapter.aside`)."""
    if not cfg.parsed.mtp:
        return cfg
    main = without_mtp(cfg)
    for fused in (False, True) if cfg.moe else (False,):
        need = {link.hf for link in adapter.links(cfg, fused) + adapter.copy_links(cfg)}
        need -= {link.hf for link in adapter.links(main, fused)}
        if need <= names:
            return cfg
    return main


def _check_copies(source: Any, links: list[Link], copies: list[Link]) -> set[str]:
    """The HF copies of our tensors (:meth:`Adapter.copy_links`), each checked byte for byte
    against the HF tensor its original comes from; returns their names (consumed)."""
    origin = {link.ours: link.hf for link in links if link.ours_idx == () and link.hf_idx == ()}
    for copy in copies:
        original = origin[copy.ours]
        if not _same_bytes(source, copy.hf, original):
            raise CheckpointError(f"{copy.hf} differs from {original}; the model shares one "
                                  f"{copy.ours} and cannot hold a different copy")
    return {copy.hf for copy in copies}


@dataclass
class _Plan:
    """What an import writes: the config built, the expert layout read, our tensors (with the
    on-disk split they were read from) and the source tensors kept aside."""

    cfg: ModelConfig
    fused: bool
    layout: dict[str, Any]
    targets: list[Target]
    order: list[str]
    aside: list[str]


def _mtp_names(names: Any, hf_cfg: dict[str, Any]) -> list[str]:
    n_layers = hf_cfg.get("num_hidden_layers")
    return sorted(n for n in names if isinstance(n_layers, int) and is_mtp_tensor(n, n_layers))


def _plan(adapter: Adapter, cfg: ModelConfig, hf_cfg: dict[str, Any], source: Any,
          names: set[str], dtype: torch.dtype | None, where: str) -> _Plan:
    """The whole import of ``cfg`` from ``source``, checked (strict: every tensor read, kept
    aside or ignored, every shape the config's), before anything is written."""
    import torch

    from composer.build.builder import build_model, fp32_names
    from composer.portable import DTYPE_NAMES

    fused, links = _choose_layout(adapter, cfg, names)
    hf_shapes = {n: tuple(info.shape) for n, info in source.tensors.items()}
    layout = adapter.source_layout(cfg, hf_shapes)
    links = adapter.relink(links, layout)
    copies = _check_copies(source, links, adapter.copy_links(cfg))
    used = {link.hf for link in links} | copies
    aside = sorted(n for n in names if n not in used and adapter.aside(n, hf_cfg))
    unread = _mtp_names(aside, hf_cfg) if cfg.parsed.mtp else []
    if unread:  # our MTP part would ignore what the checkpoint's MTP layer holds
        raise CheckpointError(f"{where}: {unread[0]!r} has no place in our MTP part")
    kept = set(aside)
    tied_ignored = _lm_head_tied(source, links, cfg)
    check_coverage(links, "hf", names, lambda n: n in tied_ignored or n in kept or
                   n in copies or adapter.ignored(n, hf_cfg), where)
    meta = build_model(cfg, device="meta")
    our_shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    check_coverage(links, "ours", our_shapes, lambda n: False, "our model")
    files = {n: info.file.name for n, info in source.tensors.items()}
    targets = build_targets(links, "ours", our_shapes, hf_shapes, files)
    check_sources_tiled(targets, hf_shapes)
    keep32 = fp32_names(meta)
    for t in targets:
        src_dtype = source.tensors[t.pieces[0].source].torch_dtype
        out = dtype if dtype is not None else src_dtype
        if t.name in keep32 and out.itemsize < 4 and out.is_floating_point:
            out = torch.float32
        t.dtype = DTYPE_NAMES[out]
    return _Plan(cfg, fused, layout, targets, _in_source_order(targets, source, our_shapes),
                 aside)


def _in_source_order(targets: list[Target], source: Any, names: Any) -> list[str]:
    """``names`` (our model's order) sorted by where their bytes are stored in the source
    (file, then offset; the first piece's): the order an import writes them in, so that a
    checkpoint whose every tensor is a whole copy is laid out before its names are known
    (:func:`_start_prefill`)."""
    first = {t.name: source.tensors[t.pieces[0].source] for t in targets}
    return sorted(names, key=lambda n: (str(first[n].file), first[n].start))


def _plan_mtp_or_main(adapter: Adapter, cfg: ModelConfig, hf_cfg: dict[str, Any], source: Any,
                      names: set[str], dtype: torch.dtype | None, where: str,
                      notify: Notify) -> _Plan:
    """The import with the checkpoint's MTP layers as our MTP part when they become it exactly,
    else without them: then they are kept aside byte for byte (a checkpoint transformers loads
    converts; transformers never reads these layers), and ``notify`` says so in one line."""
    declared = cfg.parsed.mtp
    cfg = _mtp_if_present(adapter, cfg, names)
    why = "the checkpoint does not hold every tensor of its MTP layers" if declared else \
        "no MTP part of ours is built from this family's layers"
    try:
        plan = _plan(adapter, cfg, hf_cfg, source, names, dtype, where)
    except (CheckpointError, ConfigError) as exc:
        if not cfg.parsed.mtp:
            raise
        plan = _plan(adapter, without_mtp(cfg), hf_cfg, source, names, dtype, where)
        why = str(exc).removeprefix(f"{where}: ")
    mtp = _mtp_names(plan.aside, hf_cfg)
    if mtp:
        notify(f"{len(mtp)} multi-token-prediction tensors kept aside byte for byte in "
               f"hf/{ASIDE_DIR}/ (written back by to-hf), not converted: {why}")
    return plan


def _stderr(message: str) -> None:
    print(f"composer: note: {message}", file=sys.stderr)


def from_hf(src: str | Path, dst: str | Path, dtype: torch.dtype | None = None,
            force: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD,
            progress: Progress | None = None, notify: Notify = _stderr,
            threads: int | None = None) -> ModelConfig:
    """Convert a Hugging Face folder (or hub id) into a composer checkpoint at ``dst``.
    ``notify`` receives the one-line notices (default: printed on stderr); ``threads``, when
    given, is torch's intra-op thread count for the casts (set once torch is imported).

    While torch is imported and the model checked, the source's tensors are already copied
    into the output folder as if each became one of ours unchanged (:func:`_start_prefill`);
    the copy is kept only if the checked plan is exactly that, else it is removed and the plan
    executed. Nothing appears at ``dst`` before every check has passed."""
    dst = Path(dst)
    check_destination(dst, force)
    folder = resolve_source(str(src))
    hf_cfg = load_hf_config(folder / "config.json")
    architecture = _architecture(hf_cfg, folder)
    saved_threads: list[int] = []
    with atomic_folder(dst, force) as tmp:
        prefill = _start_prefill(tmp, folder, dtype, max_shard_bytes)
        try:
            plan, source = _plan_import(folder, hf_cfg, architecture, dtype, notify, threads,
                                        saved_threads)
            conversion = {
                "architecture": architecture,
                "fused_experts": plan.fused,
                "source_dtypes": {n: source.tensors[n].dtype for n in sorted(source.tensors)},
                "aside": plan.aside,
            }
            if plan.layout:
                conversion["layout"] = plan.layout
            _write_import(tmp, plan, source, folder, conversion, max_shard_bytes, progress,
                          prefill)
            source.close()
        finally:
            if prefill is not None:
                prefill.cancel()  # a no-op when its copy was kept
            if saved_threads:
                import torch

                torch.set_num_threads(saved_threads[0])
    return plan.cfg


def _plan_import(folder: Path, hf_cfg: dict[str, Any], architecture: str,
                 dtype: torch.dtype | None, notify: Notify, threads: int | None,
                 saved_threads: list[int]) -> tuple[_Plan, Any]:
    """The checked plan of an import and the source it reads (the work that needs torch);
    sets ``threads`` (appending the count it replaces to ``saved_threads``)."""
    import torch

    from composer.build.builder import check_buildable

    if threads is not None:
        saved_threads.append(torch.get_num_threads())
        torch.set_num_threads(threads)
    adapter = adapter_for_architecture(architecture)
    cfg = adapter.config_from_hf(hf_cfg)
    try:
        check_buildable(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{folder / 'config.json'}: {exc}") from None
    source = open_source(folder)
    canonical: dict[str, str] = {}
    for name in source.names():
        key = adapter.normalize(name)
        if key in canonical:
            raise CheckpointError(f"tensors {canonical[key]!r} and {name!r} are the same tensor "
                                  "under two names")
        canonical[key] = name
    source = source.renamed({v: k for k, v in canonical.items()})
    source = adapter.derive_hf(source, hf_cfg, notify)
    plan = _plan_mtp_or_main(adapter, cfg, hf_cfg, source, set(source.names()), dtype,
                             str(folder), notify)
    return plan, source


def _header_reserve(info_of: Callable[[str], TensorInfo]) -> Callable[[list[Any]], int]:
    """The header size an import pads each shard's header to: the header that lists the source
    tensors of the shard's tensors (``info_of``: a tensor's first source) under their on-disk
    names, plus a quarter and 256 bytes. The same for the copy started before the names are
    known (:func:`_start_prefill`) and for the planned import, so both lay the data out alike;
    our names are rarely longer than Hugging Face's, and a header that does not fit is written
    whole (the copy is then not kept)."""
    def reserve(shard: list[Any]) -> int:
        infos = [info_of(t.name) for t in shard]
        n = len(shard_header([PlannedTensor(i.name, i.dtype, i.shape) for i in infos], {}))
        return n + n // 4 + 256

    return reserve


def _start_prefill(tmp: Path, folder: Path, dtype: torch.dtype | None,
                   max_shard_bytes: int) -> Prefill | None:
    """Copy every source tensor, in the order of the source files, to where the import puts it
    if each becomes one of ours unchanged (the common case: a rename per tensor), before torch
    is imported; None when that cannot be the case (``--dtype`` casts, ``.bin`` files) or the
    source does not open (the planned import then reports why, in its place)."""
    if dtype is not None or not (any(folder.glob("*.safetensors"))
                                 or (folder / "model.safetensors.index.json").exists()):
        return None
    try:
        source = TensorSource(folder)
    except Exception:  # whatever it is, the planned import reports it after the config's errors
        return None
    infos = sorted(source.tensors.values(), key=lambda i: (str(i.file), i.start))
    writer = ShardedWriter(tmp, [PlannedTensor(i.name, i.dtype, i.shape) for i in infos],
                           max_shard_bytes, header_reserve=_header_reserve(
                               lambda name: source.tensors[name]))
    return Prefill(writer, [(i.file, i.start) for i in infos])


def _write_import(tmp: Path, plan: _Plan, source: Any, folder: Path,
                  conversion: dict[str, Any], max_shard_bytes: int,
                  progress: Progress | None, prefill: Prefill | None) -> None:
    plan.cfg.save(tmp / CONFIG_FILE)
    by_name = {t.name: t for t in plan.targets}
    writer = ShardedWriter(tmp, plan_tensors(plan.targets, plan.order), max_shard_bytes,
                           header_reserve=_header_reserve(
                               lambda name: source.tensors[by_name[name].pieces[0].source]))
    if prefill is None or not prefill.adopt(writer, whole_copies(writer, plan.targets, source),
                                            progress):
        execute(plan.targets, source, writer, progress)
    (tmp / HF_DIR).mkdir()
    if plan.aside:
        (tmp / HF_DIR / ASIDE_DIR).mkdir()
        kept_targets = _identity_targets(plan.aside, source)
        execute(kept_targets, source, ShardedWriter(tmp / HF_DIR / ASIDE_DIR, plan_tensors(
            kept_targets, plan.aside), max_shard_bytes), progress)
    shutil.copy2(folder / "config.json", tmp / HF_DIR / "config.json")
    for path in _extra_files(folder):
        shutil.copy2(path, tmp / HF_DIR / path.name)
    (tmp / HF_DIR / CONVERSION_FILE).write_text(json.dumps(conversion, indent=1) + "\n")


def _hf_dtype(name: str, ours: list[TensorInfo], recorded: dict[str, str],
              dtype: torch.dtype | None, adapter: Adapter) -> str:
    from composer.portable import DTYPE_NAMES

    if dtype is not None:
        if name.endswith(adapter.hf_keep_fp32) and dtype.itemsize < 4:
            return "F32"
        return DTYPE_NAMES[dtype]
    if name in recorded:
        return recorded[name]
    return ours[0].dtype


def _export_targets(adapter: Adapter, cfg: ModelConfig, source: TensorSource, where: str,
                    fused: bool, layout: dict[str, Any]) -> list[Target]:
    """The HF tensors of an export, each assembled from its parts of our tensors."""
    links = adapter.relink(adapter.export_links(cfg, fused_experts=fused)
                           + adapter.copy_links(cfg), layout)
    check_coverage(links, "ours", source.names(), lambda n: False, where)
    our_shapes = {n: tuple(i.shape) for n, i in source.tensors.items()}
    parts: dict[str, list] = {}
    for link in links:
        _, shape = part(our_shapes[link.ours], link.ours_idx, link.ours)
        parts.setdefault(link.hf, []).append((link.hf_idx, link.hf_shape or shape))
    hf_shapes = {name: assembled_shape(p) for name, p in parts.items()}
    return build_targets(links, "hf", hf_shapes, our_shapes)


def to_hf(src: str | Path, dst: str | Path, dtype: torch.dtype | None = None,
          force: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD,
          architecture: str | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Export a composer checkpoint at ``src`` as a Hugging Face folder at ``dst``: a portable
    checkpoint, or a training checkpoint folder (exported to a temporary portable one first).
    As in :func:`from_hf`, our tensors are copied while torch is imported and the export
    planned, and the copy is kept only if the plan is that copy."""
    folder, dst = Path(src), Path(dst)
    check_destination(dst, force)
    if is_training_checkpoint(folder):
        from composer.export import export

        dst.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{dst.name}.export-", dir=dst.parent) as tmp:
            portable = export(folder, Path(tmp) / "portable", max_shard_bytes=max_shard_bytes)
            return to_hf(portable, dst, dtype, force, max_shard_bytes, architecture, progress)
    if not (folder / CONFIG_FILE).exists():
        raise ConfigError(f"{folder}: no {CONFIG_FILE}; not a composer checkpoint")
    hf_dir = folder / HF_DIR
    with atomic_folder(dst, force) as tmp:
        prefill = _start_prefill(tmp, folder, dtype, max_shard_bytes)
        try:
            hf_cfg, targets, order, reader = _plan_export(folder, dtype, architecture)
            by_name = {t.name: t for t in targets}
            writer = ShardedWriter(tmp, plan_tensors(targets, order), max_shard_bytes,
                                   header_reserve=_header_reserve(
                                       lambda n: reader.tensors[by_name[n].pieces[0].source]))
            if prefill is None or not prefill.adopt(writer, whole_copies(writer, targets,
                                                                         reader), progress):
                execute(targets, reader, writer, progress)
            if hf_dir.exists():
                for path in _extra_files(hf_dir):
                    if path.name != CONVERSION_FILE:
                        shutil.copy2(path, tmp / path.name)
            (tmp / "config.json").write_text(json.dumps(encode_floats(hf_cfg), indent=2,
                                                        sort_keys=True) + "\n")
            reader.close()
        finally:
            if prefill is not None:
                prefill.cancel()  # a no-op when its copy was kept
    return hf_cfg


def _plan_export(folder: Path, dtype: torch.dtype | None, architecture: str | None
                 ) -> tuple[dict[str, Any], list[Target], list[str], Any]:
    """The HF config, the tensors (in the order written: where their bytes lie in our files,
    then those kept aside) and the reader of an export, checked (the work that needs torch)."""
    from composer.portable import DTYPES

    cfg = ModelConfig.load(folder / CONFIG_FILE).validate()
    hf_dir = folder / HF_DIR
    base = load_hf_config(hf_dir / "config.json") if (hf_dir / "config.json").exists() else {}
    info = json.loads((hf_dir / CONVERSION_FILE).read_text()) \
        if (hf_dir / CONVERSION_FILE).exists() else {}
    arch = architecture or info.get("architecture")
    adapter = adapter_for_architecture(arch) if arch else \
        infer_adapter(cfg, recorded_family(folder, base))
    problem = round_trip_problem(adapter, cfg, base)
    if problem:
        raise ConfigError(f"this model cannot be written as {adapter.family}: {problem}")
    hf_cfg = adapter.config_to_hf(cfg, base)
    if not base and adapter.max_positions is not None:  # a source's config keeps its own
        hf_cfg.setdefault("max_position_embeddings", max_positions(cfg, adapter.max_positions))
    source = adapter.derive_ours(TensorSource(folder), cfg)
    # the source's expert layout and on-disk split, unless --arch asks for another family
    recorded_form = not architecture or architecture == info.get("architecture")
    targets = _export_targets(adapter, cfg, source, str(folder),
                              info.get("fused_experts", adapter.save_fused_experts)
                              if recorded_form else adapter.save_fused_experts,
                              info.get("layout", {}) if recorded_form else {})
    recorded = info.get("source_dtypes", {})
    for t in targets:
        t.dtype = _hf_dtype(t.name, [source.tensors[p.source] for p in t.pieces], recorded,
                            dtype, adapter)
    counts = Counter(t.dtype for t in targets)
    main_dtype = DTYPES[counts.most_common(1)[0][0]]
    order = _in_source_order(targets, source, [t.name for t in targets])
    reader: Any = source
    if (hf_dir / ASIDE_DIR).is_dir():  # written back as they came, after the model's tensors
        kept = TensorSource(hf_dir / ASIDE_DIR)
        targets += _identity_targets(kept.names(), kept, dtype)
        order += kept.names()
        reader = _Union(source, kept)
    hf_cfg["dtype"] = str(main_dtype).removeprefix("torch.")
    hf_cfg.pop("torch_dtype", None)
    return hf_cfg, targets, order, reader
