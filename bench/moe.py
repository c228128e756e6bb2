"""Routed-expert computation, forward + backward time per token: the per-expert loop that
``composer.blocks.moe.Experts`` runs off CUDA against the alternatives, for 8, 64 and 128
experts (fp32, rows already sorted by expert, as the MoE block hands them over).

    python bench/moe.py                       # CPU, about a minute on 2 cores
    python bench/moe.py --device cuda --dtype bf16 --tokens 16384 --d-model 2048 --d-ff 1024

Candidates:
- ``loop``: one GEMM per expert over its slice (one host sync for the split sizes);
- ``padded_bmm``: every expert's rows padded to the largest count, one ``bmm`` per projection
  (one host sync for that count; the padding is wasted work);
- ``grouped_mm``: ``torch._grouped_mm`` per projection (the CUDA path; no host sync). On the CPU
  torch 2.13 has its forward only, so there every candidate is also timed forward only
  (``fwd`` rows; the ratio is to the loop's time for the same pass).

Prints one row per (experts, candidate): microseconds per token (the best of ``--repeats``
interleaved runs, and their median: the shared VMs drift) and the best's ratio to ``loop``;
``--json`` for machines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from composer.blocks.moe import Experts  # noqa: E402

CONFIGS = [(8, 2), (64, 8), (128, 8)]  # (experts, top_k): Mixtral-like, then fine-grained


def padded_bmm(experts: Experts, x_AD: torch.Tensor, n_tokens_E: torch.Tensor) -> torch.Tensor:
    E = n_tokens_E.shape[0]
    width = int(n_tokens_E.max())  # the host sync
    starts_E = torch.cumsum(n_tokens_E, 0) - n_tokens_E
    expert_A = torch.repeat_interleave(torch.arange(E, device=x_AD.device), n_tokens_E)
    slot_A = torch.arange(x_AD.shape[0], device=x_AD.device) - starts_E[expert_A]
    x_ECD = x_AD.new_zeros(E, width, x_AD.shape[1]).index_put((expert_A, slot_A), x_AD)
    h_ECF = experts.act(torch.bmm(x_ECD, experts.gate_proj.transpose(1, 2)))
    h_ECF = h_ECF * torch.bmm(x_ECD, experts.up_proj.transpose(1, 2))
    y_ECD = torch.bmm(h_ECF, experts.down_proj.transpose(1, 2))
    return y_ECD[expert_A, slot_A]


def grouped_mm(experts: Experts, x_AD: torch.Tensor, n_tokens_E: torch.Tensor) -> torch.Tensor:
    offs = torch.cumsum(n_tokens_E, 0).to(torch.int32)

    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    h = experts.act(mm(x_AD, experts.gate_proj)) * mm(x_AD, experts.up_proj)
    return mm(h, experts.down_proj)


CANDIDATES = {"loop": lambda ex, x, n: ex._loop(x, n), "padded_bmm": padded_bmm,
              "grouped_mm": grouped_mm}


def routed_rows(n_tokens: int, E: int, K: int, d_model: int, device: str, dtype: torch.dtype,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``N * K`` rows sorted by expert, with the uneven loads of a random softmax router."""
    logits = torch.randn(n_tokens, E, generator=gen) * 1.5
    idx = logits.topk(K, dim=-1).indices.flatten()
    n_tokens_E = torch.bincount(idx, minlength=E)
    x = torch.randn(n_tokens * K, d_model, generator=gen)
    return x.to(device, dtype), n_tokens_E.to(device)


def time_once(fn, experts: Experts, x: torch.Tensor, n: torch.Tensor, backward: bool) -> float:
    xr = x.detach().requires_grad_(backward)
    if x.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = fn(experts, xr, n)
    if backward:
        y.backward(torch.ones_like(y))
    if x.is_cuda:
        torch.cuda.synchronize()
    experts.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def check_equal(experts: Experts, x: torch.Tensor, n: torch.Tensor, name: str) -> float:
    with torch.no_grad():
        ref = experts._loop(x, n).double()
        got = CANDIDATES[name](experts, x, n).double()
    return float((got - ref).abs().max() / ref.abs().max())


# ---------------------------------------------------------------- the GPU check's phase


def _leaves_grads(experts: Experts, x: torch.Tensor, n: torch.Tensor, path: str,
                  gy: torch.Tensor) -> list[torch.Tensor]:
    xr = x.detach().clone().requires_grad_()
    y = getattr(experts, path)(xr, n)
    y.backward(gy)
    out = [y.detach(), xr.grad] + [p.grad for p in experts.parameters()]
    experts.zero_grad(set_to_none=True)
    return out


def parity_rows(device: str, dtypes: list[torch.dtype]) -> list[dict]:
    """``Experts._grouped`` (torch._grouped_mm) and ``_loop`` against an fp64 loop on the same
    rounded inputs, forward and backward (output, input and weight gradients), with padding
    rows (dropped assignments) and an empty expert, for plain and gpt-oss experts;
    ``err = max|got - ref| / max|ref|``."""
    rows = []
    tol = {torch.float32: 1e-2, torch.bfloat16: 3e-2}  # fp32 may run on TF32 operands
    gen = torch.Generator().manual_seed(1)
    # the plain SwiGLU experts, and gpt-oss's (biases, the clamped SwiGLU: limit 1 clamps here)
    kinds = {"experts": {}, "experts/gpt-oss": {"bias": True, "swiglu_limit": 1.0}}
    for (check, kw), dtype in itertools.product(kinds.items(), dtypes):
        experts = Experts(16, 256, 128, "swiglu", **kw)
        for p in experts.parameters():
            p.data.normal_(0, 0.05, generator=gen)
        n = torch.tensor([0, 37, 5, 90, 1, 64, 33, 2, 8, 16, 120, 0, 7, 50, 3, 11])
        x = torch.randn(int(n.sum()) + 13, 256, generator=gen)  # 13 padding rows
        gy = torch.randn(x.shape[0], 256, generator=gen)
        ref_ex = Experts(16, 256, 128, "swiglu", **kw).double()
        ref_ex.load_state_dict({k: v.to(dtype).double() for k, v in experts.state_dict().items()})
        ref = _leaves_grads(ref_ex, x.to(dtype).double(), n, "_loop", gy.to(dtype).double())
        experts.to(device, dtype)
        # the grouped path runs in bf16 on CUDA (composer.blocks.moe.grouped_mm_dtype)
        for path in ("_grouped", "_loop") if dtype == torch.bfloat16 else ("_loop",):
            t0 = time.perf_counter()
            try:
                got = _leaves_grads(experts, x.to(device, dtype), n.to(device), path,
                                    gy.to(device, dtype))
                err = max(float((g.double().cpu() - r).abs().max() / r.abs().max().clamp_min(
                    1e-30)) for g, r in zip(got, ref, strict=True))
                note = ""
            except RuntimeError as e:
                err, note = None, f"failed: {str(e).splitlines()[0][:70]}"
            rows.append({"check": check, "dtype": str(dtype).split(".")[-1],
                         "path": path.lstrip("_"), "err": err, "tol": tol[dtype],
                         "ok": err is not None and err <= tol[dtype],
                         "ms": 1e3 * (time.perf_counter() - t0), "note": note})
    return rows


def no_sync_row(device: str) -> dict:
    """A whole MoE layer's forward (router, capacity dropping, sort, grouped GEMMs, combine) and
    backward under ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation
    raises."""
    from composer.blocks.moe import MoE
    from composer.config import ModelConfig, MoEConfig

    notes = []
    ok = True
    for capacity_factor, autocast in ((None, False), (1.0, False), (None, True)):
        moe_cfg = MoEConfig(n_experts=16, top_k=4, d_ff=128, score_func="sigmoid",
                            score_correction_bias=True, bias_update_rate=1e-3,
                            aux_loss_coeff=0.01, seq_aux_loss_coeff=0.001,
                            capacity_factor=capacity_factor)
        cfg = ModelConfig(pattern="E", d_model=256, attention=None, mamba=None,
                          moe=moe_cfg).validate()
        # fp32 masters under bf16 autocast (the single-device training path), else bf16
        dtype = torch.float32 if autocast else torch.bfloat16
        moe = MoE(cfg).to(device, dtype)
        moe.router.float()
        moe.reset_parameters()
        x = torch.randn(4, 128, 256, device=device, dtype=dtype, requires_grad=True)
        what = f"capacity {capacity_factor}{', autocast' if autocast else ''}"
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            moe(x)  # warm-up outside the check (lazy initialisation may synchronise)
            try:
                torch.cuda.set_sync_debug_mode("error")
                y = moe(x)
                (y.float().square().mean() + moe.aux_loss).backward()
                torch.cuda.set_sync_debug_mode(0)
                notes.append(f"{what}: no sync")
            except RuntimeError as e:
                torch.cuda.set_sync_debug_mode(0)
                ok = False
                notes.append(f"{what}: {str(e).splitlines()[0][:60]}")
    return {"check": "MoE layer no sync", "dtype": "bfloat16", "path": "grouped", "err": None,
            "tol": None,
            "ok": ok, "ms": None, "note": "; ".join(notes)}


def gpu_phase(dry: bool) -> tuple[list[dict], list[dict], bool]:
    """bench/gpu_check.py's ``moe`` phase: parity rows, the no-sync row, and the timing rows
    (8, 64, 128 experts, bf16, fwd+bwd) of ``run_configs``. ``dry``: the CPU, fp32 (the loop
    only: the grouped path has no CPU backward), tiny shapes, no sync check."""
    device = "cpu" if dry else "cuda"
    rows = parity_rows(device, [torch.float32] if dry else [torch.float32, torch.bfloat16])
    if not dry:
        rows.append(no_sync_row(device))
    timing = run_configs(tokens=256 if dry else 16384, d_model=64 if dry else 2048,
                         d_ff=32 if dry else 1024, repeats=2 if dry else 5, device=device,
                         dtype=torch.float32 if dry else torch.bfloat16)
    ok = all(r["ok"] for r in rows) and not any("error" in r for r in timing)
    return rows, timing, ok


def run_configs(tokens: int, d_model: int, d_ff: int, repeats: int, device: str,
                dtype: torch.dtype) -> list[dict]:
    """The timing rows of every (experts, candidate) of ``CONFIGS``."""
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    for E, K in CONFIGS:
        experts = Experts(E, d_model, d_ff, "swiglu")
        for p in experts.parameters():
            p.data.normal_(0, 0.02, generator=gen)
        experts.to(device, dtype)
        x, n = routed_rows(tokens, E, K, d_model, device, dtype, gen)
        rows += time_config(experts, x, n, E, K, tokens, repeats, device)
        del experts, x
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def time_config(experts: Experts, x: torch.Tensor, n: torch.Tensor, E: int, K: int,
                tokens: int, repeats: int, device: str) -> list[dict]:
    rows: list[dict] = []
    # (candidate, backward): on the CPU grouped_mm runs forward only, so every candidate is
    # also timed forward only there, for the comparison
    runs = [(name, True) for name in CANDIDATES
            if not (name == "grouped_mm" and device == "cpu")]
    if device == "cpu":
        runs += [(name, False) for name in CANDIDATES]
    errors, times = {}, {run: [] for run in runs}
    for name in CANDIDATES:
        try:
            errors[name] = check_equal(experts, x, n, name)
        except RuntimeError as e:  # e.g. a kernel this build lacks
            rows.append({"experts": E, "top_k": K, "candidate": name,
                         "error": str(e).splitlines()[0][:80]})
    runs = [run for run in runs if run[0] in errors]
    for name, backward in runs:  # warm-up
        time_once(CANDIDATES[name], experts, x, n, backward)
    for _ in range(repeats):  # interleaved, so that drift hits every candidate alike
        for name, backward in runs:
            times[name, backward].append(time_once(CANDIDATES[name], experts, x, n,
                                                   backward))
    for name, backward in runs:
        best = min(times[name, backward])
        base = min(times["loop", backward])
        rows.append({"experts": E, "top_k": K, "candidate": name,
                     "pass": "fwd+bwd" if backward else "fwd",
                     "us_per_token": 1e6 * best / tokens,
                     "us_per_token_median":
                         1e6 * statistics.median(times[name, backward]) / tokens,
                     "vs_loop": best / base, "max_rel_err": errors[name]})
    return rows


def timing_table(rows: list[dict]) -> str:
    lines = [f"{'experts':>7} {'top_k':>5} {'candidate':<11} {'pass':<8} {'us/token':>9} "
             f"{'median':>9} {'x loop':>7} {'rel err':>8}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['experts']:>7} {r['top_k']:>5} {r['candidate']:<11} "
                         f"error: {r['error']}")
            continue
        lines.append(f"{r['experts']:>7} {r['top_k']:>5} {r['candidate']:<11} {r['pass']:<8} "
                     f"{r['us_per_token']:>9.2f} {r['us_per_token_median']:>9.2f} "
                     f"{r['vs_loop']:>7.2f} {r['max_rel_err']:>8.1e}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    rows = run_configs(args.tokens, args.d_model, args.d_ff, args.repeats, args.device, dtype)
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        return
    print(f"# {args.tokens} tokens, d_model {args.d_model}, d_ff {args.d_ff}, swiglu, "
          f"{args.dtype}, {args.device}; best and median of {args.repeats}, interleaved")
    print(timing_table(rows))


if __name__ == "__main__":
    main()
