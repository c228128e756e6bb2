"""Context parallelism (``--cp N``): each sequence split over ``N`` ranks, exact for every layer
kind, applied from outside the blocks.

Load balance. A row of ``T`` tokens is cut into ``2N`` chunks of ``L = T / 2N``; rank ``r``
holds chunks ``r`` and ``2N - 1 - r`` (Megatron-Core's layout: under a causal mask the early
chunks are cheap and the late ones dear, and each rank gets one of each). The ranks of a cp
group read the same rows; each computes its two chunks, side by side, as a ``(B, 2L)`` row
(:mod:`.layout`).

What crosses ranks, per layer kind. A sequence mixer calls its time-mixing ops as submodules
(``ops``: Mamba-2's ``conv`` and ``scan``, the gated delta net's ``conv`` and ``rule``, attention's
and MLA's ``core``); everything around them is token-wise, so :func:`.model.apply_cp` swaps
only each op for the variant its ``context`` names (:mod:`.variants`: ``halo_conv`` and
``state_passing`` in :mod:`.recurrent`, ``kv_gather`` and ``latent_gather`` in
:mod:`.attention`). A variant holds the op and the :class:`CPContext`; it handles both the
2N-chunk layout and the adaptive one, and serves every kind whose op names it (a new kind's
``LinearRecurrence`` op gets state passing as it is):

- **Attention** (:mod:`.attention`): keys and values are all-gathered (Megatron's
  ``all_gather`` CP; the point-to-point ring is not built), and each local chunk ``c`` attends
  to keys ``[0, (c + 1) L)`` under the causal mask of global positions (and of documents, with
  ``doc_ids``: a document that spans ranks stays whole). RoPE takes global positions (or
  positions within the document). The backward reduce-scatters the keys' and values'
  gradients back to their chunks. Without documents, on CPU, no mask is built: the prefix
  keys and the causal diagonal block are two flash-kernel calls merged by their log-sum-exps,
  so memory stays linear in the keys (elsewhere a boolean mask, which SDPA turns into an
  ``L x (c + 1) L`` bias kept for the backward).
- **Multi-latent attention** (``+``): the same, with the normalised latents and RoPE keys
  all-gathered (``C + R`` numbers a token instead of ``2 K E``) and expanded into per-head
  keys and values on every rank.
- **Mamba-2 and gated delta nets** (:mod:`.recurrent`): chunk state passing. Both recurrences
  are linear in the state, ``S_end = M S_start + S_local`` per chunk, where ``S_local`` is the
  chunk's end state from zero and ``M`` its transition (a decay per head for Mamba-2; a
  ``K x K`` matrix per head for the delta rule). Each rank computes both for its chunks
  (Mamba-2 in closed form, :func:`composer.kernels.scan.ssd_end_state`; the delta rule in one
  pass widened by zero columns started from ``[0 | I]``, which come out as ``M``,
  :func:`composer.kernels.gdn.gdn_end_state`), the ``(S_local, M)`` of every chunk are
  all-gathered (state-sized tensors),
  every rank runs the recurrence over the ``2N`` chunks, and scans its chunks again from their
  true starting states. That is exact, needs no divisibility of heads or groups, and keeps
  communication at the state's size; its cost is a second scan per layer. (The alternative,
  Megatron's head all-to-all, moves ``(B, T, X)`` activations twice per layer and needs the
  heads and groups to divide by ``N``.) The convolution gets its ``K - 1`` halo inputs from the
  preceding chunk (an all-gather of each chunk's tail). Document isolation: a state never
  passes a document start (the scan masks those inside a chunk, the chunk-start mask those at
  a chunk boundary) and the halo is masked by the documents' ids.
- MLP and MoE are token-wise; the MoE load statistics are summed over ``dp x cp``
  (:mod:`composer.parallel.mesh`).
- **Multi-token prediction** (:mod:`.model`): each depth's shifted inputs and targets come
  from the whole rows (every cp rank reads them) at the rank's positions, so nothing is lost
  at chunk boundaries; its layers are cut like the trunk's.

Loss (:mod:`.model`). Targets are shifted on the whole row before it is cut (a chunk's last
target is the first token of the next chunk, on another rank), then each rank's loss is the
mean over the whole rows: the sum of its tokens' cross-entropies, summed over the cp group in
the forward and divided by the rows' predicted tokens. Its gradient is the rank's own tokens'
times ``N``, so that data parallelism, which averages over ``dp x cp``, gives the mean over
the batch. To the training loop a cp rank is a data-parallel rank that holds the rows' loss.
A row of ``2 N L + 1`` tokens (the data path's ``seq_len + 1``) loses its last token as an
input: it is only a target, so the loss is the same, and only the MoE load statistics (which
count every input token at cp = 1) see the difference. Multi-token prediction's losses are
the rows' means the same way.

Pipeline parallelism: the pipeline cuts the rows (:class:`composer.parallel.pipeline.
Pipeline`), the stages carry the rows' doc ids and positions with each micro-batch, and the
last stage's cross-entropy sums are summed over the cp group.

Adaptive (``--cp-adaptive``, :mod:`.adaptive`): for packed documents, the ones shorter than
``--cp-min-tokens`` go whole to one rank (the ranks act as data parallel for them), the longer
ones are split into ``2N`` pieces; every token of the rows is an input, and the results equal
cp = 1 exactly, MoE statistics included.

Not built yet: ``--cp`` with ``--ep``; ``--cp-adaptive`` with ``--pp`` or multi-token
prediction; each is refused with one line.

Legend: B batch, T global time, L chunk length, H heads, K kv heads, E head width, X channels.
"""

from composer.parallel.context.adaptive import Layout, Piece, adaptive_layout
from composer.parallel.context.layout import (
    CPContext,
    check_cp_length,
    cp_length,
    gather_chunks,
    local_index,
    rows_mean,
    safe_targets,
)
from composer.parallel.context.model import CutRows, apply_cp, check_cp, cut_rows

__all__ = ["CPContext", "CutRows", "Layout", "Piece", "adaptive_layout", "apply_cp", "check_cp",
           "check_cp_length", "cp_length", "cut_rows", "gather_chunks", "local_index",
           "rows_mean", "safe_targets"]
