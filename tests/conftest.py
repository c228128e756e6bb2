"""Markers by place: every test under a directory of ``BY_DIRECTORY`` gets its marker
(tests/parallel: ``distributed``), so ``pytest -m "not distributed"`` (or ``convert``,
``kernels``, ``gpu``) needs no mark in the files.
``slow`` is marked by hand on the tests that take more than about 1.5 s on two CPU cores
(``pytest -m "not slow"``: the fast subset, under 3 minutes)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BY_DIRECTORY = {"parallel": "distributed", "convert": "convert", "kernels": "kernels",
                "gpu": "gpu"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            parts = Path(str(item.path)).resolve().relative_to(HERE).parts
        except ValueError:  # a test outside tests/ (a file given on the command line)
            continue
        if len(parts) > 1 and parts[0] in BY_DIRECTORY:
            item.add_marker(BY_DIRECTORY[parts[0]])
