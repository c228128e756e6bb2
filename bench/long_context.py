"""Long-context training under context parallelism: tokens/s and peak memory per rank at 8k,
16k and 32k tokens for a hybrid model at cp = 1, 2 and 4, on CPU (gloo ranks).

Each (tokens, cp) runs in fresh processes (``cp`` gloo ranks, one thread each): the model
(:data:`MODEL`, the pattern ``M-M*-ME``: Mamba-2, attention, an MLP and a MoE layer) is built
shard-local, one warm-up training step (forward, backward, AdamW) is taken, then ``--steps``
timed steps on one row of ``tokens`` random ids. Measured per rank:

- ``step_s``: the median wall time of a step; ``tok/s`` = tokens / step_s (the whole row's
  tokens: the ranks share the row);
- ``peak_MB``: the peak resident memory during a step above the memory held between steps
  (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus ``VmRSS`` before the
  step): activations, the gradients and the step's transient buffers; the maximum over ranks.
  The processes start with glibc returning every large block on free (:data:`MALLOC`), so the
  resident size follows the live tensors.

The goal (issue 15): at 8192 tokens, peak_MB at cp = 2 is at most 0.65x the cp = 1 figure.

    python bench/long_context.py                          # 8k/16k/32k x cp 1/2/4 (~10 min)
    python bench/long_context.py --tokens 8192 --cps 1 2 --no-write

A full run appends its table, with date, machine and command, to ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = {"pattern": "M-M*-ME", "d_model": 256, "vocab_size": 1024,
         "attention.n_heads": 8, "attention.n_kv_heads": 2,
         "mamba.n_heads": 8, "mamba.d_head": 32, "mamba.n_groups": 2, "mamba.d_state": 32,
         "mamba.chunk_size": 64, "mlp.d_ff": 768, "moe.n_experts": 4, "moe.top_k": 2,
         "moe.d_ff": 384}


def model_config():
    from composer.config import ModelConfig, apply_overrides

    cfg = ModelConfig(pattern=MODEL["pattern"])
    apply_overrides(cfg, [f"{k}={v}" for k, v in MODEL.items() if k != "pattern"])
    return cfg.validate()


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(cp: int, tokens: int, steps: int = 2, seed: int = 0) -> dict:
    """One rank's numbers (every rank of the cp group calls it)."""
    import gc

    from composer.parallel.mesh import ParallelConfig, build_parallel_dims
    from composer.run import build_sharded

    torch.set_num_threads(1)
    dims = build_parallel_dims(ParallelConfig(cp=cp), "cpu")
    model = build_sharded(model_config(), dims, seed=seed, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MODEL["vocab_size"], (1, tokens), generator=g)

    def step() -> float:
        out = model(ids, ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    step()  # warm-up: the optimizer's state exists from here on
    times, peaks = [], []
    for _ in range(steps):
        gc.collect()
        before = _status_kb("VmRSS")
        ok = _reset_peak()
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
        peaks.append((_status_kb("VmHWM") - before) / 1024 if ok else float("nan"))
    return {"cp": cp, "tokens": tokens, "step_s": statistics.median(times),
            "peak_MB": max(peaks), "loss": loss}


MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
"""glibc: every block of 64 KiB or more is its own mapping, returned on free, so the resident
size follows the live tensors (else freed memory stays resident and the peak reads low)."""


def run(cp: int, tokens: int, steps: int) -> dict:
    """Every cp (1 too) in fresh processes, which read :data:`MALLOC` at their start."""
    from composer.parallel.launch import run_distributed

    saved = {k: os.environ.get(k) for k in MALLOC}
    os.environ.update(MALLOC)
    try:
        rows = run_distributed(measure, cp, cp, tokens, steps, timeout=3600)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = dict(rows[0])
    out["step_s"] = max(r["step_s"] for r in rows)
    out["peak_MB"] = max(r["peak_MB"] for r in rows)
    out["tok_s"] = tokens / out["step_s"]
    return out


def table(results: list[dict]) -> str:
    base = {r["tokens"]: r for r in results if r["cp"] == 1}
    lines = ["| tokens | cp | step s | tok/s | peak MB / rank | vs cp=1 |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ref = base.get(r["tokens"])
        ratio = f"{r['peak_MB'] / ref['peak_MB']:.2f}x" if ref else "-"
        lines.append(f"| {r['tokens']} | {r['cp']} | {r['step_s']:.2f} | {r['tok_s']:,.0f} | "
                     f"{r['peak_MB']:.0f} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    results = []
    for tokens in args.tokens:
        for cp in args.cps:
            r = run(cp, tokens, args.steps)
            results.append(r)
            print(json.dumps(r), flush=True)
    text = table(results)
    print(text)
    if not args.no_write:
        cmd = "python bench/long_context.py " + " ".join(sys.argv[1:])
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write(f"\n## Long context, context parallel (issue 15): {datetime.date.today()}\n\n"
                    f"`{cmd.strip()}` on {platform.machine()} ({os.cpu_count()} cores), "
                    f"torch {torch.__version__}, model {MODEL['pattern']} d_model "
                    f"{MODEL['d_model']}, fp32, 1 row, one thread per rank.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
