"""The frozen reference model of preference and reinforcement objectives (DPO's ``logp_ref``,
GRPO's KL term): the run's STARTING weights, scored with the same math as the policy.

- Full fine-tuning (and a run that starts from a PEFT adapter, ``--adapter``): a copy, rebuilt
  from ``recipe.origin`` (what the run was first trained from: a portable checkpoint, a Hugging
  Face folder, or a preset, whose seeded init with ``--seed`` is the policy's starting point)
  through :func:`composer.run.build_sharded` with the policy's config, layout (tp, dp / FSDP, ep
  shards), master dtype and float8 transform; ``--adapter``'s tensors loaded onto it. Its
  parameters do not require grad and it stays in eval mode; a resumed run rebuilds it the same
  way, so nothing of it is saved. Memory: one more set of weights (no gradients, no optimizer
  state).
- New LoRA adapters (``--lora-rank`` without ``--adapter``): no copy. The adapters start at
  ``B = 0`` and the base is frozen, so the base alone *is* the starting model: the reference is
  the policy itself inside :func:`composer.lora.disabled`, where every adapter adds nothing.

:meth:`Reference.token_logprobs` runs under ``no_grad`` in eval mode (the policy's own mode is
restored after), under the run's autocast, and frees the FSDP roots' gathered weights after.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from composer.blocks.model import HybridModel
from composer.config import ConfigError

if TYPE_CHECKING:
    from composer.train.loop import Run


class Reference:
    """Log-probabilities under the starting weights (module docstring)."""

    def __init__(self, model: HybridModel, copies: bool, precision: str) -> None:
        self.model, self.precision = model, precision
        self.copies = copies
        """Whether the reference is a copy of the weights (False: the policy, adapters off)."""

    def _context(self) -> contextlib.AbstractContextManager:
        if self.copies:
            return contextlib.nullcontext()
        from composer.lora import disabled

        return disabled(self.model)

    @torch.no_grad()
    def token_logprobs(self, ids: torch.Tensor, targets: torch.Tensor,
                       **kw: Any) -> torch.Tensor:
        """``(B, T)`` log-probabilities of ``targets`` (``HybridModel.token_logprobs``'s
        arguments), 0 where a target is ignored."""
        from composer.parallel.data import reshard

        was_training = self.model.training
        self.model.eval()
        try:
            with self._context(), _autocast(self.precision, ids.device):
                logp = self.model.token_logprobs(ids, targets, **kw).logp
        finally:
            self.model.train(was_training)
        reshard(self.model)  # a forward without backward leaves the FSDP roots gathered
        return logp


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision in ("bf16", "fp8"):  # as composer.train.lm.autocast
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_reference(run: Run) -> Reference:
    """The run's reference: the policy with its adapters off under new LoRA adapters, else a
    frozen copy of the starting weights (module docstring)."""
    recipe = run.recipe
    if recipe.lora_rank and recipe.adapter is None:
        return Reference(run.model, copies=False, precision=run.precision)
    return Reference(build_copy(run), copies=True, precision=run.precision)


def build_copy(run: Run) -> HybridModel:
    """The starting weights, sharded like the policy, frozen, in eval mode."""
    import composer.run
    from composer.train.adapters import load_adapter_tensors, run_adapters
    from composer.train.engine import _model_config
    from composer.train.precision import model_transform

    recipe = run.recipe
    origin = dataclasses.replace(recipe, model=recipe.origin or recipe.model)
    cfg, tensors = _model_config(origin)
    if cfg.canonical() != run.model.config.canonical():
        if tensors is not None:
            tensors.close()
        raise ConfigError(f"the reference {recipe.origin!r} does not build the run's model")
    lora, start = run_adapters(recipe, None)  # --adapter: the adapter the run started from
    dtype = next(p for p in run.model.parameters() if p.is_floating_point()).dtype
    # the policy was built from the global RNG's seed; building again must not move it
    devices = [run.dims.device] if run.dims.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            model = composer.run.build_sharded(
                cfg, run.dims, seed=recipe.seed, tensors=tensors, dtype=dtype,
                transform=model_transform(run.precision, recipe.freeze, run.fp8_backend),
                lora=lora)
    finally:
        if tensors is not None:
            tensors.close()
    if start is not None:
        load_adapter_tensors(model, start)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
