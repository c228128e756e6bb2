"""One plan: the layout checked as ``composer train`` checks it, the exact bytes of every rank
class, the modelled activations, communication and step time, as the ``--json`` object."""

from __future__ import annotations

from typing import Any

from composer.plan.comm import communication, resolve_grad_sync
from composer.plan.estimate import RESERVE, UNKNOWNS, activation_bytes, in_flight, step_time
from composer.plan.hardware import GPU
from composer.plan.ranks import RankClass, StageParts, rank_classes

EXACTNESS = {"params_bytes": "exact", "grads_bytes": "exact", "optimizer_bytes": "exact",
             "buffers_bytes": "model", "activations_bytes": "model", "total_bytes": "model",
             "feasible": "model", "flops_per_token": "exact", "comm": "model",
             "step_time_s": "model", "tokens_per_s_per_gpu": "model", "mfu": "model"}
"""``buffers_bytes``: the units' sizes are exact, that two are in flight is the model.
``comm`` and the step time are the slowest stage's (``comm_stage``): each stage's collectives
at its first rank, its step time from them.
``comm`` is exact where every collective is counted and none depends on routing
(:func:`comm_exactness`)."""


def check(recipe: Any, cfg: Any, world: int) -> tuple[Any, int, str | None]:
    """The layout's dims, micro-batch size and schedule, through train's own checks: context
    parallel lengths, the sizes against the world, the model's divisibility rules, the batch
    splits and the pipeline's stages (the same one-line errors)."""
    from composer.build.builder import check_buildable, check_model
    from composer.parallel.mesh import resolve_layout
    from composer.train.engine import _check_cp, check_batches

    check_buildable(cfg)
    _check_cp(recipe, cfg, recipe.seq_len + 1)  # rows of seq_len + 1 tokens, as with --data
    dims = resolve_layout(recipe.parallel, world)
    check_model(dims, cfg)
    micro, schedule = check_batches(recipe, cfg, dims)
    return dims, micro, schedule


def make_plan(recipe: Any, cfg: Any, world: int, hw: GPU,
              stages: list[StageParts] | None = None) -> dict[str, Any]:
    """The plan of ``recipe``'s layout: train's checks, then the exact construction (the run's
    adapters and frozen parts as training builds them); ``stages``: filled with each stage's
    :class:`StageParts`."""
    from composer.train.adapters import run_adapters

    dims, micro, schedule = check(recipe, cfg, world)
    stages = [] if stages is None else stages
    lora = run_adapters(recipe, None)[0]
    classes = rank_classes(cfg, recipe.parallel, world, recipe.precision or "bf16",
                           recipe.optimizer, stages, lora, recipe.freeze)
    return assemble_plan(recipe, cfg, world, hw, (dims, micro, schedule), classes, stages)


def assemble_plan(recipe: Any, cfg: Any, world: int, hw: GPU, checked: tuple,
                  classes: list[RankClass], stages: list[StageParts],
                  stats: Any = None, times: dict[str, float] | None = None) -> dict[str, Any]:
    """The plan object from a checked layout (:func:`check`'s ``dims, micro, schedule``) and its
    rank classes with their stages' parts (exact: :func:`~composer.plan.ranks.rank_classes`;
    the search also gives estimated ones, :mod:`composer.plan.analytic`, their communication
    parts included). ``stats``: the
    model's :class:`~composer.build.builder.ModelStats` at the sequence length (computed if
    None). ``times``: filled with the step time's parts (``compute``, ``bubble``, the bounds)."""
    from composer.build.builder import build_model, model_stats

    dims, micro, schedule = checked
    precision = recipe.precision or "bf16"
    size = 2 if precision in ("bf16", "fp8") else 4
    seq = recipe.seq_len
    n_micro = recipe.global_batch_size // (micro * dims.dp)
    unknowns = list(UNKNOWNS)
    if stats is None:
        stats = model_stats(build_model(cfg, device="meta"), seq_len=seq)
    fpt = stats.flops_per_token
    out_classes, comms = [], []
    reserve = int(RESERVE * hw.mem_bytes)
    for c in classes:
        parts = stages[c.stage]
        held = in_flight(c.stage, dims.pp, n_micro, schedule)
        act, unknown = activation_bytes(cfg, parts.kinds, dims, seq, micro, dims.ac, size, held,
                                        c.stage == dims.pp - 1)
        unknowns += [u for u in unknown if u not in unknowns]
        b = c.bytes
        total = b.params + b.grads + b.optimizer + b.buffers + act + reserve
        out_classes.append({"stage": c.stage, "example_rank": c.example_rank,
                            "n_ranks": c.n_ranks, "params_bytes": b.params,
                            "grads_bytes": b.grads, "optimizer_bytes": b.optimizer,
                            "activations_bytes": act, "buffers_bytes": b.buffers + reserve,
                            "total_bytes": total, "worst": False})
    worst = max(range(len(out_classes)), key=lambda i: out_classes[i]["total_bytes"])
    out_classes[worst]["worst"] = True
    w = classes[worst]
    grad_sync = resolve_grad_sync(dims, n_micro, 4 * stages[w.stage].unsharded_params(
        w.example_rank), hw.mem_bytes)
    tokens = recipe.global_batch_size * seq
    flops_rank = stats.training_flops_per_token(dims.ac) * tokens / world  # recompute included
    # every stage's collectives (at its first rank class): the step takes the slowest stage's
    per_stage, comm_unknown = [], []
    for c in classes:
        if per_stage and per_stage[-1][0] == c.stage:
            continue
        comm, unknown = communication(cfg, dims, stages[c.stage].comm, seq, micro, n_micro, size,
                                      hw.per_node, grad_sync, schedule)
        comm_unknown += [u for u in unknown if u not in comm_unknown]
        per_stage.append((c.stage, comm, step_time(flops_rank, comm, dims, n_micro, hw,
                                                   precision)))
    slowest, comm, t = max(per_stage, key=lambda s: (s[2]["lower"], s[2]["upper"]))
    unknowns += [u for u in comm_unknown if u not in unknowns]
    exactness = {**EXACTNESS, "comm": comm_exactness(
        [c for _, cs, _ in per_stage for c in cs], comm_unknown)}
    comms = [{"kind": c.kind, "group": c.group, "bytes_per_step": c.bytes_per_step,
              "intra_node": c.intra_node} for c in comm]
    if times is not None:
        times.update(t)
    tps = {k: tokens / (t[k] * world) for k in ("lower", "upper")}
    mfu = {k: fpt * tps[k] / hw.peak_flops(precision) for k in ("lower", "upper")}
    # the fastest step gives the most tokens/s: the bounds swap
    return {"layout": {"tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "ep": dims.ep,
                       "dp": dims.dp, "dp_mode": dims.dp_mode, "micro_batch_size": micro,
                       "pp_schedule": schedule},
            "feasible": out_classes[worst]["total_bytes"] <= hw.mem_bytes,
            "gpu": hw.name, "gpu_mem_bytes": hw.mem_bytes,
            "flops_per_token": fpt, "rank_classes": out_classes, "comm": comms,
            "comm_stage": slowest,
            "step_time_s": {"lower": t["lower"], "upper": t["upper"]},
            "tokens_per_s_per_gpu": {"lower": tps["upper"], "upper": tps["lower"]},
            "mfu": {"lower": mfu["upper"], "upper": mfu["lower"]},
            "exactness": exactness, "unknowns": unknowns}


def comm_exactness(comm: list, unknown: list[str]) -> str:
    """``exact``: the formulas the gloo counts equal (tests/plan/test_comm.py) cover every
    collective; ``model``: some are not counted, or expert parallelism's bytes follow the
    routing (uniform assumed)."""
    routed = any(c.kind == "ep_all_to_all" for c in comm)
    return "model" if unknown or routed else "exact"
