#!/usr/bin/env bash
# GPU check of composer.kernels on one NVIDIA GPU (written for an H200), in about 10 minutes.
#
#   bash bench/gpu_check.sh
#
# 1. No CUDA device (nvidia-smi lists none): says so and exits 0.
# 2. Python: $PYTHON (default python3) if its torch already sees CUDA; otherwise a venv at
#    $GPU_CHECK_VENV (default ~/.cache/composer-gpu-venv, outside the repo) with `pip install
#    torch` (PyPI's default Linux wheel is a CUDA build).
# 3. composer: `pip install --no-deps --no-build-isolation -e .`, best effort (PYTHONPATH is set
#    to the checkout as well, so the check runs either way).
# 4. The `gpu` extra, one package at a time, each best effort under its own timeout:
#    causal-conv1d, mamba-ssm, transformer-engine[pytorch]. They build against the installed
#    torch (--no-build-isolation); source builds of mamba-ssm take longer than this budget, so
#    put prebuilt wheels in .whl/ (used first, offline) where the machine has no network or no
#    matching wheel. Whatever fails is reported and the check goes on without it.
# 5. python bench/gpu_check.py with what is left of the budget: parity (kernels against the
#    torch path, fp32/bf16), MFU of a 0.93B hybrid with and without kernels; prints the tables
#    and appends them to bench/RESULTS.md.
#
# Settings (environment): GPU_CHECK_BUDGET seconds in all (600), GPU_CHECK_INSTALL=0 to skip
# step 4, GPU_CHECK_INSTALL_S seconds per package (120), PYTHON, GPU_CHECK_VENV.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-600}
PER_PKG=${GPU_CHECK_INSTALL_S:-120}
left() { local s=$((BUDGET - ($(date +%s) - START))); echo $((s > 1 ? s : 1)); }
say() { echo "[gpu_check $(($(date +%s) - START))s] $*"; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
  say "no CUDA device here (nvidia-smi lists no GPU): nothing to check; run this on a machine" \
      "with one NVIDIA GPU (python bench/gpu_check.py --dry-run checks the script on a CPU)"
  exit 0
fi
nvidia-smi -L

PY=${PYTHON:-python3}
has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  >/dev/null 2>&1; }
if has_cuda_torch "$PY"; then
  say "using $PY ($("$PY" -c 'import sys, torch; print(sys.prefix, "torch", torch.__version__)'))"
else
  VENV=${GPU_CHECK_VENV:-$HOME/.cache/composer-gpu-venv}
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" || { say "cannot create $VENV"; exit 1; }
  PY=$VENV/bin/python
  if ! has_cuda_torch "$PY"; then
    say "installing torch (CUDA) into $VENV"
    timeout "$(left)" "$PY" -m pip install -q --progress-bar off torch numpy \
      || say "torch install failed"
  fi
  has_cuda_torch "$PY" || { say "no torch with CUDA in $PY: cannot check"; exit 1; }
fi

PIP=("$PY" -m pip install -q --progress-bar off --retries 1 --timeout 15 --no-build-isolation)
[ -d .whl ] && PIP+=(--find-links .whl)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
timeout 120 "${PIP[@]}" --no-deps -e . >/dev/null 2>&1 \
  || say "pip install -e . failed: running from the checkout (PYTHONPATH)"

declare -A STATUS
if [ "${GPU_CHECK_INSTALL:-1}" != 0 ]; then
  for pkg in causal-conv1d mamba-ssm "transformer-engine[pytorch]"; do
    t=$(( $(left) - 360 ))  # keep about 6 minutes for the check itself
    [ "$t" -gt "$PER_PKG" ] && t=$PER_PKG
    if [ "$t" -lt 20 ]; then STATUS[$pkg]="skipped (budget)"; continue; fi
    log=/tmp/gpu_check_pip_${pkg%%\[*}.log
    say "pip install $pkg (timeout ${t}s)"
    if timeout "$t" "${PIP[@]}" "$pkg" >"$log" 2>&1; then
      STATUS[$pkg]=installed
    else
      STATUS[$pkg]="FAILED or timed out (last lines of $log below)"
      tail -n 3 "$log"
    fi
  done
  for pkg in "${!STATUS[@]}"; do say "$pkg: ${STATUS[$pkg]}"; done
fi

REMAIN=$(( $(left) - 10 ))
if [ "$REMAIN" -lt 120 ]; then
  say "only ${REMAIN}s left of ${BUDGET}s: too little for the check"; exit 1
fi
say "running bench/gpu_check.py (budget ${REMAIN}s)"
timeout $((REMAIN + 5)) "$PY" bench/gpu_check.py --budget "$REMAIN" \
  --command "bash bench/gpu_check.sh (GPU_CHECK_BUDGET=$BUDGET)"
rc=$?
say "done (exit $rc)"
exit $rc
