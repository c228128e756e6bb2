"""composer train --dry-run: one impersonated rank through training's own setup on the meta device,
its built bytes equal to the plan's class for it, train's one-line refusals, nothing on disk."""

import json

import pytest

from composer.cli import main

SYNTHETIC = ["--tokens", "synthetic", "--seq-len", "32", "--steps", "10", "--gpu", "h100"]

# (preset, world, layout and batch flags): worlds 8 and 64, tp, ep, pp, cp, both dp modes
CASES = [
    ("llama-debug", 8, ["--tp", "2", "--global-batch-size", "8"]),
    ("qwen3-moe-debug", 64, ["--tp", "2", "--ep", "4", "--global-batch-size", "64"]),
    ("deepseek-v3-debug", 8, ["--pp", "2", "--ep", "2", "--global-batch-size", "16",
                              "--micro-batch-size", "1"]),
    ("deepseek-v3-debug", 64, ["--pp", "2", "--ep", "8", "--tp", "2",
                               "--global-batch-size", "32", "--micro-batch-size", "1"]),
    ("nemotron-h-debug", 8, ["--cp", "2", "--dp-mode", "replicate", "--global-batch-size", "8"]),
    ("qwen3-moe-debug", 64, ["--ep", "4", "--dp-replicate", "2", "--global-batch-size", "64"]),
]


def dry_run(capsys, argv: list[str]) -> tuple[int, dict | None, str]:
    code = main(["train", *argv, "--dry-run", "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out) if code == 0 else None, out.err.strip()


def class_of(plan: dict, example: int) -> dict:
    (klass,) = [c for c in plan["rank_classes"] if c["example_rank"] == example]
    return klass


def assert_plans_bytes(plan: dict) -> None:
    d = plan["dry_run"]
    klass = class_of(plan, d["class_rank"])
    assert klass["stage"] == d["stage"] and klass["n_ranks"] == d["class_ranks"]
    for k in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert d[k] == klass[k] > 0, k


@pytest.mark.parametrize(("preset", "world", "flags"), CASES)
def test_the_worst_rank_by_default_and_a_given_one(preset, world, flags, capsys, tmp_path,
                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [preset, "--gpus", str(world), *SYNTHETIC, *flags, "--save", "run"]
    code, plan, err = dry_run(capsys, argv)
    assert code == 0, err
    (worst,) = [c for c in plan["rank_classes"] if c["worst"]]
    d = plan["dry_run"]
    assert (d["rank"], d["world"], d["worst"], d["passed"]) == (worst["example_rank"], world,
                                                                 True, True)
    assert d["class_rank"] == d["rank"]
    assert_plans_bytes(plan)
    rank = world - 3  # the last stage; not a class's first rank where a stage has several
    code, plan, err = dry_run(capsys, [*argv, "--dry-run-rank", str(rank)])
    assert code == 0, err
    d = plan["dry_run"]
    assert d["rank"] == rank and d["stage"] == plan["layout"]["pp"] - 1
    assert d["class_rank"] <= rank
    assert_plans_bytes(plan)
    assert not any(tmp_path.iterdir())  # no run folder, no metrics, nothing


def test_the_table_and_the_line_naming_the_rank(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "llama-debug", "--dry-run", "--gpus", "8", "--tp", "2", *SYNTHETIC,
                 "--dry-run-rank", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("layout  tp=2 pp=1 cp=1 ep=1 dp=4 dp_mode=shard")
    assert lines[-1].startswith("dry run: rank 5 of 8 (stage 0, the worst class: 8 ranks like "
                                "rank 0) passed composer train's setup up to its first step;")
    assert lines[-1].endswith("the plan's bytes exactly")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("flags", [["--lora-rank", "4", "--tp", "2"],
                                   ["--lora-rank", "4", "--pp", "2", "--global-batch-size", "16",
                                    "--micro-batch-size", "1"]])
def test_lora_runs_plan_their_adapters_and_frozen_base(flags, capsys, tmp_path, monkeypatch):
    """The plan builds ranks as training does, adapters and frozen parts included; built the
    plan's old way (without them) the dry run sees the difference and says so (exit 1)."""
    from composer.plan import ranks

    monkeypatch.chdir(tmp_path)
    argv = ["llama-debug", "--gpus", "8", *SYNTHETIC, *flags]
    code, plan, err = dry_run(capsys, argv)
    assert code == 0, err
    d = plan["dry_run"]
    assert_plans_bytes(plan)
    assert d["grads_bytes"] < d["params_bytes"] / 4  # only the adapters train
    build = ranks.build_rank
    monkeypatch.setattr(ranks, "build_rank", lambda cfg, layout, precision, lora, frozen:
                        build(cfg, layout, precision))
    code, _, err = dry_run(capsys, argv)
    assert code == 1
    assert err.startswith(f"composer: error: dry run: rank {d['rank']} built {{'params': "
                          f"{d['params_bytes']}, 'grads': {d['grads_bytes']}"), err
    assert "(a bug of composer plan: please report it)" in err and "\n" not in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--tp", "3"], "world size 8 is not a multiple of tp*pp*cp = 3"),
    (["--global-batch-size", "6"], "--global-batch-size (6) must be divisible by dp (8)"),
    (["--ep", "16"], "ep (16) must divide dp (8): experts are spread over the data-parallel "
                     "ranks"),
    # checked by train's setup alone (the plan does not look at validation): setup ran
    (["--eval-every", "5"], "--eval-every needs validation data: an indexed dataset (--data) "
                            "with a valid share in --split, e.g. --split 98,2,0"),
    (["--tokens", "missing.npy"], "missing.npy: cannot read tokens ([Errno 2] No such file or "
                                  "directory: 'missing.npy')"),
    (["--dry-run-rank", "8"], "--dry-run-rank must be in 0..7 (--gpus 8), got 8"),
    (["--gpu", "a100"], "--gpu must be one of h100, h200, b200; got 'a100'"),
])
def test_bad_input_is_trains_one_line_and_exit_2(flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = dry_run(capsys, ["qwen3-moe-debug", "--gpus", "8", *SYNTHETIC, *flags])
    assert code == 2
    assert err == f"composer: error: {message}"
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("argv", "message"), [
    (["llama-debug", *SYNTHETIC[:-2], "--dry-run"],
     "--dry-run needs the world size: give --gpus N (or a recipe whose layout names dp)"),
    (["llama-debug", *SYNTHETIC[:-2], "--gpus", "8"],
     "--gpus is for --dry-run (a rank of a world checked here)"),
    (["llama-debug", *SYNTHETIC[:-2], "--dry-run-rank", "1"],
     "--dry-run-rank is for --dry-run (a rank of a world checked here)"),
])
def test_the_world_is_needed_and_the_flags_are_the_dry_runs(argv, message, capsys, tmp_path,
                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"composer: error: {message}"
    assert not any(tmp_path.iterdir())


def test_refused_in_a_process_with_a_process_group(capsys, tmp_path, monkeypatch):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.chdir(tmp_path)
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        code, _, err = dry_run(capsys, ["llama-debug", "--gpus", "8", *SYNTHETIC])
    finally:
        dist.destroy_process_group()
    assert code == 2
    assert err == ("composer: error: composer plan and train --dry-run impersonate ranks in a "
                   "process of their own: this one is already rank 1 of 4 (run it outside "
                   "torchrun or composer launch)")
    monkeypatch.setenv("RANK", "0")  # torchrun's rank 0 of 2, before joining its group
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = dry_run(capsys, ["llama-debug", "--gpus", "8", *SYNTHETIC])
    assert code == 2 and err.endswith("this one is already rank 0 of 2 (run it outside torchrun "
                                      "or composer launch)")


@pytest.mark.slow
def test_a_shipped_recipe_names_its_world_and_nothing_is_written(capsys, tmp_path, monkeypatch):
    """llama-3.1-8b: 64 H100s (its layout's dp), its save folder and data are the cluster's:
    the data is train's error here, synthetic tokens check the rest; nothing is created."""
    monkeypatch.chdir(tmp_path)
    code, _, err = dry_run(capsys, ["--config", "llama-3.1-8b", "--gpu", "h100"])
    assert (code, err) == (2, "composer: error: data/tokens.npy: cannot read tokens ([Errno 2] "
                              "No such file or directory: 'data/tokens.npy')")
    code, plan, err = dry_run(capsys, ["--config", "llama-3.1-8b", "--gpu", "h100", "--tokens",
                                       "synthetic"])
    assert code == 0, err
    assert plan["dry_run"]["world"] == 64 and plan["layout"]["dp"] == 64
    assert plan["dry_run"]["precision"] == "bf16"
    assert_plans_bytes(plan)
    code, _, err = dry_run(capsys, ["--config", "llama-3.1-8b", "--gpu", "h100", "--gpus", "128"])
    assert (code, err) == (2, "composer: error: dp*tp*pp*cp = 64 does not equal the world size "
                              "128 (dp=64, tp=1)")
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_resumed_run_is_dry_run_without_touching_it(capsys, tmp_path, monkeypatch):
    """A run folder as SOURCE: its saved recipe and model, read only; an interrupted save's
    leftover stays (a real start would remove it), no checkpoint is loaded."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "llama-debug", "--tokens", "synthetic", "--seq-len", "16", "--steps",
                 "1", "--global-batch-size", "2", "--save", "run", "--json"]) == 0
    capsys.readouterr()
    (tmp_path / "run" / "step-00000009").mkdir()  # newer than latest: incomplete
    before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns)
                    for p in tmp_path.rglob("*"))
    code, plan, err = dry_run(capsys, ["run", "--gpus", "4", "--gpu", "h100", "--tp", "2",
                                       "--steps", "5"])
    assert code == 0, err
    assert plan["dry_run"]["steps"] == 5 and plan["layout"]["tp"] == 2
    assert_plans_bytes(plan)
    # --save naming that run with another model: train's refusal, before any work
    code, _, err = dry_run(capsys, ["qwen3-moe-debug", "--save", "run", "--gpus", "4", "--gpu",
                                    "h100", "--tokens", "synthetic", "--seq-len", "16"])
    assert code == 2 and err.startswith("composer: error: run holds a run of a different model "
                                        "than qwen3-moe-debug ("), err
    assert sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns)
                  for p in tmp_path.rglob("*")) == before


@pytest.mark.slow
def test_deepseek_v3_671b_at_2048_ranks(capsys, tmp_path, monkeypatch):
    """The issue's scale: pp16 x ep64 x dp128, a middle stage's rank, on meta in one process."""
    monkeypatch.chdir(tmp_path)
    code, plan, err = dry_run(capsys, [
        "deepseek-v3-671b", "--gpus", "2048", "--gpu", "h100", "--pp", "16", "--ep", "64",
        "--tokens", "synthetic", "--seq-len", "4096", "--global-batch-size", "15360",
        "--micro-batch-size", "1", "--steps", "10", "--dry-run-rank", "1300"])
    assert code == 0, err
    d = plan["dry_run"]
    assert (d["stage"], d["class_rank"]) == (10, 1280)
    assert_plans_bytes(plan)
    assert not any(tmp_path.iterdir())
