"""Speed against ``transformers``: the same ~50M-parameter model, both implementations, one CPU.

For each family (Llama, Qwen3-MoE, Mamba2, Nemotron-H) the benchmark builds the ``transformers``
model from a config (its own seeded init, fp32), saves it, converts the folder with
``composer.convert.from_hf`` and loads ours with ``composer.load``; then

1. checks that the logits agree (relative max error < 1e-4, as the converter tests require; or,
   for models deep enough that fp32 rounding alone exceeds that on both sides, ours no further
   from transformers-in-fp64 than transformers' own fp32 logits) and skips the family with a
   message if they do not;
2. times ``forward`` (``eval()``, ``no_grad``) and ``train`` (``zero_grad``, forward with labels,
   ``backward``, AdamW ``step``; one optimizer per side, torch's fused AdamW on both as each
   side's own trainer defaults to, ``--adamw for-loop`` for the plain one: :func:`make_step`)
   at batch 4 x 256 tokens and, for the
   Mamba families, 1 x 2048. ``--warmup`` untimed steps per side, then ``--iters`` timed steps
   per side, interleaved (ours, theirs, ours, theirs, ...) so that drift of the machine hits
   both. Reported: median tokens/s with min and max, and ours / theirs of the medians;
3. measures peak memory of each (model, side, mode, shape) in its own process (``--probe``,
   two at a time with half the threads each; no timing runs meanwhile): the model is loaded
   from the saved folder, its weights copied out of the file mapping (as the timed models hold
   them), then one forward or two train steps run. Both sides import ``transformers`` and
   ``composer``; transformers' modeling modules, imported by its side only, add ~90 MB.
   ``peak`` is the process's ``VmHWM`` during the steps (peak RSS; read from ``/proc`` rather
   than ``ru_maxrss``, which after ``exec`` still holds the high-water mark of the process that
   forked it), ``+run`` that peak minus the RSS after loading;
4. measures this machine's fp32 matmul peak (best of a few 2048^3 products by MKL's
   ``torch.mm`` and by oneDNN, at the start and the end of the run) and reports each model's
   achieved FLOP/s as a fraction of it (MFU).
   FLOPs per token are ``composer.model_stats(ours, T).forward_flops_per_token`` (2 per
   multiply-add of every matmul incl. the LM head, plus the attention and SSD scan terms), x3
   for a train step; the same count serves both sides (same architecture). These are model
   FLOPs: the SSD terms use the config's ``chunk_size``, while our CPU path tiles the scan at 64
   steps and so does fewer of them (``composer.kernels.scan.TORCH_CHUNK``).

transformers is called with ``use_cache=False`` (ours keeps no cache) and with its defaults
otherwise (SDPA attention, its default experts implementation; the Mamba2 and Nemotron-H torch
path, as ``mamba_ssm`` is not installed). Qwen3-MoE sets ``output_router_logits=True`` so that
both sides compute the load-balancing loss, as training does. All cores, fp32.

Targets (train step, ours / theirs; issue 29's): Mamba2 >= 2.0, Nemotron-H >= 1.6, Qwen3-MoE
>= 1.5, Llama >= 1.1; forward >= 1.0 everywhere; peak memory no higher than transformers'.

    python bench/compare_hf.py                       # everything (< 15 min on 2 cores)
    python bench/compare_hf.py --wait-quiet 300      # the same on a machine shared with others
    python bench/compare_hf.py --quick               # small shapes, 3 iterations (< 2 min)
    python bench/compare_hf.py --families llama,mamba2 --no-write
    python bench/compare_hf.py --profile mamba2:train:1x2048     # top ops of both sides
    python bench/compare_hf.py --size small --shapes 4x256,1x1024  # ~14-23M models, other shapes
    python bench/compare_hf.py --size large --shapes 4x256         # ~100-115M models

A full run appends its table, with date, machine and command, to ``bench/RESULTS.md``
(``--results PATH`` elsewhere, ``--no-write`` not at all). Needs ``transformers``
(``pip install -e ".[test]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
LOGIT_TOL = 1e-4
FORWARD_TARGET = 1.0
BUSY_RETRY = 0.15
SIDES = ("ours", "theirs")
MODES = ("forward", "train")


@dataclass(frozen=True)
class Shape:
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def __str__(self) -> str:
        return f"{self.batch}x{self.seq}"

    @staticmethod
    def parse(text: str) -> Shape:
        b, t = text.split("x")
        return Shape(int(b), int(t))


@dataclass(frozen=True)
class Family:
    name: str
    hf_class: str
    """A ``transformers`` model class; its config class is ``config_class``."""
    config_class: str
    config: dict[str, Any]
    shapes: tuple[Shape, ...]
    quick_shapes: tuple[Shape, ...]
    train_target: float


VOCAB = 32000
DECODER = dict(vocab_size=VOCAB, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
               tie_word_embeddings=True)
SHORT, LONG = Shape(4, 256), Shape(1, 2048)
QUICK_SHORT, QUICK_LONG = Shape(2, 64), Shape(1, 256)

# ~50M parameters each, vocabulary 32000; dimensions in the proportions of the published models
# (Llama 3.2, Qwen3-30B-A3B, mamba2-130m, Nemotron-H). Nemotron-H never ties its LM head, which
# is why it lands at 57M.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", "LlamaConfig",
           dict(DECODER, intermediate_size=2048, rope_theta=500000.0),
           (SHORT,), (QUICK_SHORT,), 1.1),
    Family("qwen3-moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
           dict(DECODER, intermediate_size=2048, moe_intermediate_size=256, num_experts=8,
                num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                norm_topk_prob=True, output_router_logits=True, rope_theta=1000000.0),
           (SHORT,), (QUICK_SHORT,), 1.5),
    Family("mamba2", "Mamba2ForCausalLM", "Mamba2Config",
           dict(vocab_size=VOCAB, hidden_size=512, num_hidden_layers=16, num_heads=16,
                head_dim=64, expand=2, n_groups=1, state_size=128, chunk_size=256,
                conv_kernel=4, tie_word_embeddings=True),
           (SHORT, LONG), (QUICK_SHORT, QUICK_LONG), 2.0),
    Family("nemotron-h", "NemotronHForCausalLM", "NemotronHConfig",
           dict(vocab_size=VOCAB, hidden_size=512, hybrid_override_pattern="M-M*-M-M-" * 2,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                intermediate_size=1024, mlp_hidden_act="relu2", mamba_num_heads=16,
                mamba_head_dim=64, n_groups=2, ssm_state_size=128, chunk_size=128,
                conv_kernel=4, tie_word_embeddings=False),
           (SHORT, LONG), (QUICK_SHORT, QUICK_LONG), 1.6),
)}


# Other sizes for `--size`: ~14-23M and ~100-111M parameters, the same families and proportions
# (fields not named keep the base value). The train targets are meant to hold at every size.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "small": {
        "llama": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=1024),
        "qwen3-moe": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=1024,
                          moe_intermediate_size=128),
        "mamba2": dict(hidden_size=256, num_hidden_layers=12, num_heads=8),
        "nemotron-h": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=512, mamba_num_heads=8),
    },
    "large": {
        "llama": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, intermediate_size=2048),
        "qwen3-moe": dict(hidden_size=768, num_hidden_layers=10, num_attention_heads=12,
                          num_key_value_heads=4, intermediate_size=2048,
                          moe_intermediate_size=384),
        "mamba2": dict(hidden_size=768, num_hidden_layers=20, num_heads=24),
        "nemotron-h": dict(hidden_size=768, num_attention_heads=12, num_key_value_heads=4,
                           intermediate_size=2048, mamba_num_heads=24),
    },
}


def resize(family: Family, size: str, shapes: tuple[Shape, ...] | None) -> Family:
    """``family`` at another ``--size`` and/or with other ``--shapes``."""
    config = dict(family.config, **SIZES.get(size, {}).get(family.name, {}))
    return dataclasses.replace(family, config=config, shapes=shapes or family.shapes)


# ---------------------------------------------------------------- models and steps


def build_hf(family: Family, seed: int = 0) -> torch.nn.Module:
    import transformers

    config = getattr(transformers, family.config_class)(**family.config)
    torch.manual_seed(seed)
    return getattr(transformers, family.hf_class)(config).float()


def load_side(side: str, folder: Path) -> torch.nn.Module:
    if side == "ours":
        import composer

        return composer.load(folder)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def make_step(model: torch.nn.Module, side: str, mode: str, ids: torch.Tensor,
              adamw: str = "fused") -> Callable[[], torch.Tensor]:
    """One forward or one train step of ``model``; returns the logits or the loss.

    ``adamw``: ``"fused"`` (default) is the optimizer each side's own trainer takes by default,
    the same kernel for both: transformers' ``Trainer`` defaults to ``adamw_torch_fused`` on
    torch >= 2.8 (``TrainingArguments.optim``), composer's engine to torch's fused AdamW
    (``composer/train/optim.py``). ``"for-loop"`` is torch's plain CPU default (``fused`` and
    ``foreach`` unset), what this benchmark used before 2026-12-04."""
    if mode == "forward":
        model.eval()

        def forward() -> torch.Tensor:
            with torch.no_grad():
                if side == "ours":
                    return model(ids)
                return model(input_ids=ids, use_cache=False).logits

        return forward
    model.train()
    # One optimizer per side and mode, the same implementation for both.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True if adamw == "fused" else None)

    def train() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        if side == "ours":
            loss = model(ids, ids).loss
        else:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return train


def token_ids(shape: Shape, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (shape.batch, shape.seq), generator=g)


# ---------------------------------------------------------------- machine


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """Best fp32 ``n^3`` matmul rate in FLOP/s (a multiply-add is 2 FLOPs) of the two GEMM
    libraries in torch's CPU build: ``torch.mm`` (MKL) and, where present, oneDNN (what our
    projections use on the CPU, ``composer.kernels.linear``; the faster of the two here)."""
    from composer.kernels.linear import onednn_present

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    products = [lambda: torch.mm(a, b, out=out)]
    if onednn_present():
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
    best = float("inf")
    for product in products:
        product()
        for _ in range(reps):
            t0 = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import transformers

    return (f"{os.cpu_count()} CPUs ({cpu}), {ram:.0f} GiB RAM, {platform.system()} "
            f"{platform.release()}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, {torch.get_num_threads()} threads")


def git_state() -> str:
    """The commit measured, and whether the package sources differ from it."""
    def git(*a: str) -> str:
        out = subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "composer", "tools", "zoo")
    return f"commit {commit}" + (" + uncommitted changes in composer/tools/zoo" if dirty else "")


def status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


# ---------------------------------------------------------------- timing


@dataclass
class Row:
    family: str
    mode: str
    shape: Shape
    target: float
    flops_per_token: int
    tok_s: dict[str, list[float]] = field(default_factory=dict)
    other_load: float = 0.0
    """Share of the machine's CPU time that other processes used while this row was timed."""
    memory: dict[str, dict[str, float]] = field(default_factory=dict)

    def median(self, side: str) -> float:
        return statistics.median(self.tok_s[side])

    @property
    def ratio(self) -> float:
        return self.median("ours") / self.median("theirs")

    def mfu(self, side: str, peak: float) -> float:
        return self.median(side) * self.flops_per_token / peak


class OtherLoad:
    """CPU time used by other processes (and the hypervisor's steal) since construction, as a
    share of all cores: on a shared machine a busy neighbour slows both sides, and interleaving
    cancels slow drift but not bursts, so the report shows how quiet each measurement was."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        usages = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        own = sum(u.ru_utime + u.ru_stime for u in usages)
        return time.perf_counter(), busy, own

    def fraction(self) -> float:
        (t0, busy0, own0), (t1, busy1, own1) = self.start, self._read()
        other = (busy1 - busy0) - (own1 - own0)
        return max(0.0, other) / max(1e-9, (t1 - t0) * (os.cpu_count() or 1))


WAITED_S = [0.0]  # total of wait_quiet's waits, reported beside the wall time


def wait_quiet(max_s: float, share: float = 0.1, window_s: float = 5.0) -> None:
    """Wait up to ``max_s`` for a ``window_s`` window in which other processes use less than
    ``share`` of the CPUs."""
    if max_s <= 0:
        return
    start = time.perf_counter()
    while True:
        load = OtherLoad()
        time.sleep(window_s)
        busy = load.fraction()
        waited = time.perf_counter() - start
        if busy < share or waited >= max_s:
            if waited > 2 * window_s:  # say so only when the machine was busy
                print(f"   waited {waited:.0f} s for a quieter machine (other processes "
                      f"{100 * busy:.0f}% of the CPUs in the last {window_s:.0f} s)", flush=True)
            WAITED_S[0] += waited
            return


def time_interleaved(steps: dict[str, Callable[[], torch.Tensor]], tokens: int, warmup: int,
                     iters: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Tokens/s of each side, steps interleaved; also each side's first output (a loss)."""
    first: dict[str, float] = {}
    for i in range(warmup):
        for side in SIDES:
            out = steps[side]()
            if i == 0 and out.ndim == 0:
                first[side] = out.item()
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    for _ in range(iters):
        for side in SIDES:
            t0 = time.perf_counter()
            steps[side]()
            rates[side].append(tokens / (time.perf_counter() - t0))
    return rates, first


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` in fp64 (tests/helpers.py has the same, for the tests)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def check_logits(ours: torch.nn.Module, theirs: torch.nn.Module) -> tuple[bool, str]:
    """Ours against theirs in fp32 (relative max error < ``LOGIT_TOL``). Deeper models can miss
    that through fp32 rounding alone, on both sides: then both are compared with theirs run in
    fp64 (the exact answer), and ours passes if it is within ``LOGIT_TOL`` of it or no further
    from it than transformers' own fp32 logits. A wrong conversion is off by far more."""
    ids = token_ids(Shape(2, 300), seed=2)  # longer than one scan chunk, not a multiple of it
    ours.eval()
    theirs.eval()
    with torch.no_grad():
        got, want = ours(ids), theirs(input_ids=ids, use_cache=False).logits
        err = rel_err(got, want)
        if err < LOGIT_TOL:
            return True, f"logits rel. max err {err:.1e}"
        exact = theirs.double()(input_ids=ids, use_cache=False).logits
        theirs.float()
    ours_err, theirs_err = rel_err(got, exact), rel_err(want, exact)
    ok = ours_err < max(LOGIT_TOL, theirs_err)
    return ok, (f"logits rel. max err {err:.1e}; against transformers in fp64: ours "
                f"{ours_err:.1e}, transformers' fp32 {theirs_err:.1e}")


# ---------------------------------------------------------------- memory probe (own process)


def probe(spec: dict[str, Any]) -> dict[str, float]:
    """Runs in a fresh process: load one side, run a few steps, report peak RSS in MB."""
    import transformers  # noqa: F401  (the same import floor for both sides)

    import composer  # noqa: F401

    torch.set_num_threads(spec["threads"])
    model = load_side(spec["side"], Path(spec["folder"]))
    # Both loaders leave the weights memory-mapped from the safetensors file (counted in RSS only
    # once touched, and copied again when AdamW writes them); own copies make both sides hold
    # them as the timed models do, in anonymous memory.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    step = make_step(model, spec["side"], spec["mode"], token_ids(Shape.parse(spec["shape"])),
                     spec["adamw"])
    gc.collect()
    loaded_kb, hwm_before_kb = status_kb("VmRSS"), status_kb("VmHWM")
    # Reset the high-water mark to the current RSS: the peak is then that of the steps alone.
    reset = True
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        reset = False
    for _ in range(spec["steps"]):
        step()
    # Without the reset the peak may be a spike of loading rather than of the steps.
    peak_kb = status_kb("VmHWM") if reset else max(status_kb("VmHWM"), hwm_before_kb)
    return {"peak_mb": peak_kb / 1024, "loaded_mb": loaded_kb / 1024,
            "run_mb": (peak_kb - loaded_kb) / 1024}


def run_probe(side: str, mode: str, shape: Shape, folder: Path,
              threads: int, adamw: str) -> dict[str, float]:
    # Two train steps: the second holds the AdamW state, the gradients and the activations.
    spec = dict(side=side, mode=mode, shape=str(shape), folder=str(folder), threads=threads,
                steps=2 if mode == "train" else 1, adamw=adamw)
    out = subprocess.run([sys.executable, __file__, "--probe", json.dumps(spec)],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"memory probe {spec} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def probe_rows(rows: list[Row], folders: dict[str, Path], jobs: int, adamw: str) -> None:
    """Fill ``row.memory``: one process per (row, side), ``jobs`` at a time. Parallel probes
    share the cores (``cpu_count // jobs`` threads each, so no OpenMP oversubscription); they
    measure memory only, which the thread count barely changes, and no timing runs meanwhile."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    work = [(row, side) for row in rows for side in SIDES]
    with ThreadPoolExecutor(jobs) as pool:
        results = pool.map(lambda rs: run_probe(rs[1], rs[0].mode, rs[0].shape,
                                                folders[rs[1]], threads, adamw), work)
        for (row, side), result in zip(work, results, strict=True):
            row.memory[side] = result


# ---------------------------------------------------------------- one family


def prepare(family: Family, workdir: Path) -> tuple[dict[str, torch.nn.Module], str, bool]:
    """Build theirs, save it, convert and load ours; the models, a description, whether the
    logits agree (:func:`check_logits`)."""
    import composer
    from composer.convert import from_hf

    t0 = time.perf_counter()
    theirs = build_hf(family)
    theirs.save_pretrained(workdir / "theirs")
    from_hf(workdir / "theirs", workdir / "ours", force=True)  # --workdir may be reused
    ours = composer.load(workdir / "ours")
    n_params = sum(p.numel() for p in ours.parameters())
    impl = (f"attn={getattr(theirs.config, '_attn_implementation', None)}, "
            f"experts={getattr(theirs.config, '_experts_implementation', None)}")
    ok, check = check_logits(ours, theirs)
    info = (f"{family.name}: {family.hf_class}, {n_params / 1e6:.1f}M parameters, pattern "
            f"{ours.config.pattern!r}; transformers {impl}; {check}")
    print(f"\n== {info} (built and converted in {time.perf_counter() - t0:.1f} s)", flush=True)
    return {"ours": ours, "theirs": theirs}, info, ok


def time_row(family: Family, models: dict[str, torch.nn.Module], mode: str, shape: Shape,
             args: argparse.Namespace) -> Row:
    """Time one (mode, shape). With ``--wait-quiet``, a row during which other processes used
    more than ``BUSY_RETRY`` of the CPUs is timed once more after a wait; the quieter one stays."""
    import composer

    flops = composer.model_stats(models["ours"], shape.seq).forward_flops_per_token
    best: Row | None = None
    for attempt in range(2 if args.wait_quiet > 0 else 1):
        if attempt:
            wait_quiet(args.wait_quiet)
        t0, load = time.perf_counter(), OtherLoad()
        steps = {side: make_step(models[side], side, mode, token_ids(shape), args.adamw)
                 for side in SIDES}
        rates, first = time_interleaved(steps, shape.tokens, args.warmup, args.iters)
        row = Row(family.name, mode, shape,
                  family.train_target if mode == "train" else FORWARD_TARGET,
                  flops * (3 if mode == "train" else 1), rates, load.fraction())
        losses = (f"; first loss ours {first['ours']:.5f} theirs {first['theirs']:.5f}"
                  if first else "")
        print(f"   {mode:7s} {shape}: ours {row.median('ours'):8.0f} tok/s, theirs "
              f"{row.median('theirs'):8.0f} tok/s, x{row.ratio:.2f}{losses} "
              f"({time.perf_counter() - t0:.0f} s, other processes "
              f"{100 * row.other_load:.0f}% of the CPUs)", flush=True)
        del steps
        gc.collect()
        if best is None or row.other_load < best.other_load:
            best = row
        if row.other_load <= BUSY_RETRY:
            break
    assert best is not None
    return best


def bench_family(family: Family, shapes: tuple[Shape, ...], args: argparse.Namespace,
                 workdir: Path) -> tuple[list[Row], str]:
    """The rows of one family, and a line describing its model."""
    workdir = workdir / family.name
    models, info, ok = prepare(family, workdir)
    if not ok:
        print(f"!! {family.name}: logits differ beyond the tolerance ({LOGIT_TOL:.0e}); "
              "not timing this family", flush=True)
        return [], info + " (NOT timed: above the tolerance)"
    rows = [time_row(family, models, mode, shape, args) for shape in shapes for mode in MODES]
    del models
    gc.collect()
    if not args.no_memory:
        t0 = time.perf_counter()
        # --quick probes only the train step of the first shape: a check that probing works.
        probed = [r for r in rows if r.shape == shapes[0] and r.mode == "train"] \
            if args.quick else rows
        probe_rows(probed, {side: workdir / side for side in SIDES}, args.probe_jobs,
                   args.adamw)
        print(f"   memory probes: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows, info


# ---------------------------------------------------------------- report


def _rate(r: list[float]) -> str:
    return f"{statistics.median(r):.0f} [{min(r):.0f}-{max(r):.0f}]"


COLUMNS = ("family", "mode", "shape", "ours tok/s [min-max]", "theirs tok/s [min-max]", "ratio",
           "target", "met", "MFU ours", "theirs", "peak MB ours", "theirs", "+run ours",
           "theirs", "mem peak/+run", "other")


def table(rows: list[Row], peak: float) -> str:
    """One line per row; ``other``: CPU share other processes used while the row was timed."""
    cells = []
    for r in rows:
        mem = ["-"] * 5
        if r.memory:
            o, t = r.memory["ours"], r.memory["theirs"]
            ok = ["yes" if o[k] <= t[k] else "NO" for k in ("peak_mb", "run_mb")]
            mem = [f"{o['peak_mb']:.0f}", f"{t['peak_mb']:.0f}", f"{o['run_mb']:.0f}",
                   f"{t['run_mb']:.0f}", "/".join(ok)]
        cells.append([r.family, r.mode, str(r.shape), _rate(r.tok_s["ours"]),
                      _rate(r.tok_s["theirs"]), f"{r.ratio:.2f}", f">={r.target:.1f}",
                      "yes" if r.ratio >= r.target else "NO",
                      f"{100 * r.mfu('ours', peak):.1f}%", f"{100 * r.mfu('theirs', peak):.1f}%",
                      *mem, f"{100 * r.other_load:.0f}%"])
    widths = [max(len(c[i]) for c in [list(COLUMNS), *cells]) for i in range(len(COLUMNS))]
    left = {0, 1, 2, 7, 14}  # text columns; numbers align right

    def fmt(c: list[str]) -> str:
        return "  ".join(v.ljust(w) if i in left else v.rjust(w)
                         for i, (v, w) in enumerate(zip(c, widths, strict=True))).rstrip()

    head = fmt(list(COLUMNS))
    return "\n".join([head, "-" * len(head), *[fmt(c) for c in cells]])


def summary(rows: list[Row]) -> list[str]:
    out = []
    for r in rows:
        # "short by N%": how much faster ours must get to meet the target
        verdict = ("met" if r.ratio >= r.target
                   else f"MISSED, short by {100 * (r.target / r.ratio - 1):.0f}%")
        line = f"{r.family} {r.mode} {r.shape}: x{r.ratio:.2f} vs >= {r.target:.1f} ({verdict})"
        for key, what in (("peak_mb", "peak memory"), ("run_mb", "+run")):
            if r.memory:
                o, t = r.memory["ours"][key], r.memory["theirs"][key]
                line += (f"; {what} {o:.0f} vs {t:.0f} MB "
                         f"({'met' if o <= t else f'MISSED, +{o - t:.0f} MB'})")
        out.append(line)
    return out


def write_results(path: Path, text: str, rows: list[Row], infos: list[str],
                  args: argparse.Namespace, peaks: tuple[float, float], run: str,
                  command: str) -> None:
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    section = [
        f"\n## Speed against transformers: `bench/compare_hf.py` ({date})\n",
        f"**Machine**: {machine()}.\n",
        f"**Code**: {git_state()}.\n",
        f"**Command**: `{command}` ({run}; {args.warmup} warm-up + {args.iters} timed steps per "
        f"side, interleaved; train steps with {args.adamw} AdamW on both sides).\n",
        "**Models** (fp32, transformers' own init, converted with `from_hf`):\n",
        *[f"- {info}" for info in infos], "",
        f"fp32 matmul peak (2048^3, best of 5 by `torch.mm` and by oneDNN): "
        f"{peaks[0] / 1e9:.1f} GFLOP/s at the "
        f"start, {peaks[1] / 1e9:.1f} at the end; MFU uses the larger. Peak MB: peak RSS of a "
        "separate process per row and side during its steps (both import torch, transformers and "
        "composer; transformers' modeling modules, imported by its side only, add ~90 MB); +run: "
        "that peak minus the RSS after loading; mem: ours <= theirs on each. other: CPU share "
        "that other processes used while the row was timed.\n",
        "```", text, "```", "", *[f"- {line}" for line in summary(rows)], "",
    ]
    def wrap(line: str) -> str:  # prose at the file's width; the table stays as printed
        if line.startswith(("family", "-" * 10)) or line in text.splitlines():
            return line
        indent = "  " if line.startswith("- ") else ""
        lead = "\n" if line.startswith("\n") else ""  # fill() would turn it into a space
        return lead + textwrap.fill(line.lstrip("\n"), 100, subsequent_indent=indent,
                                    break_on_hyphens=False,
                                    break_long_words=False) + ("\n" if line.endswith("\n") else "")

    with path.open("a") as f:
        f.write("\n".join(wrap(line) for line in section))


# ---------------------------------------------------------------- profile


def profile(spec: str, args: argparse.Namespace, workdir: Path) -> None:
    """``family:mode:BxT``: the top ops by self CPU time of both sides, as % of all ops' self
    time (close to the step's wall time: intra-op threads are not counted separately)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    name, mode, shape_text = spec.split(":")
    family, shape = resize(FAMILIES[name], args.size, None), Shape.parse(shape_text)
    models, _, _ = prepare(family, workdir)
    steps = {side: make_step(models[side], side, mode, token_ids(shape), args.adamw)
             for side in SIDES}
    for _ in range(args.warmup):
        for side in SIDES:
            steps[side]()
    with torch_profile(activities=[ProfilerActivity.CPU]):
        pass  # the first session pays the profiler's start-up
    for side in SIDES:
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            t0 = time.perf_counter()
            for _ in range(args.profile_steps):
                steps[side]()
            wall = (time.perf_counter() - t0) / args.profile_steps
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) / 1e6 / args.profile_steps
        print(f"\n== {side} {name} {mode} {shape}: {wall:.3f} s/step under the profiler, "
              f"ops' self time {total:.3f} s/step; top ops by self time:")
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
        for e in top:
            self_s = e.self_cpu_time_total / 1e6 / args.profile_steps
            print(f"   {100 * self_s / total:5.1f}%  {self_s:7.3f} s/step  "
                  f"{e.count // args.profile_steps:5d} calls/step  {e.key}")


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma-separated subset of {', '.join(FAMILIES)}")
    p.add_argument("--quick", action="store_true",
                   help="small shapes, 1 warm-up + 3 timed steps, no RESULTS.md (a sanity run)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per side (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per side (default 2)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    p.add_argument("--adamw", choices=("fused", "for-loop"), default="fused",
                   help="the AdamW of the train steps, the same on both sides (make_step)")
    p.add_argument("--size", choices=("small", "base", "large"), default="base",
                   help="model size: ~14-23M, ~44-58M (default) or ~100-111M parameters")
    p.add_argument("--shapes", type=lambda t: tuple(Shape.parse(x) for x in t.split(",")),
                   default=None, metavar="BxT,...", help="batch shapes instead of the family's")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                   help="on a shared machine: before each family, wait up to S seconds for a "
                   "5 s window in which other processes use < 10%% of the CPUs, and time a row "
                   "again (after such a wait) if they used > 15%% during it")
    p.add_argument("--probe-jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="memory probes run at once (default: 2)")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    p.add_argument("--no-write", action="store_true", help="do not append to RESULTS.md")
    p.add_argument("--workdir", type=Path, default=None, help="keep the checkpoints here")
    p.add_argument("--profile", metavar="FAMILY:MODE:BxT",
                   help="profile both sides of one measurement instead of benchmarking")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads (default: all cores; 1 for A/Bs on a shared machine)")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        p.error(f"unknown family {unknown[0]!r}; choose from {', '.join(FAMILIES)}")
    if args.profile and args.profile.split(":")[0] not in FAMILIES:
        p.error(f"--profile FAMILY:MODE:BxT, FAMILY one of {', '.join(FAMILIES)}")
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.iters = args.iters if args.iters is not None else (3 if args.quick else 5)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.probe:
        print(json.dumps(probe(json.loads(args.probe))))
        return
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    command = "python " + " ".join(shlex.quote(a) for a in (
        [str(Path(sys.argv[0]).relative_to(ROOT)) if Path(sys.argv[0]).is_absolute()
         else sys.argv[0]] + sys.argv[1:]))
    with tempfile.TemporaryDirectory(prefix="compare_hf.") as tmp:
        workdir = args.workdir or Path(tmp)
        if args.profile:
            profile(args.profile, args, workdir)
            return
        start, load = time.perf_counter(), OtherLoad()
        print(f"{machine()}; {git_state()}", flush=True)
        peak_start = matmul_peak()
        print(f"fp32 matmul peak: {peak_start / 1e9:.1f} GFLOP/s", flush=True)
        rows: list[Row] = []
        infos: list[str] = []
        for name in args.families.split(","):
            family = resize(FAMILIES[name], args.size, args.shapes)
            shapes = family.quick_shapes if args.quick else family.shapes
            wait_quiet(args.wait_quiet)
            family_rows, info = bench_family(family, shapes, args, workdir)
            rows += family_rows
            infos.append(info)
        peak_end = matmul_peak()
        peak = max(peak_start, peak_end)
        wall = time.perf_counter() - start
        run = (f"wall time {wall / 60:.1f} min" + (f", of which {WAITED_S[0] / 60:.1f} min "
               "waiting for a quiet machine" if WAITED_S[0] > 0 else "")
               + f"; other processes used {100 * load.fraction():.0f}% of the CPUs meanwhile")
        text = table(rows, peak)
        print(f"\nfp32 matmul peak {peak_start / 1e9:.1f} GFLOP/s (start), "
              f"{peak_end / 1e9:.1f} (end); {run}\n")
        print(text + "\n\n" + "\n".join(summary(rows)))
        if rows and not (args.quick or args.no_write):
            write_results(args.results, text, rows, infos, args, (peak_start, peak_end), run,
                          command)
            print(f"\nappended to {args.results}")


if __name__ == "__main__":
    main()
