"""A copy that starts before the plan is known: the tensors' bytes copied file to file by the
kernel (:func:`composer.portable.copy_range`) in a background thread, to the places a
:class:`~composer.portable.ShardedWriter` will give them, kept only if the plan turns out to be
that copy (``composer convert``: docs/conversion.md, "Copied while torch loads")."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from composer.portable import ShardedWriter, copy_range


class Prefill:
    """Copies tensors' bytes file to file by the kernel (:func:`copy_range`), in a background
    thread, to the places ``writer`` (a :class:`ShardedWriter` with a ``header_reserve``) gives
    them, while the caller works out what the files must hold (``composer convert from-hf``
    imports torch and checks the model meanwhile). The kernel copy releases the GIL, so the two
    run on two cores.

    Nothing is final until :meth:`adopt`: given the writer the caller has planned, and for each
    of its tensors the stored bytes it copies whole (``(file, offset)``, or None), it keeps the
    copied data only if the layout is the same (same files, offsets, sizes, sources), waits
    for the copies and writes the headers; otherwise, or on :meth:`cancel`, the copies stop
    and their files are removed."""

    CHUNK = 2**30
    """Bytes per kernel call at most. Tensors that lie one after the other in both files are
    copied by one call (a shard of data in a few): the thread needs the GIL only between calls,
    and the importing thread holds it for long stretches (loading torch's libraries). A
    cancelled copy stops after the call under way."""

    def __init__(self, writer: ShardedWriter, sources: list[tuple[Path, int]]) -> None:
        self.folder, self.files = writer.folder, list(writer.files)
        self.layout = writer.data_layout()
        self.sources = list(sources)
        if len(self.sources) != len(self.layout):
            raise ValueError(f"{len(self.sources)} sources for {len(self.layout)} tensors")
        self.copied = 0
        self.error: BaseException | None = None
        self._adopted = False
        self._stop = threading.Event()
        for name in self.files:  # every shard exists from the start, even one without data
            os.close(os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        self._thread = threading.Thread(target=self._run, name="prefill", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fds: dict[Path, int] = {}

        def fd(path: Path, flags: int) -> int:
            if path not in fds:
                fds[path] = os.open(path, flags)
            return fds[path]

        runs: list[list] = []  # [file, offset, source, source offset, bytes], merged
        for (name, offset, nbytes), (path, start) in zip(self.layout, self.sources,
                                                         strict=True):
            last = runs[-1] if runs else None
            if last and (last[0], last[1] + last[4], last[2], last[3] + last[4]) == \
                    (name, offset, path, start):
                last[4] += nbytes
            else:
                runs.append([name, offset, path, start, nbytes])
        try:
            for name, offset, path, start, nbytes in runs:
                dst = fd(self.folder / name, os.O_WRONLY)
                src = fd(path, os.O_RDONLY)
                os.lseek(dst, offset, os.SEEK_SET)
                for k in range(0, nbytes, self.CHUNK):
                    if self._stop.is_set():
                        return
                    n = min(self.CHUNK, nbytes - k)
                    copy_range(src, dst, start + k, n)
                    self.copied += n
        except BaseException as exc:  # re-raised in the caller's thread by adopt()
            self.error = exc
        finally:
            for f in fds.values():
                os.close(f)

    def adopt(self, writer: ShardedWriter, sources: list[tuple[Path, int] | None],
              progress: Callable[[int], None] | None = None) -> bool:
        """Finish ``writer`` from the copied data if its layout and ``sources`` are the ones
        copied (True); else cancel (False): the caller then writes the tensors itself."""
        if (list(writer.files) != self.files or writer.data_layout() != self.layout
                or list(sources) != self.sources):
            self.cancel()
            return False
        reported = 0
        while self._thread.is_alive():
            self._thread.join(0.1)
            if progress is not None:
                done = self.copied
                progress(done - reported)
                reported = done
        if self.error is not None:
            self.cancel()
            raise self.error
        if progress is not None:
            progress(self.copied - reported)
        writer.write_headers()
        self._adopted = True
        return True

    def cancel(self) -> None:
        """Stop copying and remove the files (once; a no-op after :meth:`adopt`, whose caller
        may have written files of the same names since)."""
        if self._adopted or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        for name in self.files:
            (self.folder / name).unlink(missing_ok=True)
