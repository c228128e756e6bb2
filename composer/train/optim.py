"""Optimizers: AdamW, or Muon for the hidden weight matrices with AdamW for the rest.

Weight decay applies to matrices and embeddings, never to 1-D parameters (norm weights, biases,
Mamba's ``A_log``, ``D`` and ``dt_bias``). ``muon``: every 2-D weight other than the embedding
and the LM head is updated by :class:`ShardedMuon` (``torch.optim.Muon``'s update with the
learning rate scaled to match AdamW's RMS, Liu et al. 2025, "Muon is Scalable for LLM
Training"); 3-D expert stacks, convolutions, 1-D parameters, the embedding and the head take
AdamW. Both read the same scheduled learning rate. AdamW is torch's fused implementation
(:func:`_fused_ok`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

OUTER = ("embed.weight", "lm_head.weight")


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz orthogonalisation always sees the whole matrix:
    a tensor- or FSDP-sharded (DTensor) update is gathered, orthogonalised and cut back to this
    rank's shard, so every layout takes the single-device step. The momentum stays sharded.
    (Each rank repeats the orthogonalisation of the matrices it holds a piece of; Megatron and
    torchtitan spread that work, which is left for later.)"""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - the base class documents it
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                update = p.grad.lerp(buf, mom) if group["nesterov"] else buf
                whole = update.full_tensor() if isinstance(update, DTensor) else update
                ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"],
                                                    group["ns_steps"], group["eps"])
                if isinstance(p, DTensor):
                    mesh = p.device_mesh
                    ortho = DTensor.from_local(ortho, mesh, [Replicate()] * mesh.ndim,
                                               run_check=False).redistribute(mesh, p.placements)
                p.mul_(1 - lr * wd)
                p.add_(ortho.to(p.dtype), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


class Optimizers:
    """One or two optimizers stepped together (``opts`` is what DCP saves)."""

    def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
        self.opts = opts

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.opts for g in o.param_groups]

    @property
    def has_state(self) -> bool:
        return any(o.state for o in self.opts)

    def set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=True)


def _fused_ok(params: list[nn.Parameter]) -> bool:
    """Whether AdamW takes torch's fused implementation (one kernel per device and dtype for the
    whole step; 3.6x the default for-loop on a CPU core, bench/RESULTS.md; the same update up to
    rounding): parameters on a CPU or CUDA, all plain tensors or all DTensors (FSDP2, tensor
    parallelism), so that every layout of a model takes the same implementation."""
    kinds = {isinstance(p, DTensor) for p in params}
    return len(kinds) == 1 and all(p.device.type in ("cpu", "cuda") for p in params)


def build_optimizers(model: nn.Module, kind: str, lr: float, weight_decay: float,
                     betas: tuple[float, float], eps: float) -> Optimizers:
    decay, flat, hidden = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2:
            flat.append(p)
        elif kind == "muon" and p.ndim == 2 and name not in OUTER:
            hidden.append(p)
        else:
            decay.append(p)
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": flat, "weight_decay": 0.0}) if g["params"]]
    if kind not in ("adamw", "muon"):
        raise ValueError(f"--optimizer must be adamw or muon; got {kind!r}")
    if not groups and not hidden:
        raise ValueError("no trainable parameters: every parameter has requires_grad=False")
    adam_params = [p for g in groups for p in g["params"]]
    opts: list[torch.optim.Optimizer] = []
    if groups:  # empty when Muon takes every trainable matrix (e.g. LoRA's A and B)
        opts.append(torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps,
                                      fused=_fused_ok(adam_params) or None))
    if kind == "muon" and hidden:
        opts.append(ShardedMuon(hidden, lr=lr, weight_decay=weight_decay,
                                adjust_lr_fn="match_rms_adamw"))
    return Optimizers(opts)
