"""What a run reports: one line per logged step on stdout, one JSON object per logged step in
``DIR/metrics.jsonl``, a progress bar on a terminal, TensorBoard scalars when installed.

``mfu`` = model FLOPs per token (the builder's count: 6 x matmul parameters plus attention,
forward and backward) x tokens/s / (peak FLOP/s per device x devices). The peak comes from
``--peak-tflops`` or, on a known GPU, from :data:`PEAK_TFLOPS` (dense bf16; fp8 doubles it); it
is ``null`` on the CPU and on unknown devices.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

METRICS_FILE = "metrics.jsonl"
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "H800": 989.0, "B200": 2250.0,
               "B100": 1750.0, "GB200": 2500.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "L4": 121.0, "A10G": 125.0, "A10": 125.0}
"""Dense bf16 tensor-core peaks (TFLOP/s) by the name ``torch.cuda.get_device_name`` contains
(SXM parts; an H100 PCIe has 756)."""


def peak_flops(device: torch.device, precision: str, override_tflops: float | None) -> float | None:
    """FLOP/s of one device at this precision, or None when not known."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda" or precision == "fp32":
        return None
    name = torch.cuda.get_device_name(device)
    if "H100" in name and "PCIe" in name:
        return 756e12 * (2 if precision == "fp8" else 1)
    for key, tflops in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return tflops * 1e12 * (2 if precision == "fp8" else 1)
    return None


def max_memory_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory, or this process's peak resident memory on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:  # no /proc (macOS)
        return _rusage_peak()
    return _rusage_peak()


def _rusage_peak() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsLog:
    """Writes the metrics of rank 0 (other ranks pass ``enabled=False``)."""

    def __init__(self, folder: str | Path | None, enabled: bool, total_steps: int,
                 start_step: int, quiet: bool, tensorboard: bool = False) -> None:
        self.enabled, self.quiet = enabled, quiet
        self.file = None
        self.board = None
        self.bar = None
        if not enabled:
            return
        if folder is not None:
            path = Path(folder) / METRICS_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            _truncate_after(path, start_step)  # steps past the checkpoint are redone
            self.file = path.open("a")
            if tensorboard:
                self.board = _tensorboard(Path(folder) / "tensorboard")
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", leave=False,
                            file=sys.stderr, dynamic_ncols=True)

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.board is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.board.add_scalar(key, value, row["step"])
        if not self.quiet:
            text = format_row(row)
            if self.bar is not None:
                self.bar.write(text, file=sys.stdout)
            else:
                print(text, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def close(self) -> None:
        for thing in (self.file, self.board, self.bar):
            if thing is not None:
                thing.close()


HEADLINE = ("reward_accuracy", "reward_margin", "reward_mean", "accuracy")
"""Objective metrics shown on the console line when a row has them (every metric is in
``metrics.jsonl``)."""


def format_row(row: dict[str, Any]) -> str:
    def num(key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None else format(value, fmt)

    text = (f"step {row['step']:>6}  loss {num('loss', '.4f')}  lr {num('lr', '.3e')}  "
            f"grad_norm {num('grad_norm', '.3f')}  tok/s {num('tokens_per_s', ',.0f')}")
    if row.get("mfu") is not None:
        text += f"  mfu {row['mfu']:.1%}"
    for key in HEADLINE:  # the objectives' own (dpo, grpo)
        if row.get(key) is not None:
            text += f"  {key} {row[key]:.4f}"
    for key, value in row.items():
        if key.startswith("val_") and isinstance(value, float):
            text += f"  {key} {value:.4f}"
    if row.get("skipped"):
        text += f"  skipped {row['skipped']}"
    if row.get("grad_sync"):  # the first row: how data parallel reduces the gradients
        text += f"  grad_sync {row['grad_sync']}"
    return text


def _truncate_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    path.write_text("".join(f"{line}\n" for line in keep))


def _tensorboard(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("composer: --tensorboard needs the tensorboard package; not writing it",
              file=sys.stderr)
        return None
    return SummaryWriter(str(folder))
