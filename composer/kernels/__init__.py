"""Optional GPU kernels behind the torch blocks, chosen per call by the tensors' device
(docs/kernels.md).

| hook (block)                  | kernel (package)                            | torch path        |
|-------------------------------|---------------------------------------------|-------------------|
| ``mamba_scan`` (Mamba-2 scan) | ``mamba_chunk_scan_combined`` (mamba_ssm)   | ``kernels.ssd``   |
| ``conv_silu`` (Mamba-2 conv)  | ``causal_conv1d_fn`` (causal_conv1d)        | the conv module   |
| ``sdpa_context`` (attention)  | SDPA flash / cuDNN / efficient (torch)      | SDPA's own choice |
| ``doc_sdpa`` (packed docs)    | FlexAttention block mask (torch, ``flex``)  | SDPA + bool mask  |
| ``flex_attend`` (masked attn) | FlexAttention, compiled once (``flex``)     | dense bool masks  |
| ``gated_delta_rule`` (GDN)    | ``chunk_gated_delta_rule`` (fla)            | ``kernels.gdn``   |
| ``gated_delta_rule`` (KDA)    | ``chunk_kda`` (fla, ``fla_kda``)            | ``kernels.gdn``   |
| ``GatedRMSNorm`` (Mamba-2)    | ``rmsnorm_fn`` (mamba_ssm, ``mamba_gated_norm``) | the block's  |
| ``linear`` (projections, CPU) | oneDNN in torch (``onednn``; CPU tensors)   | ``F.linear``      |

Rules: nothing optional is imported when ``composer`` is; a CPU tensor always takes the torch path
(or ``onednn``, part of torch) and never triggers an import; a kernel is used only when its import
succeeds (any ``Exception`` means "absent") and ``COMPOSER_DISABLE_KERNELS`` (names or ``all``)
does not name it. Each hook keeps the block's parameters and keys; each wrapper translates the
kernel's argument conventions and is tested against the torch path with stand-in modules
(``tests/kernels``) and on a GPU by ``bench/gpu_check.py``. The device rule lives in one function,
``probe.on_gpu``.

Packed documents (``doc_ids``, :mod:`composer.kernels.packing`): ``mamba_scan`` and ``conv_silu``
take ``doc_ids`` and hand the kernels ``seq_idx``; their torch paths isolate the documents
themselves.

``compile_layers`` (``torch.compile`` of every layer, any device) is the one opt-in here.
"""

from composer.kernels.compile import compile_layers
from composer.kernels.conv import conv1d_silu_kernel, conv1d_silu_torch, conv_silu, select_conv
from composer.kernels.probe import (
    ENV_DISABLE,
    KERNELS,
    available,
    reset,
    why_unavailable,
)
from composer.kernels.scan import mamba_scan, select_scan, ssd_scan_kernel, ssd_scan_torch
from composer.kernels.sdpa import doc_sdpa, sdpa_backends, sdpa_context

__all__ = [
    "ENV_DISABLE",
    "KERNELS",
    "available",
    "compile_layers",
    "conv1d_silu_kernel",
    "conv1d_silu_torch",
    "conv_silu",
    "doc_sdpa",
    "mamba_scan",
    "reset",
    "sdpa_backends",
    "sdpa_context",
    "select_conv",
    "select_scan",
    "ssd_scan_kernel",
    "ssd_scan_torch",
    "why_unavailable",
]
