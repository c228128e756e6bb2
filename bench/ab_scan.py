"""Interleaved A/B of the SSD scan: this checkout's ``composer/kernels/ssd.py`` against the one
at a git revision, inside one process, on a stack of Mamba-2 layers (forward + backward).

Whole-benchmark runs on a shared 2-core VM drift by +-10% between runs, more than most single
changes to the scan are worth; alternating the two versions step by step in one process cancels
that drift. Prints the median step time of each (``--steps`` alternating steps after a warm-up).

    python bench/ab_scan.py --against HEAD~1                   # 4 layers, 4 x 256
    python bench/ab_scan.py --against 3226e98 --shape 1x2048
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def load_revision(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:composer/kernels/ssd.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "ssd_at_revision.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("ssd_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, help="git revision of the other scan")
    p.add_argument("--shape", default="4x256", help="batch x tokens (default 4x256)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    import composer.kernels.scan as kscan
    import composer.kernels.ssd as current
    from composer import build_model
    from composer.config import MambaConfig, ModelConfig

    b, t = (int(v) for v in args.shape.split("x"))
    # the width of bench/compare_hf.py's Mamba2
    cfg = ModelConfig(pattern="M" * args.layers, d_model=512, vocab_size=1000,
                      mamba=MambaConfig(n_heads=16, d_head=64, n_groups=1, d_state=128,
                                        chunk_size=256))
    model = build_model(cfg, seed=0)
    x = torch.randn(b, t, 512, requires_grad=True)
    grad = torch.randn(b, t, 512)

    def step() -> None:
        h = x
        for layer in model.layers.values():
            h = layer(h)
        h.backward(grad)

    scans = {args.against: load_revision(args.against).ssd_scan, "this checkout": current.ssd_scan}
    times: dict[str, list[float]] = {k: [] for k in scans}
    for i in range(2 + args.steps):
        for name, scan in scans.items():
            kscan.ssd_scan = scan
            t0 = time.perf_counter()
            step()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    kscan.ssd_scan = current.ssd_scan
    print(f"{args.layers} Mamba-2 layers, {args.shape}, fwd+bwd, median of {args.steps}: "
          + ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in times.items()))


if __name__ == "__main__":
    sys.exit(main())
