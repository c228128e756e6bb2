"""Learning-rate schedules: the rate used by optimizer step ``s = 1..N``.

With ``W`` warmup steps, ``D`` decay steps (wsd only) and ``p = (s - W) / (N - W)``:

- warmup (``s <= W``): ``lr * s / W``;
- ``constant``: ``lr``;
- ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``;
- ``linear``: ``lr - (lr - min_lr) * p``;
- ``wsd`` (warmup-stable-decay): ``lr`` while ``s <= N - D``, then
  ``min_lr + (lr - min_lr) * (N - s) / D``.

The rate is a pure function of the step, so a resumed run continues the schedule from its saved
step, and ``--steps`` (``N``) changed on resume reshapes the rest of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("constant", "cosine", "linear", "wsd")


@dataclass(frozen=True)
class Schedule:
    lr: float
    min_lr: float
    steps: int
    warmup_steps: int = 0
    kind: str = "cosine"
    decay_steps: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}; got {self.kind!r}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr <= --lr and --lr > 0; got lr={self.lr}, "
                             f"min_lr={self.min_lr}")
        if self.warmup_steps < 0:  # more warmup than steps: every step warms up
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.kind == "wsd" and not 0 < self.decay_steps <= self.steps - self.warmup_steps:
            raise ValueError(f"--schedule wsd needs 0 < --decay-steps ({self.decay_steps}) <= "
                             f"--steps - --warmup-steps ({self.steps - self.warmup_steps})")

    def __call__(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (1-based)."""
        n, w = self.steps, self.warmup_steps
        if step <= w:
            return self.lr * step / w
        if self.kind == "constant":
            return self.lr
        if self.kind == "wsd":
            if step <= n - self.decay_steps:
                return self.lr
            return self.min_lr + (self.lr - self.min_lr) * max(n - step, 0) / self.decay_steps
        p = min((step - w) / max(n - w, 1), 1.0)
        if self.kind == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * (1 + math.cos(math.pi * p)) / 2
        return self.lr - (self.lr - self.min_lr) * p
