"""The modelled part of a plan (docs/planning.md): activations, communication, step time.

Activations: each layer's declared ``activation_bytes_per_token`` (its kind's record: per token
of a rank's ``seq_len / cp`` share on one tp rank, the residual stream cut by tp under sequence
parallel and the mixer's own tensors by the heads or channels each rank holds) times the tokens
of a micro-batch, times the micro-batches a stage holds at once (1F1B: ``pp - stage``; GPipe:
all of them; no pipeline: one); under checkpointing, one layer's recompute at a time; plus the
MoE dispatch buffer (:func:`dispatch_bytes`) and, on the last stage, the final norm (``2 d +
1``) and the chunked loss (:func:`loss_bytes`), and an allocator reserve.
Communication: bytes each rank sends per step, by collective, ring algorithms
(``(n - 1) / n`` of the buffer per all-gather, reduce-scatter or all-to-all, twice that per
all-reduce). Step time: compute at peak plus the pipeline bubble; the lower bound adds only the
communication that cannot overlap compute (TP, PP, EP, CP), the upper bound adds all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from composer.config import ModelConfig
from composer.parallel.mesh import ParallelDims
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


@dataclass
class Collective:
    kind: str
    group: str
    bytes_per_step: int
    intra_node: bool


def _ring(n: int, nbytes: float) -> float:
    return nbytes * (n - 1) / n if n > 1 else 0.0


def intra(dims: ParallelDims, group: str, hw: GPU) -> bool:
    """Whether a group's ranks share a node (the mesh is pp, dp_outer, ep, cp, tp row-major)."""
    span = {"tp": dims.tp, "cp": dims.tp * dims.cp, "ep": dims.tp * dims.cp * dims.ep,
            "dp_cp": dims.tp * dims.cp * dims.dp, "dp": dims.tp * dims.cp * dims.dp,
            "pp": dims.world_size}[group]
    return span <= hw.per_node


def communication(cfg: ModelConfig, dims: ParallelDims, kinds: list, seq_len: int, micro: int,
                  n_micro: int, unsharded_params: int, size: int, hw: GPU) -> list[Collective]:
    """Bytes one rank sends per step, by collective (module docstring)."""
    d, out = cfg.d_model, []
    act = micro * seq_len // dims.cp * d * size  # one layer's activations of a micro-batch

    def add(kind: str, group: str, n: float) -> None:
        if n > 0:
            out.append(Collective(kind, group, int(n), intra(dims, group, hw)))

    g = dims.grad_replicas
    if dims.dp_mode == "shard":
        add("fsdp_all_gather", "dp_cp", n_micro * 2 * _ring(g, unsharded_params * size))
        add("fsdp_reduce_scatter", "dp_cp", n_micro * _ring(g, unsharded_params * 4))
    else:
        add("dp_all_reduce", "dp_cp", 2 * _ring(g, unsharded_params * 4))
    n_layers = len(kinds)
    # sequence parallel: all-gather + reduce-scatter per layer forward, the same backward
    add("tp_all_gather_reduce_scatter", "tp", n_micro * n_layers * 4 * _ring(dims.tp, act))
    if dims.pp > 1:
        add("pp_send_recv", "pp", n_micro * 2 * act)
    moe = [k for k in kinds if k is not None and k.section == "moe"]
    if moe and dims.ep > 1:
        top_k = cfg.moe.top_k
        add("ep_all_to_all", "ep", n_micro * len(moe) * 4 * top_k * _ring(dims.ep, act))
    attn = [k for k in kinds if k is not None and k.section == "attention"]
    if attn and dims.cp > 1:
        a = cfg.attention
        kv = 2 * (a.n_kv_heads or a.n_heads) * (a.d_head or d // a.n_heads)
        kv_bytes = micro * seq_len * kv * size // dims.tp
        add("cp_kv_all_gather", "cp", n_micro * len(attn) * 2 * _ring(dims.cp, kv_bytes))
    return out


OVERLAPPED = ("fsdp_all_gather", "fsdp_reduce_scatter", "dp_all_reduce")
"""What data parallelism overlaps with compute (prefetch, bucketed backward reduction)."""


def step_time(flops_per_rank: float, comm: list[Collective], dims: ParallelDims, n_micro: int,
              hw: GPU, precision: str) -> dict[str, float]:
    compute = flops_per_rank / hw.peak_flops(precision)
    bubble = compute * (dims.pp - 1) / n_micro if dims.pp > 1 else 0.0

    def seconds(c: Collective) -> float:
        return c.bytes_per_step / ((hw.nvlink_gbs if c.intra_node else hw.net_gbs) * 1e9)

    exposed = sum(seconds(c) for c in comm if c.kind not in OVERLAPPED)
    everything = sum(seconds(c) for c in comm)
    return {"lower": compute + bubble + exposed, "upper": compute + bubble + everything,
            "compute": compute, "bubble": bubble}
