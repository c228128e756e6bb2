"""Plot a training run's curves: loss, learning rate and gradient norm against the step.

``plot(run_dir)`` reads ``RUN_DIR/metrics.jsonl`` (one JSON object a line with at least ``step``,
``loss``, ``lr`` and ``grad_norm``; blank lines are ignored) and writes three stacked panels to
``RUN_DIR/loss.png`` with matplotlib's Agg backend (no display needed). A value that is missing
or null, such as the ``grad_norm`` of a skipped step, is drawn as a gap in its curve.

matplotlib is an optional dependency, imported only when drawing: the metrics file is read and
checked first, so a missing or malformed file is reported whether or not matplotlib is there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
SERIES = ("loss", "lr", "grad_norm")
"""The curves drawn, top to bottom."""
LABELS = {"loss": "loss", "lr": "learning rate", "grad_norm": "grad norm"}


def _number(value: Any, key: str, where: str) -> float:
    """``value`` as a float; ``None`` (JSON null) is NaN, which matplotlib leaves as a gap."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key} must be a number or null, got {value!r}")
    return float(value)


def read_metrics(path: str | Path) -> dict[str, list[float]]:
    """The columns ``step``, ``loss``, ``lr`` and ``grad_norm`` of a ``metrics.jsonl`` file.

    Missing or null values are NaN. Raises :class:`FileNotFoundError` when the file does not
    exist and :class:`ValueError` (naming the file and line) for a line that is not a JSON
    object with a numeric ``step``, or when the file holds no records.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    columns: dict[str, list[float]] = {"step": [], **{key: [] for key in SERIES}}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if record.get("step") is None:
                raise ValueError(f"{where}: record has no step")
            columns["step"].append(_number(record["step"], "step", where))
            for key in SERIES:
                columns[key].append(_number(record.get(key), key, where))
    if not columns["step"]:
        raise ValueError(f"{path}: no metrics records")
    return columns


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``RUN_DIR/metrics.jsonl`` as loss, learning rate and grad norm against the step.

    Writes ``out`` (default ``RUN_DIR/loss.png``; the format follows its suffix) and returns its
    path. Raises :class:`FileNotFoundError` / :class:`ValueError` as :func:`read_metrics`, and
    :class:`ImportError` when matplotlib is not installed.
    """
    run_dir = Path(run_dir)
    columns = read_metrics(run_dir / METRICS_FILE)
    try:
        import matplotlib  # noqa: F401  (fails fast when blocked or absent)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("composer plot needs matplotlib: pip install matplotlib") from None

    # A Figure with an Agg canvas of its own: no pyplot, no global backend switch.
    figure = Figure(figsize=(8, 9), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(SERIES), 1, sharex=True)
    for ax, key in zip(axes, SERIES, strict=True):
        ax.plot(columns["step"], columns[key], linewidth=1.0)
        ax.set_ylabel(LABELS[key])
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[0].set_title(run_dir.resolve().name)

    out = Path(out) if out is not None else run_dir / PLOT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    return out
