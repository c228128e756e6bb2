"""The modelled part of a plan (docs/planning.md): activations, communication, step time.

Activations: each layer's declared ``activation_bytes_per_token`` (its kind's record) times the
tokens of a micro-batch, divided by tp under sequence parallel and by cp, times the micro-batches
a stage holds at once (1F1B: ``pp - stage``; GPipe: all of them; no pipeline: one), plus the
last stage's fp32 logits of one micro-batch (vocab-parallel: ``/ tp``) and an allocator reserve.
Communication is :mod:`composer.plan.comm`'s. Step time: compute at peak plus the pipeline
bubble; the lower bound adds only the communication that cannot overlap compute (all but data
parallelism's), and is at least the time of the communication that can (data parallelism's);
the upper bound adds all of it, each collective at its ring traffic.
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.parallel.mesh import ParallelDims
from composer.plan.comm import Collective
from composer.plan.hardware import GPU

RESERVE = 0.05
"""Allocator reserve: a fraction of the GPU's memory kept free for fragmentation (model)."""
UNKNOWNS = ["allocator fragmentation beyond the reserve", "NCCL and CUDA context buffers",
            "real overlap of communication with compute", "kernel efficiency below peak",
            "MoE routing imbalance (uniform routing assumed)",
            "fp32 internals of norms and softmax under bf16 (counted in the compute dtype)"]


def in_flight(stage: int, pp: int, n_micro: int, schedule: str | None) -> int:
    """Micro-batches whose activations a stage holds at once."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return n_micro
    return min(pp - stage, n_micro)


def activation_bytes(cfg: ModelConfig, kinds: list, dims: ParallelDims, seq_len: int,
                     micro: int, ac: str, size: int, held: int, last: bool
                     ) -> tuple[int, list[str]]:
    """A stage's activation bytes, and the kinds it could not model."""
    tokens = micro * seq_len // dims.cp
    shard = dims.tp if dims.sequence_parallel else 1
    per_token, unknown = 0, []
    for kind in kinds:
        b = kind.activation_bytes_per_token(cfg, seq_len, ac, size) if kind is not None else None
        if b is None:
            name = kind.name if kind is not None else "a layer"
            unknown.append(f"activations of {name} layers (no activation_bytes_per_token)")
        else:
            per_token += b
    total = per_token * tokens // shard * held
    if ac != "none" and kinds:  # one layer recomputed at a time, whole
        total += max((k.activation_bytes_per_token(cfg, seq_len, "none", size) or 0
                      for k in kinds if k is not None), default=0) * tokens // shard
    if last:
        total += micro * seq_len // dims.cp * cfg.vocab_size * 4 // dims.tp  # fp32 logits
    return total, sorted(set(unknown))


OVERLAPPED = ("fsdp_all_gather", "fsdp_reduce_scatter", "fsdp_all_reduce", "dp_all_reduce")
"""What data parallelism overlaps with compute (prefetch, bucketed backward reduction)."""


def step_time(flops_per_rank: float, comm: list[Collective], dims: ParallelDims, n_micro: int,
              hw: GPU, precision: str) -> dict[str, float]:
    """Compute at peak plus the bubble; each collective's ring traffic
    (:attr:`~composer.plan.comm.Collective.traffic`) at NVLink or network speed, only the
    non-overlapped ones in the lower bound, all of them in the upper."""
    compute = flops_per_rank / hw.peak_flops(precision)
    bubble = compute * (dims.pp - 1) / n_micro if dims.pp > 1 else 0.0

    def seconds(c: Collective) -> float:
        return c.traffic / ((hw.nvlink_gbs if c.intra_node else hw.net_gbs) * 1e9)

    exposed = sum(seconds(c) for c in comm if c.kind not in OVERLAPPED)
    everything = sum(seconds(c) for c in comm)
    # what overlaps hides behind compute and the bubble, but no longer than they last
    overlapped = everything - exposed
    lower = max(compute + bubble + exposed, overlapped)
    return {"lower": lower, "upper": compute + bubble + everything,
            "compute": compute, "bubble": bubble}
