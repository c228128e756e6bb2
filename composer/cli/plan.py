"""``composer plan``: the parser and the printing (the work is :mod:`composer.plan`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from composer.cli.base import UsageError

GPU_FLAGS = {"gpus", "gpu", "mem_gib", "tflops", "hbm_tbs", "nvlink_gbs", "net_gbs",
             "gpus_per_node"}
"""The world and GPU flags (:func:`add_gpu_arguments`): plan's and ``train --dry-run``'s."""
PLAN_ONLY = {"func", "command", "config", "json", "source", "preset", "pattern", "top",
             *GPU_FLAGS}


def add_gpu_arguments(p: argparse.ArgumentParser, gpus_required: bool = True,
                      gpus_help: str = "the world size") -> None:
    """``--gpus`` and the GPU: ``--gpu`` or its numbers (:func:`gpu_of`)."""
    p.add_argument("--gpus", type=int, required=gpus_required, default=None, help=gpus_help)
    p.add_argument("--gpu", default=None, help="h100, h200 or b200 (docs/planning.md)")
    for flag, unit in (("--mem-gib", "GPU memory, GB"), ("--tflops", "dense TFLOP/s"),
                       ("--hbm-tbs", "HBM TB/s"), ("--nvlink-gbs", "NVLink GB/s per direction"),
                       ("--net-gbs", "network GB/s per GPU and direction")):
        p.add_argument(flag, type=float, default=None, help=unit + " (replaces --gpu's)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per NVLink domain")


def gpu_of(args: argparse.Namespace):
    """The :class:`~composer.plan.hardware.GPU` the flags of :func:`add_gpu_arguments` name."""
    from composer.plan.hardware import gpu

    return gpu(args.gpu if args.gpu or args.mem_gib is None else None, mem_gb=args.mem_gib,
               tflops=args.tflops, hbm_tbs=args.hbm_tbs, nvlink_gbs=args.nvlink_gbs,
               net_gbs=args.net_gbs, per_node=args.gpus_per_node)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from composer.train.recipe import add_arguments

    p = sub.add_parser("plan", help="per-rank memory, communication and step-time bounds of a "
                                    "layout, or the best layouts that fit when any of --tp "
                                    "--pp --cp --ep is left out (docs/planning.md)")
    p.add_argument("source", nargs="?", default=None, help="a preset (or use --pattern)")
    p.add_argument("--preset", default=None, help="the same as SOURCE")
    p.add_argument("--pattern", help="a layer pattern instead of a preset (with --set)")
    p.add_argument("--config", help="a recipe YAML file or a shipped recipe's name")
    add_gpu_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--top", type=int, default=5,
                   help="search mode (any of --tp --pp --cp --ep left out): the layouts shown")
    add_arguments(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from composer.plan.report import make_plan
    from composer.plan.search import SEARCHED, search
    from composer.train.engine import _model_config, resolve

    if args.gpus < 1 or args.top < 1:
        raise UsageError("--gpus and --top must be >= 1")
    if args.preset is not None:
        if args.source is not None and args.source != args.preset:
            raise UsageError(f"plan: SOURCE {args.source!r} and --preset {args.preset!r} differ")
        args.source = args.preset
    if (args.source is None) == (args.pattern is None):
        raise UsageError("plan: give SOURCE (a preset) or --pattern, one of them")
    hw = gpu_of(args)
    flags = {k: v for k, v in vars(args).items() if k not in PLAN_ONLY}
    if flags.pop("activation_checkpointing", False):
        flags.setdefault("ac", "full")
    flags.setdefault("steps", 1)
    source = args.source if args.pattern is None else {"pattern": args.pattern}
    recipe, _ = resolve(None, args.config, {**flags, "model": source})
    if not recipe.seq_len:
        raise UsageError("plan: --seq-len is required (tokens per sample)")
    cfg, tensors = _model_config(recipe)
    if tensors is not None:
        tensors.close()
    fixed = given_layout(recipe, args.config, flags)
    if len(fixed) < len(SEARCHED):
        plan = search(recipe, cfg, args.gpus, hw, fixed, args.top)
    else:
        plan = make_plan(recipe, cfg, args.gpus, hw)
    if args.json:
        print(json.dumps(plan))
    elif "candidates" in plan:
        print_candidates(plan["candidates"])
    else:
        print_plan(plan)
    return 0


def given_layout(recipe: Any, config: str | None, flags: dict[str, Any]) -> dict[str, int]:
    """The sizes the user fixed, on the command line or in the ``--config`` recipe."""
    from composer.plan.search import SEARCHED
    from composer.train.recipe import read_recipe, recipe_path

    from_config = read_recipe(recipe_path(config)) if config else {}
    nested = from_config.get("parallel") or {}
    return {k: getattr(recipe.parallel, k) for k in SEARCHED
            if k in flags or k in from_config or k in nested}


def print_candidates(candidates: list[dict]) -> None:
    """One line per layout, best first."""
    print(f"{'#':>2} {'layout':<46} {'worst GiB':>9} {'step s':>17} {'tokens/s/GPU':>17} "
          f"{'MFU':>13}  binding")
    for i, plan in enumerate(candidates, 1):
        lay = plan["layout"]
        text = " ".join(f"{k}={lay[k]}" for k in ("tp", "pp", "cp", "ep", "dp"))
        text += f" mb={lay['micro_batch_size']} {lay['dp_mode']}"
        if lay["pp_schedule"]:
            text += f" {lay['pp_schedule']}"
        worst = max(c["total_bytes"] for c in plan["rank_classes"]) / 2**30
        t, tps, mfu = plan["step_time_s"], plan["tokens_per_s_per_gpu"], plan["mfu"]
        print(f"{i:>2} {text:<46} {worst:>9.2f} {t['lower']:>8.3g}-{t['upper']:<8.3g} "
              f"{tps['lower']:>8.4g}-{tps['upper']:<8.4g} {mfu['lower']:>6.1%}-{mfu['upper']:<6.1%}"
              f"  {plan['binding']}")


def print_plan(plan: dict) -> None:
    lay = plan["layout"]
    print("layout  " + " ".join(f"{k}={v}" for k, v in lay.items()))
    print(f"{'stage':>5} {'rank':>6} {'ranks':>6} {'params':>10} {'grads':>10} {'optim':>10} "
          f"{'activ':>10} {'buffers':>10} {'total':>10}")
    for c in plan["rank_classes"]:
        gib = [c[k] / 2**30 for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                      "activations_bytes", "buffers_bytes", "total_bytes")]
        print(f"{c['stage']:>5} {c['example_rank']:>6} {c['n_ranks']:>6} "
              + " ".join(f"{g:>10.3f}" for g in gib) + ("  worst" if c["worst"] else ""))
    print(f"(GiB; GPU {plan['gpu']}: {plan['gpu_mem_bytes'] / 2**30:.1f} GiB; "
          f"{'fits' if plan['feasible'] else 'does NOT fit'})")
    if plan["layout"]["pp"] > 1:
        print(f"comm of stage {plan['comm_stage']} (the slowest step of the stages):")
    for c in plan["comm"]:
        where = "intra-node" if c["intra_node"] else "inter-node"
        print(f"comm {c['kind']:<30} over {c['group']:<6} {c['bytes_per_step'] / 2**30:>10.3f}"
              f" GiB/step ({where})")
    t, tps, mfu = plan["step_time_s"], plan["tokens_per_s_per_gpu"], plan["mfu"]
    print(f"step {t['lower']:.4g}-{t['upper']:.4g} s, {tps['lower']:.4g}-{tps['upper']:.4g} "
          f"tokens/s per GPU, MFU {mfu['lower']:.1%}-{mfu['upper']:.1%}")
    print("not modelled: " + "; ".join(plan["unknowns"]))
