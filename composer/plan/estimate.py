"""The modelled part of a plan (docs/planning.md): activations, communication, step time.

Activations: each layer's declared ``activation_bytes_per_token`` (its kind's record: per token
of a rank's ``seq_len / cp`` share on one tp rank, the residual stream cut by tp under sequence
parallel and the mixer's own tensors by the heads or channels each rank holds) times the tokens
of a micro-batch, times the micro-batches a stage holds at once (1F1B: ``pp - stage``; GPipe:
all of them; no pipeline: one); under checkpointing, one layer's recompute at a time; plus the
MoE dispatch buffer (:func:`dispatch_bytes`) and, on the last stage, the final norm (``2 d +
1``) and the chunked loss (:func:`loss_bytes`), and an allocator reserve.
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
    """A stage's activation bytes, and the kinds it could not model (module docstring)."""
    local = seq_len // dims.cp  # each rank's share of a sequence
    tokens = micro * local
    sp = dims.sequence_parallel

    def per_token(kind, mode: str) -> float | None:
        return kind.activation_bytes_per_token(cfg, local, mode, size, dims.tp, sp, dims.cp)

    layers, unknown = 0.0, []
    for kind in kinds:
        b = per_token(kind, ac) if kind is not None else None
        if b is None:
            unknown.append(f"activations of {kind.name} layers (no activation_bytes_per_token)"
                           if kind is not None else
                           "activations of layers with no kind of their own (parallel groups)")
        else:
            layers += b
    total = layers * tokens * held
    if ac != "none" and kinds:  # one layer recomputed at a time, whole
        total += max((per_token(k, "none") or 0.0 for k in kinds if k is not None),
                     default=0.0) * tokens
    if any(k is not None and k.section == "moe" for k in kinds):
        total += dispatch_bytes(cfg, dims, tokens, size)
    if last:  # the final norm keeps its input, scaled input and 1/rms, then the loss
        shard = dims.tp if sp else 1
        total += held * tokens * (2 * cfg.d_model + 1) * size / shard
        total += loss_bytes(cfg, dims, tokens, size, held)
    return int(total), sorted(set(unknown))


def dispatch_bytes(cfg: ModelConfig, dims: ParallelDims, tokens: int, size: int) -> int:
    """The MoE dispatch buffer live during one MoE layer's forward and not saved: under expert
    parallel the all-to-all's send copy of the routed rows (``top_k`` rows of ``d`` per token),
    freed when the exchange ends, and later the experts' outputs on their way back (the same
    size, not at the same time); without expert parallel the routed rows are indexed in place
    and saved (counted in the layer). Uniform routing: a rank receives as many rows as it
    sends."""
    if dims.ep == 1 or cfg.moe is None:
        return 0
    return tokens * cfg.moe.top_k * cfg.d_model * size


def loss_bytes(cfg: ModelConfig, dims: ParallelDims, tokens: int, size: int, held: int) -> int:
    """The chunked head and loss (:mod:`composer.blocks.loss`; vocab-parallel:
    :mod:`composer.parallel.vocab`): the gradients it forms in the forward and keeps for the
    backward, per micro-batch in flight: ``dloss/dh`` (``tokens x d`` at ``size``) and the
    head's ``dloss/dW`` (``V / tp x d`` in fp32); and one chunk of ``max(64, 2^23 // (V /
    tp))`` rows of fp32 logits while it is worked on (and its gradient cast to ``size`` when
    that is narrower). The whole ``tokens x V`` logits are never held."""
    from composer.blocks.loss import CHUNK_ELEMENTS

    vocab = -(-cfg.vocab_size // dims.tp)
    rows = min(tokens, max(64, CHUNK_ELEMENTS // max(vocab, 1)))
    chunk = rows * vocab * (4 + (size if size < 4 else 0))
    return held * (tokens * cfg.d_model * size + vocab * cfg.d_model * 4) + chunk


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
