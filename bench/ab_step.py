"""A train step's time at this checkout or any other, for A/B runs between revisions.

Builds a model with ``composer.build_model`` (seed 0, fp32) and times ``zero_grad``, a forward
with labels, ``backward`` and an AdamW step at 4 x 256 tokens: the median of 6 steps after 2
warm-up steps. Run it alternately against two checkouts (a ``git worktree`` of the old revision)
so that the machine's drift hits both:

    git worktree add /tmp/old REV
    for i in 1 2 3; do
      PYTHONPATH=/tmp/old python bench/ab_step.py old MMMMMMMMMMMM
      PYTHONPATH=.       python bench/ab_step.py new MMMMMMMMMMMM
    done
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import composer
from composer.config import ModelConfig


def main() -> None:
    label, pattern = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "M" * 12
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict({
        "pattern": pattern, "d_model": 512, "vocab_size": 32000,
        "mamba": {"n_heads": 16, "d_head": 64, "n_groups": 1, "d_state": 64, "chunk_size": 64},
        "attention": {"n_heads": 8}, "mlp": {"d_ff": 1536, "activation": "relu2"}})
    model = composer.build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32000, (4, 256))
    times = []
    for i in range(8):
        start = time.perf_counter()
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    print(f"{label} {composer.__file__} {statistics.median(times):.3f} s/step")


if __name__ == "__main__":
    main()
