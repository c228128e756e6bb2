"""``composer.train.plot``: reading metrics.jsonl, its error paths, and drawing (if matplotlib)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from composer.train.plot import plot, read_metrics


def write_metrics(run_dir: Path, lines: list[str]) -> Path:
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def records(n: int = 6, skipped: tuple[int, ...] = (3,)) -> list[str]:
    return [json.dumps({"step": s, "loss": 5.0 - 0.5 * s, "lr": 1e-3 * min(1, s / 2),
                        "grad_norm": None if s in skipped else 1.0 / s, "tokens_per_s": 10.0})
            for s in range(1, n + 1)]


def test_read_metrics_columns_with_gaps_and_blank_lines(tmp_path: Path) -> None:
    lines = records()
    path = write_metrics(tmp_path, [lines[0], "", "   ", *lines[1:]])
    columns = read_metrics(path)
    assert columns["step"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert columns["loss"][0] == 4.5 and columns["lr"][1] == pytest.approx(1e-3)
    assert math.isnan(columns["grad_norm"][2])
    assert columns["grad_norm"][3] == pytest.approx(0.25)


def test_missing_metrics_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        plot(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "metrics.jsonl") in message and "\n" not in message


def test_bad_line_names_file_and_line(tmp_path: Path) -> None:
    lines = records(3)
    path = write_metrics(tmp_path, [lines[0], "", "{not json", lines[1]])
    with pytest.raises(ValueError, match=r"metrics\.jsonl:3: not valid JSON") as info:
        plot(tmp_path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("line, problem", [
    ("[1, 2]", "expected a JSON object"),
    ('{"loss": 1.0}', "record has no step"),
    ('{"step": 1, "loss": "high"}', "loss must be a number or null"),
])
def test_malformed_record(tmp_path: Path, line: str, problem: str) -> None:
    write_metrics(tmp_path, [records(1)[0], line])
    with pytest.raises(ValueError, match=rf"metrics\.jsonl:2: {problem}"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_empty_metrics_file(tmp_path: Path) -> None:
    write_metrics(tmp_path, ["", ""])
    with pytest.raises(ValueError, match="no metrics records"):
        plot(tmp_path)


def test_missing_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_metrics(tmp_path, records())
    for name in [m for m in sys.modules if m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError) as info:
        plot(tmp_path)
    assert str(info.value) == "composer plot needs matplotlib: pip install matplotlib"
    assert not (tmp_path / "loss.png").exists()


def test_draws_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    write_metrics(tmp_path, records(20, skipped=(4, 5, 11)))
    out = plot(tmp_path)
    assert out == tmp_path / "loss.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    custom = plot(str(tmp_path), out=tmp_path / "plots" / "curves.png")
    assert custom == tmp_path / "plots" / "curves.png" and custom.stat().st_size > 0
