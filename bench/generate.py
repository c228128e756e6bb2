"""Generation speed against ``transformers.generate``: the same converted weights, one CPU, fp32.

For each family (Llama, Mamba2, Nemotron-H; the ~50M-parameter models of ``compare_hf.py``) the
benchmark builds the ``transformers`` model from its config (seeded init), saves it, converts
it with ``composer.convert.from_hf`` and loads ours with ``composer.load``; then

1. checks that greedy decoding agrees (the first ``--check-tokens`` new tokens of a batch-1
   prompt; a mismatch is reported, not hidden);
2. for batch 1 and 8, a prompt of ``--prompt`` random tokens and ``--new`` new tokens (eos
   disabled on both sides, so both produce exactly that many), times ``composer.generate`` and
   ``transformers``' ``generate(do_sample=False)`` (its default cache, SDPA attention, the
   Mamba2 / Nemotron-H torch path as ``mamba_ssm`` is not installed), ``--repeats`` times,
   interleaved. Each run is split at its first new token (ours: ``on_token``; theirs: a
   streamer's second ``put``): prefill = prompt tokens / time to the first new token, decode =
   the other ``new - 1`` tokens x batch / the rest. Reported: medians, and ours / theirs;
3. measures peak memory of each (family, side, batch) in its own process: ``+run`` is the peak
   RSS during ``generate`` minus the RSS after loading (the caches and activations);
4. for a Mamba-only model (the Mamba2 family), ours only: per-token decode time and memory with
   ``--flat-contexts`` tokens of context (prompt), to show the state does not grow: decode
   ms/token, the inference cache's bytes, and the RSS growth across the decode steps.

Goals (issue 13): decode >= 1.5x transformers for Mamba2 and Nemotron-H, >= 1.0x for Llama.

    python bench/generate.py                        # everything (~15 min on 2 cores)
    python bench/generate.py --quick                # prompt 64, 16 new, 1 repeat (~2 min)
    python bench/generate.py --families llama --batches 1 --no-write

A full run appends its table, with date, machine and command, to ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_hf import FAMILIES, ROOT, VOCAB, build_hf, git_state, machine, status_kb  # noqa: E402

SIDES = ("ours", "theirs")
GOALS = {"llama": 1.0, "mamba2": 1.5, "nemotron-h": 1.5}


@dataclass
class Row:
    family: str
    batch: int
    prefill: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SIDES})
    decode: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SIDES})
    memory: dict[str, float] = field(default_factory=dict)

    def med(self, what: str, side: str) -> float:
        return statistics.median(getattr(self, what)[side])


class _Clock:
    """Streamer for transformers' ``generate`` (its first ``put`` is the prompt) and callback
    for ours: the time of the first new token."""

    def __init__(self, skip_first_put: bool) -> None:
        self.puts = -1 if skip_first_put else 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 1:
            self.first = time.perf_counter()

    def end(self) -> None:
        self.last = time.perf_counter()  # the streamer protocol's close (not timed here)


def ids_for(batch: int, prompt: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, prompt), generator=g)


def run_side(side: str, model: torch.nn.Module, ids: torch.Tensor,
             new: int) -> tuple[torch.Tensor, float, float]:
    """Generate; returns the output, the time to the first new token and the total time."""
    import composer

    clock = _Clock(skip_first_put=side == "theirs")
    t0 = time.perf_counter()
    if side == "ours":
        out = composer.generate(model, ids, new, on_token=clock.put)
    else:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=0, do_sample=False, pad_token_id=0,
                                 streamer=clock)
    total = time.perf_counter() - t0
    assert clock.first is not None
    return out, clock.first - t0, total


def load(side: str, folder: Path) -> torch.nn.Module:
    if side == "ours":
        import composer

        return composer.load(folder).eval()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly `new` tokens on both sides
    return model


def probe(spec: dict[str, Any]) -> dict[str, float]:
    """In a fresh process: load one side, generate once, report peak RSS growth in MB."""
    import transformers  # noqa: F401  (the same import floor for both sides)

    import composer  # noqa: F401

    model = load(spec["side"], Path(spec["folder"]))
    with torch.no_grad():  # own copies, not the file mapping (as the timed models)
        for p in model.parameters():
            p.data = p.data.clone()
    ids = ids_for(spec["batch"], spec["prompt"])
    gc.collect()
    loaded_kb = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    run_side(spec["side"], model, ids, spec["new"])
    return {"run_mb": (status_kb("VmHWM") - loaded_kb) / 1024}


def run_probe(side: str, folder: Path, batch: int, args: argparse.Namespace) -> float:
    spec = dict(side=side, folder=str(folder), batch=batch, prompt=args.prompt, new=args.new)
    out = subprocess.run([sys.executable, __file__, "--probe", json.dumps(spec)],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"memory probe {spec} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["run_mb"]


def prepare(name: str, workdir: Path) -> dict[str, Path]:
    from composer.convert import from_hf

    theirs = build_hf(FAMILIES[name]).eval()
    theirs.save_pretrained(workdir / name / "hf")
    from_hf(workdir / name / "hf", workdir / name / "ours")
    return {"ours": workdir / name / "ours", "theirs": workdir / name / "hf"}


def bench_family(name: str, folders: dict[str, Path], args: argparse.Namespace,
                 notes: list[str]) -> list[Row]:
    models = {side: load(side, folders[side]) for side in SIDES}
    n_params = sum(p.numel() for p in models["ours"].parameters())
    check = {side: run_side(side, models[side], ids_for(1, args.prompt, 1),
                            args.check_tokens)[0] for side in SIDES}
    same = torch.equal(check["ours"], check["theirs"])
    notes.append(f"{name} ({n_params / 1e6:.0f}M parameters): greedy tokens "
                 f"{'equal' if same else 'DIFFER'} over the first {args.check_tokens}")
    rows = []
    for batch in args.batches:
        row = Row(name, batch)
        ids = ids_for(batch, args.prompt)
        for side in SIDES:  # warm-up
            run_side(side, models[side], ids[:, :16], 4)
        for _ in range(args.repeats):
            for side in SIDES:
                _, first, total = run_side(side, models[side], ids, args.new)
                row.prefill[side].append(batch * args.prompt / first)
                row.decode[side].append(batch * (args.new - 1) / (total - first))
        rows.append(row)
        print(f"{name} batch {batch}: decode ours {row.med('decode', 'ours'):.1f} tok/s, "
              f"theirs {row.med('decode', 'theirs'):.1f}", flush=True)
    del models
    gc.collect()
    if not args.no_memory:
        for row in rows:
            for side in SIDES:
                row.memory[side] = run_probe(side, folders[side], row.batch, args)
    return rows


def flat_check(folder: Path, contexts: list[int], steps: int) -> list[str]:
    """Ours, a Mamba-only model: decode cost and memory against the context length."""
    import composer

    model = composer.load(folder).eval()
    lines = [f"{'context':>8} {'decode ms/token':>16} {'cache MB':>9} {'RSS growth MB':>14}"]
    for t in contexts:
        ids = ids_for(1, t, 2)
        with torch.inference_mode():
            cache = model.new_cache(1, t + steps)
            logits = model.forward_cached(ids, cache)
            token = logits.argmax(-1)[:, None]
            model.forward_cached(token, cache)  # warm
            gc.collect()
            rss0 = status_kb("VmRSS")
            t0 = time.perf_counter()
            for _ in range(steps - 1):
                token = model.forward_cached(token, cache).argmax(-1)[:, None]
            ms = (time.perf_counter() - t0) / (steps - 1) * 1000
            grown = (status_kb("VmRSS") - rss0) / 1024
        cache_mb = sum(x.numel() * x.element_size() for s in cache.layers.values()
                       for x in vars(s).values()) / 2**20
        lines.append(f"{t:>8} {ms:>16.2f} {cache_mb:>9.2f} {grown:>14.1f}")
        print(lines[-1], flush=True)
    return lines


def table(rows: list[Row]) -> str:
    head = (f"{'family':<11} {'batch':>5} {'prefill ours':>12} {'theirs':>8} {'ratio':>6} "
            f"{'decode ours':>11} {'theirs':>8} {'ratio':>6} {'goal':>5} "
            f"{'+run MB ours':>12} {'theirs':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        p = r.med("prefill", "ours") / r.med("prefill", "theirs")
        d = r.med("decode", "ours") / r.med("decode", "theirs")
        mem = (f"{r.memory['ours']:>12.0f} {r.memory['theirs']:>7.0f}" if r.memory else
               f"{'-':>12} {'-':>7}")
        lines.append(f"{r.family:<11} {r.batch:>5} {r.med('prefill', 'ours'):>12.0f} "
                     f"{r.med('prefill', 'theirs'):>8.0f} {p:>6.2f} "
                     f"{r.med('decode', 'ours'):>11.1f} {r.med('decode', 'theirs'):>8.1f} "
                     f"{d:>6.2f} {GOALS[r.family]:>5.1f} {mem}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="llama,mamba2,nemotron-h")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--flat-contexts", default="512,2048,8192")
    p.add_argument("--flat-steps", type=int, default=64)
    p.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    p.add_argument("--quick", action="store_true", help="prompt 64, 16 new, 1 repeat")
    p.add_argument("--no-write", action="store_true", help="do not append to bench/RESULTS.md")
    p.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"))
    p.add_argument("--probe", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.prompt, args.new, args.repeats, args.check_tokens = 64, 16, 1, 8
        args.flat_contexts, args.flat_steps = "64,256", 8
    args.families = [f for f in args.families.split(",") if f]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.flat_contexts = [int(c) for c in args.flat_contexts.split(",") if c]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.probe:
        print(json.dumps(probe(json.loads(args.probe))))
        return
    start = time.perf_counter()
    rows: list[Row] = []
    notes: list[str] = []
    flat: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            folders = prepare(name, Path(tmp))
            rows += bench_family(name, folders, args, notes)
            if name == "mamba2" and args.flat_contexts:
                flat = flat_check(folders["ours"], args.flat_contexts, args.flat_steps)
    text = table(rows)
    print(text)
    print("\n".join(notes))
    if flat:
        print("\n".join(flat))
    if args.no_write or args.quick:
        return
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    command = "python bench/generate.py " + " ".join(sys.argv[1:] if argv is None else argv)
    section = [
        f"\n## Generation against transformers: `bench/generate.py` ({date})\n",
        f"**Machine**: {machine()}.\n", f"**Code**: {git_state()}.\n",
        f"**Command**: `{command.strip()}` ({time.perf_counter() - start:.0f} s; prompt "
        f"{args.prompt} random tokens, {args.new} new, {args.repeats} repeats per side, "
        "interleaved; medians). Prefill and decode in tokens/s (x batch); +run MB: peak RSS "
        "during one `generate` minus the RSS after loading, each side in its own process.\n",
        "```", text, "```", "", *[f"- {n}" for n in notes], "",
    ]
    if flat:
        section += [f"Mamba-only decoding against context length (ours, batch 1, "
                    f"{args.flat_steps} decode steps after a prompt of `context` tokens):\n",
                    "```", *flat, "```", ""]
    with Path(args.results).open("a") as f:
        f.write("\n".join(section))


if __name__ == "__main__":
    main()
