"""Pipeline parallelism: the layers cut into stages, on ``torch.distributed.pipelining``.

Stages. With ``|`` in the pattern the segments are the stages, ``pp x V`` of them (``V >= 1``
virtual stages per rank); without, the layers are cut into ``pp`` contiguous stages that balance
forward FLOPs per token (:mod:`composer.build.stages`; the LM head counts on the last stage).
Stage ``s``
lives on pipeline rank ``s % pp`` (rank ``r`` holds ``r, r + pp, ...``: the interleaved layout).
The embedding sits on the first stage; the final norm, the head, the loss (and multi-token
prediction) on the last; with tied embeddings or multi-token prediction the last stage holds a
copy of the embedding, and so does every stage with a layer whose mixer reads the model's input
embeddings (``uses_embeddings``: Zamba2's ``Z``); the copies' gradients are summed after every
backward (they start equal and stay equal). Such a stage recomputes the embeddings from the
token ids, which reach every stage with each micro-batch like the labels (``embed_ids``),
rather than receiving them beside the hidden state: the same table and the same lookup give
the same tensor (exact), a lookup is cheap next to sending ``[B, T, D]`` more each way per
micro-batch, and the backward needs no second tensor through the schedule; the cost is the
table's copy and one sum of its gradient per step, as for tied embeddings. A shared layer
(``{a:T}``, :mod:`composer.blocks.shared`) is held by every pipeline rank whose stages use it,
its copies' gradients summed the same way.

Each rank builds only its stages: the model is built on the meta device, pruned to the rank's
layers (:func:`prune`), and parallelised and materialised as without pipelining. Layers keep
their global index (``layers.7.*``), so every key is the same at any pp size and checkpoints
reshard between them. The rank's pruned model is what the optimizer, the gradient norm and the
checkpoints see; each stage is a :class:`StageView` of it (shared modules), the module that
``PipelineStage`` runs and data parallelism wraps as its own root.

Losses. The last stage computes, inside its forward (so that data parallelism's root has its
weights gathered), each micro-batch's cross-entropy (a mean over its ``n_i`` predicted tokens)
times ``n_i * dp / N``: summed over micro-batches and averaged over dp that is the mean over
every predicted token of the global batch, as without pipelining (:mod:`composer.train.loop`);
plus the multi-token-prediction term and its layers' aux losses times ``1 / micro-batches``.
MoE load-balancing losses of earlier layers stay on the stage that computes them:
:class:`AttachAux` makes each layer's output carry its aux loss into the backward with the
weight ``1 / micro-batches``, as ``aux / k`` does without pipelining.

The schedule's first step runs every stage once on placeholder tensors to learn the shapes it
exchanges: the logs keep the last ``n_micro`` entries, that first forward leaves the MoE
statistics of the step as they were (their ``step_stats``: expert loads for the balancing
bias, global-batch loss counts), and a new batch shape builds a new schedule. Under sequence
parallelism the later stages are told that their inputs are sequence-sharded (the embedding, on
the first stage, decides it).

Schedules: ``gpipe``, ``1f1b`` (default for ``V = 1``) and ``interleaved-1f1b`` (``V > 1``);
the engine's micro-batches are the schedule's, and there must be at least ``pp`` of them.
Evaluation runs the stages forward only, the whole batch at once (:meth:`Pipeline.loss`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from composer.blocks.kind import token_declares
from composer.blocks.loss import IGNORE_INDEX
from composer.blocks.model import HybridModel, mask_doc_boundaries, shift_labels
from composer.blocks.protocol import declared
from composer.parallel.comm import all_reduce_coalesced, recv_tensor, send_tensor
from composer.parallel.mesh import ParallelDims

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


# ---------------------------------------------------------------- this rank's stages


def rank_stages(n_stages: int, pp: int, pp_rank: int) -> list[int]:
    return list(range(pp_rank, n_stages, pp))


def embed_on_last(model: HybridModel) -> bool:
    """The last stage holds a copy of the embedding: as the head (tied), or for multi-token
    prediction's shifted tokens."""
    return _embed_on_last(model.config)  # (pruned or not)


def _embed_on_last(cfg: Any) -> bool:
    return cfg.tie_embeddings or bool(cfg.parsed.mtp)


def reads_embeddings(cfg: Any, layers: tuple[int, ...]) -> bool:
    """Whether a mixer of ``layers`` reads the model's input embeddings (``uses_embeddings``)."""
    return any(token_declares(cfg.parsed.layers[i], "uses_embeddings") for i in layers)


def embed_stages(cfg: Any, groups: list[tuple[int, ...]]) -> list[int]:
    """The stages holding a copy of the embedding: the first, the last with tied weights or
    multi-token prediction, and every stage whose layers read the input embeddings."""
    last = len(groups) - 1
    return [s for s, layers in enumerate(groups)
            if s == 0 or (s == last and _embed_on_last(cfg)) or reads_embeddings(cfg, layers)]


def prune(model: HybridModel, groups: list[tuple[int, ...]], stages: list[int]) -> None:
    """Keep (on meta) only what ``stages`` need: their layers, the embedding (and a vision
    tower) on the first stage (the embedding on the others of :func:`embed_stages` too), the
    final norm, head and MTP on the last."""
    keep = {i for s in stages for i in groups[s]}
    for key in list(model.layers.keys()):
        if int(key) not in keep:
            del model.layers[key]
    if model.shared is not None:
        used = {layer.shared_label for layer in model.layers.values()}
        for label in list(model.shared.keys()):
            if label not in used:
                del model.shared[label]
    first, last = 0 in stages, len(groups) - 1 in stages
    if not set(stages) & set(embed_stages(model.config, groups)):
        model.embed = None
    if not first and getattr(model, "visual", None) is not None:
        model.visual = None
    if not last:
        model.final_norm = None
        if hasattr(model, "lm_head"):
            model.lm_head = None
        if getattr(model, "mtp", None) is not None:
            model.mtp = None


def shared_holders(cfg: Any, pp: int, groups: list[tuple[int, ...]]) -> dict[str, list[int]]:
    """Shared label -> the pipeline ranks whose stages use it (the same on every rank)."""
    pattern = cfg.parsed
    stage_of = {i: s for s, layers in enumerate(groups) for i in layers}
    return {label: sorted({stage_of[i] % pp for i in uses})
            for label, uses in pattern.shared_uses().items()}


def _shared_groups(dims: ParallelDims, holders: dict[str, list[int]]) -> dict[str, Any]:
    """This rank's process group per shared label held on several pipeline ranks: the ranks
    of one position of the other mesh dimensions, at those pipeline ranks. Every rank creates
    every group, in the same order (``new_group`` is collective)."""
    mine: dict[str, Any] = {}
    if dims.pp == 1:
        return mine
    ranks = dims.mesh.mesh.reshape(dims.pp, -1)
    for label, ranks_of_label in holders.items():
        if len(ranks_of_label) < 2:
            continue
        for col in range(ranks.shape[1]):
            members = [int(ranks[r, col]) for r in ranks_of_label]
            group = dist.new_group(members)
            if dist.get_rank() in members:
                mine[label] = group
    return mine


class AttachAux(torch.autograd.Function):
    """Identity on ``x`` whose backward also sends ``scale`` into ``aux`` (a 0-dim loss computed
    beside ``x``): the aux loss's gradient without it being part of the pipelined output
    (Megatron-Core's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_shape, ctx.aux_dtype = scale, aux.shape, aux.dtype
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


class StageView(nn.Module):
    """One stage over the rank's pruned model (shared modules): ids -> hidden on the first
    stage, hidden -> hidden after. The last stage, given ``labels`` (unshifted, as the model's
    forward takes them), returns its micro-batch's weighted loss ``ce * n * loss_scale`` (``n``
    its predicted tokens) and logs ``ce * n``: the norm, head and loss run inside the stage, so
    data parallelism's root gathers their weights around it."""

    def __init__(self, model: HybridModel, layers: tuple[int, ...], first: bool,
                 last: bool, holds_embed: bool | None = None) -> None:
        super().__init__()
        self.config = model.config
        self.__dict__["_model"] = model  # not a submodule: the view registers its own parts
        self.keys = tuple(str(i) for i in layers)
        self.first, self.last = first, last
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        labels = dict.fromkeys(self.layers[k].shared_label for k in self.keys)
        if any(label is not None for label in labels):  # its shared layers' copies
            self.shared = nn.ModuleDict({label: model.shared[label] for label in labels
                                         if label is not None})
        if holds_embed is None:
            holds_embed = first or (last and embed_on_last(model))
        if holds_embed:
            self.embed = model.embed
        self.reads_embeddings = reads_embeddings(model.config, layers)
        """Its layers read the input embeddings: recomputed from ``embed_ids`` after the first
        stage."""
        if last:
            self.final_norm = model.final_norm
            if not model.config.tie_embeddings:
                self.lm_head = model.lm_head
            if getattr(model, "mtp", None) is not None:
                self.mtp = model.mtp
            self.readout = model.readout
        self.aux_scale = 1.0
        self.loss_scale = 1.0
        self.aux_log: list[torch.Tensor] = []
        self.ce_log: list[torch.Tensor] = []
        self.mtp_log: list[torch.Tensor] = []
        self.mtp_aux_log: list[torch.Tensor] = []
        self.tp: Any = None
        """The tensor-parallel context (set once the layout is applied)."""
        self.cp: Any = None
        """The context-parallel one (:class:`composer.parallel.context.CPContext`), or None."""
        self.placeholder = False
        """The next forward is a new schedule's shape inference on placeholder tensors."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                cp_doc: torch.Tensor | None = None, cp_pos: torch.Tensor | None = None,
                cp_ids: torch.Tensor | None = None,
                embed_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``targets`` (shifted, instead of ``labels``), ``cp_doc`` (the whole rows' doc ids),
        ``cp_pos`` (the local tokens' RoPE positions) and ``cp_ids`` (the whole rows' ids, for
        multi-token prediction): context parallelism's cut rows
        (:mod:`composer.parallel.context`), which reach every stage with each micro-batch.
        ``embed_ids``: the first stage's input ids, for a later stage whose layers read the
        input embeddings."""
        args = (x, labels, doc_ids, targets, cp_doc, cp_pos, cp_ids, embed_ids)
        if not self.placeholder:
            return self._forward(*args)
        self.placeholder = False
        saved = [(m, name, getattr(m, name)) for m in self.modules()
                 for name in declared(m, "step_stats")]
        try:
            return self._forward(*args)
        finally:  # placeholder tokens do not count towards the step's statistics
            for module, name, value in saved:
                setattr(module, name, value)

    def _forward(self, x: torch.Tensor, labels: torch.Tensor | None,
                 doc_ids: torch.Tensor | None, targets: torch.Tensor | None,
                 cp_doc: torch.Tensor | None, cp_pos: torch.Tensor | None,
                 cp_ids: torch.Tensor | None, embed_ids: torch.Tensor | None) -> torch.Tensor:
        given = labels if labels is not None else targets
        if self.cp is not None and cp_pos is not None:
            self.cp.set_rows(cp_pos.shape[1] * self.cp.size, cp_pos, cp_doc, cp_ids)
        if self.tp is not None and not self.first and given is not None:
            # The embedding decides sequence parallelism on the first stage; later stages get
            # its sequence-sharded hidden states and must know (the readout gathers them).
            self.tp.last_sp = self.tp.sp_active(given.shape[1])
        model: HybridModel = self._model
        embeddings = None
        if self.first:
            x = embeddings = model.embed_tokens(x)
        elif self.reads_embeddings:
            if embed_ids is None:
                raise ValueError("this stage's layers read the input embeddings: give it "
                                 "embed_ids")
            embeddings = model.embed_tokens(embed_ids)
        auxes: list[torch.Tensor] = []

        def attach(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
            aux = declared(layer.mixer, "aux_loss")
            if aux is None:
                return x
            auxes.append(aux.detach())
            return AttachAux.apply(x, aux, self.aux_scale) if torch.is_grad_enabled() else x

        x = model.run_layers(x, doc_ids=doc_ids, keys=self.keys, after=attach,
                             embeddings=embeddings)
        if auxes:
            self.aux_log.append(sum(auxes[1:], auxes[0]).double())
        if not self.last or given is None:
            return x
        weight = model.output_weight()
        h = model.final_norm(x)
        from composer.parallel.context import safe_targets

        if targets is None:  # a micro-batch without a target (masked labels): a stand-in, n = 0
            targets = model.targets_for(labels, doc_ids)
        # context parallel: this rank's cut of the rows (none real: a stand-in, n = 0)
        ce, _ = model.readout(h, weight, None, targets_BT=safe_targets(targets))
        n = (targets != IGNORE_INDEX).sum()
        ce = torch.where(n > 0, ce, torch.zeros_like(ce))  # no target: a NaN mean
        self.ce_log.append(ce.detach().double() * n)
        loss = ce * (n.to(ce.dtype) * self.loss_scale)
        if getattr(self, "mtp", None) is None:
            return loss
        # multi-token prediction on the trunk's normalised output (labels are the input ids);
        # its loss and its MoE layers' are per-micro-batch means, weighted as the aux losses
        mtp, _ = model.mtp_loss(h, labels, labels, doc_ids=doc_ids)
        aux = [a for depth in self.mtp for layer in depth.layers.values()
               if (a := declared(layer.mixer, "aux_loss")) is not None]
        extra = mtp + sum(aux) if aux else mtp
        self.mtp_log.append(mtp.detach().double())
        if aux:
            self.mtp_aux_log.append(sum(a.detach().double() for a in aux))
        return loss + extra * self.aux_scale


# ---------------------------------------------------------------- the runtime


class Pipeline:
    """This rank's stages, their schedule, and the forward-only path for evaluation."""

    def __init__(self, model: HybridModel, dims: ParallelDims, groups: list[tuple[int, ...]],
                 schedule: str | None = None, n_micro: int | None = None) -> None:
        self.model, self.dims, self.groups = model, dims, groups
        self.n_stages = len(groups)
        self.stage_ids = rank_stages(self.n_stages, dims.pp, dims.pp_rank())
        self.embed_stages = embed_stages(model.config, groups)
        self.views = [StageView(model, groups[s], s == 0, s == self.n_stages - 1,
                                s in self.embed_stages) for s in self.stage_ids]
        self.embed_holders = sorted({s % dims.pp for s in self.embed_stages})
        """The pipeline ranks holding a copy of the embedding."""
        self.embed_group = (dims.tied_group if self.embed_holders == [0, dims.pp - 1]
                            else _shared_groups(dims, {"embed": self.embed_holders}).get("embed"))
        """This rank's group of the embedding's copies (None: it holds none, or the only)."""
        self.feeds_ids = any(v.reads_embeddings and not v.first for v in self.views)
        self.shared_holders = shared_holders(model.config, dims.pp, groups)
        self.shared_groups = _shared_groups(dims, self.shared_holders)
        self.schedule_name = schedule
        self.n_micro = n_micro
        self._schedule = None
        self._shape: tuple[int, ...] | None = None

    def _attach_tp(self) -> None:
        for view in self.views:
            view.tp = self.dims.tp_context
            view.cp = self.dims.cp_context

    def _cut(self, ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None,
             labels_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, dict, Any]:
        """The first stage's input and every stage's keyword arguments for the rows: the ids
        and (unshifted) labels (the ids when none are given), or under context parallelism this
        rank's cut of them."""
        cp = self.dims.cp_context
        labels_BT = ids_BT if labels_BT is None else labels_BT
        if cp is None:
            kwargs = {"labels": labels_BT}  # the last stage masks document boundaries
            if doc_ids_BT is not None:
                kwargs["doc_ids"] = doc_ids_BT
            if self.feeds_ids:
                kwargs["embed_ids"] = ids_BT
            return ids_BT, kwargs, None
        from composer.parallel.context import cut_rows

        rows = cut_rows(cp, ids_BT, labels_BT, doc_ids_BT, self.model.config)
        kwargs = {"targets": rows.targets, "cp_pos": rows.pos.contiguous()}
        if getattr(self.model, "mtp", None) is not None:
            kwargs["cp_ids"] = rows.rows_ids
        if doc_ids_BT is not None:
            kwargs |= {"doc_ids": rows.doc_ids, "cp_doc": rows.rows_doc_ids}
        if self.feeds_ids:
            kwargs["embed_ids"] = rows.ids
        return rows.ids, kwargs, rows

    def configure(self, schedule: str, n_micro: int) -> None:
        """The schedule and the micro-batches per step (the engine's, checked by
        :func:`check_pipeline`)."""
        self.schedule_name, self.n_micro, self._schedule = schedule, n_micro, None

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    @staticmethod
    def _loss_fn(loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss  # the last stage computed it (StageView.forward)

    # ------------------------------------------------------------ training

    def _build_schedule(self) -> Any:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        group = self.dims.pp_mesh.get_group()
        stages = [PipelineStage(view, s, self.n_stages, self.dims.device, group=group)
                  for view, s in zip(self.views, self.stage_ids, strict=True)]
        kw = dict(loss_fn=self._loss_fn, scale_grads=False)
        if self.schedule_name == "interleaved-1f1b":
            return ScheduleInterleaved1F1B(stages, self.n_micro, **kw)
        cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
        return cls(stages[0], self.n_micro, **kw)

    def train_step(self, ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None,
                   scale: float, labels_BT: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of this rank's rows (``n_micro`` micro-batches of them) through
        the pipeline (``labels_BT``: their own labels, else the ids); returns the summed token
        cross-entropy (on the last stage; 0 elsewhere) and the mean aux loss of this rank's
        stages. ``scale`` is ``dp x cp / N`` (the ranks data parallelism averages over, by the
        rows' predicted tokens)."""
        if self._schedule is None or self._shape != tuple(ids_BT.shape):
            # the stages learn the shapes they exchange on their first step: a new batch shape
            # needs a new schedule
            self._schedule, self._shape = self._build_schedule(), tuple(ids_BT.shape)
            for view in self.views:
                view.placeholder = True
        self._attach_tp()
        for view in self.views:
            view.aux_scale, view.loss_scale = 1.0 / self.n_micro, scale
            view.aux_log.clear()
            view.ce_log.clear()
            view.mtp_log.clear()
            view.mtp_aux_log.clear()
        x_BT, kwargs, _ = self._cut(ids_BT, doc_ids_BT, labels_BT)  # doc_ids reach every stage
        args = (x_BT,) if self.has_first else ()
        target = x_BT if self.has_last else None  # unused (the last stage computes the loss)
        self._schedule.step(*args, target=target, return_outputs=False, **kwargs)
        device = self.dims.device
        # the last n_micro entries: the schedule's first step also runs each stage once on
        # placeholder tensors to learn the shapes it sends (metadata inference)
        k = self.n_micro
        ce_terms = [c for v in self.views for c in v.ce_log[-k:]]
        mtp_terms = [c for v in self.views for c in v.mtp_log[-k:]]
        aux_terms = [a for v in self.views for a in v.aux_log[-k:] + v.mtp_aux_log[-k:]]
        zero = torch.zeros((), dtype=torch.float64, device=device)
        ce = torch.stack(ce_terms).sum() if ce_terms else zero
        cp = self.dims.cp_context
        if cp is not None and self.has_last:  # the rows' sum, as without pipelining
            dist.all_reduce(ce, group=cp.group)
        aux = torch.stack(aux_terms).sum() / self.n_micro if aux_terms else zero
        mtp = torch.stack(mtp_terms).sum() / self.n_micro if mtp_terms else zero
        return ce, aux, mtp

    def sync_tied(self) -> None:
        """Sum the gradients of the embedding's copies (:func:`embed_stages`: the first stage;
        the last with tied weights or multi-token prediction; the stages whose layers read the
        input embeddings)."""
        if self.embed_group is None or self.model.embed is None:
            return
        weight = self.model.embed.weight
        if weight.grad is None:  # both ends must take part (a copy no loss reached: zeros)
            weight.grad = torch.zeros_like(weight)
        g = weight.grad
        local = g.to_local() if hasattr(g, "to_local") else g
        dist.all_reduce(local, group=self.embed_group)

    def sync_shared(self) -> None:
        """Sum the gradients of each shared layer's copies over the pipeline ranks that hold
        one (every use's contribution, as on one process)."""
        for label, group in self.shared_groups.items():
            grads = []
            for p in self.model.shared[label].parameters():
                if p.grad is None:  # every copy takes part (a use no loss reached: zeros)
                    p.grad = torch.zeros_like(p)
                g = p.grad
                grads.append(g.to_local() if hasattr(g, "to_local") else g)
            all_reduce_coalesced(grads, group, scale=1.0)

    def copies(self) -> dict[str, int]:
        """Parameter name -> the pipeline ranks holding a copy of it, where more than one:
        the tied embedding's and the shared layers' (what the gradient norm counts once)."""
        holders = len(self.embed_holders)
        out = {"embed.weight": holders} if holders > 1 else {}
        for label in (self.model.shared or {}):
            for name, _ in self.model.shared[label].named_parameters():
                out[f"shared.{label}.{name}"] = len(self.shared_holders[label])
        return out

    # ------------------------------------------------------------ forward only

    @torch.no_grad()
    def loss(self, ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None = None,
             labels_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean cross-entropy (and the aux loss sum) of the whole batch, stage after stage,
        on every pipeline rank."""
        group = self.dims.pp_mesh.get_group()
        pp = self.dims.pp
        self._attach_tp()
        x = None
        first_in, kwargs, rows = self._cut(ids_BT, doc_ids_BT, labels_BT)
        out = torch.zeros(2, dtype=torch.float64, device=self.dims.device)
        for s in range(self.n_stages):
            if s % pp != self.dims.pp_rank():
                continue
            view = self.views[self.stage_ids.index(s)]
            if s == 0:
                x = first_in
            else:
                x = recv_tensor(dist.get_global_rank(group, (s - 1) % pp), group, self.dims.device)
            view.aux_log.clear()
            view.loss_scale, view.aux_scale = 1.0, 0.0  # the main cross-entropy only
            x = view(x, **kwargs)
            out[1] += sum(view.aux_log) if view.aux_log else 0.0
            if s + 1 < self.n_stages:
                send_tensor(x, dist.get_global_rank(group, (s + 1) % pp), group)
        if self.has_last:
            if rows is None:
                labels = ids_BT if labels_BT is None else labels_BT
                if doc_ids_BT is not None:
                    labels = mask_doc_boundaries(labels, doc_ids_BT)
                n = (shift_labels(labels) != IGNORE_INDEX).sum()
            else:  # this rank's tokens' sum, over the cp group: the rows'
                n = rows.n_rows
                x = x.detach().clone()
                dist.all_reduce(x, group=self.dims.cp_context.group)
            out[0] = x.double() / n.clamp(min=1)
        dist.all_reduce(out, group=group)  # the loss from the last stage, aux from all
        return out[0], out[1]
