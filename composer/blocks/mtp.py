"""Multi-token prediction: the pattern's ``/`` parts (DeepSeek-V3 §2.2; Megatron-Core
``multi_token_prediction.py``). ``"main/p/p"`` builds ``D = 2`` sequential depths, each a stack of
the layers of ``p`` (ordinary residual blocks built by the registry, with their own parallel
plans) between a projection and a final norm; the embedding and the LM head are the main model's
(the same tensors, not copies). Depth ``k = 1..D`` predicts token ``t + k + 1`` at position ``t``:

    g_0[t]   = final_norm(x_L)[t]                       the main trunk's normalised output
    e_k[t]   = embed(ids[t + k])     or 0 where t + k is past the row or in another document
    u_k[t]   = W_k [norm_h(g_{k-1}[t]); norm_e(e_k[t])]          W_k: [D_model, 2 D_model]
    g_k      = final_norm_k(layers_k(u_k))
    logits_k = head(g_k),   ce_k = mean over t with a target of  -log softmax(logits_k[t])[y_k[t]]
    y_k[t]   = labels[t + k + 1], ignored past the row, where the label is ignored, or in
               another document than t's (document isolation, ``doc_ids``)
    mtp_loss = (w / D) * sum_k ce_k                      w = ``mtp.loss_weight`` (default 0.1)

Each depth reads the *normalised* states of the previous one, ``g_{k-1}``, the tensor that the
head before it reads: Megatron-Core hands depth 1 the decoder's output after its final layernorm
and each later depth the previous depth's ``final_layernorm`` output; transformers' ``MtpModel``
feeds ``hidden_states[-1]`` (tied to the normed last hidden state) and each ``MtpLayer``'s
``post_norm`` output. A converted DeepSeek-V3 or Qwen3-Next MTP module therefore predicts as
trained. ``W_k``'s columns are ``[h; e]`` (the paper's eq. 21 order); checkpoints store
``[e; h]`` (``eh_proj``, ``mtp.fc``) and the converters swap the halves.

A depth without any target (a row shorter than ``k + 2`` tokens, or only short documents)
contributes 0 and reports NaN in ``ModelOutput.mtp_losses``. Inference (a forward without
labels, ``forward_cached``, ``composer.generate``) never runs these modules.

State-dict keys (``d = k - 1``, 0-based like every index here):

    mtp.{d}.norm_h.weight        [D_model]
    mtp.{d}.norm_e.weight        [D_model]
    mtp.{d}.proj.weight          [D_model, 2 D_model], columns [h; e]
    mtp.{d}.layers.{j}.*         layer j of the part, keys as ``layers.{i}.*``
    mtp.{d}.final_norm.weight    [D_model]

A layer's ``layer_idx`` (what blocks read, e.g. ``post_norm_layers``) continues the main
numbering: layer ``j`` of depth ``d`` is ``n_layers + d * len(part) + j``, as Megatron and the
checkpoints number MTP layers after the main ones; ``post_norm_layers`` (indices below
``n_layers``) thus never applies to them.

Tensor parallelism (:func:`composer.parallel.tensor.apply_tp`): the depth's layers take their
own plans; the glue (two norms, ``proj``, the final norm) is token-wise and replicated, run on
the residual stream as it is (``[B, T/tp, D]`` under sequence parallelism), its gradients summed
over ``tp`` like the layer norms'. The shifted embedding comes from the (vocabulary-parallel)
embedding, already scattered over the sequence; the per-position keep mask goes through a
:class:`~composer.blocks.plan.SequenceChunk`, which the parallel layer cuts to the rank's part.

Legend: B batch, T time, D model width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.loss import IGNORE_INDEX
from composer.blocks.norm import RMSNorm, rms_norm_ref
from composer.blocks.plan import Init, Normal, SequenceChunk
from composer.config import ModelConfig
from composer.kernels.linear import Linear
from composer.kernels.packing import doc_segments


def shift_left(x_BT: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``out[:, t] = x[:, t + k]``, ``fill`` where ``t + k`` is past the row."""
    return F.pad(x_BT[:, k:], (0, min(k, x_BT.shape[1])), value=fill)


def segments(input_ids: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """``(B, T)`` document index of every position (all 0 without ``doc_ids``)."""
    return torch.zeros_like(input_ids) if doc_ids is None else doc_segments(doc_ids)


def depth_inputs(input_ids: torch.Tensor, labels: torch.Tensor, seg_BT: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For depth ``k``: the shifted ids ``ids[t + k]`` (0 where none), the mask of positions
    whose shifted token exists in the same document, and the targets ``y_k`` (module
    docstring), all ``(B, T)``."""
    same_BT = shift_left(seg_BT, k, -1) == seg_BT
    ids_BT = shift_left(input_ids, k, 0)
    target_BT = shift_left(labels, k + 1, IGNORE_INDEX)
    target_BT = target_BT.masked_fill(shift_left(seg_BT, k + 1, -1) != seg_BT, IGNORE_INDEX)
    return ids_BT, same_BT, target_BT


class MTPDepth(nn.Module):
    """One depth: ``mtp.{d}.{norm_h, norm_e, proj, layers.{j}, final_norm}``."""

    def __init__(self, cfg: ModelConfig, layers: Mapping[int, nn.Module]) -> None:
        super().__init__()
        d = cfg.d_model
        self.init_std = cfg.init_std
        self.norm_h = RMSNorm(d, cfg.norm_eps)
        self.norm_e = RMSNorm(d, cfg.norm_eps)
        self.proj = Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleDict({str(j): layer for j, layer in layers.items()})
        self.final_norm = RMSNorm(d, cfg.norm_eps)
        self.keep = SequenceChunk()

    def init_rules(self) -> dict[str, Init]:
        return {"proj.weight": Normal(self.init_std)}

    def forward(self, g_BTD: torch.Tensor, e_BTD: torch.Tensor, keep_BT: torch.Tensor, *,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``g_k`` from ``g_{k-1}`` and the shifted embeddings; ``keep`` zeroes the positions
        whose shifted token does not exist (past the row, another document)."""
        e_BTD = e_BTD.masked_fill(~self.keep(keep_BT)[..., None], 0.0)
        x_BTD = self.proj(torch.cat([self.norm_h(g_BTD), self.norm_e(e_BTD)], dim=-1))
        for layer in self.layers.values():
            x_BTD = layer(x_BTD) if doc_ids is None else layer(x_BTD, doc_ids=doc_ids)
        return self.final_norm(x_BTD)


ReadoutFn = Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]]


class DepthRows:
    """Each depth's shifted ids, keep mask and targets, and their count of real targets, from
    the rows the model reads; the seam context parallelism replaces by its variant (which
    reads the whole rows and keeps this rank's positions, :mod:`composer.parallel.context`)."""

    reads_whole_rows = False
    """The inputs come from elsewhere than the forward's ``input_ids`` / ``labels`` (then the
    model may be driven by shifted ``targets``)."""

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor,
                 doc_ids: torch.Tensor | None, n_depths: int
                ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        seg_BT = segments(input_ids, doc_ids)
        out = []
        for k in range(1, n_depths + 1):
            ids_BT, keep_BT, target_BT = depth_inputs(input_ids, labels, seg_BT, k)
            out.append((ids_BT, keep_BT, target_BT, (target_BT != IGNORE_INDEX).sum()))
        return out

    def loss(self, readout: ReadoutFn, g_BTD: torch.Tensor, weight_VD: torch.Tensor,
             target_BT: torch.Tensor, n_targets: torch.Tensor) -> torch.Tensor:
        """The depth's mean cross-entropy over its targets."""
        ce, _ = readout(g_BTD, weight_VD, None, targets_BT=target_BT)
        return ce


class MultiTokenPrediction(nn.ModuleList):
    """The ``D`` depths (``mtp.{d}``) and the loss of the module docstring."""

    def __init__(self, cfg: ModelConfig, depths: Sequence[MTPDepth]) -> None:
        super().__init__(depths)
        assert cfg.mtp is not None, "multi-token prediction needs cfg.mtp"
        self.loss_weight = cfg.mtp.loss_weight
        self.rows = DepthRows()
        """Where each depth's inputs come from (a plain object, not a depth)."""

    def forward(self, g_BTD: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, *,
                embed: Callable[[torch.Tensor], torch.Tensor], readout: ReadoutFn,
                weight_VD: torch.Tensor, doc_ids: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(mtp_loss, (ce_1, ..., ce_D))`` from the main trunk's normalised output ``g_0``;
        ``embed`` is the model's token embedding (ids -> ``[B, T, D]``), ``readout`` and
        ``weight_VD`` its head. The per-depth losses are detached."""
        inputs = self.rows(input_ids, labels, doc_ids, len(self))
        # one host sync for every depth: which of them has a target at all
        counts = torch.stack([n for *_, n in inputs]).tolist()
        total = g_BTD.new_zeros((), dtype=torch.promote_types(g_BTD.dtype, torch.float32))
        losses = []
        for depth, (ids_BT, keep_BT, target_BT, n_BT), n in zip(self, inputs, counts,
                                                                strict=True):
            g_BTD = depth(g_BTD, embed(ids_BT), keep_BT, doc_ids=doc_ids)
            if n == 0:
                losses.append(total.new_full((), float("nan")))
                continue
            ce = self.rows.loss(readout, g_BTD, weight_VD, target_BT, n_BT)
            total = total + ce
            losses.append(ce.detach())
        return total * (self.loss_weight / len(self)), tuple(losses)


def mtp_loss_ref(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                 doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Plain-math twin of the MTP loss of a :class:`~composer.blocks.model.HybridModel` (use
    fp64): position by position, whole logits, the norms by formula; each depth's layers are
    called as they are (their own references test them). Returns ``(mtp_loss, [ce_k])``."""
    cfg = model.config
    B, T = input_ids.shape
    z0 = cfg.norm_zero_centered
    W = model.output_weight()
    emb = model.embed.weight
    seg = [[0] * T for _ in range(B)] if doc_ids is None else doc_segments(doc_ids).tolist()
    g = model.hidden_states(input_ids, doc_ids=doc_ids)
    total, losses = torch.zeros((), dtype=g.dtype), []
    for k, depth in enumerate(model.mtp, start=1):
        e = torch.zeros_like(g)
        for b in range(B):
            for t in range(T - k):
                if seg[b][t + k] == seg[b][t]:
                    e[b, t] = emb[input_ids[b, t + k]] * cfg.embedding_multiplier
        u = torch.cat([rms_norm_ref(g, depth.norm_h.weight, cfg.norm_eps, z0),
                       rms_norm_ref(e, depth.norm_e.weight, cfg.norm_eps, z0)], -1)
        x = u @ depth.proj.weight.T
        for layer in depth.layers.values():
            x = layer(x) if doc_ids is None else layer(x, doc_ids=doc_ids)
        g = rms_norm_ref(x, depth.final_norm.weight, cfg.norm_eps, z0)
        logp = torch.log_softmax((g @ W.T) / cfg.logits_scaling, dim=-1)
        terms = [-logp[b, t, labels[b, t + k + 1]] for b in range(B) for t in range(T - k - 1)
                 if seg[b][t + k + 1] == seg[b][t] and labels[b, t + k + 1] != IGNORE_INDEX]
        if not terms:
            losses.append(torch.tensor(float("nan"), dtype=g.dtype))
            continue
        ce = torch.stack(terms).mean()
        losses.append(ce)
        total = total + ce
    return total * (cfg.mtp.loss_weight / len(model.mtp)), losses
