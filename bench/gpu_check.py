"""One-GPU check of composer (written for an H200 without network); bench/gpu_check.sh drives it.

    python bench/gpu_check.py PHASE [--out DIR] [--seconds S] [--steps N] [--dry-run]
    python bench/gpu_check.py --dry-run [--out DIR]       # the whole check's logic, on a CPU

PHASE is one of the phases below. Each writes its results into ``--out`` (default ``$OUT``, else
``bench/out``) as it goes, prints a short table and also writes that table to ``DIR/PHASE.txt``;
it exits 0 when its checks pass, 1 when one fails. Without a CUDA device a phase says so and
exits 0. With ``--dry-run`` a phase runs on the CPU with tiny shapes instead.

setup    the interpreter, torch / CUDA / triton, the GPU, which kernels and torchao import, where
         composer imports from (and whether ``composer.zoo`` does, which the CLI needs)
         -> setup.json
train    writes train/recipe.yaml: ``model: {pattern, set}`` for the 1.0B hybrid of ``MODEL``
         below plus the optimiser settings of ``recipe()``; sizes it with ``composer build
         --json`` (train/model.json); runs ``python -m composer train --config recipe.yaml
         --tokens synthetic --seq-len 4096 --steps 30 --precision bf16 --ac full --device cuda
         --peak-tflops 989 --log-dir train --log-every 1 --json`` (train/command.txt,
         stdout.txt, train.log); then reads train/metrics.jsonl (one line per step, written by
         the CLI): every step must have its parameters (``device``) and its batch
         (``batch_device``) on CUDA (reported; tests/gpu/test_train.py asserts it, and that
         losses are finite and fall), all steps logged and the final ``--json`` line there
         (else there is no timing). tokens/s and MFU are medians over the
         steps after the first ``warm`` (compilation, autotuning, LR warm-up); MFU as the CLI
         reports it and as checked here: ``composer build``'s flops_per_token (3 x forward,
         attention without the causal discount) x tokens/s / 989 TFLOP/s, the H200 SXM dense
         bf16 peak of NVIDIA's spec sheet -> train/report.json
fp8      the same recipe with ``--precision fp8`` for 6 steps -> fp8/; "skipped: ..." when
         torchao does not import or the GPU is older than compute capability 8.9
kernels  the time (``ms``: one forward + backward, fp32 and bf16) of composer.kernels and of the
         torch path: the SSD scan (mamba_ssm), causal conv + SiLU (causal_conv1d), SDPA per
         backend (flash, cuDNN, efficient, math, and the hook's choice), and whole blocks
         (Mamba-2 mixer, attention, at the trained model's widths) with the kernels off and on.
         A row fails only when its path raises.
         Rows are appended to kernels.jsonl after each check, then kernels.json holds them all.
moe      forward + backward time per token of the routed experts' loop, padded bmm and
         grouped_mm for 8, 64 and 128 experts (``bench/moe.py``; 16384 tokens, d_model 2048,
         d_ff 1024, bf16) -> moe.json
tests    the correctness checks, ``pytest tests/gpu``: each kernel and block above against an
         fp64 torch reference on the same rounded inputs (``err = max|out - ref| / max|ref|``
         over the output and every input gradient; fp32 1e-2, the Triton kernels use TF32
         operands; bf16 3e-2; FP8 1.5e-1), that the blocks dispatch to their kernels, the
         routed experts against an fp64 loop, a MoE layer without host synchronisation, and a
         short training run on CUDA -> tests.txt, tests.xml
summary  reads phases.tsv (``phase<TAB>exit status<TAB>seconds``, one line per phase, written by
         the shell script) and the tables -> summary.txt; exits 1 when a phase failed or timed
         out.

``--dry-run`` alone checks the script on a CPU: ``bash -n`` and shellcheck (when installed) on
gpu_check.sh; the 1.0B recipe parses as YAML, uses only the CLI's keys and builds with ``composer
build``; the train report's logic on made-up metrics (a timed-out run must fail);
then ``GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh``, every phase on the CPU with tiny shapes,
the train phase through the real CLI (reported as "pending" while the CLI rejects the flags),
and the files each phase must leave; and without a GPU, that plain ``bash bench/gpu_check.sh``
exits 0. It writes into a temporary folder unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("composer") is None:  # not installed, not on PYTHONPATH: the checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

from composer import kernels  # noqa: E402
from composer.kernels import conv as kconv  # noqa: E402
from composer.kernels import probe  # noqa: E402
from composer.kernels import scan as kscan  # noqa: E402
from composer.kernels import sdpa as ksdpa  # noqa: E402

PEAK_TFLOPS = 989  # H200 SXM, dense bf16 (NVIDIA's spec sheet)
INF = float("inf")
PHASES = ("setup", "train", "fp8", "moe", "kernels", "tests", "summary")

# ---------------------------------------------------------------- the model and the recipe

MODEL = {
    "pattern": "M-M-M*-M-M-M*-M-",  # 7 Mamba-2, 7 MLP, 2 attention: Nemotron-H's mix
    "set": {
        "d_model": 2048, "vocab_size": 131072, "tie_embeddings": False,
        "attention.n_heads": 16, "attention.n_kv_heads": 4, "attention.d_head": 128,
        "mamba.n_heads": 64, "mamba.d_head": 64, "mamba.n_groups": 8, "mamba.d_state": 128,
        "mamba.chunk_size": 128,
        "mlp.d_ff": 8192, "mlp.activation": "relu2",
    },
}
"""999,441,728 parameters (embedding and lm head 268M each). Attention keeps the default RoPE:
``attention.position=none`` (Nemotron-H's) cannot be given as an override today (the string
"none" is read as null)."""

TINY = {
    "pattern": "M-M*-",
    "set": {
        "d_model": 64, "vocab_size": 512, "tie_embeddings": False,
        "attention.n_heads": 4, "attention.n_kv_heads": 2, "attention.d_head": 16,
        "mamba.n_heads": 4, "mamba.d_head": 32, "mamba.n_groups": 2, "mamba.d_state": 16,
        "mamba.chunk_size": 16,
        "mlp.d_ff": 128, "mlp.activation": "relu2",
    },
}
"""The dry run's model (CPU)."""

CLI_KEYS = {"model", "tokens", "seq_len", "steps", "global_batch_size", "micro_batch_size", "lr",
            "min_lr", "warmup_steps", "schedule", "optimizer", "grad_clip", "precision", "ac",
            "tp", "ep", "dp", "device", "save", "log_dir", "log_every", "peak_tflops", "json"}
CLI_CHOICES = {"schedule": {"constant", "cosine", "linear", "wsd"},
               "optimizer": {"adamw", "muon"}, "precision": {"fp32", "bf16", "fp8"},
               "ac": {"none", "full", "selective"}, "device": {"auto", "cpu", "cuda"}}
"""What ``composer train`` accepts (recipe keys are its flags with underscores)."""


@dataclass(frozen=True)
class Plan:
    """One ``composer train`` run of the check."""

    model: dict = field(default_factory=lambda: MODEL)
    precision: str = "bf16"
    device: str = "cuda"
    seq_len: int = 4096
    steps: int = 30
    warm: int = 5  # steps left out of the tokens/s and MFU medians
    global_batch: int = 8
    micro_batch: int = 4


TRAIN = Plan()
FP8 = replace(TRAIN, precision="fp8", steps=6, warm=2)
DRY = Plan(model=TINY, precision="fp32", device="cpu", seq_len=64, steps=12, warm=2,
           global_batch=2, micro_batch=1)


def recipe(plan: Plan) -> dict:
    """The recipe file: the model and the optimiser; the run's flags go on the command line."""
    return {"model": plan.model, "global_batch_size": plan.global_batch,
            "micro_batch_size": plan.micro_batch, "lr": 3e-4, "min_lr": 3e-5,
            "warmup_steps": min(5, plan.steps), "schedule": "cosine", "optimizer": "adamw",
            "grad_clip": 1.0}


def train_command(plan: Plan, folder: Path) -> list[str]:
    return [sys.executable, "-m", "composer", "train", "--config", str(folder / "recipe.yaml"),
            "--tokens", "synthetic", "--seq-len", str(plan.seq_len), "--steps", str(plan.steps),
            "--precision", plan.precision, "--ac", "full", "--device", plan.device,
            "--peak-tflops", str(PEAK_TFLOPS), "--log-dir", str(folder), "--log-every", "1",
            "--json"]


def build_command(model: dict, seq_len: int) -> list[str]:
    sets = [a for k, v in model["set"].items() for a in ("--set", f"{k}={json.dumps(v)}")]
    return [sys.executable, "-m", "composer", "build", "--pattern", model["pattern"], *sets,
            "--seq-len", str(seq_len), "--json"]


def model_config(model: dict):
    from composer import ModelConfig, apply_overrides

    return apply_overrides(ModelConfig(pattern=model["pattern"]),
                           [f"{k}={json.dumps(v)}" for k, v in model["set"].items()])


def dims(model: dict) -> str:
    s = model["set"]
    return (f"d_model {s['d_model']}, vocab {s['vocab_size']}, Mamba-2 {s['mamba.n_heads']} x "
            f"{s['mamba.d_head']} (groups {s['mamba.n_groups']}, state {s['mamba.d_state']}), "
            f"attention {s['attention.n_heads']} heads / {s['attention.n_kv_heads']} kv x "
            f"{s['attention.d_head']}, MLP {s['mlp.d_ff']} {s['mlp.activation']}")


# ---------------------------------------------------------------- small helpers


class Interrupted(BaseException):
    """SIGTERM (the shell's ``timeout``): stop, but still write what there is."""


def on_sigterm(signum, frame) -> None:
    raise Interrupted


def child_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):
        path = os.pathsep.join(p for p in (path, str(ROOT)) if p)  # after a shim, if any
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def cli_json(cmd: list[str], timeout: float = 120) -> dict:
    """Run a ``composer ... --json`` command; its last stdout line as JSON."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(),
                          cwd=tempfile.gettempdir())  # cwd: not the checkout (see gpu_check.sh)
    if proc.returncode:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
    return rows


def last_json(path: Path) -> dict | None:
    for line in reversed(path.read_text().splitlines() if path.exists() else []):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def median(values) -> float | None:
    values = [v for v in map(num, values) if v is not None]
    return statistics.median(values) if values else None


def fmt(v, spec: str = ".2e") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return format(v, spec) if isinstance(v, float) else str(v)


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def publish(out: Path, name: str, text: str) -> None:
    print(text, flush=True)
    (out / f"{name}.txt").write_text(text + "\n")


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def tail(path: Path, n: int = 8) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("    " + line for line in lines[-n:])


# ---------------------------------------------------------------- setup


def phase_setup(out: Path, dry: bool, pip: str) -> int:
    def attempt(name: str) -> str:
        try:
            mod = __import__(name, fromlist=["_"])
            return f"{getattr(mod, '__version__', 'imports')} ({Path(mod.__file__).parent})"
        except Exception as e:
            return f"not importable: {type(e).__name__}: {e!s:.100}"

    cuda = torch.cuda.is_available()
    info = {"python": f"{sys.executable} ({sys.version.split()[0]})",
            "torch": f"{torch.__version__}, CUDA {torch.version.cuda}, triton "
                     f"{attempt('triton').split(' (')[0]}",
            "gpu": "none (dry run)" if not cuda else
            "{}, {:.1f} GiB, capability {}.{}".format(
                torch.cuda.get_device_name(0),
                torch.cuda.get_device_properties(0).total_memory / 2**30,
                *torch.cuda.get_device_capability(0)),
            "composer": attempt("composer"), "composer.zoo": attempt("composer.zoo"),
            "pip install -e .": pip, "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            "kernels": {n: probe.why_unavailable(n) or "available" for n in probe.KERNELS},
            "torchao": attempt("torchao")}
    write_json(out / "setup.json", info)
    width = max(map(len, info))
    lines = ["== setup"] + [f"{k:<{width}}  {'; '.join(f'{a}: {b}' for a, b in v.items())}"
                            if isinstance(v, dict) else f"{k:<{width}}  {v}"
                            for k, v in info.items()]
    ok = "not importable" not in info["composer.zoo"] and (cuda or dry)
    if "not importable" in info["composer.zoo"]:
        lines.append("FAIL composer.zoo does not import: the CLI cannot run")
    publish(out, "setup", "\n".join(lines))
    return 0 if ok else 1


# ---------------------------------------------------------------- train and fp8


def train_report(folder: Path, rc: int, plan: Plan, info: dict | None,
                 expect: str) -> dict:
    """Read ``folder/metrics.jsonl`` (and the final ``--json`` line) and check them."""
    steps = read_jsonl(folder / "metrics.jsonl")
    final = last_json(folder / "stdout.txt")
    after = steps[plan.warm:] or steps
    tok_s = median(s.get("tokens_per_s") for s in after)
    losses = [num(s.get("loss")) for s in steps]
    where = {k: sorted({str(s.get(k)) for s in steps}) for k in ("device", "batch_device")}
    mem = [num(s.get("max_memory_bytes")) for s in steps]
    fpt = (info or {}).get("flops_per_token")
    r = {"steps": len(steps), "of": plan.steps, "exit": rc,
         "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
         "tokens_per_s": tok_s, "mfu_cli": median(s.get("mfu") for s in after),
         "mfu_check": fpt * tok_s / (PEAK_TFLOPS * 1e12) if fpt and tok_s else None,
         "max_memory_gib": max((m for m in mem if m is not None), default=None),
         "device": where["device"], "batch_device": where["batch_device"], "final": final,
         "n_params": (info or {}).get("n_params"), "flops_per_token": fpt}
    if r["max_memory_gib"] is not None:
        r["max_memory_gib"] /= 2**30
    if rc == 2:  # the project's CLI: bad input is one line on stderr and exit code 2
        lines = (folder / "train.log").read_text().strip().splitlines() \
            if (folder / "train.log").exists() else []
        r["cli_rejected"] = lines[-1] if lines else "exit 2"

    def on(key: str) -> bool:
        return bool(steps) and all(str(s.get(key, "")).startswith(expect) for s in steps)

    # Whether the run gave a timing; that the engine trains on CUDA (parameters and batches
    # there, losses finite and falling, no step skipped) is tests/gpu/test_train.py's.
    checks = [("exit 0", rc == 0, "timed out" if rc == 124 else f"exit {rc}"),
              (f"{plan.steps} steps logged", len(steps) == plan.steps, f"{len(steps)} logged"),
              ("final --json line", bool(final) and final.get("steps") == plan.steps,
               str(final)[:120])]
    r["on_" + expect] = on("device") and on("batch_device")
    r["checks"] = [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks]
    r["ok"] = all(ok for _, ok, _ in checks)
    if r["mfu_cli"] and r["mfu_check"] and abs(r["mfu_cli"] / r["mfu_check"] - 1) > 0.15:
        r["note"] = "the CLI's MFU and the check's differ by more than 15%"
    return r


def train_table(name: str, plan: Plan, r: dict) -> str:
    if "skipped" in r:
        return f"== {name}: skipped: {r['skipped']}"
    n = r.get("n_params") or 0
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    lines = [f"== {name}: {size} hybrid {plan.model['pattern']} ({dims(plan.model)}); "
             f"{plan.precision}, ac full, {plan.global_batch} x {plan.seq_len} tokens/step (micro "
             f"{plan.micro_batch}), {plan.steps} steps on {plan.device}; medians after step "
             f"{plan.warm}; MFU against {PEAK_TFLOPS} TFLOP/s (bf16 dense)",
             f"{'steps':>7} {'loss first -> last':>20} {'tok/s':>9} {'MFU CLI':>8} "
             f"{'MFU check':>9} {'max GiB':>8} {'wall s':>7}  params / batches"]
    loss = f"{fmt(r['loss_first'], '.3f')} -> {fmt(r['loss_last'], '.3f')}"
    wall = (r.get("final") or {}).get("wall_s")
    lines.append(f"{r['steps']:>3}/{r['of']:<3} {loss:>20} {fmt(r['tokens_per_s'], ',.0f'):>9} "
                 f"{pct(r['mfu_cli']):>8} {pct(r['mfu_check']):>9} "
                 f"{fmt(r['max_memory_gib'], '.1f'):>8} {fmt(num(wall), '.1f'):>7}  "
                 f"{','.join(r['device']) or '-'} / {','.join(r['batch_device']) or '-'}")
    lines += [f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']}" + ("" if c["ok"] else
                                                                 f": {c['detail']}")
              for c in r["checks"]]
    if "cli_rejected" in r:
        lines.append(f"the CLI rejected the command line: {r['cli_rejected']}")
    if "note" in r:
        lines.append(f"note: {r['note']}")
    return "\n".join(lines)


def run_logged(cmd: list[str], folder: Path, timeout: float, name: str, steps: int) -> int:
    """Run ``cmd`` (stdout -> stdout.txt, stderr -> train.log), printing progress from
    metrics.jsonl every 20 s; 124 when it ran out of time."""
    t0 = time.monotonic()
    with (folder / "stdout.txt").open("w") as so, (folder / "train.log").open("w") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=child_env(), cwd=folder)
        try:
            while True:
                try:
                    return proc.wait(timeout=max(1.0, min(20.0, t0 + timeout - time.monotonic())))
                except subprocess.TimeoutExpired:
                    rows = read_jsonl(folder / "metrics.jsonl")
                    last = rows[-1] if rows else {}
                    print(f"   {name}: {time.monotonic() - t0:.0f} s, {len(rows)}/{steps} steps,"
                          f" loss {fmt(num(last.get('loss')), '.3f')}, tok/s "
                          f"{fmt(num(last.get('tokens_per_s')), ',.0f')}", flush=True)
                    if time.monotonic() > t0 + timeout:
                        raise Interrupted from None
        except Interrupted:
            proc.terminate()  # the CLI stops at the end of its step and prints its summary
            try:
                proc.wait(timeout=6)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return 124


def skip_fp8(plan: Plan) -> str | None:
    """Why the fp8 run cannot be tried here, else ``None``."""
    try:
        import torchao.float8  # noqa: F401  (what composer.train's fp8 uses)
    except Exception as e:
        return f"torchao is not importable ({type(e).__name__}: {e!s:.80})"
    if plan.device != "cuda" or not torch.cuda.is_available():
        return "fp8 needs a CUDA device"
    if (cap := torch.cuda.get_device_capability(0)) < (8, 9):
        return f"fp8 needs compute capability 8.9+, this GPU has {cap[0]}.{cap[1]}"
    return None


def phase_train(out: Path, name: str, plan: Plan, seconds: float) -> int:
    deadline = time.monotonic() + seconds - 20  # time to stop the CLI and write the report
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    if name == "fp8" and (why := skip_fp8(plan)):
        write_json(folder / "report.json", {"skipped": why})
        publish(out, name, train_table(name, plan, {"skipped": why}))
        return 0
    for stale in ("metrics.jsonl", "stdout.txt", "train.log", "report.json"):
        (folder / stale).unlink(missing_ok=True)  # the CLI appends to metrics.jsonl
    import yaml

    (folder / "recipe.yaml").write_text(
        f"# composer train recipe written by bench/gpu_check.py ({name})\n"
        + yaml.safe_dump(recipe(plan), sort_keys=False))
    try:
        info = cli_json(build_command(plan.model, plan.seq_len), timeout=90)
        write_json(folder / "model.json", info)
    except Exception as e:
        info = None
        print(f"   {name}: composer build failed ({e!s:.200}); MFU check unavailable")
    cmd = train_command(plan, folder)
    (folder / "command.txt").write_text(shlex.join(cmd) + "\n")
    print(f"   {name}: {shlex.join(cmd[1:])}", flush=True)
    rc = run_logged(cmd, folder, deadline - time.monotonic(), name, plan.steps)
    r = train_report(folder, rc, plan, info, expect=plan.device)
    write_json(folder / "report.json", r)
    text = train_table(name, plan, r)
    if not r["ok"] and (log := tail(folder / "train.log")):
        text += f"\nlast lines of {folder / 'train.log'}:\n{log}"
    publish(out, name, text)
    return 0 if r["ok"] else 1


# ---------------------------------------------------------------- kernels: measuring


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def fwd_bwd(fn: Callable, leaves: list[torch.Tensor], dtype: torch.dtype,
            seed: int = 7) -> float:
    """The time (ms) of one ``fn(*leaves)`` forward + backward against a fixed random upstream
    gradient, on copies of ``leaves`` cast to ``dtype``, after one untimed call (Triton compiles
    and autotunes on its first)."""
    xs = [t.detach().to(dtype).requires_grad_() for t in leaves]
    out = fn(*xs)
    g = torch.Generator(device=out.device).manual_seed(seed)
    gy = torch.randn(out.shape, generator=g, device=out.device).to(out.dtype)
    out.backward(gy)
    for t in xs:
        t.grad = None
    dev = out.device.type
    sync(dev)
    t0 = time.perf_counter()
    out = fn(*xs)
    out.backward(gy)
    sync(dev)
    return 1e3 * (time.perf_counter() - t0)


def row(name: str, dtype, path: str, ms: float | None, note: str = "",
        ok: bool | None = None) -> dict:
    """One timing row; ``ok`` False only when the path raised (its parity is tests/gpu's)."""
    return dict(check=name, dtype=str(dtype).replace("torch.", ""), path=path, ms=ms, ok=ok,
                note=note)


def paths(name: str, dtype, leaves: list, torch_fn: Callable, kernel_fn: Callable | None,
          kernel: str, why: str | None) -> list[dict]:
    """Timing rows for the torch path and, when available, the kernel."""
    rows = [row(name, dtype, "torch", fwd_bwd(torch_fn, leaves, dtype))]
    if kernel_fn is None:
        rows.append(row(name, dtype, kernel, None, f"n/a: {why}"))
        return rows
    try:
        rows.append(row(name, dtype, kernel, fwd_bwd(kernel_fn, leaves, dtype)))
    except Exception as e:  # report and go on: one broken kernel must not hide the others
        rows.append(row(name, dtype, kernel, None, f"error: {e!s:.80}", ok=False))
    return rows


# ---------------------------------------------------------------- kernels: timing


def shapes(dry: bool) -> dict:
    if dry:
        return dict(b=1, T=50, H=4, P=8, G=2, N=8, L=16, heads=4, kv=2, Tq=32, d=32)
    return dict(b=2, T=2000, H=64, P=64, G=8, N=128, L=128, heads=16, kv=4, Tq=2048,
                d=128)


def check_scan(dev: str, s: dict, dtypes: list) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(0)
    b, T, H, P, G, N = s["b"], s["T"], s["H"], s["P"], s["G"], s["N"]

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev)

    A = -torch.exp(torch.rand(H, generator=g, device=dev) * math.log(16))
    leaves = [r(b, T, H, P), r(b, T, H) - 2, r(b, T, G, N), r(b, T, G, N), r(H), 0.5 * r(H)]
    kw = dict(dt_softplus=True, dt_limit=(1e-3, INF))

    def make(fn: Callable) -> Callable:
        return lambda x, dt, B, C, D, bias: fn(x, dt, A.to(torch.promote_types(
            x.dtype, torch.float32)), B, C, s["L"], D_H=D, dt_bias_H=bias, **kw)

    ok = probe.on_gpu(leaves[0]) and probe.available("mamba_ssm")
    rows = []
    for dtype in dtypes:
        rows += paths("SSD scan", dtype, leaves, make(kscan.ssd_scan_torch),
                      make(kscan.ssd_scan_kernel) if ok else None, "mamba_ssm",
                      probe.why_unavailable("mamba_ssm") or "CPU tensor")
    return rows


def check_conv(dev: str, s: dict, dtypes: list) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(1)
    C = s["H"] * s["P"] + 2 * s["G"] * s["N"]
    E = s["H"] * s["P"]
    wide = torch.randn(s["b"], s["T"], E + C + s["H"], generator=g, device=dev)
    weight = 0.5 * torch.randn(C, 1, 4, generator=g, device=dev)
    bias = 0.1 * torch.randn(C, generator=g, device=dev)
    ok = probe.on_gpu(wide) and probe.available("causal_conv1d")

    def make(fn: Callable) -> Callable:  # the mixer's input: a slice of in_proj's output
        return lambda w, wt, bs: fn(w[..., E:E + C], wt, bs)

    rows = []
    for dtype in dtypes:
        rows += paths("causal conv + SiLU", dtype, [wide, weight, bias],
                      make(kconv.conv1d_silu_torch),
                      make(kconv.conv1d_silu_kernel) if ok else None, "causal_conv1d",
                      probe.why_unavailable("causal_conv1d") or "CPU tensor")
    return rows


def check_sdpa(dev: str, s: dict, dtypes: list) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(2)
    q = torch.randn(s["b"], s["heads"], s["Tq"], s["d"], generator=g, device=dev)
    k, v = (torch.randn(s["b"], s["kv"], s["Tq"], s["d"], generator=g, device=dev)
            for _ in range(2))

    def attn(ctx: Callable) -> Callable:
        def fn(q, k, v):
            with ctx(q):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return fn

    rows = []
    for dtype in dtypes:
        named = [(b.name.lower(), lambda q, b=b: sdpa_kernel([b])) for b in ksdpa.GPU_ORDER]
        for name, ctx in named + [("hook", kernels.sdpa_context)]:
            try:
                rows.append(row("SDPA causal GQA", dtype, name,
                                fwd_bwd(attn(ctx), [q, k, v], dtype)))
            except Exception as e:
                rows.append(row("SDPA causal GQA", dtype, name, None, f"unsupported: {e!s:.60}"))
    return rows


def set_kernels(disable: str | None) -> None:
    if disable is None:
        os.environ.pop(probe.ENV_DISABLE, None)
    else:
        os.environ[probe.ENV_DISABLE] = disable
    probe.reset()


def block_ms(block, x: torch.Tensor, gy: torch.Tensor) -> float:
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    sync(x.device.type)
    t0 = time.perf_counter()
    out = block(x)
    out.backward(gy.to(out.dtype))
    sync(x.device.type)
    return 1e3 * (time.perf_counter() - t0)


def cast_block(block, dtype: torch.dtype):
    block = copy.deepcopy(block)
    keep = set(getattr(block, "keep_fp32", ()))
    for name, p in block.named_parameters():
        p.data = p.data.to(torch.float32 if name in keep else dtype)
    return block


def check_blocks(dev: str, dry: bool, dtypes: list) -> list[dict]:
    """Forward + backward of whole blocks with the kernels off and on (that they dispatch to
    the kernels and match fp64 is tests/gpu/test_blocks.py's)."""
    from composer.blocks.attention import Attention
    from composer.blocks.mamba2 import Mamba2Mixer

    cfg = model_config(TINY if dry else MODEL)
    rows = []
    for name, cls in (("Mamba-2 mixer", Mamba2Mixer), ("attention block", Attention)):
        block = cls(cfg).to(dev)
        block.reset_parameters(torch.Generator(device=dev).manual_seed(3))
        g = torch.Generator(device=dev).manual_seed(4)
        T = 64 if dry else 2048
        x = torch.randn(2, T, cfg.d_model, generator=g, device=dev)
        gy = torch.randn(2, T, cfg.d_model, generator=g, device=dev)
        for dtype in dtypes:
            blk = cast_block(block, dtype)
            for label, disable in (("torch", "all"), ("kernels", None)):
                set_kernels(disable)
                block_ms(blk, x.to(dtype), gy)  # warm-up (Triton compiles, autotunes)
                note = "CPU: the torch path by design" if label == "kernels" and dev != "cuda" \
                    else ""
                rows.append(row(name, dtype, label, block_ms(blk, x.to(dtype), gy), note))
    set_kernels(None)
    return rows


def timing_rows_table(rows: list[dict]) -> str:
    head = f"{'check':<22} {'dtype':<8} {'path':<19} {'ms':>8}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['check']:<22} {r['dtype']:<8} {r['path']:<19} "
                     f"{fmt(r['ms'], '.2f'):>8}  {r['note']}")
    return "\n".join(lines)


def phase_kernels(out: Path, dry: bool) -> int:
    dev = "cpu" if dry else "cuda"
    s = shapes(dry)
    dtypes = [torch.float32] if dry else [torch.float32, torch.bfloat16]
    env = {name: probe.why_unavailable(name) or "available" for name in probe.KERNELS}
    checks = [("SSD scan", lambda: check_scan(dev, s, dtypes)),
              ("causal conv + SiLU", lambda: check_conv(dev, s, dtypes)),
              ("SDPA causal GQA", lambda: check_sdpa(dev, s, dtypes)),
              ("blocks", lambda: check_blocks(dev, dry, dtypes))]
    jsonl = out / "kernels.jsonl"
    jsonl.write_text("")
    rows: list[dict] = []
    done = "complete"
    torch.manual_seed(0)
    try:
        for name, check in checks:
            t0 = time.perf_counter()
            try:
                new = check()
            except Exception as e:  # one failing check (OOM, a crash) must not hide the rest
                new = [row(name, "-", "-", None, f"check failed: {e!r:.90}", ok=False)]
            rows += new
            with jsonl.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)
            bad = sum(r["ok"] is False for r in new)
            print(f"   kernels: {name}: {len(new)} rows, {bad} failed "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
            if dev == "cuda":
                torch.cuda.empty_cache()
    except Interrupted:
        done = "interrupted (timeout): the rows so far"
    write_json(out / "kernels.json", {"rows": rows, "kernels": env, "status": done})
    failed = [r for r in rows if r["ok"] is False]
    text = "\n".join([f"== kernels ({done}; {len(failed)} failed)",
                      "available: " + "; ".join(f"{k}: {v}" for k, v in env.items()),
                      timing_rows_table(rows)])
    publish(out, "kernels", text)
    return 0 if done == "complete" and not failed else 1


# ---------------------------------------------------------------- moe


def phase_moe(out: Path, dry: bool) -> int:
    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "bench" / "moe.py")
    bench_moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_moe)
    try:  # the shapes of bench/moe.py's gpu_phase; its parity rows are tests/gpu/test_moe.py's
        timing = bench_moe.run_configs(
            tokens=256 if dry else 16384, d_model=64 if dry else 2048, d_ff=32 if dry else 1024,
            repeats=2 if dry else 5, device="cpu" if dry else "cuda",
            dtype=torch.float32 if dry else torch.bfloat16)
        status = "complete"
    except Interrupted:
        timing, status = [], "interrupted (timeout)"
    write_json(out / "moe.json", {"timing": timing, "status": status})
    failed = [r for r in timing if "error" in r]
    text = "\n".join([f"== moe ({status}; {len(failed)} failed)",
                      "expert forward + backward per token (best of the repeats):",
                      bench_moe.timing_table(timing)])
    publish(out, "moe", text)
    return 0 if not failed and status == "complete" else 1


# ---------------------------------------------------------------- tests


def phase_tests(out: Path, dry: bool, seconds: float) -> int:
    """The correctness checks: ``pytest tests/gpu`` (kernels, blocks and MoE against fp64, a
    short training run on CUDA) and the kernel-wiring cases of ``tests/kernels/wiring`` compiled
    (``COMPOSER_KERNEL_WIRING=cuda``: fp32 and bf16, a few seconds), output in tests.txt and a
    JUnit file; ``dry``: their logic on
    the CPU (``COMPOSER_GPU_TESTS_DEVICE=cpu``: the kernel tests skip)."""
    env = {**child_env(), **({"COMPOSER_GPU_TESTS_DEVICE": "cpu"} if dry else
                             {"COMPOSER_KERNEL_WIRING": "cuda"})}
    # on the GPU also the kernel-wiring cases, compiled (fp32 and bf16; tests/kernels/wiring)
    wiring = [] if dry else ["tests/kernels/wiring"]
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", *wiring, "-q", "-rs", "-p",
           "no:cacheprovider", f"--junitxml={out / 'tests.xml'}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=max(10.0, seconds - 10))
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"timed out after {e.timeout:.0f} s\n{e.stdout or ''}"
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    publish(out, "tests", f"== tests ({shlex.join(cmd[1:])}; exit {rc})\n{text.strip()}")
    return 0 if rc == 0 else 1


# ---------------------------------------------------------------- summary


def phase_summary(out: Path) -> int:
    results = []
    tsv = out / "phases.tsv"
    for line in tsv.read_text().splitlines() if tsv.exists() else []:
        name, rc, secs = (line.split("\t") + ["", ""])[:3]
        report = out / name / "report.json"
        skipped = json.loads(report.read_text()).get("skipped") if report.exists() else None
        result = ("ok" if rc == "0" and not skipped else f"skipped: {skipped}" if rc == "0"
                  else "NOT RUN (time budget)" if rc == "skipped"
                  else "TIMED OUT" if rc in ("124", "137") else f"FAIL (exit {rc})")
        results.append((name, result, secs))
    bad = [n for n, res, _ in results if not res.startswith(("ok", "skipped"))]
    lines = [f"== gpu_check summary ({out})", f"{'phase':<8} {'seconds':>7}  result"]
    lines += [f"{n:<8} {s:>7}  {res}" for n, res, s in results]
    lines.append(f"{'FAILED: ' + ', '.join(bad) if bad else 'all phases passed'}")
    tables = [(out / f"{n}.txt").read_text().rstrip() for n, _, _ in results
              if (out / f"{n}.txt").exists()]
    text = "\n\n".join(tables + ["\n".join(lines)])
    print("\n".join(lines))
    (out / "summary.txt").write_text(text + "\n")
    print(f"(all tables: {out / 'summary.txt'})")
    return 1 if bad or not results else 0


# ---------------------------------------------------------------- the dry run


def dry_run(out: Path) -> int:
    """See the module docstring (``--dry-run`` alone)."""
    import yaml

    script = ROOT / "bench" / "gpu_check.sh"
    results: list[tuple[str, str, str]] = []

    def record(name: str, fn: Callable[[], str | None]) -> None:
        print(f"-- {name}", flush=True)
        try:
            detail = fn() or ""
            status = "pending" if detail.startswith("pending") else "ok"
        except Exception as e:
            status, detail = "FAIL", f"{type(e).__name__}: {e}"
        results.append((name, status, detail))

    def sh(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                              env={**os.environ, **env})

    def shell_syntax() -> str:
        p = sh(["bash", "-n", str(script)])
        assert p.returncode == 0, p.stderr
        if not shutil.which("shellcheck"):
            return "bash -n ok; shellcheck not installed"
        p = sh(["shellcheck", str(script)])
        assert p.returncode == 0, p.stdout[-1500:]
        return "bash -n and shellcheck ok"

    def recipe_1b() -> str:
        folder = out / "recipe-1b"
        folder.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(recipe(TRAIN), sort_keys=False)
        (folder / "recipe.yaml").write_text(text)
        back = yaml.safe_load((folder / "recipe.yaml").read_text())
        assert back == recipe(TRAIN), "the recipe does not read back as written"
        assert set(back) <= CLI_KEYS, f"keys the CLI lacks: {set(back) - CLI_KEYS}"
        assert set(back["model"]) == {"pattern", "set"}
        for key, allowed in CLI_CHOICES.items():
            assert back.get(key, next(iter(allowed))) in allowed, f"{key}: {back[key]}"
        flags = train_command(TRAIN, folder)[3:]
        keys = {f[2:].replace("-", "_") for f in flags if f.startswith("--")} - {"config"}
        assert keys <= CLI_KEYS, f"flags the CLI lacks: {keys - CLI_KEYS}"
        info = cli_json(build_command(TRAIN.model, TRAIN.seq_len))
        write_json(folder / "model.json", info)
        n = info["n_params"]
        assert 0.9e9 <= n <= 1.1e9, f"{n:,} parameters, not about 1B"
        tiny = cli_json(build_command(TINY, DRY.seq_len))
        return (f"{n:,} parameters, {info['n_layers']} layers {info['layer_counts']}, "
                f"{info['flops_per_token'] / 1e9:.2f} GFLOP/token at seq 4096; tiny model "
                f"{tiny['n_params']:,}")

    def report_logic() -> str:
        folder = out / "report-logic"
        folder.mkdir(parents=True, exist_ok=True)
        info = {"flops_per_token": 4.66e9, "n_params": 1e9}

        def fake(n: int, batch_device: str = "cuda:0", rc: int = 0) -> dict:
            with (folder / "metrics.jsonl").open("w") as f:
                for i in range(n):
                    f.write(json.dumps(dict(
                        step=i + 1, loss=11.0 - 0.1 * i, lr=3e-4, grad_norm=1.0,
                        tokens=(i + 1) * 32768, tokens_per_s=80000.0 + i, mfu=0.377,
                        skipped=False, max_memory_bytes=30 * 2**30, device="cuda:0",
                        batch_device=batch_device)) + "\n")
                f.write('{"step": 31, "lo')  # a line cut short
            (folder / "stdout.txt").write_text(json.dumps(dict(
                steps=n, loss=11.0 - 0.1 * (n - 1), tokens=n * 32768, tokens_per_s=79000.0,
                wall_s=50.0)) + "\n")
            return train_report(folder, rc, TRAIN, info, expect="cuda")

        good = fake(30)
        assert good["ok"], [c for c in good["checks"] if not c["ok"]]
        assert abs(good["mfu_check"] - 4.66e9 * good["tokens_per_s"] / 989e12) < 1e-9
        print(train_table("train (made-up metrics)", TRAIN, good))
        assert not fake(30, batch_device="cpu")["on_cuda"], "a batch on the CPU goes unseen"
        short = fake(12, rc=124)
        failed = {c["check"] for c in short["checks"] if not c["ok"]}
        assert failed == {"exit 0", "30 steps logged", "final --json line"}, failed
        return "passes good metrics; fails a timed-out run; sees a batch on the CPU"

    def whole_script() -> str:
        folder = out / "sh"
        p = sh(["bash", str(script)], OUT=str(folder), GPU_CHECK_DRY_RUN="1")
        (out / "sh.log").write_text(p.stdout + p.stderr)
        print(p.stdout[-6000:], p.stderr[-2000:])
        for f in ("setup.json", "setup.txt", "train/recipe.yaml", "train/command.txt",
                  "train/report.json", "train.txt", "fp8/report.json", "kernels.jsonl",
                  "kernels.json", "moe.json", "moe.txt", "tests.txt", "phases.tsv",
                  "summary.txt"):
            assert (folder / f).exists(), f"{f} was not written"
        assert yaml.safe_load((folder / "train/recipe.yaml").read_text())["model"] == TINY
        assert len(read_jsonl(folder / "kernels.jsonl")) >= 10, "kernel rows missing"
        phases = dict(line.split("\t")[:2] for line in (folder / "phases.tsv").read_text()
                      .splitlines())
        assert set(phases) == {"setup", "train", "fp8", "moe", "kernels", "tests"}, phases
        failed = {k for k, v in phases.items() if v != "0"}
        train = json.loads((folder / "train/report.json").read_text())
        if failed == {"train"} and "cli_rejected" in train:
            assert p.returncode == 1, f"exit {p.returncode} with train failing"
            return ("pending: every phase ran; the train CLI rejects the command line: "
                    f"{train['cli_rejected']}")
        assert not failed, f"phases failed: {failed} (see {folder}/summary.txt)"
        assert p.returncode == 0, f"exit {p.returncode}"
        return f"every phase ran on the CPU and passed; train: {train['steps']} steps"

    def no_gpu() -> str:
        has_gpu = shutil.which("nvidia-smi") and "GPU" in sh(["nvidia-smi", "-L"]).stdout
        if has_gpu:
            return "not run: this machine has a GPU"
        p = sh(["bash", str(script)], OUT=str(out / "no-gpu"))
        assert p.returncode == 0 and "no CUDA device" in p.stdout, (p.returncode, p.stdout)
        return "says so, exits 0"

    record("gpu_check.sh syntax", shell_syntax)
    record("1.0B recipe: YAML, keys, composer build", recipe_1b)
    record("train report assertions (made-up metrics)", report_logic)
    record("GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh", whole_script)
    record("bash bench/gpu_check.sh without a GPU", no_gpu)
    print(f"\n== dry run ({out})")
    for name, status, detail in results:
        print(f"{status:<8} {name}: {detail}")
    return 1 if any(s == "FAIL" for _, s, _ in results) else 0


# ---------------------------------------------------------------- main


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", nargs="?", choices=PHASES)
    p.add_argument("--out", type=Path, default=None, help="results folder ($OUT, bench/out)")
    p.add_argument("--seconds", type=float, default=300, help="time for the phase")
    p.add_argument("--steps", type=int, default=None, help="train steps (30)")
    p.add_argument("--pip", default="not run", help="setup: what `pip install -e .` said")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    return p.parse_args()


def main() -> int:
    args = parse()
    signal.signal(signal.SIGTERM, on_sigterm)
    if args.phase is None:
        if not args.dry_run:
            print("gpu_check.py: give a PHASE or --dry-run; bash bench/gpu_check.sh runs them all")
            return 2
        out = args.out or Path(tempfile.mkdtemp(prefix="gpu_check_dry_"))
        out.mkdir(parents=True, exist_ok=True)
        return dry_run(out.resolve())
    out = (args.out or Path(os.environ.get("OUT") or ROOT / "bench" / "out")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.phase == "summary":
        return phase_summary(out)
    if not args.dry_run and not torch.cuda.is_available():
        print(f"gpu_check.py {args.phase}: no CUDA device here (torch.cuda.is_available() is "
              "False): nothing to check; --dry-run runs it on the CPU")
        return 0
    if args.phase == "setup":
        return phase_setup(out, args.dry_run, args.pip)
    if args.phase == "kernels":
        return phase_kernels(out, args.dry_run)
    if args.phase == "moe":
        return phase_moe(out, args.dry_run)
    if args.phase == "tests":
        return phase_tests(out, args.dry_run, args.seconds)
    plan = DRY if args.dry_run else TRAIN if args.phase == "train" else FP8
    if args.steps and args.phase == "train" and not args.dry_run:
        plan = replace(plan, steps=args.steps, warm=min(plan.warm, args.steps // 3))
    try:
        return phase_train(out, args.phase, plan, args.seconds)
    except Interrupted:
        print(f"gpu_check.py {args.phase}: interrupted (timeout)")
        return 124


if __name__ == "__main__":
    sys.exit(main())
