"""Optional ``torch.compile`` of the residual layers (off by default).

``compile_layers(model)`` calls ``nn.Module.compile`` on every layer in place, so parameters and
state-dict keys are unchanged (no ``_orig_mod.`` prefix), and layers of the same structure share
one compiled graph. The embedding, the final norm and the chunked LM head + loss stay eager: the
head is a few large matmuls that compiling does not speed up.

Measured by ``bench/compile_tradeoff.py`` on the CPU of ``bench/RESULTS.md`` (fp32, 2 cores,
train step 4 x 256, ~50M params, cold inductor cache): 16-19 s of compilation for 0-8% faster
steps (Llama 1.08x, Mamba2 1.07x, Nemotron-H 1.02x in one run; Llama 0.99x in another). The
step is matmul-bound on a CPU, so fusing the elementwise work saves little; compile when a run is
long enough to repay the start-up (hundreds of steps here; on a GPU the balance differs).
Inductor needs a C++ compiler on a CPU.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def compile_layers(model: nn.Module, **options: Any) -> nn.Module:
    """``torch.compile`` each of ``model.layers`` in place (``options`` go to ``torch.compile``,
    e.g. ``mode="max-autotune"``); returns ``model``. Compilation happens at the first call."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError("compile_layers expects a HybridModel (a model with a `layers` ModuleDict)")
    every = model.all_layers() if hasattr(model, "all_layers") else layers.values()
    for layer in every:  # a HybridModel's MTP depths' layers too
        layer.compile(**options)
    return model
