"""composer plan's search: its candidates pass train's checks and equal the plans of their
layouts given explicitly; the analytic estimate it ranks by equals the exact construction on
the debug presets; no-layout messages are one line; the DeepSeek-V3 671B anchor at 2,048 GPUs."""

import json

import pytest

from composer.parallel.layout import ParallelConfig
from composer.parallel.mesh import resolve_layout
from composer.plan.analytic import PlainModel
from composer.plan.ranks import rank_classes, rank_coords
from composer.zoo import get_preset

# (preset, world, layout): tp, pp, ep, cp, both dp modes, HSDP, uneven FSDP shards (12, 24)
CASES = [
    ("llama-debug", 8, {"tp": 2}),
    ("llama-debug", 12, {}),
    ("llama-debug", 64, {"tp": 2, "pp": 2, "dp_mode": "replicate"}),
    ("llama-debug", 12, {"dp_replicate": 2}),
    ("qwen3-moe-debug", 16, {"ep": 2, "dp_replicate": 2, "pp": 2}),
    ("qwen3-moe-debug", 8, {"tp": 2, "ep": 2}),
    ("qwen3-moe-debug", 64, {"ep": 4, "pp": 2}),
    ("qwen3-moe-debug", 24, {"ep": 4, "dp_mode": "replicate"}),
    ("nemotron-h-debug", 8, {"cp": 2, "tp": 2}),
    ("nemotron-h-debug", 64, {"cp": 2, "dp_mode": "replicate"}),
    ("deepseek-v3-debug", 8, {"pp": 2, "ep": 2}),
    ("deepseek-v3-debug", 16, {"ep": 2, "tp": 2}),
    ("deepseek-v3-debug", 64, {"pp": 2, "ep": 8, "tp": 2}),
]


@pytest.mark.parametrize(("preset", "world", "layout"), CASES)
def test_analytic_estimate_equals_the_exact_construction(preset, world, layout):
    """Every rank class's parameter, gradient, optimizer and in-flight unit bytes, each stage's
    gathered parameters and layer kinds: the estimate from the plans equals the construction."""
    check_estimate(preset, world, layout, "adamw")


@pytest.mark.parametrize(("preset", "world", "layout"), [
    ("llama-debug", 8, {"tp": 2}), ("deepseek-v3-debug", 8, {"pp": 2, "ep": 2})])
def test_analytic_estimate_with_muon(preset, world, layout):
    check_estimate(preset, world, layout, "muon")


# what the communication parts read beyond CASES: Zamba2's shared parts (their own plans,
# partial sums inside, embeddings read, the tied embedding's copies over pp), Gemma 3's
# sandwich norms, Falcon-H1's parallel branches and convolution halos under cp, multi-token
# prediction (DeepSeek-V3's ``/+E``: its norms, projection, layer and readout on the last
# stage), virtual stages (two per pipeline rank, the tied embedding on both ends)
MORE = [
    ("zamba2-debug", 8, {"tp": 2, "pp": 2}),
    ("gemma3-debug", 8, {"tp": 2, "pp": 2}),
    ("falcon-h1-debug", 8, {"tp": 2, "cp": 2}),
    ("deepseek-v3-debug=(+-)x1(+E)x2/+E", 16, {"tp": 2, "pp": 2, "ep": 2}),
    ("qwen3-debug=*-|*-|*-|*-", 8, {"tp": 2, "pp": 2}),
]


@pytest.mark.parametrize(("preset", "world", "layout"), MORE)
def test_analytic_communication_parts(preset, world, layout):
    check_estimate(preset, world, layout, "adamw")


def check_estimate(preset: str, world: int, layout: dict, optimizer: str) -> None:
    """Bytes, gathered parameters, layer kinds and communication parts of every stage;
    ``preset=PATTERN``: the preset with that pattern."""
    import dataclasses

    from composer.build.stages import stage_layers
    from composer.parallel.pipeline import rank_stages

    preset, _, pattern = preset.partition("=")
    cfg = get_preset(preset).config()
    if pattern:
        cfg = dataclasses.replace(cfg, pattern=pattern)
    pc = ParallelConfig(**layout)
    stages = []
    classes = rank_classes(cfg, pc, world, "bf16", optimizer, stages)
    dims = resolve_layout(pc, world)
    plain = PlainModel(cfg, optimizer)
    groups = stage_layers(cfg, pc.pp)
    per_stage = world // pc.pp
    for s in range(pc.pp):
        parts = plain.stage_parts(dims, groups, rank_stages(len(groups), pc.pp, s), 2)
        assert parts.kinds == stages[s].kinds
        assert parts.unsharded_params(s * per_stage) == stages[s].unsharded_params(s * per_stage)
        for c in (c for c in classes if c.stage == s):
            assert parts.bytes_at(rank_coords(c.example_rank, dims)) == c.bytes, (s, c)
        check_comm(cfg, dims, parts.comm, stages[s].comm, s)


def check_comm(cfg, dims, estimated, exact, stage: int) -> None:
    """The analytic :class:`CommParts` equal the construction's field by field (the units as
    FSDP2 holds them, in its order: the layers', then the root), so each collective of
    ``communication()`` is the same, at two micro-batch counts, both gradient syncs and the
    pipeline's schedules."""
    from composer.plan.comm import communication

    by_key = {k: v for k, v in vars(exact).items() if k != "units"}
    assert {k: v for k, v in vars(estimated).items() if k != "units"} == by_key, stage
    assert sorted(map(repr, estimated.units)) == sorted(map(repr, exact.units)), stage
    schedules = ["1f1b", "gpipe"] if dims.pp > 1 else [None]
    for n_micro, sync, schedule in [(1, "every", schedules[0]), (4, "last", schedules[-1]),
                                    (4, "every", schedules[0])]:
        args = (cfg, dims, None, 64, 2, n_micro, 2, 8, sync, schedule)
        got = communication(*args[:2], estimated, *args[3:])
        want = communication(*args[:2], exact, *args[3:])
        assert got == want, (stage, n_micro, sync, schedule)


def run_plan(argv, capsys):
    from composer.cli import main

    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


SEARCH = ["--preset", "qwen3-moe-debug", "--gpus", "8", "--gpu", "h100", "--seq-len", "64",
          "--global-batch-size", "16", "--json", "--top", "4"]


def test_candidates_equal_the_plans_of_their_layouts(capsys):
    """Each candidate passes train's checks and is the plan of its layout given explicitly
    (exact bytes included), plus its binding; best first by the lower bound."""
    code, out, _ = run_plan(SEARCH, capsys)
    assert code == 0
    result = json.loads(out)
    candidates = result["candidates"]
    assert len(candidates) == 4
    assert {k: v for k, v in result.items() if k != "candidates"} == candidates[0]
    lowers = [c["step_time_s"]["lower"] for c in candidates]
    assert lowers == sorted(lowers)
    for c in candidates:
        assert c["feasible"] is True
        assert c["binding"] in {"memory", "bubble"} | {x["kind"] for x in c["comm"]}
        lay = c["layout"]
        argv = ["qwen3-moe-debug", *SEARCH[2:-2]]
        for k in ("tp", "pp", "cp", "ep", "micro_batch_size"):
            argv += [f"--{k.replace('_', '-')}", str(lay[k])]
        code, out, _ = run_plan(argv, capsys)
        assert code == 0
        explicit = json.loads(out)
        assert "candidates" not in explicit
        assert {k: v for k, v in c.items() if k != "binding"} == explicit


def test_fixed_sizes_are_kept(capsys):
    code, out, _ = run_plan([*SEARCH, "--tp", "2", "--micro-batch-size", "2"], capsys)
    assert code == 0
    for c in json.loads(out)["candidates"]:
        assert (c["layout"]["tp"], c["layout"]["micro_batch_size"]) == (2, 2)


def test_table_prints_one_line_per_candidate(capsys):
    code, out, _ = run_plan([a for a in SEARCH if a != "--json"], capsys)
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1 + 4 and lines[1].lstrip().startswith("1 tp=")


def test_no_layout_divides_the_gpus_is_one_line(capsys):
    code, _, err = run_plan(["llama-debug", "--gpus", "7", "--gpu", "h100", "--seq-len", "64",
                             "--global-batch-size", "8"], capsys)
    assert code == 2
    assert err == ("composer: error: no layout of 7 GPUs passes train's checks; the first tried "
                   "(tp=1 pp=1 cp=1 ep=1 micro_batch_size=1): --global-batch-size (8) must be "
                   "divisible by dp (7)")


def test_no_layout_fits_names_the_closest(capsys):
    code, _, err = run_plan(["llama-debug", "--gpus", "8", "--gpu", "h100", "--mem-gib",
                             "0.00001", "--seq-len", "64", "--global-batch-size", "8"], capsys)
    assert code == 2
    assert "\n" not in err
    assert err.startswith("composer: error: no layout of 8 GPUs fits in 0.0 GiB; the closest, "
                          "tp="), err
    assert err.endswith("GiB on its worst rank")


def test_binding():
    from composer.plan.hardware import GPU
    from composer.plan.search import binding

    hw = GPU("test", 1.0, 1.0, 1.0, 1.0, 1.0)  # 1 GB of memory, 1 GB/s links
    dims = resolve_layout(ParallelConfig(), 1)

    def plan(total, comm):
        return {"rank_classes": [{"total_bytes": total}],
                "comm": [{"kind": k, "group": "dp", "bytes_per_step": int(s * 1e9),
                          "intra_node": False} for k, s in comm]}

    assert binding(plan(0.95e9, [("pp_send_recv", 2.0)]), dims, 1.0, hw, "bf16") == "memory"
    assert binding(plan(0.5e9, [("pp_send_recv", 2.0), ("ep_all_to_all", 3.0)]), dims, 1.0, hw,
                   "bf16") == "ep_all_to_all"
    assert binding(plan(0.5e9, [("pp_send_recv", 0.5)]), dims, 1.0, hw, "bf16") == "bubble"


@pytest.mark.slow
def test_deepseek_v3_671b_pp16_ep64_on_2048_h100(capsys):
    """The published anchor: DeepSeek-V3 671B on 2,048 80-GB GPUs at pp16 x ep64 (dp 128) fits.
    ``--ac full``: DeepSeek-V3 recomputes in the backward (arXiv 2412.19437 §3.2.3), and with
    every kind's activations kept whole the first stage's 16 micro-batches in flight would not
    fit. The worst rank is on a middle stage: the parameter state (exact) is largest on the
    stages of routed-expert layers only (the first holds the dense layers and the embedding,
    the last fewer layers: the head's FLOPs count in the stage balance), and under 1F1B the
    first stage's extra micro-batches in flight (layer inputs only, at ``--ac full``) weigh
    less than the experts it does not hold."""
    code, out, _ = run_plan(["deepseek-v3-671b", "--gpus", "2048", "--gpu", "h100", "--pp", "16",
                             "--ep", "64", "--tp", "1", "--cp", "1", "--seq-len", "4096",
                             "--global-batch-size", "15360", "--micro-batch-size", "1",
                             "--ac", "full", "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert plan["feasible"] is True and plan["layout"]["dp"] == 128
    state = {}
    for c in plan["rank_classes"]:
        b = c["params_bytes"] + c["grads_bytes"] + c["optimizer_bytes"]
        state[c["stage"]] = max(state.get(c["stage"], 0), b)
    assert max(state, key=state.get) not in (0, 15)
    (worst,) = [c for c in plan["rank_classes"] if c["worst"]]
    assert worst["stage"] not in (0, 15), worst
    # the exact part: AdamW holds two fp32 moments (+ a step) per fp32 master, all sharded over
    # the 128 ranks of a stage: the model's 671B parameters x 16 bytes / 2048 ranks, about
    total = sum(c["n_ranks"] * (c["params_bytes"] + c["grads_bytes"] + c["optimizer_bytes"])
                for c in plan["rank_classes"])
    assert abs(total / 16 - 671.0e9) < 0.01 * 671.0e9
