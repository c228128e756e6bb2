#!/usr/bin/env bash
# One-GPU check of composer, written for an H200 with no network, in at most 8 minutes.
#
#   bash bench/gpu_check.sh                    # results in $OUT, else bench/out/
#   python bench/gpu_check.py --dry-run        # checks this script's logic on a CPU
#
# No CUDA device (nvidia-smi lists no GPU): says so and exits 0. Nothing is installed from the
# network unless GPU_CHECK_INSTALL=1: by default it uses whatever torch and kernels import.
#
# Phases, each under `timeout` with what is left of the budget (a phase that would get too
# little is skipped); each writes its results into $OUT as it goes and prints a short table
# (the tables, also in $OUT/PHASE.txt, are collected in $OUT/summary.txt at the end):
#   setup    a python whose torch sees CUDA ($PYTHON, else .venv/bin/python, python3, python);
#            the checkout on PYTHONPATH; unless composer.zoo imports from the checkout already
#            (pyproject maps zoo/ and tools/convert/ into the package, which PYTHONPATH alone
#            does not), `pip install --no-index --no-deps --no-build-isolation -e .`, best
#            effort and offline ($OUT/pip_install_e.log); when composer.zoo still does not
#            import, a symlinked copy of the package in a temp dir goes first on PYTHONPATH
#            -> $OUT/setup.json: versions, GPU, which kernels and torchao import
#   train    `python -m composer train` of a 1.0B hybrid (M-M-M*-M-M-M*-M-, d_model 2048,
#            vocab 131072), bf16, --ac full, 30 steps of 8 x 4096 synthetic tokens, MFU against
#            989 TFLOP/s (the timing; that training runs on CUDA is tests/gpu's)
#            -> $OUT/train/ (recipe.yaml, model.json, command.txt, metrics.jsonl, stdout.txt,
#            train.log, report.json)
#   fp8      the same for 6 steps with --precision fp8 -> $OUT/fp8/ ("skipped: ..." without
#            torchao)
#   moe      the expert time per token of the loop, padded bmm and grouped GEMMs for 8, 64
#            and 128 experts (bench/moe.py) -> $OUT/moe.json
#   kernels  forward + backward time of composer.kernels and the torch path -> $OUT/kernels.jsonl
#            (rows as they come), $OUT/kernels.json
#   tests    the correctness checks: pytest tests/gpu (kernels, blocks and routed experts
#            against fp64, a MoE layer without host synchronisation, a short training run on
#            CUDA) and tests/kernels/wiring compiled (COMPOSER_KERNEL_WIRING=cuda: composer's
#            dispatch into mamba_ssm's and fla's Triton kernels against the torch path, fp32
#            and bf16) -> $OUT/tests.txt, $OUT/tests.xml
#   flex     tests/kernels/test_flex.py on CUDA: the FlexAttention paths, compiled (its block
#            near the end; GPU_CHECK_FLEX=0 skips it) -> $OUT/flex.txt, flex.log
#   summary  one line per phase -> $OUT/summary.txt; exit status 0 when every phase passed
# bench/gpu_check.py (its docstring) says what each phase checks and measures.
#
# Budget (GPU_CHECK_BUDGET, 460 s, counted from the start): the setup steps have their own
# timeouts (60 s each; about 10 s in all as a rule); then train gets at most 200 s, fp8 60 s,
# moe 60 s, kernels 120 s and tests the rest, each less what the phases after it need at least
# (fp8 50 s, moe 40 s, kernels 60 s, tests 90 s, summary 15 s, and 10 s for a last
# `timeout -k`); a phase left under 30 s is skipped, which the summary counts as not passed.
#
# Environment:
#   OUT                 results folder (default bench/out)
#   GPU_CHECK_BUDGET    seconds in all (460)
#   GPU_CHECK_PHASES    which of train,fp8,moe,kernels,tests to run (all five); setup always
#                       runs
#   GPU_CHECK_STEPS     train steps (30)
#   PYTHON              the interpreter to use (default: the first of .venv/bin/python,
#                       python3, python whose torch sees CUDA)
#   GPU_CHECK_INSTALL=1 opt in to installing from the network: torch into a venv at
#                       GPU_CHECK_VENV (~/.cache/composer-gpu-venv) when no torch sees CUDA,
#                       then mamba-ssm, causal-conv1d and torchao, each best effort (120 s)
#   GPU_CHECK_DRY_RUN=1 every phase on the CPU with tiny shapes (what --dry-run uses)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-460}
PHASES=${GPU_CHECK_PHASES:-train,fp8,moe,kernels,tests}
STEPS=${GPU_CHECK_STEPS:-30}
OUT=${OUT:-$ROOT/bench/out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
export OUT
for p in ${PHASES//,/ }; do
  case $p in
    train | fp8 | moe | kernels | tests) ;;
    *) echo "GPU_CHECK_PHASES: unknown phase $p (train, fp8, moe, kernels, tests)" >&2; exit 2 ;;
  esac
done
left() { echo $((BUDGET - ($(date +%s) - START))); }
say() { echo "[gpu_check $(($(date +%s) - START))s] $*"; }
selected() { case ",$PHASES," in *",$1,"*) return 0 ;; esac; return 1; }

DRY=()
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
  DRY=(--dry-run)
  say "dry run: every phase on the CPU with tiny shapes, results in $OUT"
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
  say "no CUDA device here (nvidia-smi lists no GPU): nothing to check; run this on a machine" \
      "with one NVIDIA GPU (python bench/gpu_check.py --dry-run checks the script on a CPU)"
  exit 0
else
  nvidia-smi -L
fi

# ---- setup: the interpreter, composer importable, optional installs
usable() {  # usable PYTHON: its torch imports (and sees CUDA unless dry)
  local need='torch.cuda.is_available()'
  [ ${#DRY[@]} -gt 0 ] && need=True
  timeout 60 "$1" -c "import sys, torch; sys.exit(0 if $need else 1)" >/dev/null 2>&1
}
if [ -n "${PYTHON:-}" ]; then CANDIDATES=("$PYTHON"); else
  CANDIDATES=("$ROOT/.venv/bin/python" python3 python); fi
PY=
for c in "${CANDIDATES[@]}"; do
  if command -v "$c" >/dev/null 2>&1 && usable "$c"; then PY=$(command -v "$c"); break; fi
done
if [ -z "$PY" ] && [ "${GPU_CHECK_INSTALL:-0}" = 1 ]; then
  VENV=${GPU_CHECK_VENV:-$HOME/.cache/composer-gpu-venv}
  say "no torch with CUDA among ${CANDIDATES[*]}: installing torch into $VENV (network)"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  timeout "$(left)" "$VENV/bin/python" -m pip install -q --progress-bar off torch numpy \
    pyyaml einops safetensors huggingface-hub >"$OUT/pip_torch.log" 2>&1 \
    || say "torch install failed: $OUT/pip_torch.log"
  usable "$VENV/bin/python" && PY=$VENV/bin/python
fi
if [ -z "$PY" ]; then
  say "no python among ${CANDIDATES[*]} has a torch that sees CUDA: set PYTHON, or" \
      "GPU_CHECK_INSTALL=1 to pip install torch (needs the network)"
  exit 1
fi
say "python: $PY"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
zoo_ok() {  # composer.zoo imports, from this checkout (the CLI needs it)
  timeout 60 "$PY" -c "import sys, composer.zoo as z
sys.exit(not z.__file__.startswith('$ROOT/'))" >/dev/null 2>&1
}
if zoo_ok; then PIP_STATUS="not needed (composer and composer.zoo import from the checkout)"
elif timeout 60 "$PY" -m pip install --no-index --no-deps --no-build-isolation -q -e . \
       >"$OUT/pip_install_e.log" 2>&1; then PIP_STATUS=ok
else PIP_STATUS="failed (pip_install_e.log): running from the checkout on PYTHONPATH"; fi
if ! zoo_ok; then
  SHIM=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_src.XXXXXX") && mkdir "$SHIM/composer" \
    && ln -s "$ROOT"/composer/* "$SHIM/composer/" && ln -s "$ROOT/zoo" "$SHIM/composer/zoo" \
    && ln -s "$ROOT/tools/convert" "$SHIM/composer/convert" \
    && export PYTHONPATH="$SHIM:$PYTHONPATH" && PIP_STATUS="$PIP_STATUS; package laid out in $SHIM"
  trap 'rm -rf "$SHIM"' EXIT  # symlinks only
fi
say "pip install -e .: $PIP_STATUS"

if [ "${GPU_CHECK_INSTALL:-0}" = 1 ]; then
  for pkg in causal-conv1d mamba-ssm torchao; do
    t=$(( $(left) - 300 )); [ "$t" -gt 120 ] && t=120
    if [ "$t" -lt 20 ]; then say "pip install $pkg: skipped (budget)"; continue; fi
    say "pip install $pkg (network, timeout ${t}s)"
    timeout "$t" "$PY" -m pip install -q --progress-bar off --no-build-isolation "$pkg" \
      >"$OUT/pip_$pkg.log" 2>&1 || say "pip install $pkg failed: $OUT/pip_$pkg.log"
  done
fi

# ---- the phases
: >"$OUT/phases.tsv"
# phase NAME MOST RESERVE [ARGS]: bench/gpu_check.py NAME under a timeout of MOST seconds, or
# of what is left less RESERVE (what the phases after it need) when that is less
phase() {
  local name=$1 most=$2 reserve=$3 t t0 rc
  shift 3
  t=$(( $(left) - reserve )); [ "$t" -gt "$most" ] && t=$most
  if [ "$t" -lt 30 ]; then
    say "$name: skipped (too little time: $(left)s of ${BUDGET}s left)"
    printf '%s\tskipped\t0\n' "$name" >>"$OUT/phases.tsv"
    return
  fi
  say "$name (timeout ${t}s; $(left)s of ${BUDGET}s left)"
  t0=$(date +%s)
  timeout -k 10 "$t" "$PY" bench/gpu_check.py "$name" --out "$OUT" --seconds "$t" \
    ${DRY[@]+"${DRY[@]}"} "$@"
  rc=$?
  [ "$rc" = 124 ] && say "$name: timed out after ${t}s"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >>"$OUT/phases.tsv"
}
R_FP8=0; selected fp8 && R_FP8=50
R_MOE=0; selected moe && R_MOE=40
R_KERNELS=0; selected kernels && R_KERNELS=60
R_TESTS=0; selected tests && R_TESTS=90

phase setup 60 0 --pip "$PIP_STATUS"
selected train && phase train 200 $((R_FP8 + R_MOE + R_KERNELS + R_TESTS + 25)) --steps "$STEPS"
selected fp8 && phase fp8 60 $((R_MOE + R_KERNELS + R_TESTS + 25))
selected moe && phase moe 60 $((R_KERNELS + R_TESTS + 25))
selected kernels && phase kernels 120 $((R_TESTS + 25))
R_FLEX=0; [ "${GPU_CHECK_FLEX:-1}" = 1 ] && R_FLEX=60  # the flex block below
selected tests && phase tests 300 $((25 + R_FLEX))

# ---- flex (issue 28, item 3): the FlexAttention paths on CUDA, compiled ------------------------
# tests/kernels/test_flex.py on CUDA tensors: every masked attention (packed documents, sliding
# window, sinks, context-parallel chunks, the adaptive layout, cached calls) through the compiled
# flex_attention against the dense-mask path on the same GPU, fp32, forward and gradients, with
# the dense-mask builders raising on the flex path. At most 90 s (its compiles dominate); skipped
# by GPU_CHECK_FLEX=0 or in a dry run. -> $OUT/flex.txt (pytest's output), a line in the summary.
if [ "${GPU_CHECK_FLEX:-1}" = 1 ] && [ ${#DRY[@]} -eq 0 ]; then
  t=$(( $(left) - 25 )); [ "$t" -gt 90 ] && t=90
  if [ "$t" -lt 30 ]; then
    say "flex: skipped (too little time: $(left)s of ${BUDGET}s left)"
    printf 'flex\tskipped\t0\n' >>"$OUT/phases.tsv"
  else
    say "flex (timeout ${t}s; $(left)s of ${BUDGET}s left)"
    t0=$(date +%s)
    timeout -k 10 "$t" "$PY" -m pytest -q -p no:cacheprovider -W ignore::UserWarning \
      tests/kernels/test_flex.py >"$OUT/flex.log" 2>&1
    rc=$?
    { echo "== flex: tests/kernels/test_flex.py on CUDA (exit $rc)"; tail -n 15 "$OUT/flex.log"; } \
      >"$OUT/flex.txt"
    printf 'flex\t%s\t%s\n' "$rc" "$(( $(date +%s) - t0 ))" >>"$OUT/phases.tsv"
  fi
fi
# ---- end of the flex block ---------------------------------------------------------------------

# ---- BEGIN fp8-te (issue 29): a short FP8 run through transformer-engine, when TE imports
# 6 steps of a small hybrid with --precision fp8 --fp8-backend te, then tests/gpu/test_fp8_te.py
# (te.Linear with bf16's names, losses near bf16's) -> $OUT/fp8_te/ (metrics.jsonl, stdout.txt,
# train.log, pytest.txt, status). Not in the summary's phases: its status file says what ran.
mkdir -p "$OUT/fp8_te"
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
  echo "skipped: dry run" >"$OUT/fp8_te/status"
elif ! "$PY" -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
  echo "skipped: transformer_engine.pytorch does not import" >"$OUT/fp8_te/status"
  say "fp8-te: skipped (transformer-engine does not import)"
elif [ "$(left)" -lt 60 ]; then
  echo "skipped: $(left)s left" >"$OUT/fp8_te/status"
  say "fp8-te: skipped (too little time)"
else
  say "fp8-te: 6 steps with --fp8-backend te"
  printf '%s\n' 'model: {pattern: "M-M*-M-M*-", set: {d_model: 1024, vocab_size: 32768}}' \
    >"$OUT/fp8_te/recipe.yaml"  # 95M parameters
  timeout -k 5 60 "$PY" -m composer train --config "$OUT/fp8_te/recipe.yaml" \
    --tokens synthetic --seq-len 2048 --steps 6 --global-batch-size 4 --micro-batch-size 2 \
    --precision fp8 --fp8-backend te --device cuda --log-every 1 --log-dir "$OUT/fp8_te" \
    --json >"$OUT/fp8_te/stdout.txt" 2>"$OUT/fp8_te/train.log"
  rc=$?
  echo "train exit $rc" >"$OUT/fp8_te/status"
  if [ "$(left)" -gt 40 ]; then
    timeout -k 5 30 "$PY" -m pytest -q tests/gpu/test_fp8_te.py >"$OUT/fp8_te/pytest.txt" 2>&1
    echo "pytest exit $?" >>"$OUT/fp8_te/status"
  fi
  say "fp8-te: $(tr '\n' ' ' <"$OUT/fp8_te/status")"
fi
# ---- END fp8-te
timeout 15 "$PY" bench/gpu_check.py summary --out "$OUT"
rc=$?
say "done in $(($(date +%s) - START))s (exit $rc); results in $OUT"
exit $rc
