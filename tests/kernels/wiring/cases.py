"""The kernel-wiring cases and their worker: composer's own dispatch (the hooks a CUDA tensor
takes) with the real Triton kernels, against the torch path, forward and every gradient.

Each case is a function of its leaves (activations and parameters) through a composer hook or
block. The kernel path runs it in the test dtype (activations in that dtype, parameters fp32, as
under mixed precision) with :func:`composer.kernels.probe.on_gpu` saying yes; the reference is the
torch path (``on_gpu`` saying no) in fp64 on the same rounded values. ``err`` is the largest
``max|got - ref| / max|ref|`` over the outputs and the gradients of every leaf, against fixed
random upstream gradients of every output (final states included).

Modes (``COMPOSER_KERNEL_WIRING``):

- ``interpret`` (default): CPU tensors, the kernels under Triton's interpreter
  (:mod:`tests.kernels.wiring.shim`); fp32 within 1e-4 (the interpreter computes fp32 in
  numpy, so the kernel's own error is a few ulps per reduction over <= 96 terms, ~1e-6) and
  fp16 within 1e-2 (fp16 operands: 2^-11 each, through a few products and sums);
- ``cuda``: a real GPU (bench/gpu_check.sh), fp32 within 1e-2 (the kernels use TF32 operands,
  2^-11 each) and bf16 within 3e-2 (2^-8), the bounds of ``tests/gpu/parity.py``.

``python -m tests.kernels.wiring.cases OUT.json`` runs every case (the worker: a fresh process,
because the interpreter must be chosen before triton is imported); ``test_wiring.py`` reads the
results. Documents: every packed case has a boundary inside a chunk and one exactly on a chunk
edge (mamba_ssm: the wrapper's ``chunk_size``; fla: its fixed 64-step chunks, counted from
each document's start in its varlen batch).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

MODE = os.environ.get("COMPOSER_KERNEL_WIRING", "interpret")
DTYPES = {"interpret": ("float32", "float16"), "cuda": ("float32", "bfloat16")}[MODE]
TOL = {"interpret": {"float32": 1e-4, "float16": 1e-2},
       "cuda": {"float32": 1e-2, "bfloat16": 3e-2}}[MODE]
ACT, PARAM = "act", "param"
SSD = ("_chunk_cumsum_fwd_kernel", "_chunk_state_fwd_kernel", "_state_passing_fwd_kernel",
       "_chunk_scan_fwd_kernel", "_chunk_scan_bwd_dstates_kernel")
GATED_NORM = ("_layer_norm_fwd_1pass_kernel", "_layer_norm_bwd_kernel")
GDN = ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_fwd_kernel_o")
KDA = ("chunk_kda_fwd_kernel_inter_solve_fused", "chunk_gla_fwd_kernel_o")


@dataclass(frozen=True)
class Case:
    name: str
    kernels: tuple[str, ...]
    """Names that the launch log must show (forward and backward kernels)."""
    build: Callable[[], tuple[Callable[..., tuple[torch.Tensor, ...]], list, list[str]]]
    """``() -> (fn, leaves fp64, kinds)``: ``fn(*leaves)`` returns the outputs."""
    dtypes: tuple[str, ...] = DTYPES


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _docs(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """``doc_ids (B, T)`` from each row's document lengths."""
    rows = [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in
            lengths_per_row]
    return torch.stack(rows)


# ---------------------------------------------------------------- the Mamba-2 scan (mamba_ssm)

def _ssd(docs: list[list[int]] | None, T: int, init: bool, dt_limit=(0.0, float("inf")),
         chunk: int = 16):
    def build():
        from composer.kernels import mamba_scan
        b, H, P, G, N = 2, 2, 8, 1, 8  # two heads sharing one group of B/C
        g = _gen(0)
        x = torch.randn(b, T, H, P, generator=g, dtype=torch.float64)
        dt = torch.randn(b, T, H, generator=g, dtype=torch.float64) - 1.0
        B = torch.randn(b, T, G, N, generator=g, dtype=torch.float64)
        C = torch.randn(b, T, G, N, generator=g, dtype=torch.float64)
        A = -torch.rand(H, generator=g, dtype=torch.float64) - 0.5
        D = torch.randn(H, generator=g, dtype=torch.float64)
        dt_bias = 0.5 * torch.randn(H, generator=g, dtype=torch.float64)
        s0 = torch.randn(b, H, P, N, generator=g, dtype=torch.float64)
        doc_ids = None if docs is None else _docs(docs)

        def fn(x, dt, B, C, A, D, dt_bias, *s0):
            y, final = mamba_scan(x, dt, A, B, C, chunk, D_H=D, dt_bias_H=dt_bias,
                                  dt_softplus=True, dt_limit=dt_limit,
                                  initial_state_BHPN=s0[0] if s0 else None,
                                  return_final_state=True, doc_ids=_on(doc_ids, x))
            return y, final
        leaves = [x, dt, B, C, A, D, dt_bias] + ([s0] if init else [])
        kinds = [ACT] * 4 + [PARAM] * 3 + ([PARAM] if init else [])
        return fn, leaves, kinds
    return build


def _on(doc_ids: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if doc_ids is None else doc_ids.to(like.device)


# ---------------------------------------------------------------- the gated RMSNorm (mamba_ssm)

def _gated_norm(norm_before_gate: bool):
    def build():
        from torch.func import functional_call

        from composer.blocks.norm import GatedRMSNorm
        g = _gen(1)
        b, T, d, group = 2, 5, 32, 8
        norm = GatedRMSNorm(d, group, eps=1e-5, norm_before_gate=norm_before_gate)
        x = torch.randn(b, T, d, generator=g, dtype=torch.float64)
        z = torch.randn(b, T, d, generator=g, dtype=torch.float64)
        w = 1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)

        def fn(x, z, w):
            return (functional_call(norm.to(x.device), {"weight": w}, (x,), {"gate": z}),)
        return fn, [x, z, w], [ACT, ACT, PARAM]
    return build


# ---------------------------------------------------------------- the delta rules (fla)

def _delta(docs: list[list[int]] | None, T: int, init: bool, per_channel: bool, b: int = 2):
    def build():
        import torch.nn.functional as F

        from composer.kernels.gdn import gated_delta_rule
        G, H, K, V = 1, 2, 16, 16
        g = _gen(2)
        q = F.normalize(torch.randn(b, T, G, K, generator=g, dtype=torch.float64), dim=-1)
        k = F.normalize(torch.randn(b, T, G, K, generator=g, dtype=torch.float64), dim=-1)
        v = torch.randn(b, T, H, V, generator=g, dtype=torch.float64)
        decay_shape = (b, T, H, K) if per_channel else (b, T, H)
        ld = -0.3 * torch.rand(*decay_shape, generator=g, dtype=torch.float64)
        beta = torch.rand(b, T, H, generator=g, dtype=torch.float64)
        s0 = torch.randn(b, H, K, V, generator=g, dtype=torch.float64)
        doc_ids = None if docs is None else _docs(docs)

        def fn(q, k, v, ld, beta, *s0):
            return gated_delta_rule(q, k, v, ld, beta, 16,
                                    initial_state_BHKV=s0[0] if s0 else None,
                                    return_final_state=True, doc_ids=_on(doc_ids, v))
        leaves = [q, k, v, ld, beta] + ([s0] if init else [])
        return fn, leaves, [ACT, ACT, ACT, PARAM, ACT] + ([PARAM] if init else [])
    return build


# ---------------------------------------------------------------- whole mixers through their hooks

def _mixer(kind: str, docs: list[list[int]]):
    """A Mamba-2 or GatedDeltaNet mixer's forward with packed documents: every hook inside
    (scan, gated norm; the delta rule with the block's own q/k l2norm; the convolutions on the
    torch path, causal_conv1d being a CUDA extension), every parameter's gradient. fp32 only:
    a lower dtype is the hooks' cases' (a mixer in it would need autocast)."""
    def build():
        from torch.func import functional_call

        from composer.blocks.gdn import GatedDeltaNet, GDNConfig
        from composer.blocks.mamba2 import Mamba2Mixer, MambaConfig
        from composer.config import ModelConfig
        if kind == "M":
            cfg = ModelConfig(pattern="M", d_model=32, init_std=0.2, mamba=MambaConfig(
                n_heads=2, d_head=8, n_groups=1, d_state=8, d_conv=4, chunk_size=16))
            mixer = Mamba2Mixer(cfg)
        else:
            cfg = ModelConfig(pattern="G", d_model=32, init_std=0.2, gdn=GDNConfig(
                n_heads=2, n_kv_heads=1, d_head_k=16, d_head_v=16, chunk_size=16))
            mixer = GatedDeltaNet(cfg)
        mixer.reset_parameters(_gen(3))
        names = [n for n, _ in mixer.named_parameters()]
        params = [p.detach().double() for _, p in mixer.named_parameters()]
        doc_ids = _docs(docs)
        x = torch.randn(len(docs), doc_ids.shape[1], 32, generator=_gen(4), dtype=torch.float64)

        def fn(x, *ps):
            m = mixer.to(x.device)
            return (functional_call(m, dict(zip(names, ps, strict=True)), (x,),
                                    {"doc_ids": doc_ids.to(x.device)}),)
        return fn, [x, *params], [ACT] + [PARAM] * len(params)
    return build


ROWS_16 = [[10, 22, 16], [16, 30, 2]]
"""T 48 in chunks of 16: row 0 has a boundary inside chunk 0 (10) and one on the edge of chunks
1/2 (32); row 1 one on an edge (16) and one inside chunk 2 (46)."""
ROWS_64 = [[10, 64, 22], [64, 20, 12]]
"""T 96, fla's 64-step chunks per document: row 0's second document is exactly one chunk (its
end, 74, on a chunk edge), the first ends inside one; row 1's first document ends on the edge."""

CASES = [
    Case("ssd_docs_init", SSD, _ssd(ROWS_16, 48, init=True)),
    Case("ssd_partial_chunk_dt_limit", SSD, _ssd(None, 40, init=False, dt_limit=(0.05, 1.5))),
    Case("gated_norm", GATED_NORM, _gated_norm(False)),
    Case("gated_norm_before_gate", GATED_NORM, _gated_norm(True)),
    Case("gdn_docs_init", GDN, _delta(ROWS_64, 96, init=True, per_channel=False)),
    Case("gdn_two_chunks_init", GDN, _delta(None, 80, init=True, per_channel=False, b=1)),
    Case("kda_docs_init", KDA, _delta([[8, 64]], 72, init=True, per_channel=True, b=1)),
    Case("mamba2_mixer_docs", SSD + GATED_NORM, _mixer("M", ROWS_16), dtypes=DTYPES[:1]),
    Case("gdn_mixer_docs", GDN, _mixer("G", [[10, 64, 6]]), dtypes=DTYPES[:1]),
]
BROKEN = {"ssd_docs_init:dropped_seq_idx": ("ssd_docs_init", "float32")}
"""Deliberately mis-wired runs: the dispatch hands mamba_ssm no ``seq_idx`` (must fail)."""


def case_ids() -> list[str]:
    return [f"{c.name}:{d}" for c in CASES for d in c.dtypes]


# ---------------------------------------------------------------- the worker

def _run(case: Case, dtype_name: str, device: torch.device) -> dict:
    from composer.kernels import probe
    from tests.kernels.wiring import shim
    dtype = getattr(torch, dtype_name)
    fn, leaves, kinds = case.build()
    rounded = [t.to(dtype if k == ACT else torch.float32) for t, k in zip(leaves, kinds,
                                                                          strict=True)]
    real_rule = probe.on_gpu

    def forward_backward(xs: list[torch.Tensor], on_gpu) -> list[torch.Tensor]:
        probe.on_gpu = on_gpu
        try:
            xs = [t.detach().to(device).requires_grad_() for t in xs]
            outs = fn(*xs)
            gen = _gen(5)
            loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)
                        .to(device)).sum() for o in outs)
            loss.backward()
            return [o.detach() for o in outs] + [t.grad for t in xs]
        finally:
            probe.on_gpu = real_rule

    shim.clear()
    t0 = time.perf_counter()
    got = forward_backward(rounded, (lambda t: True) if MODE == "interpret" else real_rule)
    seconds = time.perf_counter() - t0
    launched = sorted(set(shim.LAUNCHES))
    shim.clear()
    ref = forward_backward([t.double() for t in rounded], lambda t: False)
    errs = [float("inf") if a is None else
            ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            for a, b in zip(got, ref, strict=True)]
    return {"err": max(errs), "errs": errs, "launched": launched,
            "torch_path_launched": sorted(set(shim.LAUNCHES)), "seconds": round(seconds, 2)}


def _broken(name: str) -> dict:
    """``name``'s run with the deliberate mis-wiring of :data:`BROKEN`."""
    from composer.kernels import scan
    case_name, dtype_name = BROKEN[name]
    case = next(c for c in CASES if c.name == case_name)
    seq_idx = scan.seq_idx
    scan.seq_idx = lambda doc_ids: None  # the kernel call then gets seq_idx=None
    try:
        return _run(case, dtype_name, DEVICE)
    finally:
        scan.seq_idx = seq_idx


DEVICE = torch.device("cuda" if MODE == "cuda" else "cpu")


def main(out_path: str) -> None:
    from tests.kernels.wiring import shim
    if MODE == "interpret":
        shim.activate()
    else:
        shim.compiled()
        torch.backends.cuda.matmul.allow_tf32 = False  # the torch reference is fp64 anyway
    results = {}
    jobs = [(cid, None) for cid in case_ids()] + [(name, True) for name in BROKEN]
    for cid, broken in jobs:
        try:
            if broken:
                results[cid] = _broken(cid)
            else:
                name, dtype_name = cid.split(":")
                results[cid] = _run(next(c for c in CASES if c.name == name), dtype_name,
                                    DEVICE)
        except Exception as e:  # one case's failure is its test's, not the others'
            results[cid] = {"error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()}
        print(cid, json.dumps({k: v for k, v in results[cid].items() if k != "traceback"}),
              flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
