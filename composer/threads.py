"""How many intra-op threads a compute command gives torch.

torch's default (one thread per core it sees) is right for big work on an idle machine and very
wrong for small work on a busy one: ``composer train --config debug`` (419K parameters, 256
tokens per forward) took 618 s with the default on a loaded 2-core machine and 10.6 s with one
thread, because each of its tiny ops costs less than the threads' fork/join, and a thread that
the kernel has descheduled stalls every op. So the count follows the size of the work, capped by
the CPUs this process may run on, and ``OMP_NUM_THREADS`` (when set) decides instead.

:func:`intra_op_threads` is the policy (a pure function, tested directly); :func:`use_threads`
applies it and :func:`restore_threads` undoes it (``composer.cli.main`` calls it, so that an
in-process call leaves the caller's setting as it found it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

WORK_PER_THREAD = 2**28
"""Parameter-tokens (parameters x tokens per forward, ~2 FLOPs each) that justify one thread:
about 0.5 GFLOP per forward, some milliseconds of one core. The debug recipe (1.1e8) gets one
thread; the shakespeare recipe (0.5M parameters x 4,096 tokens, 2e9) gets up to 7, and on an
idle 2-core machine its steps take 30 s per 30 with 2 threads against 42 s with 1; a 1B model
on 2,048 tokens (2e12) gets every CPU."""

_saved: int | None = None


def available_cpus(env: Mapping[str, str] | None = None) -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's core count),
    divided among the ranks a launcher started on this node (``LOCAL_WORLD_SIZE``)."""
    env = os.environ if env is None else env
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        cpus = os.cpu_count() or 1
    local = _positive_int(env.get("LOCAL_WORLD_SIZE")) or 1
    return max(1, cpus // local)


def intra_op_threads(n_params: float, tokens: float, cpus: int,
                     env: Mapping[str, str] | None = None) -> int:
    """Threads for a forward over ``tokens`` tokens of a model with ``n_params`` parameters on
    ``cpus`` CPUs: one per :data:`WORK_PER_THREAD` parameter-tokens, at least 1, at most
    ``cpus``. A valid ``OMP_NUM_THREADS`` in ``env`` (a positive integer) wins outright."""
    env = os.environ if env is None else env
    forced = _positive_int(env.get("OMP_NUM_THREADS"))
    if forced is not None:
        return forced
    wanted = int(max(n_params, 0) * max(tokens, 0) // WORK_PER_THREAD)
    return max(1, min(cpus, wanted))


def use_threads(n_params: float, tokens: float) -> int:
    """Apply :func:`intra_op_threads` to torch before the work starts; return the count."""
    import torch

    global _saved
    n = intra_op_threads(n_params, tokens, available_cpus())
    if _saved is None:
        _saved = torch.get_num_threads()
    torch.set_num_threads(n)
    return n


def restore_threads() -> None:
    """Put back the count :func:`use_threads` found (a no-op if it never ran)."""
    global _saved
    if _saved is not None:
        import torch

        torch.set_num_threads(_saved)
        _saved = None


def _positive_int(value: str | None) -> int | None:
    try:
        n = int(value) if value is not None else None
    except ValueError:  # OMP_NUM_THREADS=abc: ignored, as OpenMP ignores it
        return None
    return n if n is not None and n > 0 else None
