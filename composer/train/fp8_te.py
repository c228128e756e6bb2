"""FP8 training through NVIDIA transformer-engine (``--precision fp8 --fp8-backend te``).

The linear layers: every plain ``nn.Linear`` whose input and output widths are multiples of 16
(the FP8 GEMM's shape rule), the LM head excepted (as with torchao), becomes a ``te.Linear``
holding the same parameters under the same names (``weight``, ``bias``), in the master dtype
(fp32) and on the same device (meta while the model is built), so initialisation, checkpoints,
converters and the optimizer see exactly what a bf16 run has. FSDP2 gathers bf16 copies of the
fp32 masters (``MixedPrecisionPolicy``) and TE quantises them, and the activations, per GEMM.

The recipe (:func:`fp8_recipe`): current scaling (``Float8CurrentScaling``, HYBRID: E4M3
forward, E5M2 gradients), each tensor scaled by its own amax at the time it is cast: no amax
history, so nothing beyond the weights to checkpoint and nothing to agree on across ranks.
Where TE predates it (< 2.2), delayed scaling (``DelayedScaling``, HYBRID, amax history 16,
``max``), its amaxes reduced over the data-parallel ranks (``amax_reduction_group``) so every
replica scales alike. TE's own tensor-parallel and sequence-parallel machinery is not used: a
model with ``--tp > 1`` or LoRA adapters is refused (:func:`check_layout`).

No transformer-engine import at module level (on a machine without CUDA it installs as a shell
whose import raises): :func:`available` and the functions below import it when called.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from composer.config import ConfigError
from composer.kernels.linear import Linear

FP8_MULTIPLE = 16
"""FP8 GEMMs need both dimensions of each operand divisible by this."""


def _te() -> Any:
    import transformer_engine.pytorch as te

    return te


def available() -> bool:
    """Whether transformer-engine's PyTorch modules import here (any failure: no)."""
    try:
        _te()
    except Exception:  # noqa: BLE001 - a CPU-only install raises RuntimeError, others ImportError
        return False
    return True


def check_layout(tp: int, lora_rank: int) -> None:
    """What this backend does not support yet, as one line, before any work."""
    if tp > 1:
        raise ConfigError("--fp8-backend te with --tp > 1 is not built yet (te.Linear is not "
                          "split by composer's tensor-parallel plans); use --fp8-backend torchao")
    if lora_rank:
        raise ConfigError("--fp8-backend te with LoRA adapters is not built yet; use "
                          "--fp8-backend torchao")


def _keep(name: str, module: nn.Module) -> bool:
    return (type(module) in (nn.Linear, Linear) and "lm_head" not in name
            and module.in_features % FP8_MULTIPLE == 0
            and module.out_features % FP8_MULTIPLE == 0)


def swap_linears(model: nn.Module) -> list[str]:
    """Replace the eligible ``nn.Linear`` modules (module docstring) by ``te.Linear`` with the
    same parameters (the very tensors: a meta model stays on meta); returns their names."""
    te = _te()
    swapped = []
    for name, module in list(model.named_modules()):
        if not _keep(name, module):
            continue
        weight = module.weight
        new = te.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                        params_dtype=weight.dtype, device=weight.device)
        new.weight = weight  # the same Parameter objects: names, dtype, requires_grad kept
        if module.bias is not None:
            new.bias = module.bias
        parent, _, leaf = name.rpartition(".")
        model.get_submodule(parent).register_module(leaf, new)
        swapped.append(name)
    return swapped


def fp8_recipe() -> Any:
    """Current scaling where TE has it, else delayed scaling (module docstring)."""
    from transformer_engine.common import recipe

    if hasattr(recipe, "Float8CurrentScaling"):
        return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
    return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                 amax_compute_algo="max")


@contextmanager
def te_autocast(device: torch.device, group: Any = None) -> Iterator[None]:
    """bf16 autocast around TE's FP8 autocast with :func:`fp8_recipe`; ``group``: the
    data-parallel process group its delayed scaling reduces amaxes over (None: one process)."""
    te = _te()
    recipe = fp8_recipe()
    if hasattr(te, "autocast"):  # TE >= 2.8 renamed fp8_autocast
        fp8 = te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)
    else:
        fp8 = te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)
    with torch.autocast(device.type, dtype=torch.bfloat16), fp8:
        yield
