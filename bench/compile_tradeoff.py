"""The ``torch.compile`` trade-off for our models: compile time against step time.

For each family of ``compare_hf.py`` (same ~50M configs, weights converted from a random
transformers model), two copies of our model run the train step (forward, backward, AdamW) in
turns: eager, and with :func:`composer.kernels.compile_layers` (inductor). Prints the first
compiled step (the compile cost), the median step of each and the speed-up. fp32, all cores.

    python bench/compile_tradeoff.py                       # llama and mamba2, 4 x 256
    python bench/compile_tradeoff.py --families nemotron-h --shape 1x2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# A cold start: inductor's on-disk cache would otherwise hide the compile cost after a first run.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_hf as ch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="llama,mamba2")
    p.add_argument("--shape", default="4x256")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    import composer
    from composer.convert import from_hf
    from composer.kernels import compile_layers

    shape = ch.Shape.parse(args.shape)
    ids = ch.token_ids(shape)
    print(ch.machine())
    for name in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            ch.build_hf(ch.FAMILIES[name]).save_pretrained(work / "theirs")
            from_hf(work / "theirs", work / "ours", force=True)
            models = {"eager": composer.load(work / "ours"),
                      "compiled": compile_layers(composer.load(work / "ours"))}
        steps = {k: ch.make_step(m, "ours", "train", ids) for k, m in models.items()}
        t0 = time.perf_counter()
        steps["compiled"]()
        first = time.perf_counter() - t0
        times: dict[str, list[float]] = {k: [] for k in steps}
        for k in steps:  # one more warm-up each
            steps[k]()
        for _ in range(args.iters):
            for k, step in steps.items():
                t0 = time.perf_counter()
                step()
                times[k].append(time.perf_counter() - t0)
        eager, compiled = (statistics.median(times[k]) for k in ("eager", "compiled"))
        payoff = (f"pays off after ~{first / (eager - compiled):.0f} steps" if eager > compiled
                  else "never pays off")
        print(f"{name} train {shape}: first compiled step {first:.1f} s (cold cache); median "
              f"step eager {eager:.3f} s, compiled {compiled:.3f} s: {eager / compiled:.3f}x; "
              f"compiling {payoff}", flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
