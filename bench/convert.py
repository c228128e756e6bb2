"""Conversion benchmark: ``composer convert`` against ``cp -r`` of the same files.

Builds, tensor by tensor and without materialising a model, a Llama-3.2-1B-shaped Hugging Face
checkpoint with random bf16 weights (two shards and an index), then times each step in its own
child process and reads that child's peak RSS from ``os.wait4`` (``ru_maxrss``):

  cp -r          copying the source folder (the floor for any tool that reads and writes it)
  import only    ``python -c "import torch, composer.build.builder, composer.convert.families,
                 composer.cli"``: what a conversion imports, nothing converted (the RSS floor,
                 and the time floor of a conversion that copied nothing before importing torch)
  from-hf        ``composer convert from-hf SRC OURS``
  to-hf          ``composer convert to-hf OURS BACK``
  transformers   ``AutoModelForCausalLM.from_pretrained(SRC, dtype=bf16)`` + ``save_pretrained``

Each step runs ``--runs`` times. The first run is ``cold``: its input files are evicted from the
page cache (``sync`` + ``posix_fadvise(DONTNEED)``; Python and torch stay cached). The others are
``warm`` (input cached) and the fastest is reported, with the slowest and the median beside it
(wall and CPU time; ``med x cp`` is median over median): on a VM, writing
into memory the guest has not touched lately costs extra system time, so single runs vary by up to
2x. Dirty pages are flushed (``sync``, untimed) before every run, and no time includes writing the
output back to disk. ``wall s`` is the whole child (interpreter start and imports included);
``work s`` is the time the tool reports for the conversion itself: both directions copy while
they import torch (docs/conversion.md), so it includes that import. Finally the to-hf output is
compared with the source byte for byte, tensor by tensor, in chunks.

The children read cached bytecode (:func:`bytecode_cache`), as an installed package does, unless
``--compile-every-run``.

Targets (converters issue): peak RSS within the largest tensor + ~300 MB, time within ~3x ``cp``.

    python bench/convert.py [--workdir DIR] [--size 1b|small] [--keep] [--runs N] [--json]
                            [--no-transformers] [--compile-every-run]

``--size small`` (~100 MB) checks the script in under a minute; its ratios say little, since
``cp`` takes a few hundredths of a second and the conversions are all interpreter start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from composer.portable import DTYPES, PlannedTensor, ShardedWriter, TensorSource

MB, GB = 10**6, 10**9
TARGET_X_CP = 3.0
TARGET_RSS_OVER_LARGEST = 300 * MB
CHUNK_BYTES = 32 * 2**20

# Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json), and a ~100 MB model of the same family.
SIZES: dict[str, dict] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
               max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}),
    "small": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=32000,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True),
}

TRANSFORMERS_SCRIPT = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
t1 = time.perf_counter()
model.save_pretrained(sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - t0, "load_s": t1 - t0}))
"""


# ---------------------------------------------------------------- the source checkpoint


def llama_tensors(hf: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes exactly as ``LlamaForCausalLM.save_pretrained`` writes them."""
    d, f, v, hd = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["head_dim"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, d))]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (d,)),
                (f"{p}.self_attn.q_proj.weight", (q, d)),
                (f"{p}.self_attn.k_proj.weight", (kv, d)),
                (f"{p}.self_attn.v_proj.weight", (kv, d)),
                (f"{p}.self_attn.o_proj.weight", (d, q)),
                (f"{p}.post_attention_layernorm.weight", (d,)),
                (f"{p}.mlp.gate_proj.weight", (f, d)),
                (f"{p}.mlp.up_proj.weight", (f, d)),
                (f"{p}.mlp.down_proj.weight", (d, f))]
    out.append(("model.norm.weight", (d,)))
    if not hf["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, d)))
    return out


def build_checkpoint(folder: Path, size: str, seed: int = 0) -> None:
    """Write config.json and two bf16 shards + index, streaming random rows (~32 MB at a time)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**SIZES[size], architectures=["LlamaForCausalLM"], dtype="bfloat16")
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    plan = [PlannedTensor(n, "BF16", s) for n, s in llama_tensors(config.to_dict())]
    total, largest = sum(t.nbytes for t in plan), max(t.nbytes for t in plan)
    writer = ShardedWriter(folder, plan, max_shard_bytes=(total + largest) // 2 + 1)
    g = torch.Generator().manual_seed(seed)
    for t in writer.plan_order():
        if len(t.shape) == 1:  # norm weights, centred on 1 like trained ones
            chunk = 1 + 0.1 * torch.randn(t.shape, generator=g)
            writer.write(t.name, chunk.to(torch.bfloat16).view(torch.uint8).numpy().data)
            continue
        rows, cols = t.shape
        step = max(1, CHUNK_BYTES // (2 * cols))
        for a in range(0, rows, step):
            chunk = 0.02 * torch.randn(min(step, rows - a), cols, generator=g)
            writer.write(t.name, chunk.to(torch.bfloat16).view(torch.uint8).numpy().data)
    writer.close()


def tensor_map(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (i.dtype, i.shape) for n, i in TensorSource(folder).tensors.items()}


# ---------------------------------------------------------------- measuring


@dataclass
class Run:
    step: str
    cache: str
    wall_s: float
    """Whole child process, start-up and imports included."""
    work_s: float | None
    """Time the tool reports for the work itself (after imports), when it reports one."""
    cpu_s: float
    peak_rss: int


# A fresh, small process that runs the command and reports its rusage. Measuring from the big
# benchmark process itself would be wrong: Linux carries the RSS high-water mark of the forking
# process across exec into the child's ru_maxrss, so every child would read >= our own RSS.
LAUNCHER = """
import json, os, subprocess, sys, time
out = open(sys.argv[1], "wb")
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[2:], stdout=out, stderr=subprocess.STDOUT)
_, status, ru = os.wait4(proc.pid, 0)
print(json.dumps({"wall_s": time.perf_counter() - start, "rc": os.waitstatus_to_exitcode(status),
                  "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss": ru.ru_maxrss * 1024}))
"""


CHILD_ENV = dict(os.environ)
"""The environment of the measured children (:func:`bytecode_cache`)."""


def bytecode_cache(folder: Path) -> None:
    """Let the children read compiled bytecode, as an installed package does: Python writes
    ``__pycache__`` on first import unless ``PYTHONDONTWRITEBYTECODE`` is set (some sandboxes
    set it), and then compiles every composer module on every start (~0.3-1 s on this VM, none
    of it conversion). Caches go under ``folder`` (``PYTHONPYCACHEPREFIX``), not the source
    tree, and are filled once here."""
    CHILD_ENV.pop("PYTHONDONTWRITEBYTECODE", None)
    CHILD_ENV["PYTHONPYCACHEPREFIX"] = str(folder)
    subprocess.run([sys.executable, "-c", "import torch, composer.convert.families, "
                    "composer.cli, composer.build.builder"], env=CHILD_ENV, check=True)


def measure(step: str, cache: str, argv: list[str]) -> Run:
    """Run ``argv`` in a fresh child; its wall time, CPU time and peak RSS."""
    os.sync()
    with tempfile.NamedTemporaryFile() as out:
        launched = subprocess.run([sys.executable, "-I", "-S", "-c", LAUNCHER, out.name, *argv],
                                  capture_output=True, text=True, check=True, env=CHILD_ENV)
        m = json.loads(launched.stdout)
        text = Path(out.name).read_text(errors="replace")
    if m["rc"] != 0:
        raise SystemExit(f"{step} failed (exit {m['rc']}): {' '.join(argv)}\n{text[-3000:]}")
    work = None
    lines = text.strip().splitlines()
    if lines and lines[-1].startswith("{"):
        work = json.loads(lines[-1]).get("seconds")
    return Run(step, cache, m["wall_s"], work, m["cpu_s"], m["peak_rss"])


def evict(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache (clean pages only, hence the sync)."""
    os.sync()
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def others_cpu_s() -> float:
    """CPU seconds the whole machine has been busy, less this process and its children: what
    other processes took from the measurements."""
    import resource

    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    ours = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))
    return busy - ours


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_steps(work: Path, src: Path, runs: int, with_transformers: bool) -> list[Run]:
    py = [sys.executable]
    cli = py + ["-m", "composer", "convert"]
    ours, back, copy, ref = work / "ours", work / "back", work / "copy", work / "transformers"
    results = []
    for i in range(runs):
        cache = "cold" if i == 0 else "warm"
        cold = cache == "cold"
        for path in (copy, ours, back, ref):
            remove(path)
        if cold:
            evict(src)
        results.append(measure("cp -r", cache, ["cp", "-r", str(src), str(copy)]))
        remove(copy)
        results.append(measure("import only", cache,
                               py + ["-c", "import torch, composer.build.builder, "
                                     "composer.convert.families, composer.cli"]))
        if cold:
            evict(src)
        results.append(measure("from-hf", cache, cli + ["from-hf", str(src), str(ours), "--json"]))
        if cold:
            evict(ours)
        results.append(measure("to-hf", cache, cli + ["to-hf", str(ours), str(back), "--json"]))
        if with_transformers:
            if cold:
                evict(src)
            results.append(measure("transformers", cache,
                                   py + ["-c", TRANSFORMERS_SCRIPT, str(src), str(ref)]))
            if tensor_map(ref) != tensor_map(src):
                raise SystemExit("transformers saved other names/shapes than the built source: "
                                 "the benchmark checkpoint is not shaped like LlamaForCausalLM")
    remove(ref)
    return results


# ---------------------------------------------------------------- checking


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_bytes(a: Path, b: Path) -> int:
    """Every tensor of ``a`` equals ``b``'s byte for byte; read in row chunks. Returns count."""
    from safetensors import safe_open

    ta, tb = TensorSource(a).tensors, TensorSource(b).tensors
    if sorted(ta) != sorted(tb):
        raise SystemExit(f"tensor names differ: {sorted(set(ta) ^ set(tb))[:5]}")
    for name, info in ta.items():
        other = tb[name]
        if (info.dtype, info.shape) != (other.dtype, other.shape):
            raise SystemExit(f"{name}: {info.dtype}{list(info.shape)} became "
                             f"{other.dtype}{list(other.shape)}")
        with safe_open(str(info.file), "pt") as fa, safe_open(str(other.file), "pt") as fb:
            sa, sb = fa.get_slice(name), fb.get_slice(name)
            rows = info.shape[0] if info.shape else 1
            row_bytes = max(1, info.nbytes // max(1, rows))
            step = max(1, CHUNK_BYTES // row_bytes)
            for r in range(0, rows, step):
                x = sa[r:r + step] if info.shape else fa.get_tensor(name)
                y = sb[r:r + step] if info.shape else fb.get_tensor(name)
                if not torch.equal(as_bytes(x), as_bytes(y)):
                    raise SystemExit(f"{name}: bytes differ in rows {r}..{r + step}")
    return len(ta)


# ---------------------------------------------------------------- report


def summarise(results: list[Run], model_bytes: int, largest: int) -> list[dict]:
    """One row per step and cache state: the fastest run (``wall_s``), and the slowest."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in results:
        groups.setdefault((r.step, r.cache), []).append(r)
    best = {k: min(v, key=lambda r: r.wall_s) for k, v in groups.items()}
    rows = []
    for (step, cache), r in best.items():
        cp = best[("cp -r", cache)].wall_s
        med = statistics.median(x.wall_s for x in groups[step, cache])
        rows.append({**asdict(r), "n": len(groups[step, cache]),
                     "max_wall_s": max(x.wall_s for x in groups[step, cache]),
                     "median_wall_s": med,
                     "median_cpu_s": statistics.median(x.cpu_s for x in groups[step, cache]),
                     "median_x_cp": med / statistics.median(
                         x.wall_s for x in groups["cp -r", cache]),
                     "gb_per_s": model_bytes / r.wall_s / GB, "x_cp": r.wall_s / cp,
                     "work_x_cp": r.work_s / cp if r.work_s is not None else None,
                     "rss_over_largest": r.peak_rss - largest,
                     "rss_per_model": r.peak_rss / model_bytes})
    return sorted(rows, key=lambda r: r["cache"] == "warm")


def print_table(rows: list[dict]) -> None:
    head = (f"{'step':<13}{'cache':<6}{'n':>2}{'wall s':>8}{'max s':>7}{'med s':>7}{'work s':>8}"
            f"{'CPU s':>7}{'med CPU':>8}{'GB/s':>6}{'x cp':>8}{'med x cp':>9}{'work x cp':>10}"
            f"{'peak RSS MB':>12}{'-largest':>9}{'RSS/model':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        work = f"{r['work_s']:.2f}" if r["work_s"] is not None else "-"
        work_x = f"{r['work_x_cp']:.2f}" if r["work_x_cp"] is not None else "-"
        print(f"{r['step']:<13}{r['cache']:<6}{r['n']:>2}{r['wall_s']:>8.2f}"
              f"{r['max_wall_s']:>7.2f}{r['median_wall_s']:>7.2f}{work:>8}{r['cpu_s']:>7.2f}"
              f"{r['median_cpu_s']:>8.2f}{r['gb_per_s']:>6.2f}{r['x_cp']:>8.2f}"
              f"{r['median_x_cp']:>9.2f}{work_x:>10}{r['peak_rss'] / MB:>12.0f}"
              f"{r['rss_over_largest'] / MB:>9.0f}{r['rss_per_model']:>10.2f}")


def print_targets(rows: list[dict]) -> None:
    for r in rows:
        if r["step"] not in ("from-hf", "to-hf"):
            continue
        t_ok = "ok" if r["x_cp"] <= TARGET_X_CP else "MISSED"
        w_ok = "ok" if r["work_x_cp"] <= TARGET_X_CP else "MISSED"
        m_ok = "ok" if r["rss_over_largest"] <= TARGET_RSS_OVER_LARGEST else "MISSED"
        print(f"target {r['step']:<8}{r['cache']:<5} time {r['x_cp']:.2f}x cp ({t_ok}; median "
              f"{r['median_x_cp']:.2f}x), "
              f"work {r['work_x_cp']:.2f}x ({w_ok}) [<= {TARGET_X_CP:g}x]; "
              f"peak RSS = largest tensor {r['rss_over_largest'] / MB:+.0f} MB ({m_ok}) "
              "[<= +300 MB]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where to build and convert (default: a "
                        "new folder under /tmp)")
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--runs", type=int, help="runs per step: the first cold, the others "
                        "warm, of which the fastest is reported (default: 3 for 1b, 2 for small)")
    parser.add_argument("--no-transformers", action="store_true",
                        help="skip the transformers load+save reference")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--json", action="store_true", help="one line of JSON on stdout")
    parser.add_argument("--compile-every-run", action="store_true",
                        help="keep PYTHONDONTWRITEBYTECODE as the environment has it (default: "
                        "the children read cached bytecode, as an installed package does)")
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="composer-bench-convert-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "hf"
    try:
        remove(src)
        start = time.perf_counter()
        build_checkpoint(src, args.size)
        built_s = time.perf_counter() - start
        infos = TensorSource(src).tensors.values()
        model_bytes = sum(i.nbytes for i in infos)
        largest = max(i.nbytes for i in infos)
        n_params = sum(i.nbytes // DTYPES[i.dtype].itemsize for i in infos)
        if shutil.disk_usage(work).free < 4 * model_bytes:
            raise SystemExit(f"{work}: needs {4 * model_bytes / GB:.1f} GB free")
        with_tf = not args.no_transformers and mem_available() > 3 * model_bytes
        if not with_tf and not args.no_transformers:
            print("skipping transformers: not enough free memory", file=sys.stderr)
        runs = args.runs or (3 if args.size == "1b" else 2)
        if not args.compile_every_run:
            bytecode_cache(work / "pycache")
        start, others = time.perf_counter(), others_cpu_s()
        results = run_steps(work, src, max(1, runs), with_tf)
        span, others = time.perf_counter() - start, others_cpu_s() - others
        n_checked = assert_same_bytes(src, work / "back")
        rows = summarise(results, model_bytes, largest)
    finally:
        if not args.keep:
            remove(work if args.workdir is None else src)
            if args.workdir is not None:
                for name in ("ours", "back", "copy", "transformers", "pycache"):
                    remove(work / name)
    summary = {"size": args.size, "n_params": n_params, "model_bytes": model_bytes,
               "bytecode_cached": not args.compile_every_run,
               "largest_tensor_bytes": largest, "build_s": built_s,
               "roundtrip_identical_tensors": n_checked, "others_cpu_s": others,
               "measure_s": span,
               "summary": rows,
               "runs": [asdict(r) for r in results]}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"model: Llama {args.size}, {n_params / 1e9:.3f}B params, bf16, "
          f"{model_bytes / GB:.2f} GB in 2 shards; largest tensor {largest / MB:.0f} MB "
          f"(built in {built_s:.1f}s)")
    print("children read cached bytecode" if not args.compile_every_run else
          "children compile composer's modules on every start (PYTHONDONTWRITEBYTECODE as set)")
    print(f"other processes used {others:.1f} CPU-s during the {span:.0f} s of measurements "
          f"({others / span:.0%} of one of {os.cpu_count()} cores)\n")
    print_table(rows)
    print()
    print_targets(rows)
    print(f"\nround trip: to-hf output equals the source byte for byte ({n_checked} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
