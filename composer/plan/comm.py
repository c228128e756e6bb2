"""Communication per step and rank, by collective (docs/planning.md): what composer runs.

``bytes_per_step`` of an entry is the size of the buffer one rank hands each call of that
collective, summed over the step's calls (the message size of nccl-tests): an all-gather's
gathered output, a reduce-scatter's unreduced input, an all-reduce's tensor, an all-to-all's
input (what this rank sends, to itself included), a send's or a receive's tensor. Collectives
over a group of one rank move nothing and are left out. ``traffic`` is what a ring algorithm
puts on each rank's link for it (``(n - 1) / n`` of the buffer per all-gather, reduce-scatter
or all-to-all, twice that per all-reduce, the whole tensor per send), which step time uses.

The parts come from the impersonated rank's model on meta
(:func:`composer.plan.comm_parts.comm_parts`): FSDP2's units (each parameter's dim-0 padded
shard times the shard group, in the policy's dtypes; a root gathers once per micro-batch, other
units in the forward and again in the backward, fewer under a pipeline schedule), the
replicated weights whose gradients tensor parallel sums, the experts data parallelism leaves
to :func:`composer.parallel.data.finish_grads`, the layer kinds a rank runs and their
convolutions. Activations are the shapes the step moves (micro-batch ``m``, tokens ``T``,
width ``D``, the compute dtype or the residual stream's).
Expert parallelism's all-to-alls depend on routing: the rows a rank receives, ``routed`` over
the step (uniform routing by default: each rank receives as many as it sends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer.config import ModelConfig
from composer.parallel.mesh import ParallelDims
from composer.plan.comm_parts import CommParts

DELTA_SIZE = 4
"""Bytes per number of the chunk states and transitions context parallelism passes for the
delta rule (GDN, KDA) and Mamba-1: fp32."""
STATS_WIDTH = 6
"""fp64 numbers of the loop's step statistics (loss, aux, MTP, stop, count, processed)."""


@dataclass
class Collective:
    kind: str
    group: str
    bytes_per_step: int
    intra_node: bool
    size: int = 2
    """Ranks in the group."""

    @property
    def op(self) -> str:
        """The collective itself: all_gather, reduce_scatter, all_reduce, all_to_all, send,
        recv (the kind's suffix)."""
        for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "recv"):
            if self.kind.endswith(op):
                return op
        raise ValueError(f"no collective in kind {self.kind!r}")

    @property
    def traffic(self) -> float:
        """Bytes on one rank's link for a ring algorithm (module docstring); a receive is its
        peer's send."""
        n = self.size
        factor = {"all_reduce": 2 * (n - 1) / n, "send": 1.0, "recv": 0.0}.get(self.op,
                                                                            (n - 1) / n)
        return self.bytes_per_step * factor


def intra(dims: ParallelDims, group: str, per_node: int) -> bool:
    """Whether a group's ranks share a node (the mesh is pp, dp_outer, ep, cp, tp row-major)."""
    inner = {"tp": 1, "cp": dims.tp, "ep": dims.tp * dims.cp,
             "dp_outer": dims.tp * dims.cp * dims.ep}
    sizes = group_sizes(dims)
    if group in inner:
        span = inner[group] * sizes[group]
    elif group == "dp_replicate":
        span = dims.world_size // dims.pp
    elif group == "dp_shard":
        span = dims.tp * dims.dp_shard
    elif group.startswith("expert_"):  # HSDP's split of dp_outer
        span = inner["dp_outer"] * (dims.dp_outer if group == "expert_dp_replicate"
                                    else dims.dp_outer // dims.dp_replicate)
    else:  # dp, dp_cp: all but pp; pp and world: everything
        span = dims.tp * dims.cp * dims.dp if group in ("dp", "dp_cp") else dims.world_size
    return span <= per_node


def group_sizes(dims: ParallelDims) -> dict[str, int]:
    return {"tp": dims.tp, "cp": dims.cp, "ep": dims.ep, "pp": dims.pp, "dp": dims.dp,
            "dp_outer": dims.dp_outer, "dp_cp": dims.grad_replicas,
            "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
            "expert_dp_replicate": dims.dp_replicate,
            "expert_dp_shard": dims.dp_outer // dims.dp_replicate, "world": dims.world_size}


def resolve_grad_sync(dims: ParallelDims, n_micro: int, grad_bytes: int, mem_bytes: int) -> str:
    """``--grad-sync`` as training resolves it on a GPU of ``mem_bytes``
    (:func:`composer.parallel.data.default_grad_sync`); ``grad_bytes``: this rank's unsharded
    fp32 gradients."""
    from composer.parallel.data import GRAD_SYNC_MEMORY_SHARE

    if dims.pp > 1:
        return "last"
    if dims.grad_replicas == 1 or n_micro == 1:
        return "every"
    if dims.grad_sync is not None:
        return dims.grad_sync
    return "last" if grad_bytes <= GRAD_SYNC_MEMORY_SHARE * mem_bytes else "every"


def communication(cfg: ModelConfig, dims: ParallelDims, parts: CommParts, seq_len: int,
                  micro: int, n_micro: int, size: int, per_node: int, grad_sync: str,
                  schedule: str | None = None, routed: int | None = None
                  ) -> tuple[list[Collective], list[str]]:
    """One rank's collectives of one training step, by kind and group (module docstring), and
    what it could not count. ``size``: the compute dtype's bytes; ``schedule``: the pipeline's;
    ``routed``: the rows this rank's experts receive over the step (None: uniform routing)."""
    out: dict[tuple[str, str], int] = {}
    sizes = group_sizes(dims)
    unknown: list[str] = []

    def add(kind: str, group: str, n: int, ranks: int | None = None) -> None:
        if n > 0 and (ranks or sizes[group]) > 1:
            out[(kind, group)] = out.get((kind, group), 0) + int(n)
            group_size[(kind, group)] = ranks or sizes[group]

    group_size: dict[tuple[str, str], int] = {}
    order = schedule_order(schedule, dims.pp, parts.stage_ids[0], n_micro)
    if dims.pp > 1 and order is None and any(u.gather_bytes for u in parts.units):
        unknown.append(f"FSDP all-gathers under the {schedule} schedule: counted as without "
                       "a pipeline")
    _data_parallel(parts, n_micro, grad_sync, add, order)
    tokens = micro * seq_len // dims.cp  # a micro-batch's tokens on this rank, before tp
    sp = dims.tp > 1 and dims.sequence_parallel and tokens % dims.tp == 0  # tp.sp_active
    # the residual stream is in the compute dtype where data parallelism casts the weights
    # (FSDP2's param_dtype); else the fp32 masters' (autocast casts only the matmuls' outputs)
    stream = size if dims.grad_replicas > 1 else 4
    _tensor_parallel(cfg, dims, parts, tokens, n_micro, (stream, size), sp, add)
    if dims.pp > 1:
        message = tokens // (dims.tp if sp else 1) * cfg.d_model * stream
        for s in parts.stage_ids:
            if s + 1 < parts.n_stages:  # activations forward, their gradients back
                add("pp_send", "pp", n_micro * message)
                add("pp_recv", "pp", n_micro * message)
            if s > 0:
                add("pp_recv", "pp", n_micro * message)
                add("pp_send", "pp", n_micro * message)
        add("pp_tied_all_reduce", "pp", parts.tied_bytes, ranks=parts.tied_ranks)
    _context_parallel(cfg, dims, parts, micro, seq_len, n_micro, size, add, unknown)
    _experts(cfg, dims, parts, micro, tokens, n_micro, size, routed, add)
    add("grad_norm_all_reduce", "world", 8)  # fp64, composer.parallel.grads
    add("step_stats_all_reduce", "world", 8 * STATS_WIDTH)
    return [Collective(k, g, n, intra(dims, g, per_node), group_size[(k, g)])
            for (k, g), n in out.items()], unknown


def schedule_order(schedule: str | None, pp: int, stage: int, n_micro: int) -> list[str] | None:
    """A pipeline stage's forwards (``F``) and backwards (``B``) in the order torch's
    schedule runs them (``Schedule1F1B``: ``min(n, pp - stage)`` forwards, then a backward
    and a forward each until the forwards are done, then the backwards; ``ScheduleGPipe``:
    every forward, then every backward); None without a pipeline or for another schedule."""
    if pp == 1 or schedule not in ("1f1b", "gpipe"):
        return None
    if schedule == "gpipe":
        return ["F"] * n_micro + ["B"] * n_micro
    warmup = min(n_micro, pp - stage)
    return ["F"] * warmup + ["B", "F"] * (n_micro - warmup) + ["B"] * warmup


def unit_gathers(root: bool, n_micro: int, order: list[str] | None) -> int:
    """How often FSDP2 all-gathers a unit in a step. Without a pipeline a root gathers in
    each micro-batch's forward and keeps its weights through the backward, the other units
    gather in the forward and again in the backward. A pipeline stage turns resharding after
    backward off until its last backward (torch.distributed.pipelining's ``PipelineStage``):
    a unit then gathers only where it is sharded, after a forward (a root never is)."""
    if order is None:
        return n_micro * (1 if root else 2)
    count, unsharded = 0, False
    for action in order:
        count += not unsharded
        unsharded = root or action == "B"
    return count


def _data_parallel(parts: CommParts, n_micro: int, grad_sync: str, add: Any,
                   order: list[str] | None) -> None:
    reductions = n_micro if grad_sync == "every" else 1
    gathers = {root: unit_gathers(root, n_micro, order) for root in (True, False)}
    for u in parts.units:
        if u.gather_bytes:
            add("fsdp_all_gather", u.group, u.gather_bytes * gathers[u.root], u.size)
            add("fsdp_reduce_scatter", u.group, u.reduce_bytes * reductions, u.size)
            if u.replicate_group is not None:
                add("fsdp_all_reduce", u.replicate_group, u.shard_bytes * reductions,
                    u.replicate_size)
        else:
            add("dp_all_reduce", u.group, u.reduce_bytes * reductions, u.size)
    add("expert_all_reduce", "dp_outer", parts.expert_grad_bytes)


def _tensor_parallel(cfg: ModelConfig, dims: ParallelDims, parts: CommParts, tokens: int,
                     n_micro: int, sizes: tuple[int, int], sp: bool, add: Any) -> None:
    """Each mixer's entry (its normed input, the stream's dtype) and exit (its output, the
    compute dtype), the vocabulary-parallel embedding's exit and the readout's entry (the
    stream's dtype; composer.parallel.tensor, .vocab), once more each per MTP depth, and the
    input embeddings' entry into a mixer that reads them: under sequence parallel an
    all-gather and a reduce-scatter of the whole sequence forward, the same backward; without
    it an all-reduce forward (exit) and backward (entry). A ``PartialSum`` inside a mixer (a
    sub-layer's ``D``-wide output) is all-reduced forward and backward. The readout's loss: a
    row max and two row sums per token, fp32, forward. Then the partial gradients of
    replicated weights, once."""
    if dims.tp == 1:
        return
    stream, out = sizes
    ends = parts.has_embed + parts.has_readout + 2 * parts.mtp_depths + parts.embedding_reads
    per_micro = (len(parts.sections) * (stream + out) + ends * stream) * tokens * cfg.d_model
    inside = 2 * parts.partial_sums * tokens * cfg.d_model * out  # forward and backward
    if sp:
        add("tp_all_gather", "tp", per_micro * n_micro)
        add("tp_reduce_scatter", "tp", per_micro * n_micro)
        add("tp_all_reduce", "tp", inside * n_micro)
    else:
        add("tp_all_reduce", "tp", (per_micro + inside) * n_micro)
    if parts.has_readout:  # fp32 logits' statistics, the MTP depths' too
        add("tp_loss_all_reduce", "tp", (1 + parts.mtp_depths) * 3 * tokens * 4 * n_micro)
    partial = parts.tp_grad_bytes.get("partial", 0)
    if sp:
        partial += parts.tp_grad_bytes.get("partial_if_sp", 0)
    add("tp_grad_all_reduce", "tp", partial)


def _context_parallel(cfg: ModelConfig, dims: ParallelDims, parts: CommParts, micro: int,
                      seq_len: int, n_micro: int, size: int, add: Any,
                      unknown: list[str]) -> None:
    """Attention gathers the whole sequence's K and V (one all-gather each, forward; their
    reduce-scatters backward), multi-latent attention its latents and RoPE keys; a layer with
    convolutions gathers its 2N chunks' convolution tails, Mamba-2 its chunk states (compute
    dtype) and decays (fp32), forward, and reduce-scatters them backward; the loss mean is
    summed over cp once per micro-batch (fp32; an MTP depth's too). The 2N-chunk layout
    (``--cp-adaptive`` is not counted)."""
    if dims.cp == 1:
        return
    if dims.cp_adaptive:
        unknown.append("context parallel's adaptive layout: counted as the 2N-chunk one")
    tp = dims.tp
    chunks = 2 * dims.cp * micro
    per_layer = chunks * sum(parts.halos)
    fp32 = delta = 0
    for section in parts.branches:
        if section == "attention":
            a = cfg.attention
            d_head = a.d_head or cfg.d_model // a.n_heads
            per_layer += 2 * micro * seq_len * (a.n_kv_heads or a.n_heads) // tp * d_head
        elif section == "mla":  # the normalised latents and RoPE keys, whole on every tp rank
            per_layer += micro * seq_len * (cfg.mla.kv_lora_rank + cfg.mla.d_head_rope)
        elif section == "mamba":
            m = cfg.mamba
            heads = m.n_heads // tp
            per_layer += chunks * heads * m.d_head * m.d_state
            fp32 += chunks * heads  # the chunks' decays: A_log is kept in fp32
        elif section in ("gdn", "kda"):  # the delta rule: S [H, K, V] and M [H, K, K]
            c = getattr(cfg, section)
            d_k, d_v = (c.d_head_k, c.d_head_v) if section == "gdn" else (c.d_head, c.d_head)
            delta += chunks * c.n_heads // tp * d_k * (d_v + d_k)
        elif section == "mamba1":  # S and its decay, both [d_inner, d_state]
            delta += chunks * 2 * cfg.mamba1.d_inner // tp * cfg.mamba1.d_state
        elif section not in ("mlp", "moe", "shortconv"):  # others pass states too
            unknown.append(f"context-parallel state passing of {section or 'unregistered'} "
                           "layers: not counted")
    exchanged = (per_layer * size + fp32 * 4 + delta * DELTA_SIZE) * n_micro
    add("cp_all_gather", "cp", exchanged)
    add("cp_reduce_scatter", "cp", exchanged)
    if parts.has_readout and dims.pp == 1:
        add("cp_loss_all_reduce", "cp", (1 + parts.mtp_depths) * 4 * n_micro)
    elif parts.has_readout:
        unknown.append("the pipeline's loss sums over cp: not counted")


def _experts(cfg: ModelConfig, dims: ParallelDims, parts: CommParts, micro: int, tokens: int,
             n_micro: int, size: int, routed: int | None, add: Any) -> None:
    """Per MoE layer and micro-batch: the routing counts (int64 per expert), the dispatch of
    this rank's ``m T k`` rows and the combine of the rows its experts received, forward; the
    same two backward (composer.parallel.expert). The load statistics (``2E + 1`` fp32 sums,
    with aux loss) are summed over ``dp x cp`` forward and backward, the sequence-wise ones
    (``2E`` per sequence) over cp; aux-loss-free balancing sums each layer's ``E`` loads once
    per step (``finish_moe_step``)."""
    n_moe = sum(1 for s in parts.sections if s == "moe")
    if not n_moe:
        return
    moe = cfg.moe
    dp = "dp_cp" if dims.cp > 1 else "dp"  # the mesh's name of data parallelism's ranks
    if dims.ep > 1:
        sent = n_moe * n_micro * tokens * moe.top_k
        received = sent if routed is None else routed
        add("ep_all_to_all", "ep", 2 * (sent + received) * cfg.d_model * size
            + n_moe * n_micro * moe.n_experts * (2 if dims.ep_overlap else 1) * 8)
    if dims.grad_replicas > 1 and moe.aux_loss_coeff:
        add("moe_stats_all_reduce", dp, 2 * n_moe * n_micro * (2 * moe.n_experts + 1) * 4)
    if dims.cp > 1 and moe.seq_aux_loss_coeff:  # per sequence: (chosen, probs) per expert
        add("moe_stats_all_reduce", "cp", 2 * n_moe * n_micro * micro * 2 * moe.n_experts * 4)
    if dims.grad_replicas > 1 and moe.bias_update_rate:  # aux-loss-free balancing, per step
        add("moe_load_all_reduce", dp, n_moe * moe.n_experts * 4)
