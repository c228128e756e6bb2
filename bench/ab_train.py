"""Interleaved A/B of ``bench/compare_hf.py``'s train step: this checkout against other revisions
and/or transformers, one worker process per side, steps taken in turn.

On a shared machine two benchmark runs made minutes apart differ by more than most single changes
are worth, and even ``compare_hf.py``'s interleaving (ours, theirs, ours, ...) in one process sees
bursts of other load. Here each side lives in its own process (a revision's ``composer`` is ``git
archive``-d into a temporary folder and put first on that worker's ``PYTHONPATH``), the model is the
family's from ``compare_hf.py`` (built and saved by transformers, converted by this checkout, and by
a revision's own converter for that revision's worker), and the driver asks the workers for one step
each in rotating order, round after round, while the others wait. Per round it records each side's
wall time and process CPU time (user + system, all threads; with one thread that is the step's own
work, without the time the scheduler gave to other processes) and prints the median of each and the
median over rounds of the paired ratio against the first side, with its quartiles.

    python bench/ab_train.py --family nemotron-h --sides .,HEAD~1       # this tree vs HEAD~1
    python bench/ab_train.py --family mamba2 --sides .,theirs --shape 1x2048
    python bench/ab_train.py --family llama --sides .,94bd55f,theirs --rounds 20 --threads 1

``.`` is this checkout's working tree (uncommitted changes included), ``theirs`` transformers,
anything else a git revision. ``--threads`` (default 1: fair to other users of a shared machine)
sets each worker's intra-op threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import compare_hf as hf  # noqa: E402


def export_revision(rev: str, into: Path) -> Path:
    """``composer/``, ``zoo/`` and ``tools/`` of ``rev`` under ``into/rev`` (no worktree)."""
    tree = into / rev.replace("/", "_")
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "composer", "zoo", "tools"], cwd=ROOT,
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def worker(spec: dict) -> None:
    """One side: load, warm up, then one step per ``step`` line on stdin, a JSON line back."""
    torch.set_num_threads(spec["threads"])
    side = "theirs" if spec["side"] == "theirs" else "ours"
    folder = Path(spec["folder"]) / side
    if spec["side"] not in (".", "theirs"):  # the revision's own converter and config format
        from composer.convert import from_hf

        folder = Path(spec["tmp"]) / f"ours-{spec['side']}"
        from_hf(Path(spec["folder"]) / "theirs", folder, force=True)
    model = hf.load_side(side, folder)
    with torch.no_grad():  # own copies, not the file mapping (as compare_hf's timed models)
        for p in model.parameters():
            p.data = p.data.clone()
    step = hf.make_step(model, side, spec["mode"], hf.token_ids(hf.Shape.parse(spec["shape"])))
    first = [float(step()) for _ in range(spec["warmup"])][0]
    import composer

    print(json.dumps({"ready": True, "loss": first, "composer": composer.__file__}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        print(json.dumps({"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0}),
              flush=True)


def quartiles(v: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    return q[0], statistics.median(v), q[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="nemotron-h", choices=list(hf.FAMILIES))
    p.add_argument("--sides", default=".,theirs",
                   help="comma-separated: '.' (this tree), 'theirs', or git revisions")
    p.add_argument("--shape", default="4x256")
    p.add_argument("--mode", default="train", choices=hf.MODES)
    p.add_argument("--size", choices=("small", "base", "large"), default="base")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the converted checkpoints here (reused when present)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    sides = args.sides.split(",")
    with tempfile.TemporaryDirectory(prefix="ab_train.") as tmp:
        folder = (args.workdir or Path(tmp) / "models") / f"{args.family}-{args.size}"
        if not (folder / "ours").exists():
            folder.mkdir(parents=True, exist_ok=True)
            hf.prepare(hf.resize(hf.FAMILIES[args.family], args.size, None), folder)
        procs = {}
        for side in sides:
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            if side not in (".", "theirs"):
                tree = export_revision(side, Path(tmp) / "revs")
                env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
            spec = dict(side=side, folder=str(folder), shape=args.shape, mode=args.mode,
                        threads=args.threads, warmup=args.warmup, tmp=tmp)
            procs[side] = subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(spec)], cwd=ROOT, env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for side, proc in procs.items():  # one at a time: loading is not what is measured
            line = proc.stdout.readline()
            if not line:
                raise SystemExit(f"the {side} worker failed (its error is above)")
            hello = json.loads(line)
            print(f"{side:>10}: first loss {hello['loss']:.6f}, composer {hello['composer']}")
        times: dict[str, dict[str, list[float]]] = {s: {"wall": [], "cpu": []} for s in sides}
        for r in range(args.rounds):
            order = sides[r % len(sides):] + sides[:r % len(sides)]  # rotate who goes first
            for side in order:
                procs[side].stdin.write("step\n")
                procs[side].stdin.flush()
                out = json.loads(procs[side].stdout.readline())
                for k in ("wall", "cpu"):
                    times[side][k].append(out[k])
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    base = sides[0]
    print(f"\n{args.family} {args.mode} {args.shape}, {args.threads} thread(s), {args.rounds} "
          f"rounds; per side: median s/step (wall, cpu); side / {base}: the paired ratio of "
          "their times per round, median [quartiles] (> 1: the side is slower)")
    for side in sides:
        line = f"{side:>10}: wall {statistics.median(times[side]['wall']):.3f} " \
               f"cpu {statistics.median(times[side]['cpu']):.3f}"
        if side != base:
            for k in ("wall", "cpu"):
                ratio = [s / b for b, s in zip(times[base][k], times[side][k], strict=True)]
                lo, mid, hi = quartiles(ratio)
                line += f"  {k} {side}/{base} {mid:.3f} [{lo:.3f}-{hi:.3f}]"
        print(line)


if __name__ == "__main__":
    main()
