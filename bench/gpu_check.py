"""GPU check of composer.kernels on one CUDA device: parity with the torch path, then MFU.

    python bench/gpu_check.py [--budget 540] [--phases device,parity,mfu,mfu-torch] [--json]
                              [--results bench/RESULTS.md | --no-results] [--dry-run]

Each phase runs in its own child process under its own timeout, inside ``--budget`` seconds:

parity     kernel vs torch path, forward and backward, fp32 and bf16, each measured against an
           fp64 torch reference on the same (rounded) inputs: ``err = max|out - ref| / max|ref|``,
           the max over the output and every input gradient. Rows: the SSD scan (mamba_ssm),
           the causal conv + SiLU (causal_conv1d), SDPA per backend (flash, cuDNN, efficient,
           math, and the hook's choice), TE linear (bf16 and FP8, when TE imports), and whole
           blocks (Mamba-2 mixer, attention) through their hooks. Tolerances on the kernel's
           error: fp32 1e-2 (the Triton kernels use TF32 operands), bf16 3e-2; FP8 1.5e-1.
           ``ms`` is one forward + backward. A block row says "not wired" when the block does
           not call its composer.kernels hook.
mfu        bf16 training steps (forward + backward + fused AdamW, eager) of a 0.93B hybrid,
           Nemotron-H style ``(M-M-M*-)x4`` at d_model 2048 (Mamba-2: 64 heads x 64, 8 groups,
           state 128, chunk 128; attention: 16 heads, 4 kv heads, width 128, no RoPE; squared-ReLU
           MLP 8192; vocabulary 32000, untied), batch 2 x 4096, kernels on: 3 warm-up steps,
           then up to 20 timed;
mfu-torch  the same with ``COMPOSER_DISABLE_KERNELS=all`` (attention then runs SDPA's math
           backend too); ``--phases ...,mfu-no-mamba`` adds a run without the Mamba kernels only.
           MFU = ``model_stats(model, seq).flops_per_token`` (3 x forward; attention counted
           without the causal discount, as Megatron and PaLM do) x tokens/s / 989 TFLOP/s, the
           H200 SXM dense bf16 peak of NVIDIA's spec sheet (a plain 8192^3 bf16 matmul reaches
           about 790 there).

device     the command line end to end on the GPU (``--device cuda``): ``train --steps 0`` on the
           GPU and on the CPU, exported, must give bit-identical weights (the init does not
           depend on the device); 3 fp32 training steps of ``nemotron-3-nano-debug`` on the GPU
           against the CPU (relative loss difference); the same under ``torchrun`` with one NCCL
           rank; ``eval --device cuda`` of the trained run folder.

Without a CUDA device it says so and exits 0. ``--dry-run`` runs every phase on the CPU with
tiny shapes (kernel rows then read "n/a"), to check the script itself; it writes no results.
The tables are printed and appended to ``bench/RESULTS.md`` with the date and command.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing it

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from composer import kernels  # noqa: E402
from composer.kernels import conv as kconv  # noqa: E402
from composer.kernels import probe  # noqa: E402
from composer.kernels import scan as kscan  # noqa: E402
from composer.kernels import sdpa as ksdpa  # noqa: E402

PEAK_BF16 = 989e12
TOL = {torch.float32: 1e-2, torch.bfloat16: 3e-2, "fp8": 1.5e-1}
CAPS = {"device": 120, "parity": 200, "mfu": 180, "mfu-torch": 160, "mfu-no-mamba": 160}
MFU_RUNS = {"mfu": ("on", None), "mfu-torch": ("off (all)", "all"),
            "mfu-no-mamba": ("SDPA only", "mamba_ssm,causal_conv1d")}
"""MFU phase -> (table label, COMPOSER_DISABLE_KERNELS)."""
INF = float("inf")


# ---------------------------------------------------------------- measuring


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def relerr(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def fwd_bwd(fn: Callable, leaves: list[torch.Tensor], dtype: torch.dtype,
            seed: int = 7) -> tuple[list[torch.Tensor], float]:
    """``fn(*leaves)`` forward + backward against a fixed random upstream gradient, on copies of
    ``leaves`` cast to ``dtype``; returns ``[out, *grads]`` and the time of one call (ms) after
    one untimed call (Triton compiles and autotunes on its first)."""
    xs = [t.detach().to(dtype).requires_grad_() for t in leaves]
    out = fn(*xs)
    g = torch.Generator(device=out.device).manual_seed(seed)
    gy = torch.randn(out.shape, generator=g, device=out.device).to(out.dtype)
    out.backward(gy)
    for t in xs:
        t.grad = None
    dev = out.device.type
    sync(dev)
    t0 = time.perf_counter()
    out = fn(*xs)
    out.backward(gy)
    sync(dev)
    ms = 1e3 * (time.perf_counter() - t0)
    return [out.detach()] + [t.grad for t in xs], ms


def compare(got: list[torch.Tensor | None], ref: list[torch.Tensor | None]) -> float:
    """The largest :func:`relerr` over outputs and gradients (a missing gradient is infinite)."""
    return max(INF if a is None else relerr(a, b)
               for a, b in zip(got, ref, strict=True) if b is not None)


def row(name: str, dtype, path: str, err: float | None, ms: float | None,
        tol: float | None, note: str = "") -> dict:
    ok = None if err is None or tol is None else err <= tol
    return dict(check=name, dtype=str(dtype).replace("torch.", ""), path=path, err=err, ms=ms,
                tol=tol, ok=ok, note=note)


def paths(name: str, dtype, leaves: list, ref: list, torch_fn: Callable,
          kernel_fn: Callable | None, kernel: str, why: str | None) -> list[dict]:
    """Rows for the torch path and, when available, the kernel, both against ``ref``."""
    got, ms = fwd_bwd(torch_fn, leaves, dtype)
    rows = [row(name, dtype, "torch", compare(got, ref), ms, None)]
    if kernel_fn is None:
        rows.append(row(name, dtype, kernel, None, None, TOL[dtype], f"n/a: {why}"))
        return rows
    try:
        got, ms = fwd_bwd(kernel_fn, leaves, dtype)
        rows.append(row(name, dtype, kernel, compare(got, ref), ms, TOL[dtype]))
    except Exception as e:  # report and go on: one broken kernel must not hide the others
        rows.append({**row(name, dtype, kernel, None, None, TOL[dtype], f"error: {e!s:.80}"),
                     "ok": False})
    return rows


# ---------------------------------------------------------------- parity


def shapes(dry: bool) -> dict:
    if dry:
        return dict(b=1, T=50, H=4, P=8, G=2, N=8, L=16, heads=4, kv=2, Tq=32, d=32)
    return dict(b=2, T=2000, H=64, P=64, G=8, N=128, L=128, heads=16, kv=4, Tq=2048,
                d=128)


def check_scan(dev: str, s: dict, dtypes: list) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(0)
    b, T, H, P, G, N = s["b"], s["T"], s["H"], s["P"], s["G"], s["N"]

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev)

    A = -torch.exp(torch.rand(H, generator=g, device=dev) * math.log(16))
    leaves = [r(b, T, H, P), r(b, T, H) - 2, r(b, T, G, N), r(b, T, G, N), r(H), 0.5 * r(H)]
    kw = dict(dt_softplus=True, dt_limit=(1e-3, INF))

    def make(fn: Callable) -> Callable:
        return lambda x, dt, B, C, D, bias: fn(x, dt, A.to(torch.promote_types(
            x.dtype, torch.float32)), B, C, s["L"], D_H=D, dt_bias_H=bias, **kw)

    ok = probe.on_gpu(leaves[0]) and probe.available("mamba_ssm")
    rows = []
    for dtype in dtypes:
        rounded = [t.to(dtype) for t in leaves]
        ref, _ = fwd_bwd(make(kscan.ssd_scan_torch), rounded, torch.float64)
        rows += paths("SSD scan", dtype, rounded, ref, make(kscan.ssd_scan_torch),
                      make(kscan.ssd_scan_kernel) if ok else None, "mamba_ssm",
                      probe.why_unavailable("mamba_ssm") or "CPU tensor")
    return rows


def check_conv(dev: str, s: dict, dtypes: list) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(1)
    C = s["H"] * s["P"] + 2 * s["G"] * s["N"]
    E = s["H"] * s["P"]
    wide = torch.randn(s["b"], s["T"], E + C + s["H"], generator=g, device=dev)
    weight = 0.5 * torch.randn(C, 1, 4, generator=g, device=dev)
    bias = 0.1 * torch.randn(C, generator=g, device=dev)
    ok = probe.on_gpu(wide) and probe.available("causal_conv1d")

    def make(fn: Callable) -> Callable:  # the mixer's input: a slice of in_proj's output
        return lambda w, wt, bs: fn(w[..., E:E + C], wt, bs)

    rows = []
    for dtype in dtypes:
        rounded = [t.to(dtype) for t in (wide, weight, bias)]
        ref, _ = fwd_bwd(make(kconv.conv1d_silu_torch), rounded, torch.float64)
        rows += paths("causal conv + SiLU", dtype, rounded, ref, make(kconv.conv1d_silu_torch),
                      make(kconv.conv1d_silu_kernel) if ok else None, "causal_conv1d",
                      probe.why_unavailable("causal_conv1d") or "CPU tensor")
    return rows


def check_sdpa(dev: str, s: dict, dtypes: list) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(2)
    q = torch.randn(s["b"], s["heads"], s["Tq"], s["d"], generator=g, device=dev)
    k, v = (torch.randn(s["b"], s["kv"], s["Tq"], s["d"], generator=g, device=dev)
            for _ in range(2))

    def attn(ctx: Callable) -> Callable:
        def fn(q, k, v):
            with ctx(q):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return fn

    rows = []
    for dtype in dtypes:
        rounded = [t.to(dtype) for t in (q, k, v)]
        ref, _ = fwd_bwd(attn(lambda q: sdpa_kernel([SDPBackend.MATH])), rounded, torch.float64)
        named = [(b.name.lower(), lambda q, b=b: sdpa_kernel([b])) for b in ksdpa.GPU_ORDER]
        for name, ctx in named + [("hook", kernels.sdpa_context)]:
            try:
                got, ms = fwd_bwd(attn(ctx), rounded, dtype)
                rows.append(row("SDPA causal GQA", dtype, name, compare(got, ref), ms, TOL[dtype]))
            except Exception as e:
                rows.append(row("SDPA causal GQA", dtype, name, None, None, None,
                                f"unsupported: {e!s:.60}"))
    return rows


def check_te(dev: str, s: dict) -> list[dict]:
    import torch.nn as nn

    if not (dev == "cuda" and probe.available("transformer_engine")):
        why = probe.why_unavailable("transformer_engine") or "CPU tensor"
        return [row("TE linear", torch.bfloat16, "transformer_engine", None, None, None,
                    f"n/a: {why}")]
    te = probe.module("transformer_engine")
    linear = nn.Linear(2048, 8192, bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(8192, 2048, device=dev).bfloat16()
    # out and dx are compared; the weight gradient lands on linear.weight in both paths
    ref, _ = fwd_bwd(lambda x: F.linear(x, linear.weight.double()), [x], torch.float64)
    rows = paths("TE linear 2048->8192", torch.bfloat16, [x], ref,
                 lambda x: F.linear(x, linear.weight), lambda x: kernels.te_linear(x, linear),
                 "transformer_engine", None)
    autocast = getattr(te, "fp8_autocast", None) or getattr(te, "autocast", None)
    try:
        def fp8(x):
            with autocast(enabled=True):
                return kernels.te_linear(x, linear)
        got, ms = fwd_bwd(fp8, [x], torch.bfloat16)
        rows.append(row("TE linear 2048->8192", "fp8", "transformer_engine", compare(got, ref),
                        ms, TOL["fp8"]))
    except Exception as e:
        rows.append(row("TE linear 2048->8192", "fp8", "transformer_engine", None, None, None,
                        f"error: {e!s:.80}"))
    return rows


# ---------------------------------------------------------------- blocks and the model


def hybrid_config(dry: bool):
    """0.93B parameters: Nemotron-H's block settings at d_model 2048, vocabulary 32000."""
    from composer.config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig

    d, heads, kv, d_ff, m_heads, n_state = (64, 4, 2, 128, 4, 16) if dry else \
        (2048, 16, 4, 8192, 64, 128)
    return ModelConfig(
        pattern="(M-M-M*-)x1" if dry else "(M-M-M*-)x4", d_model=d,
        vocab_size=512 if dry else 32000, tie_embeddings=False, norm_eps=1e-5,
        attention=AttentionConfig(n_heads=heads, n_kv_heads=kv, d_head=d // heads * 2 if dry
                                  else 128, position="none"),
        mamba=MambaConfig(n_heads=m_heads, d_head=32 if dry else 64, n_groups=2 if dry else 8,
                          d_state=n_state, d_conv=4, chunk_size=16 if dry else 128,
                          dt_limit=(1e-3, INF)),
        mlp=MLPConfig(d_ff=d_ff, activation="relu2"), moe=None)


class count_dispatch:
    """Counts the calls that reach each kernel wrapper (they are looked up at call time)."""

    def __enter__(self) -> dict[str, int]:
        self.counts = {"mamba_ssm": 0, "causal_conv1d": 0, "sdpa on GPU": 0}
        self.saved = (kscan.ssd_scan_kernel, kconv.conv1d_silu_kernel, ksdpa.sdpa_backends)

        def counted(key: str, fn: Callable, hit: Callable = lambda r: True) -> Callable:
            def wrapper(*a, **kw):
                out = fn(*a, **kw)
                self.counts[key] += bool(hit(out))
                return out
            return wrapper

        kscan.ssd_scan_kernel = counted("mamba_ssm", self.saved[0])
        kconv.conv1d_silu_kernel = counted("causal_conv1d", self.saved[1])
        ksdpa.sdpa_backends = counted("sdpa on GPU", self.saved[2], lambda r: r is not None)
        return self.counts

    def __exit__(self, *exc) -> None:
        kscan.ssd_scan_kernel, kconv.conv1d_silu_kernel, ksdpa.sdpa_backends = self.saved


def set_kernels(disable: str | None) -> None:
    if disable is None:
        os.environ.pop(probe.ENV_DISABLE, None)
    else:
        os.environ[probe.ENV_DISABLE] = disable
    probe.reset()


def block_run(block, x: torch.Tensor, gy: torch.Tensor) -> tuple[list, float]:
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    sync(x.device.type)
    t0 = time.perf_counter()
    out = block(x)
    out.backward(gy.to(out.dtype))
    sync(x.device.type)
    ms = 1e3 * (time.perf_counter() - t0)
    return [out.detach(), x.grad] + [p.grad for p in block.parameters()], ms


def cast_block(block, dtype: torch.dtype):
    block = copy.deepcopy(block)
    keep = set(getattr(block, "keep_fp32", ()))
    for name, p in block.named_parameters():
        p.data = p.data.to(torch.float32 if name in keep else dtype)
    return block


def check_blocks(dev: str, dry: bool, dtypes: list) -> list[dict]:
    from composer.blocks.attention import Attention
    from composer.blocks.mamba2 import Mamba2Mixer

    cfg = hybrid_config(dry)
    rows = []
    for name, cls, key in (("Mamba-2 mixer", Mamba2Mixer, "mamba_ssm"),
                           ("attention block", Attention, "sdpa on GPU")):
        block = cls(cfg).to(dev)
        block.reset_parameters(torch.Generator(device=dev).manual_seed(3))
        g = torch.Generator(device=dev).manual_seed(4)
        T = 64 if dry else 2048
        x = torch.randn(2, T, cfg.d_model, generator=g, device=dev)
        gy = torch.randn(2, T, cfg.d_model, generator=g, device=dev)
        for dtype in dtypes:
            blk = cast_block(block, dtype)
            ref, _ = block_run(cast_block(blk, torch.float64), x.to(dtype).double(), gy)
            for label, disable in (("torch", "all"), ("kernels", None)):
                set_kernels(disable)
                block_run(blk, x.to(dtype), gy)  # warm-up (Triton compiles, autotunes)
                with count_dispatch() as counts:
                    got, ms = block_run(blk, x.to(dtype), gy)
                note, tol = "", TOL[dtype] if label == "kernels" else None
                if label == "kernels" and dev != "cuda":
                    note, tol = "CPU: the torch path by design", None
                elif label == "kernels" and not counts[key]:
                    note, tol = f"not wired: no {key} dispatch (see composer.kernels)", None
                rows.append(row(name, dtype, label, compare(got, ref), ms, tol, note))
    set_kernels(None)
    return rows


def run_parity(dev: str, dry: bool) -> dict:
    s = shapes(dry)
    dtypes = [torch.float32] if dry else [torch.float32, torch.bfloat16]
    env = {name: probe.why_unavailable(name) or "available" for name in probe.KERNELS}
    checks = [("SSD scan", lambda: check_scan(dev, s, dtypes)),
              ("causal conv + SiLU", lambda: check_conv(dev, s, dtypes)),
              ("SDPA causal GQA", lambda: check_sdpa(dev, s, dtypes)),
              ("TE linear", lambda: check_te(dev, s)),
              ("blocks", lambda: check_blocks(dev, dry, dtypes))]
    rows = []
    for name, check in checks:
        try:
            rows += check()
        except Exception as e:  # one failing check (OOM, a kernel crash) must not hide the rest
            rows.append(row(name, "-", "-", None, None, None, f"check failed: {e!r:.90}"))
        if dev == "cuda":
            torch.cuda.empty_cache()
    return dict(rows=rows, kernels=env)


def run_mfu(dev: str, dry: bool, seconds: float) -> dict:
    from composer import build_model, model_stats

    stop = time.monotonic() + seconds - 15
    cfg = hybrid_config(dry)
    batch, seq = (1, 64) if dry else (2, 4096)
    model = build_model(cfg, device=dev, dtype=torch.float32 if dry else torch.bfloat16)
    stats = model_stats(model, seq_len=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=dev == "cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g, device=dev)

    def step() -> float:
        loss = model(ids, ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # syncs

    t0 = time.perf_counter()
    with count_dispatch() as counts:
        losses = [step()]
    first_s = time.perf_counter() - t0
    losses += [step() for _ in range(2)]
    times = []
    while len(times) < (2 if dry else 20) and time.monotonic() < stop:
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    step_s = sum(times) / len(times)
    tok_s = batch * seq / step_s
    flops = stats.flops_per_token * tok_s
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None
    return dict(params=stats.n_params, flops_per_token=stats.flops_per_token, batch=batch,
                seq=seq, steps=len(times), step_ms=1e3 * step_s, tokens_per_s=tok_s,
                tflops=flops / 1e12, mfu=flops / PEAK_BF16, peak_gib=peak, first_step_s=first_s,
                loss_first=losses[0], loss_last=losses[-1], dispatch=counts)


# ---------------------------------------------------------------- orchestration and output


def run_device(dev: str, dry: bool) -> dict:
    """The CLI on ``dev`` against the CPU (see the module docstring, ``device``)."""
    import numpy as np

    from composer.testing import read_all

    def cli(*args: str, torchrun: bool = False) -> str:
        head = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", "1"] if torchrun else [sys.executable])
        proc = subprocess.run([*head, "-m", "composer", *args], capture_output=True, text=True,
                              cwd=tmp, timeout=100)
        if proc.returncode:
            raise RuntimeError(f"composer {' '.join(args)}: {proc.stderr.strip()[-300:]}")
        return proc.stdout

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "t.npy", np.random.default_rng(0).integers(0, 512, (8, 32)))
        for where in dict.fromkeys(("cpu", dev)):
            cli("train", "nemotron-3-nano-debug", "--steps", "0", "--seed", "3", "--save",
                f"init-{where}", "--device", where)
            cli("export", f"init-{where}", f"out-{where}")
        a, b = read_all(Path(tmp) / "out-cpu"), read_all(Path(tmp) / f"out-{dev}")
        out["init_identical"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        train = ["train", "nemotron-3-nano-debug", "--tokens", "t.npy", "--steps", "3",
                 "--batch-size", "4", "--json"]
        cpu = json.loads(cli(*train, "--device", "cpu"))["losses"]
        gpu = json.loads(cli(*train, "--device", dev, "--save", "run"))["losses"]
        one = json.loads(cli(*train, "--device", dev, torchrun=True))["losses"]
        out["train_rel_diff"] = max(abs(g - c) / abs(c) for g, c in zip(gpu, cpu, strict=True))
        out["torchrun_rel_diff"] = max(abs(g - c) / abs(c) for g, c in zip(one, cpu, strict=True))
        out["eval_loss"] = json.loads(cli("eval", "run", "--tokens", "t.npy", "--device", dev,
                                          "--json"))["loss"]
    return out


def fmt(v, spec: str = ".2e") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return format(v, spec) if isinstance(v, float) else str(v)


def parity_table(rows: list[dict]) -> str:
    head = f"{'check':<22} {'dtype':<8} {'path':<19} {'err':>9} {'tol':>9} {'ok':>3} " \
           f"{'ms':>8}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['check']:<22} {r['dtype']:<8} {r['path']:<19} {fmt(r['err']):>9} "
                     f"{fmt(r['tol']):>9} {fmt(r['ok']):>3} {fmt(r['ms'], '.2f'):>8}  {r['note']}")
    return "\n".join(lines)


def mfu_table(results: dict) -> str:
    head = f"{'kernels':<12} {'params':>7} {'batch x seq':>11} {'step ms':>8} {'tok/s':>8} " \
           f"{'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8} {'1st step s':>10} {'loss':>13}  " \
           "dispatches in step 1"
    lines = [head, "-" * len(head)]
    for phase, (label, _) in MFU_RUNS.items():
        r = results.get(phase)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"{label:<12} {r['error']}")
            continue
        loss = f"{r['loss_first']:.2f}->{r['loss_last']:.2f}"
        lines.append(
            f"{label:<12} {r['params'] / 1e9:>6.2f}B {r['batch']:>4} x {r['seq']:<4} "
            f"{r['step_ms']:>8.1f} {r['tokens_per_s']:>8.0f} {r['tflops']:>8.1f} "
            f"{100 * r['mfu']:>5.1f}% {fmt(r['peak_gib'], '.1f'):>8} {r['first_step_s']:>10.1f} "
            f"{loss:>13}  {r['dispatch']}")
    on, off = results.get("mfu", {}), results.get("mfu-torch", {})
    if "tokens_per_s" in on and "tokens_per_s" in off:
        lines.append(f"speed-up with kernels: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x")
    return "\n".join(lines)


def run_child(phase: str, timeout: float, dry: bool) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_CACHE_AUTOTUNING": "1"}
    env.pop(probe.ENV_DISABLE, None)
    disable = MFU_RUNS.get(phase, (None, None))[1]
    if disable:
        env[probe.ENV_DISABLE] = disable
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        argv = [sys.executable, __file__, "--phase", phase, "--out", str(out),
                "--seconds", str(int(timeout))] + (["--dry-run"] if dry else [])
        print(f"== {phase} (timeout {timeout:.0f} s)", flush=True)
        try:
            proc = subprocess.run(argv, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out.exists():
            return {"error": f"failed (exit {proc.returncode}); see its output above"}
        return json.loads(out.read_text())


def machine() -> str:
    if not torch.cuda.is_available():
        return f"CPU (dry run), torch {torch.__version__}"
    try:
        import triton
        tri = triton.__version__
    except Exception:
        tri = "absent"
    return (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, triton {tri}")


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except Exception:
        return "?"


def report(results: dict, args: argparse.Namespace) -> str:
    parts = [f"machine: {machine()}; commit {commit()}; peak for MFU {PEAK_BF16 / 1e12:.0f} "
             "TFLOP/s (H200 bf16 dense spec)"]
    par = results.get("parity", {})
    if "kernels" in par:
        parts.append("kernels: " + "; ".join(f"{k}: {v}" for k, v in par["kernels"].items()))
    if "rows" in par:
        parts.append(parity_table(par["rows"]))
    elif "error" in par:
        parts.append(f"parity: {par['error']}")
    if "device" in results:
        parts.append("device (CLI end to end): " + ", ".join(
            f"{k} {fmt(v) if isinstance(v, float) else v}" for k, v in results["device"].items()))
    if any(p in results for p in MFU_RUNS):
        parts.append(mfu_table(results))
    return "\n\n".join(parts)


def append_results(text: str, path: Path, command: str) -> None:
    date = datetime.date.today().isoformat()
    with path.open("a") as f:
        f.write(f"\n## GPU check of composer.kernels ({date})\n\nCommand: `{command}` "
                "(what each column means: the docstring of `bench/gpu_check.py`).\n\n"
                f"```\n{text}\n```\n")
    print(f"appended to {path}")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=float, default=540, help="seconds for all phases")
    p.add_argument("--phases", default="device,parity,mfu,mfu-torch")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    p.add_argument("--no-results", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no results")
    p.add_argument("--command", default=None, help="the command to record in RESULTS.md")
    p.add_argument("--phase", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=600, help=argparse.SUPPRESS)
    return p.parse_args()


def child(args: argparse.Namespace) -> None:
    dev = "cpu" if args.dry_run else "cuda"
    torch.manual_seed(0)
    try:
        if args.phase == "parity":
            out = run_parity(dev, args.dry_run)
        elif args.phase == "device":
            out = run_device(dev, args.dry_run)
        else:
            out = run_mfu(dev, args.dry_run, args.seconds)
    except torch.cuda.OutOfMemoryError as e:
        out = {"error": f"out of memory: {e!s:.100}"}
    args.out.write_text(json.dumps(out))


def main() -> int:
    args = parse()
    if args.phase:
        child(args)
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to "
              "check. It needs one NVIDIA GPU (written for an H200); --dry-run checks the script "
              "on the CPU.")
        return 0
    deadline = time.monotonic() + args.budget
    phases = [p for p in args.phases.split(",") if p]
    if set(phases) - set(CAPS):
        print(f"gpu_check: unknown phase(s) {sorted(set(phases) - set(CAPS))}; known: "
              f"{', '.join(CAPS)}")
        return 2
    results: dict[str, dict] = {}
    for i, phase in enumerate(phases):
        left = deadline - time.monotonic() - 60 * (len(phases) - i - 1)
        if left < 30:
            results[phase] = {"error": "skipped: time budget spent"}
            continue
        results[phase] = run_child(phase, min(CAPS[phase], left), args.dry_run)
    text = report(results, args)
    print("\n" + text)
    if args.json:
        print(json.dumps(results, indent=1))
    if not (args.no_results or args.dry_run):
        command = args.command or "python " + " ".join([sys.argv[0]] + sys.argv[1:])
        append_results(text, args.results, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
