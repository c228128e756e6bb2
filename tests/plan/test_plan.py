"""composer plan: the exact bytes of every rank class equal the construction of concrete ranks
(impersonated through the fake process group) and what gloo ranks hold after a training step;
validity refusals are train's; the modelled parts follow their stated formulas (the activation
models against measured bytes: test_activations.py)."""

import pytest
import torch

from composer.parallel.layout import ParallelConfig
from composer.plan.ranks import build_rank, impersonate, rank_bytes, rank_classes
from composer.zoo import get_preset

# (preset, world, layout): tp, pp, ep, cp and both dp modes at worlds 8, 64 and 2,048, HSDP
CASES = [
    ("llama-debug", 8, {"tp": 2}),
    ("llama-debug", 64, {"tp": 2, "pp": 2, "dp_mode": "replicate"}),
    ("qwen3-moe-debug", 8, {"tp": 2, "ep": 2}),
    ("qwen3-moe-debug", 64, {"ep": 4, "pp": 2}),
    ("nemotron-h-debug", 8, {"cp": 2, "tp": 2}),
    ("nemotron-h-debug", 64, {"cp": 2, "dp_mode": "replicate"}),
    ("deepseek-v3-debug", 8, {"pp": 2, "ep": 2}),
    ("deepseek-v3-debug", 64, {"pp": 2, "ep": 8, "tp": 2}),
    # HSDP: 2-D shard meshes (dense parameters over dp_cp unflattened, experts over dp_outer
    # unflattened), uneven shards within a replica group
    ("llama-debug", 64, {"dp_replicate": 2, "tp": 2}),
    ("qwen3-moe-debug", 64, {"ep": 4, "dp_replicate": 2}),
    ("nemotron-h-debug", 64, {"cp": 2, "dp_replicate": 4}),
    ("llama-debug", 12, {"dp_replicate": 2}),
    ("qwen3-moe-debug", 16, {"ep": 2, "dp_replicate": 2, "pp": 2}),
    # world 2,048 (the debug presets' few experts cannot be sharded over dp_outer that wide:
    # FSDP refuses it, test_a_layout_the_construction_refuses_is_one_line; they replicate)
    ("llama-debug", 2048, {"tp": 2, "pp": 2}),
    ("qwen3-moe-debug", 2048, {"ep": 4, "tp": 2, "dp_mode": "replicate"}),
    ("nemotron-h-debug", 2048, {"cp": 2, "tp": 2, "dp_mode": "replicate"}),
    ("deepseek-v3-debug", 2048, {"pp": 2, "ep": 8, "dp_mode": "replicate"}),
]


def concrete(cfg, layout: ParallelConfig, world: int, rank: int) -> tuple[int, int]:
    """(local parameter bytes, trainable local parameter bytes) of ``rank``, built itself."""
    with impersonate(rank, world):
        model, _ = build_rank(cfg, layout, "bf16")
        local = [(p.to_local().numel() * p.element_size(), p.requires_grad)
                 for p in model.parameters()]
    return sum(n for n, _ in local), sum(n for n, t in local if t)


@pytest.mark.parametrize(("preset", "world", "layout"), CASES)
def test_rank_classes_equal_concrete_ranks(preset, world, layout):
    cfg = get_preset(preset).config()
    pc = ParallelConfig(**layout)
    classes = rank_classes(cfg, pc, world)
    assert sum(c.n_ranks for c in classes) == world
    assert {c.stage for c in classes} == set(range(pc.pp))
    # every class's first rank, and the world's last rank (in the last class of the last stage,
    # the one most likely to hold the short end of an uneven shard), built by themselves
    checks = [(c, c.example_rank) for c in classes] + [(classes[-1], world - 1)]
    for c, rank in checks:
        params, trainable = concrete(cfg, pc, world, rank)
        assert c.bytes.params == params, (c, rank)
        assert c.bytes.grads == trainable
        n_trainable = sum(1 for p in _meta_params(cfg, pc, world, rank) if p.requires_grad)
        assert c.bytes.optimizer == 2 * trainable + 4 * n_trainable  # AdamW: 2 moments + step


def _meta_params(cfg, pc, world, rank):
    with impersonate(rank, world):
        model, _ = build_rank(cfg, pc, "bf16")
        return list(model.parameters())


def test_tp_closed_form():
    """llama-debug at tp=2 on 2 ranks: the matrices halve, the norms are whole on each rank."""
    from composer.build.builder import build_model

    cfg = get_preset("llama-debug").config()
    params = list(build_model(cfg, device="meta").parameters())
    full = sum(p.numel() for p in params) * 4
    replicated = sum(p.numel() for p in params if p.ndim == 1) * 4
    (only,) = rank_classes(cfg, ParallelConfig(tp=2), 2)
    assert only.n_ranks == 2
    assert only.bytes.params == (full - replicated) // 2 + replicated
    # bf16 compute, no data parallelism: nothing is gathered, the whole fp32 model is cast
    # unit by unit only under data parallelism
    assert only.bytes.buffers == 0


def test_fsdp_closed_form_and_units_in_flight():
    """dp=4 shard: each rank holds a quarter of every parameter (torch.chunk on dim 0); the two
    largest units (the root's embedding + head, and one layer) are gathered in bf16."""
    from composer.build.builder import build_model

    cfg = get_preset("llama-debug").config()
    model = build_model(cfg, device="meta")
    classes = rank_classes(cfg, ParallelConfig(), 4)
    for c in classes:
        expected = 0
        r = c.example_rank
        for p in model.parameters():
            sizes = [len(part) for part in torch.arange(p.shape[0]).chunk(4)] + [0] * 4
            expected += sizes[r] * p[0].numel() * 4
        assert c.bytes.params == expected
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.layers.values()]
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    assert classes[0].bytes.buffers == 2 * sum(sorted([root, *layers], reverse=True)[:2])


# one training step on 2 and on 4 gloo ranks: (preset, layout and recipe values)
STEPPED = [
    ("llama-debug", {"dp_mode": "shard"}),
    ("llama-debug", {"tp": 2, "optimizer": "muon"}),
    ("qwen3-moe-debug", {"ep": 2}),
    ("deepseek-v3-debug", {"pp": 2, "global_batch_size": 4, "micro_batch_size": 1}),
    ("nemotron-h-debug", {"cp": 2, "dp_mode": "replicate"}),
]
STEPPED_4 = [  # groups that differ: tp x dp, experts sharded over dp_outer, pp x dp, HSDP, cp x dp
    ("llama-debug", {"tp": 2, "global_batch_size": 4}),
    ("qwen3-moe-debug", {"ep": 2, "global_batch_size": 4}),
    ("deepseek-v3-debug", {"pp": 2, "ep": 2, "global_batch_size": 4, "micro_batch_size": 1}),
    ("llama-debug", {"dp_replicate": 2, "global_batch_size": 4}),
    ("nemotron-h-debug", {"cp": 2, "global_batch_size": 4}),
]


def held_after_a_step(cases: list) -> list[dict]:
    """Each case trained one step by the engine; then what the rank holds (its gradients from
    a second forward and backward: the step's own are zeroed after it)."""
    from composer.parallel.data import finish_grads
    from composer.plan.ranks import local_bytes
    from composer.train.engine import resolve, setup
    from composer.train.loop import accumulate, train_loop

    out = []
    for preset, values in cases:
        values = {"tokens": "synthetic", "seq_len": 16, "steps": 1, "global_batch_size": 2,
                  **values}
        recipe, _ = resolve(preset, None, values)
        run, last = setup(recipe, None, quiet=True)
        train_loop(run, last, quiet=True)
        run.log.close()
        accumulate(run)
        finish_grads(run.model, run.dims)
        held = local_bytes(run.model, run.optimizers.opts)
        out.append(held)
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("world", "cases"), [(2, STEPPED), (4, STEPPED_4)], ids=["2", "4"])
def test_plan_equals_what_gloo_ranks_hold_after_a_step(world, cases):
    from composer.parallel.launch import run_distributed

    held = run_distributed(held_after_a_step, world, cases)
    layout_keys = set(ParallelConfig.__dataclass_fields__)
    for i, (preset, values) in enumerate(cases):
        pc = ParallelConfig(**{k: v for k, v in values.items() if k in layout_keys})
        planned = rank_bytes(get_preset(preset).config(), pc, world, precision="fp32",
                             optimizer=values.get("optimizer", "adamw"))
        for rank in range(world):
            b = planned[rank][1]
            assert {"params": b.params, "grads": b.grads, "optimizer": b.optimizer} == \
                held[rank][i], (preset, values, rank)


PLAN = ["plan", "qwen3-moe-debug", "--gpus", "8", "--gpu", "h100", "--tp", "2", "--ep", "2",
        "--pp", "1", "--cp", "1", "--seq-len", "64", "--global-batch-size", "8",
        "--micro-batch-size", "1", "--json"]  # a full layout: no search (tests/plan/test_search)


def test_cli_json_fields_and_exact_bytes(capsys):
    import json

    from composer.cli import main

    assert main(PLAN) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan["layout"]) == {"tp", "pp", "cp", "ep", "dp", "dp_mode", "micro_batch_size",
                                   "pp_schedule"}
    assert plan["layout"]["dp"] == 4 and plan["feasible"] is True
    keys = {"stage", "example_rank", "n_ranks", "params_bytes", "grads_bytes", "optimizer_bytes",
            "activations_bytes", "buffers_bytes", "total_bytes", "worst"}
    assert all(set(c) == keys for c in plan["rank_classes"])
    assert sum(c["worst"] for c in plan["rank_classes"]) == 1
    expected = rank_classes(get_preset("qwen3-moe-debug").config(), ParallelConfig(tp=2, ep=2), 8)
    assert [(c["params_bytes"], c["grads_bytes"], c["optimizer_bytes"])
            for c in plan["rank_classes"]] == \
        [(c.bytes.params, c.bytes.grads, c.bytes.optimizer) for c in expected]
    assert {c["kind"] for c in plan["comm"]} >= {"fsdp_all_gather", "ep_all_to_all",
                                                  "tp_all_gather", "tp_reduce_scatter"}
    assert all(set(c) == {"kind", "group", "bytes_per_step", "intra_node"} for c in plan["comm"])
    for field in ("step_time_s", "tokens_per_s_per_gpu", "mfu"):
        assert plan[field]["lower"] <= plan[field]["upper"]
    assert plan["exactness"]["params_bytes"] == "exact"
    assert plan["exactness"]["activations_bytes"] == "model"
    assert plan["unknowns"]


@pytest.mark.parametrize(("change", "message"), [
    ({"--gpu": "a100"}, "--gpu must be one of h100, h200, b200; got 'a100'"),
    ({"--tp": "3"}, "world size 8 is not a multiple of tp*pp*cp = 3"),
    ({"--gpus": "7"}, "world size 7 is not a multiple of tp*pp*cp = 2"),
    ({"--global-batch-size": "6"}, "--global-batch-size (6) must be divisible by dp (4)"),
    ({"--ep": "8"}, "ep (8) must divide dp (4): experts are spread over the data-parallel ranks"),
])
def test_bad_input_is_trains_one_line(change, message, capsys):
    from composer.cli import main

    argv = list(PLAN)
    for flag, value in change.items():
        argv[argv.index(flag) + 1] = value
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"composer: error: {message}"


def test_a_layout_the_construction_refuses_is_one_line(capsys):
    """FSDP2 refuses experts too few to shard over dp_outer: the plan says so, as one line."""
    from composer.cli import main

    argv = ["plan", "deepseek-v3-debug", "--gpus", "256", "--gpu", "h100", "--pp", "2", "--ep",
            "2", "--tp", "1", "--cp", "1", "--seq-len", "64", "--global-batch-size", "256",
            "--micro-batch-size", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("composer: error: rank 128 cannot be built: FSDP does not support "
                          "uneven sharding"), err
    assert "\n" not in err


def test_comm_and_step_time_are_the_slowest_stages(monkeypatch, capsys):
    """Each pipeline stage's collectives are timed (at its first rank); the plan reports the
    slowest stage's step and its collectives (``comm_stage``), here a dense stage and a MoE
    stage whose all-to-alls only it runs."""
    import json

    from composer.cli import main
    from composer.plan import report

    timed = []

    def recording(flops, comm, *args):
        t = step_time(flops, comm, *args)
        timed.append((t, {c.kind for c in comm}))
        return t

    step_time = report.step_time
    monkeypatch.setattr(report, "step_time", recording)
    argv = ["plan", "qwen3-moe-debug", "--set", "pattern=*-*-|*E*E", "--set", "mlp.d_ff=128",
            "--gpus", "8", "--gpu", "h100", "--tp", "1", "--cp", "1", "--pp", "2", "--ep", "2",
            "--seq-len", "64", "--global-batch-size", "16", "--micro-batch-size", "1", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(timed) == 2  # one per stage
    assert "ep_all_to_all" in timed[1][1] and "ep_all_to_all" not in timed[0][1]
    slowest = max(range(2), key=lambda s: (timed[s][0]["lower"], timed[s][0]["upper"]))
    assert plan["comm_stage"] == slowest
    assert plan["step_time_s"] == {k: timed[slowest][0][k] for k in ("lower", "upper")}
    assert {c["kind"] for c in plan["comm"]} == timed[slowest][1]
