"""The strict tensor map between a Hugging Face checkpoint and ours, and its streaming execution.

A family adapter lists :class:`Link` objects, each saying "this part of our tensor is that part
of an HF tensor". A part is a contiguous block of rows: the whole tensor ``()``, one leading index
``(e,)`` (expert ``e`` of a fused ``[E, F, D]`` tensor), a row range ``((a, b),)``, or rows of one
leading index ``(e, (a, b))`` (the gate half of a fused ``gate_up [E, 2F, D]``). Because every part
is a contiguous byte range, a conversion is a sequence of byte copies (with a dtype cast when
asked), in the target's order, one bounded chunk at a time.

Strictness (docs/conversion.md): every target tensor must be tiled exactly once by its parts,
every source tensor must be consumed or explicitly ignored, and every part's shape must equal the
config's; an error names the tensor and both shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from composer.portable import (
    ITEMSIZE,
    CheckpointError,
    PlannedTensor,
    ShardedWriter,
    TensorSource,
    tensor_bytes,
)

Index = tuple
CHUNK_BYTES = 8 * 2**20


@dataclass(frozen=True)
class Link:
    ours: str
    hf: str
    ours_idx: Index = ()
    hf_idx: Index = ()
    hf_shape: tuple[int, ...] | None = None
    """The HF tensor's shape when it holds our whole tensor's elements in another shape, the
    same bytes row-major (Kimi Linear's ``A_log`` ``[1, 1, H, 1]``, ours ``[H]``)."""


@dataclass(frozen=True)
class Piece:
    source: str
    offset: int
    """Element offset of the part inside the source tensor."""
    numel: int
    target_offset: int


@dataclass
class Target:
    name: str
    shape: tuple[int, ...]
    pieces: list[Piece]
    dtype: str = ""


def _prod(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def part(shape: tuple[int, ...], idx: Index, name: str) -> tuple[int, tuple[int, ...]]:
    """Element offset and shape of part ``idx`` of a tensor of ``shape``."""
    def bad() -> CheckpointError:
        return CheckpointError(f"tensor {name!r} with shape {list(shape)} has no part {idx}")

    if idx == ():
        return 0, shape
    lead, rest = idx[0], idx[1:]
    if isinstance(lead, int):
        if not shape or not 0 <= lead < shape[0]:
            raise bad()
        offset = lead * _prod(shape[1:])
        if not rest:
            return offset, shape[1:]
        (a, b), = rest
        if len(shape) < 2 or not 0 <= a < b <= shape[1]:
            raise bad()
        return offset + a * _prod(shape[2:]), (b - a, *shape[2:])
    a, b = lead
    if rest or not shape or not 0 <= a < b <= shape[0]:
        raise bad()
    return a * _prod(shape[1:]), (b - a, *shape[1:])


def assembled_shape(parts: list[tuple[Index, tuple[int, ...]]]) -> tuple[int, ...]:
    """The shape of a tensor assembled from parts given as ``(idx, part_shape)``."""
    idx0, shape0 = parts[0]
    if idx0 == ():
        return shape0
    if isinstance(idx0[0], int):
        n_lead = max(idx[0] for idx, _ in parts) + 1
        if len(idx0) == 1:
            return (n_lead, *shape0)
        rows = max(idx[1][1] for idx, _ in parts)
        return (n_lead, rows, *shape0[1:])
    rows = max(idx[0][1] for idx, _ in parts)
    return (rows, *shape0[1:])


def _same_view(link: Link, a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whole tensors that a link declares as two shapes of the same elements."""
    hf, ours = (a, b) if tuple(a) == link.hf_shape else (b, a)
    return (link.hf_shape is not None and tuple(hf) == link.hf_shape
            and link.ours_idx == link.hf_idx == () and _prod(hf) == _prod(ours))


def build_targets(links: list[Link], target_side: str, target_shapes: dict[str, tuple[int, ...]],
                  source_shapes: dict[str, tuple[int, ...]],
                  source_files: dict[str, str] | None = None) -> list[Target]:
    """Group links by target tensor, check shapes, and check that parts tile every target.
    ``source_files`` names the file of each source tensor, for error messages."""
    src_side = "hf" if target_side == "ours" else "ours"
    grouped: dict[str, list[Link]] = {}
    for link in links:
        grouped.setdefault(getattr(link, target_side), []).append(link)
    targets = []
    for name, group in grouped.items():
        if name not in target_shapes:
            raise CheckpointError(f"no shape known for target tensor {name!r}")
        shape = target_shapes[name]
        pieces = []
        for link in group:
            src = getattr(link, src_side)
            src_offset, src_part = part(source_shapes[src], getattr(link, f"{src_side}_idx"), src)
            dst_offset, dst_part = part(shape, getattr(link, f"{target_side}_idx"), name)
            if tuple(src_part) != tuple(dst_part) and not _same_view(link, src_part, dst_part):
                where = f" (in {source_files[src]})" if source_files else ""
                raise CheckpointError(
                    f"shape mismatch: {src!r}{_fmt(getattr(link, f'{src_side}_idx'))}{where} is "
                    f"{list(src_part)}, {name!r}{_fmt(getattr(link, f'{target_side}_idx'))} "
                    f"needs {list(dst_part)} for this config")
            pieces.append(Piece(src, src_offset, _prod(src_part), dst_offset))
        pieces.sort(key=lambda p: p.target_offset)
        covered = 0
        for p in pieces:
            if p.target_offset != covered:
                what = "written twice" if p.target_offset < covered else "left unwritten"
                raise CheckpointError(f"tensor {name!r}: part at element {covered} is {what}")
            covered += p.numel
        if covered != _prod(shape):
            raise CheckpointError(f"tensor {name!r}: only {covered} of {_prod(shape)} elements "
                                  "are mapped")
        targets.append(Target(name, shape, pieces))
    return targets


def check_sources_tiled(targets: list[Target], source_shapes: dict[str, tuple[int, ...]]
                        ) -> None:
    """Every source tensor that the targets read is read whole and once: a part left unread
    (a wider tensor than the config's, whose rows the links still find) is an error."""
    pieces: dict[str, list[tuple[int, int]]] = {}
    for t in targets:
        for p in t.pieces:
            pieces.setdefault(p.source, []).append((p.offset, p.numel))
    for name, spans in pieces.items():
        covered = 0
        for offset, numel in sorted(spans):
            if offset != covered:
                break
            covered += numel
        if covered != _prod(source_shapes[name]):
            raise CheckpointError(f"shape mismatch: {name!r} is {list(source_shapes[name])}, "
                                  "more than this config reads from it (or read twice)")


def _fmt(idx: Index) -> str:
    if idx == ():
        return ""
    return "[" + ", ".join(str(i) if isinstance(i, int) else f"{i[0]}:{i[1]}" for i in idx) + "]"


def check_coverage(links: list[Link], side: str, available: Iterable[str],
                   ignored: Callable[[str], bool], where: str) -> None:
    """Every name on ``side`` used by a link must exist; every available name must be used or
    ignored."""
    used = {getattr(link, side) for link in links}
    available = set(available)
    missing = sorted(used - available)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing{more}")
    unexpected = sorted(n for n in available - used if not ignored(n))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r}{more}")


def execute(targets: list[Target], source: TensorSource, writer: ShardedWriter,
            progress: Callable[[int], None] | None = None) -> None:
    """Stream every target's parts from ``source`` into ``writer`` (in the writer's order)."""
    by_name = {t.name: t for t in targets}
    buffer = memoryview(bytearray(CHUNK_BYTES))  # reused: fresh memory per chunk costs faults
    for planned in writer.plan_order():
        target = by_name[planned.name]
        out_size = ITEMSIZE[target.dtype]
        for p in target.pieces:
            in_dtype = source.tensors[p.source].dtype
            in_size = ITEMSIZE[in_dtype]
            # bytes that do not change are copied file to file by the kernel
            stored = source.locate(p.source) if target.dtype == in_dtype else None
            step = max(1, CHUNK_BYTES // in_size)
            for start in range(0, p.numel, step):
                n = min(step, p.numel - start)
                offset = (p.offset + start) * in_size
                if stored is not None:
                    writer.copy(target.name, stored[0], stored[1] + offset, n * in_size)
                    if progress is not None:
                        progress(n * out_size)
                    continue
                chunk = buffer[:n * in_size]
                source.read_into(p.source, offset, chunk)
                if target.dtype == in_dtype:
                    writer.write(target.name, chunk)
                else:  # a cast: the one place a conversion computes with torch
                    import torch

                    from composer.portable import DTYPES

                    t = torch.frombuffer(chunk, dtype=DTYPES[in_dtype], count=n)
                    writer.write(target.name, tensor_bytes(t.to(DTYPES[target.dtype])))
                if progress is not None:
                    progress(n * out_size)
    writer.close()


def whole_copies(writer: ShardedWriter, targets: list[Target], source: TensorSource
                 ) -> list[tuple[Path, int] | None]:
    """For each tensor of ``writer`` (in its order), where the stored bytes it is a whole,
    unchanged copy of lie (``(file, offset)``: one piece, the whole source tensor, its dtype);
    None for a tensor assembled, cut or cast (:class:`~composer.portable.Prefill` keeps its
    copy only where every tensor is such a copy)."""
    by_name = {t.name: t for t in targets}
    out: list[tuple[Path, int] | None] = []
    for planned in writer.plan_order():
        t = by_name[planned.name]
        info = source.tensors[t.pieces[0].source] if len(t.pieces) == 1 else None
        whole = info is not None and t.pieces[0].offset == 0 and info.dtype == t.dtype \
            and ITEMSIZE[info.dtype] * t.pieces[0].numel == info.nbytes
        out.append(source.locate(t.pieces[0].source) if whole else None)
    return out


def plan_tensors(targets: list[Target], order: list[str]) -> list[PlannedTensor]:
    by_name = {t.name: t for t in targets}
    return [PlannedTensor(n, by_name[n].dtype, by_name[n].shape) for n in order]

