"""Shard-local construction: the initial weights do not depend on the layout, `composer export`
turns any layout's training checkpoint into the portable checkpoint `composer build` writes, and
a rank never holds the whole model."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import composer
from composer.cli import main
from composer.parallel.launch import run_distributed
from tests.helpers import assert_same_tensors, rel_err

pytestmark = pytest.mark.slow  # every test here spawns ranks or processes

# together: M, *, - and E
PRESETS = ("nemotron-h-debug", "nemotron-3-nano-debug")
SEED = 5
LAYOUTS = {2: [{"tp": 2}, {"ep": 2}, {"dp": 2}, {"dp": 2, "dp_mode": "replicate"},
               {"tp": 2, "sequence_parallel": False}],
           4: [{"tp": 2, "dp": 2}, {"tp": 2, "ep": 2}]}


def save_initial(world_layouts: list[dict], folder: str) -> None:
    """What `composer train P --steps 0 --seed S --save D` does, for every layout and preset."""
    from composer.parallel.checkpoint import save_checkpoint
    from composer.parallel.mesh import ParallelConfig
    from composer.run import prepare

    for i, layout in enumerate(world_layouts):
        for preset in PRESETS:
            model, _, opt, step = prepare(preset, ParallelConfig(**layout), seed=SEED,
                                          optimizer_lr=1e-3)
            save_checkpoint(f"{folder}/{preset}-{i}", step, model, opt)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("built")
    for preset in PRESETS:
        assert main(["build", "--preset", preset, "--seed", str(SEED), "--out",
                     str(root / preset)]) == 0
    return root


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_initial_weights_do_not_depend_on_the_layout(tmp_path, built, world, capsys):
    run_distributed(save_initial, world, LAYOUTS[world], str(tmp_path))
    for i, layout in enumerate(LAYOUTS[world]):
        for preset in PRESETS:
            out = tmp_path / f"export-{preset}-{i}"
            assert main(["export", str(tmp_path / f"{preset}-{i}"), str(out)]) == 0, layout
            assert_same_tensors(built / preset, out)  # bit for bit


def test_cli_train_steps_0_under_torchrun_exports_the_build(tmp_path, built):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "composer", "train", PRESETS[1], "--steps", "0", "--seed", str(SEED),
           "--save", str(tmp_path / "run"), "--tp", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--json"]) == 0
    assert_same_tensors(built / PRESETS[1], tmp_path / "out")
    # a step-0 checkpoint holds no optimizer state (a fresh one); training resumes from it
    np.save(tmp_path / "t.npy", np.random.default_rng(0).integers(0, 512, (4, 16)))
    assert main(["train", str(tmp_path / "run"), "--tokens", str(tmp_path / "t.npy"), "--steps",
                 "1", "--batch-size", "2", "--save", str(tmp_path / "run"), "--tp", "1"]) == 0
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-00000001"


def train_dp2(src: str, run: str, data: np.ndarray) -> None:
    from composer.parallel.checkpoint import save_checkpoint
    from composer.parallel.mesh import ParallelConfig
    from composer.run import prepare
    from tests.helpers import adamw_steps as train

    model, dims, opt, _ = prepare(src, ParallelConfig(dp=2), optimizer_lr=1e-2)
    result = train(model, dims, opt, list(data), 2, batch_size=4, seed=1)
    save_checkpoint(run, result.step, model, opt)


def test_dp2_checkpoint_exports_to_transformers(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    assert main(["build", "--preset", "llama-debug", "--out", str(tmp_path / "ck")]) == 0
    data = np.random.default_rng(0).integers(0, 512, (8, 16))
    run_distributed(train_dp2, 2, str(tmp_path / "ck"), str(tmp_path / "run"), data)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert main(["convert", "to-hf", str(tmp_path / "out"), str(tmp_path / "hf")]) == 0
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf2")]) == 0
    assert_same_tensors(tmp_path / "hf", tmp_path / "hf2")
    ours = composer.load(tmp_path / "out")
    trained = composer.load(tmp_path / "ck")
    assert not torch.equal(ours.embed.weight, trained.embed.weight)  # the steps were exported
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.from_numpy(data[:2]).long()
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) < 1e-4


# ---------------------------------------------------------------- memory

BIG = {"pattern": "(*-)x8", "d_model": 2048, "vocab_size": 32000,
       "attention": {"n_heads": 16}, "mlp": {"d_ff": 8192}, "mamba": None, "moe": None}


def peak_rss() -> int:
    """This process's peak resident set (VmHWM: reset by exec, unlike ru_maxrss, which a spawned
    process inherits from the parent it was forked from)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def build_and_measure(layout: dict) -> dict:
    from composer.parallel.mesh import ParallelConfig, build_parallel_dims
    from composer.run import build_sharded

    cfg = composer.ModelConfig.from_dict(BIG)
    model = build_sharded(cfg, build_parallel_dims(ParallelConfig(**layout)), seed=0)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in model.parameters())
    return {"peak_bytes": peak_rss(), "local": local}


@pytest.mark.parametrize("layout", [{"tp": 2}, {"dp": 2}], ids=["tp2", "dp2-shard"])
def test_each_rank_allocates_only_its_shards(layout):
    model = composer.build_model(composer.ModelConfig.from_dict(BIG), device="meta")
    n_params = sum(p.numel() for p in model.parameters())
    fp32_bytes = 4 * n_params
    assert fp32_bytes >= 1.5e9
    code = f"import composer, {__name__} as t; print(t.peak_rss())"
    idle = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    idle_bytes = int(idle.stdout)
    results = run_distributed(build_and_measure, 2, layout, fresh=True)  # measures its RSS
    for rank in results:
        assert rank["local"] < 0.55 * n_params
        peak = rank["peak_bytes"]
        assert peak < 0.6 * fp32_bytes + idle_bytes, json.dumps(
            {"peak_gb": peak / 1e9, "model_gb": fp32_bytes / 1e9, "idle_gb": idle_bytes / 1e9})
