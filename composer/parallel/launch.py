"""Starting processes: under ``torchrun`` (the CLI) or spawned here (tests, small runs).

``init_distributed()`` joins the group described by torchrun's environment, with NCCL on GPUs and
gloo on CPU. ``run_distributed(fn, n, *args)`` starts ``n`` gloo processes on this machine (forked
from a fork server that has torch and composer imported; each gets the caller's environment), runs
``fn(*args)`` in each once the group is up, and returns every rank's result in rank order; any
rank's exception is raised here with its traceback text.
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def init_distributed(device: str = "auto", timeout_s: float | None = None) -> bool:
    """Join the process group torchrun describes; False when not launched by torchrun. NCCL with
    ``cuda:LOCAL_RANK`` when ``device`` is ``cuda`` (or ``auto`` and CUDA is available), gloo on
    the CPU otherwise. ``timeout_s`` bounds every collective (PyTorch's default otherwise)."""
    if dist.is_initialized():
        return True
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("nccl" if cuda else "gloo", **kwargs)
    return True


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
            queue: Any, environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(*args)
        # As bytes: a tensor sent through the queue would live in shared memory that dies
        # with this process; torch.save output is read back with weights_only=True.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Leave without interpreter finalisation, where a communication thread taking the GIL
    # aborts the process (rarely; see composer.cli.main), once the report is surely sent.
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = 300.0, fresh: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the results in rank order. The
    free port can be taken by another process before rank 0 listens on it: then it retries
    with another port (twice at most). ``fresh``: spawn new interpreters instead of forking
    from the fork server, for ranks that measure their own memory (a fork's first writes to
    the pages it shares with the server are copies, which its resident size counts)."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout, fresh)
        except RuntimeError as exc:
            if "address already in use" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


PRELOAD = ["torch.distributed.tensor", "torch.distributed.checkpoint", "torch._dynamo",
           "composer.train.engine", "composer.run", "composer.zoo", "composer.data.indexed",
           "composer.cli"]
"""What the fork server imports once, so that each rank forks with it imported instead of
importing it again (torch.distributed.tensor alone takes seconds per rank: 91 s -> 46 s for a
4-rank spawn of four engine layouts on 2 loaded cores). The server imports it before any thread
pool or process group exists; a module that fails to import there is imported by the rank."""


AT_START = ("MALLOC_", "LD_", "GLIBC_TUNABLES", "PYTHON")
"""Environment variables read when a process starts (glibc's, the dynamic loader's, Python's):
a fork inherits the fork server's, so when the caller's differ from those the server started
with, the ranks are spawned instead (bench/long_context.py sets glibc's ``MALLOC_*``)."""
_server_env: dict[str, str] | None = None


def _context(fresh: bool = False) -> Any:
    global _server_env
    if fresh:
        return mp.get_context("spawn")
    now = {k: v for k, v in os.environ.items() if k.startswith(AT_START)}
    if _server_env is None:  # the fork server starts with this call's first process
        _server_env = now
    if now != _server_env:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple,
              timeout: float, fresh: bool = False) -> list[Any]:
    ctx = _context(fresh)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue,
                                               dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not errors:
        try:
            rank, ok, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            # a rank that crashed (segfault, OOM kill) never reports: notice it at once
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                errors.append(f"ranks {dead} exited with codes "
                              f"{[procs[r].exitcode for r in dead]} without a result")
            elif time.monotonic() > deadline:
                errors.append(f"no result within {timeout:.0f}s")
            continue
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=True)
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
    if errors:  # the first report may be a peer's broken connection: hear the others too
        until = time.monotonic() + 5
        while len(results) + len(errors) < world_size and time.monotonic() < until:
            try:
                rank, ok, payload = queue.get(timeout=0.5)
            except queue_module.Empty:
                continue
            if not ok:
                errors.append(f"rank {rank} failed:\n{payload}")
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead:
            errors.append(f"exit codes: {[procs[r].exitcode for r in range(world_size)]}")
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
