"""The portable checkpoint format: file names, streaming safetensors reading and writing,
checked against headers, published atomically. The one owner of the format: the builder
(``composer build --out``, :func:`composer.save`), ``composer export`` and the converters all
write through :class:`ShardedWriter` inside :func:`atomic_folder`, and read through
:class:`TensorSource`.

A portable checkpoint is a folder with ``config.yaml`` and ``model.safetensors`` (or shards listed
by ``model.safetensors.index.json``), canonical keys (docs/conversion.md).
:class:`TensorSource` reads every shard's header (8-byte length, JSON) up front and checks it
against the index and the file size, so a truncated shard, an index naming a missing shard or a
tensor the shard lacks is an error before any work. Tensors are read as byte ranges with
``readinto``: nothing is unpickled
and memory holds one piece at a time.

:class:`ShardedWriter` is given the full plan (names, dtypes, shapes) first, writes each shard's
header, then takes each tensor's bytes in order and checks that every planned tensor is written
exactly once with exactly its size (a tensor may come in pieces: ``composer build --out`` streams
row blocks), and knows its files' exact size up front (:meth:`ShardedWriter.total_bytes`, for
:func:`check_free_space`). :func:`atomic_folder` makes the output appear only complete.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.yaml"
ORIGIN_FILE = "origin.json"  # {"family": ...} of the zoo preset a checkpoint was built from
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD = 50 * 10**9

ITEMSIZE: dict[str, int] = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4,
                            "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
"""Bytes per element of each safetensors dtype this format reads and writes: reading headers,
planning and copying need no torch (``composer convert`` imports it only to compute)."""
_TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def __getattr__(name: str) -> Any:
    """``DTYPES`` (safetensors name -> torch dtype) and ``DTYPE_NAMES`` (the inverse), made on
    first use: the rest of this module works without importing torch."""
    if name not in ("DTYPES", "DTYPE_NAMES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    dtypes = {k: getattr(torch, v) for k, v in _TORCH_NAMES.items()}
    globals().update(DTYPES=dtypes, DTYPE_NAMES={v: k for k, v in dtypes.items()})
    return globals()[name]


class CheckpointError(ValueError):
    """A malformed or inconsistent checkpoint; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the data in ``file``."""
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return __getattr__("DTYPES")[self.dtype]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header and check it against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path.name}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 * 2**20):
            raise CheckpointError(f"{path.name}: header length {n} does not fit the file "
                                  f"({size} bytes): truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path.name}: unreadable safetensors header") from None
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        if meta["dtype"] not in ITEMSIZE:
            raise CheckpointError(f"{path.name}: tensor {name!r} has unsupported dtype "
                                  f"{meta['dtype']}")
        shape = tuple(meta["shape"])
        expected = ITEMSIZE[meta["dtype"]] * _numel(shape)
        if end - begin != expected:
            raise CheckpointError(f"{path.name}: tensor {name!r} spans {end - begin} bytes, its "
                                  f"shape {list(shape)} needs {expected}")
        if base + end > size:
            raise CheckpointError(f"{path.name}: truncated: tensor {name!r} ends at byte "
                                  f"{base + end}, the file has {size}")
        out[name] = TensorInfo(name, path, meta["dtype"], shape, base + begin, end - begin)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class TensorSource:
    """All tensors of a checkpoint folder (single file or index + shards), read lazily."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.tensors: dict[str, TensorInfo] = {}
        index = folder / INDEX_NAME
        if index.exists():
            self._read_index(index)
        elif (folder / SINGLE_NAME).exists():
            self.tensors = read_header(folder / SINGLE_NAME)
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{folder}: no {SINGLE_NAME}, {INDEX_NAME} or "
                                      "*.safetensors file")
            for path in files:
                self._add(read_header(path))

    def _add(self, infos: dict[str, TensorInfo]) -> None:
        for name, info in infos.items():
            if name in self.tensors:
                raise CheckpointError(f"tensor {name!r} appears in both "
                                      f"{self.tensors[name].file.name} and {info.file.name}")
            self.tensors[name] = info

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index.name}: not a valid index (no weight_map)") from None
        headers: dict[str, dict[str, TensorInfo]] = {}
        for shard in dict.fromkeys(weight_map.values()):
            path = self.folder / shard
            if not path.exists():
                raise CheckpointError(f"{index.name} names shard {shard!r}, which is missing")
            headers[shard] = read_header(path)
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise CheckpointError(f"{index.name} puts {name!r} in {shard}, which lacks it")
            self.tensors[name] = headers[shard][name]
        for shard, infos in headers.items():
            extra = sorted(set(infos) - set(weight_map))
            if extra:
                raise CheckpointError(f"{shard} holds {extra[0]!r}, which {index.name} does "
                                      "not list")

    def renamed(self, new_names: dict[str, str]) -> TensorSource:
        """The same tensors under other names (``old -> new``)."""
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        out.__dict__.pop("_handles", None)
        out.tensors = {new_names.get(k, k): v for k, v in self.tensors.items()}
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def read_bytes(self, name: str, offset: int = 0, nbytes: int | None = None) -> bytearray:
        """``nbytes`` bytes of tensor ``name`` starting ``offset`` bytes into its data."""
        info = self.tensors[name]
        nbytes = info.nbytes - offset if nbytes is None else nbytes
        buf = bytearray(nbytes)
        self.read_into(name, offset, memoryview(buf))
        return buf

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes of tensor ``name`` from ``offset``; each shard stays open, and
        the caller reuses ``out``, so no fresh memory is touched per chunk."""
        info = self.tensors[name]
        handles: dict[Path, object] = self.__dict__.setdefault("_handles", {})
        f = handles.get(info.file)
        if f is None:
            f = handles[info.file] = open(info.file, "rb")  # noqa: SIM115 - closed in close()
        f.seek(info.start + offset)
        if f.readinto(out) != out.nbytes:
            raise CheckpointError(f"{info.file.name}: truncated while reading {name!r}")

    def locate(self, name: str) -> tuple[Path, int] | None:
        """``(file, byte offset)`` of tensor ``name``'s data when its bytes are stored there as
        they are read (so :meth:`ShardedWriter.copy` may copy them file to file); ``None`` for a
        source that computes or transforms bytes."""
        info = self.tensors[name]
        return info.file, info.start

    def close(self) -> None:
        for f in self.__dict__.pop("_handles", {}).values():
            f.close()

    def read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        return bytes_to_tensor(self.read_bytes(name), info.torch_dtype, info.shape)


def bytes_to_tensor(buf: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    import torch

    if not buf:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor, without a copy when it is contiguous."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


# ---------------------------------------------------------------- training run folders

LATEST = "latest"
"""The file of a training run folder (DCP steps, :mod:`composer.parallel.checkpoint`) that names
its newest step; here so that telling a run folder from a portable checkpoint imports no DCP."""


def is_training_checkpoint(folder: Path) -> bool:
    return (Path(folder) / LATEST).exists()


def latest_step(folder: Path) -> Path:
    folder = Path(folder)
    name = (folder / LATEST).read_text().strip()
    path = folder / name
    if not path.is_dir():
        raise FileNotFoundError(f"{folder}/{LATEST} names {name!r}, which is missing")
    return path


# ---------------------------------------------------------------- writing


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return ITEMSIZE[self.dtype] * _numel(self.shape)


class ShardedWriter:
    """Write planned tensors in order into shards of at most ``max_shard_bytes`` each."""

    def __init__(self, folder: Path, plan: list[PlannedTensor], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None, prefix: str = "model",
                 header_reserve: Callable[[list[PlannedTensor]], int] | None = None) -> None:
        """``header_reserve`` gives, for a shard's tensors, the bytes its header is padded to
        with spaces (at least; a longer header is not cut): a
        :class:`~composer.prefill.Prefill` copies the data to where such a header puts it
        before the names of the header are known."""
        self.folder = folder
        self.plan = plan
        self.metadata = {"format": "pt", **(metadata or {})}
        self.header_reserve = header_reserve
        self.shards = _split_into_shards(plan, max_shard_bytes)
        n = len(self.shards)
        self.files = ([f"{prefix}.safetensors"] if n == 1 else
                      [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        self._order = [t for shard in self.shards for t in shard]
        self._shard_index = [i for i, shard in enumerate(self.shards) for _ in shard]
        self._next = 0
        self._shard = -1
        self._fd: int | None = None
        self._sources: dict[Path, int] = {}  # files copy() reads, open until close()
        self._written_in_tensor = 0

    def plan_order(self) -> list[PlannedTensor]:
        """The order in which tensors must be written (shard by shard)."""
        return list(self._order)

    def _header(self, i: int) -> bytes:
        """Shard ``i``'s 8-byte header length and JSON header (safetensors' layout)."""
        reserve = self.header_reserve(self.shards[i]) if self.header_reserve else 0
        return shard_header(self.shards[i], self.metadata, reserve)

    def data_layout(self) -> list[tuple[str, int, int]]:
        """Where each tensor's bytes go, in :meth:`plan_order`: (file name, byte offset in it,
        bytes)."""
        out = []
        for i, shard in enumerate(self.shards):
            offset = len(self._header(i))
            for t in shard:
                out.append((self.files[i], offset, t.nbytes))
                offset += t.nbytes
        return out

    def write_headers(self) -> None:
        """Finish shards whose data is already in place (:class:`~composer.prefill.Prefill`):
        check each file's size, write its header in front of the data, and the index; every
        tensor counts as written."""
        if self._next or self._written_in_tensor:
            raise CheckpointError("write_headers() after tensors were written one by one")
        for i, name in enumerate(self.files):
            header = self._header(i)
            size = len(header) + sum(t.nbytes for t in self.shards[i])
            fd = os.open(self.folder / name, os.O_WRONLY)
            try:
                if os.fstat(fd).st_size != size:
                    raise CheckpointError(f"{name}: {os.fstat(fd).st_size} bytes in place, its "
                                          f"plan needs {size}")
                os.pwrite(fd, header, 0)
            finally:
                os.close(fd)
        self._next = len(self._order)
        self._write_index()

    def _index(self) -> str | None:
        if len(self.files) == 1:
            return None
        weight_map = {t.name: self.files[i] for i, s in enumerate(self.shards) for t in s}
        total = sum(t.nbytes for t in self.plan)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        return json.dumps(index, indent=2) + "\n"

    def total_bytes(self) -> int:
        """The size of every file this writer writes (shards with headers, and the index)."""
        index = self._index()
        return sum(len(self._header(i)) for i in range(len(self.shards))) + \
            sum(t.nbytes for t in self.plan) + (len(index.encode()) if index else 0)

    def _open_shard(self, i: int) -> None:
        self._close_shard()
        # a raw descriptor (no Python buffer): write() and copy() append at the one file offset
        self._fd = os.open(self.folder / self.files[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                           0o644)
        _write_all(self._fd, memoryview(self._header(i)))
        self._shard = i

    def _close_shard(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _advance(self, name: str, n: int) -> None:
        """Check that ``n`` more bytes of ``name`` are due now, opening its shard if it starts
        one; :meth:`_wrote` counts them once they are out."""
        if self._next >= len(self._order):
            raise CheckpointError(f"tensor {name!r} written after the plan was complete")
        planned = self._order[self._next]
        if name != planned.name:
            raise CheckpointError(f"tensor {name!r} written out of order (expected "
                                  f"{planned.name!r})")
        if self._written_in_tensor == 0 and self._shard_index[self._next] != self._shard:
            self._open_shard(self._shard_index[self._next])
        if self._written_in_tensor + n > planned.nbytes:
            raise CheckpointError(f"tensor {name!r}: more bytes than its shape "
                                  f"{list(planned.shape)} holds")

    def _wrote(self, n: int) -> None:
        self._written_in_tensor += n
        if self._written_in_tensor == self._order[self._next].nbytes:
            self._next += 1
            self._written_in_tensor = 0

    def write(self, name: str, data: memoryview | bytes | bytearray) -> None:
        """Append bytes of tensor ``name``; a tensor may arrive in several consecutive calls."""
        data = memoryview(data).cast("B")
        self._advance(name, data.nbytes)
        _write_all(self._fd, data)
        self._wrote(data.nbytes)

    def copy(self, name: str, path: Path, offset: int, nbytes: int) -> None:
        """Append ``nbytes`` bytes of tensor ``name`` copied from file ``path`` at ``offset``,
        by the kernel (:func:`copy_range`): the bytes never pass through this process."""
        self._advance(name, nbytes)
        src = self._sources.get(path)
        if src is None:
            src = self._sources[path] = os.open(path, os.O_RDONLY)
        copy_range(src, self._fd, offset, nbytes)
        self._wrote(nbytes)

    def close(self) -> None:
        """Finish: every planned tensor must be complete; writes the index when sharded."""
        while self._next < len(self._order) and self._order[self._next].nbytes == 0:
            self.write(self._order[self._next].name, b"")
        if self._next != len(self._order) or self._written_in_tensor:
            missing = self._order[self._next].name
            raise CheckpointError(f"tensor {missing!r} was never (fully) written")
        if self._fd is None and self.shards:
            self._open_shard(0)
        self._close_shard()
        for fd in self._sources.values():
            os.close(fd)
        self._sources.clear()
        self._write_index()

    def _write_index(self) -> None:
        index = self._index()
        if index is not None:
            (self.folder / INDEX_NAME).write_text(index)


def shard_header(tensors: list[PlannedTensor], metadata: dict[str, str], reserve: int = 0
                 ) -> bytes:
    """A safetensors file's 8-byte header length and JSON header for ``tensors`` stored in this
    order, padded with spaces to a multiple of 8 bytes (tensor data stays 8-byte aligned) and to
    at least ``reserve`` bytes."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (max(reserve - len(raw), 0) + (-max(reserve, len(raw)) % 8))
    return struct.pack("<Q", len(raw)) + raw


def _write_all(fd: int, data: memoryview) -> None:
    """``os.write`` until every byte is out (a write may take fewer bytes than it is given)."""
    while data:
        data = data[os.write(fd, data):]


def copy_range(src: int, dst: int, offset: int, nbytes: int) -> None:
    """Copy ``nbytes`` bytes of file descriptor ``src`` from ``offset`` to ``dst``'s current
    position (advancing it), inside the kernel: ``os.copy_file_range`` (reflinks or in-kernel
    copies, Linux 4.5+), else ``os.sendfile``, else ``pread`` + write in 32 MiB pieces (another
    platform, or a pair of file systems the kernel will not copy between)."""
    end = offset + nbytes
    for call in (getattr(os, "copy_file_range", None), _sendfile):
        if call is None:
            continue
        try:
            while offset < end:
                n = call(src, dst, min(end - offset, 1 << 30), offset)
                if n == 0:
                    raise CheckpointError(f"source file ended {end - offset} bytes early")
                offset += n
            return
        except OSError as e:  # EXDEV, EINVAL, ENOSYS...: not for this pair, try the next way
            if e.errno not in _NO_KERNEL_COPY:
                raise
    while offset < end:
        piece = os.pread(src, min(end - offset, 32 << 20), offset)
        if not piece:
            raise CheckpointError(f"source file ended {end - offset} bytes early")
        _write_all(dst, memoryview(piece))
        offset += len(piece)


def _sendfile(src: int, dst: int, count: int, offset: int) -> int:
    if not hasattr(os, "sendfile"):
        raise OSError(errno.ENOSYS, "no sendfile")
    return os.sendfile(dst, src, offset, count)


_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF,
                   errno.ENOTSUP}


def _split_into_shards(plan: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in plan:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1000"`` -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper().replace(" ", "")
    digits = s.rstrip("KMGTIB")
    unit = s[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1
    if unit not in units or value <= 0:
        raise ValueError(f"cannot read size {text!r}; use e.g. 5GB, 500MB or 2GiB")
    return int(value * units[unit])


# ---------------------------------------------------------------- atomic output


def check_destination(dst: Path, force: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{dst} exists and is not a folder")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise FileExistsError(f"{dst} is not empty; pass --force to replace it")


class NotEnoughSpace(ValueError):
    """The destination's file system cannot hold what is about to be written."""


def check_free_space(dst: Path, needed: int) -> None:
    """Refuse (one line) before writing ``needed`` bytes into ``dst`` (made beside it, then
    renamed) when its file system has less free: a failure halfway wastes the time and fills
    the disk for everyone else."""
    probe = dst.resolve().parent
    while not probe.exists():  # atomic_folder will create the missing parents
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise NotEnoughSpace(f"not enough disk space for {dst}: it needs {needed:,} bytes "
                             f"({needed / 1e9:.2f} GB), {probe} has {free:,} bytes "
                             f"({free / 1e9:.2f} GB) free")


@contextmanager
def atomic_folder(dst: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside ``dst``; on success it replaces ``dst``, on any failure
    it is removed and ``dst`` is untouched."""
    check_destination(dst, force)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for path in tmp.rglob("*"):
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
