"""The GPU kernel paths' wiring, proven with the real Triton kernels (issue 28): composer's own
dispatch (argument order, layouts, casts, ``seq_idx`` / ``cu_seqlens`` from ``doc_ids``,
initial and final states, chunk sizes, the backward) against the torch path, for mamba_ssm's
SSD scan and gated RMSNorm and fla's gated delta rule and Kimi delta attention, hook by hook
and through whole mixers (:mod:`tests.kernels.wiring.cases` says what and within what).

One worker process runs every case (Triton's interpreter has to be chosen before triton is
imported, so it cannot share this process) and the tests read its results. On a CPU the
kernels run interpreted (``TRITON_INTERPRET=1`` and :mod:`tests.kernels.wiring.shim`); on a GPU
the same cases run compiled with ``COMPOSER_KERNEL_WIRING=cuda`` (bench/gpu_check.sh does).
Skipped, with the reason, when the kernel packages are absent, or when a GPU is present and
that variable is not set (the interpreter shim is for CPU-only torch builds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.wiring import cases, shim

ROOT = Path(__file__).resolve().parents[3]
WORKER_TIMEOUT = 600


def _skip_reason() -> str | None:
    if cases.MODE not in ("interpret", "cuda"):
        return f"COMPOSER_KERNEL_WIRING={cases.MODE!r}: expected interpret or cuda"
    if cases.MODE == "cuda":
        if not torch.cuda.is_available():
            return "COMPOSER_KERNEL_WIRING=cuda: no GPU"
        return shim.missing()
    if torch.cuda.is_available():
        return ("a GPU is present: run these compiled with COMPOSER_KERNEL_WIRING=cuda "
                "(bench/gpu_check.sh does)")
    return shim.missing()


REASON = _skip_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("wiring") / "results.json"
    env = {**os.environ, "COMPOSER_KERNEL_WIRING": cases.MODE, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)  # the worker's shim sets it
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.wiring.cases", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=WORKER_TIMEOUT)
    assert proc.returncode == 0, f"the worker failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("case_id", cases.case_ids())
def test_kernel_path_matches_torch_path(results: dict, case_id: str) -> None:
    r = results[case_id]
    assert "error" not in r, f"{case_id}: {r['error']}\n{r.get('traceback', '')}"
    name, dtype = case_id.split(":")
    case = next(c for c in cases.CASES if c.name == name)
    missing = sorted(set(case.kernels) - set(r["launched"]))
    assert not missing, f"{case_id}: Triton kernels {missing} never launched: {r['launched']}"
    assert r["torch_path_launched"] == [], "the torch path launched Triton kernels"
    tol = cases.TOL[dtype]
    assert r["err"] <= tol, (f"{case_id}: kernel path vs torch path {r['err']:.2e} > {tol:.0e}"
                             f" (outputs then gradients: {r['errs']})")


@pytest.mark.parametrize("name", sorted(cases.BROKEN))
def test_a_mis_wired_dispatch_fails(results: dict, name: str) -> None:
    """The comparison can fail: the scan's dispatch without ``seq_idx`` (documents leak into
    each other) is off by orders of magnitude more than the bound."""
    r = results[name]
    assert "error" not in r, r.get("traceback")
    assert r["launched"], "the mis-wired run must still reach the kernel"
    _, dtype = cases.BROKEN[name]
    assert r["err"] > 100 * cases.TOL[dtype], (name, r["err"])
