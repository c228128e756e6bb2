"""LoRA (composer/lora.py): exact at init for every kind, merged equals unmerged, the adapter math
against its fp64 reference twin, frozen base in a training step, the targets' errors, adapters
initialised on a loaded base."""

import copy
import math

import pytest
import torch

from composer.blocks.split import SplitLinear
from composer.build.builder import build_model
from composer.build.init import init_weights
from composer.config import ConfigError, ModelConfig, apply_overrides
from composer.lora import (
    LoRA,
    LoRAConfig,
    adapter_names,
    add_lora,
    available_targets,
    lora_config,
    lora_state_dict,
    merge_lora,
)
from tests.helpers import randomize

TINY = ["d_model=32", "vocab_size=61", "attention.n_heads=4", "attention.n_kv_heads=2",
        "mamba.n_heads=4", "mamba.d_head=8", "mamba.n_groups=2", "mamba.d_state=8",
        "mamba.chunk_size=8", "mlp.d_ff=64", "moe.n_experts=4", "moe.top_k=2", "moe.d_ff=32",
        "moe.n_shared_experts=1", "moe.aux_loss_coeff=0.0", "gdn.n_heads=2", "gdn.n_kv_heads=2",
        "mla.n_heads=2", "mla.kv_lora_rank=16", "mla.q_lora_rank=16"]
PATTERN = "M*-EG+"


def tiny(pattern: str = PATTERN, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    cfg = apply_overrides(ModelConfig(pattern=pattern), TINY).validate()
    model = build_model(cfg)
    randomize(model, seed=0, std=0.1)
    return model.to(dtype)


def _ids(vocab: int = 61) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def _randomize_adapters(model: torch.nn.Module, seed: int = 2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in adapter_names(model):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.1)


def test_every_kind_declares_its_projections():
    avail = available_targets(tiny())
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 "in_proj", "out_proj", "z_proj", "b_proj", "a_proj", "q_a_proj", "q_b_proj",
                 "kv_a_proj", "kv_b_proj", "experts"):
        assert name in avail, name
    assert "layers.3.mixer.shared_experts.gate_proj" in avail["gate_proj"]


def test_at_init_logits_bit_identical_to_base():
    base = tiny()
    ids = _ids()
    want = base(ids)
    adapted = copy.deepcopy(base)
    add_lora(adapted, LoRAConfig(rank=4, alpha=8, targets=("all", "experts")))
    # the builder's init: A Kaiming-uniform, B zero, whatever the base's values
    init_weights(adapted, seed=3, only=lambda n: n in adapter_names(adapted))
    names = adapter_names(adapted)
    assert any(n.endswith("experts.lora.up_proj.A") for n in names)
    assert "layers.0.mixer.in_proj.lora.B.weight_x" in names
    for name, p in adapted.named_parameters():
        assert p.requires_grad == (name in names), name
        if name.endswith(".B") or ".B.weight" in name:
            assert not p.any(), name
        elif name in names:
            bound = 1 / math.sqrt(p.shape[-1])
            assert p.abs().max() <= bound and p.std() > bound / 4, name
    assert torch.equal(adapted(ids), want)


def test_state_dict_keys():
    model = tiny("M*")
    add_lora(model, LoRAConfig(rank=3))
    sd = lora_state_dict(model)
    assert sd["layers.1.mixer.q_proj.lora.A.weight"].shape == (3, 32)
    assert sd["layers.1.mixer.q_proj.lora.B.weight"].shape == (32, 3)
    fused = model.layers["0"].mixer.in_proj.weight_z.shape[0]
    assert sd["layers.0.mixer.in_proj.lora.B.weight"].shape[1] == 3
    assert sd["layers.0.mixer.in_proj.lora.B.weight"].shape[0] > fused  # all parts, fused
    assert "layers.1.mixer.q_proj.weight" in model.state_dict()  # the base's keys unchanged


def test_merged_equals_unmerged():
    model = tiny(dtype=torch.float64)
    add_lora(model, LoRAConfig(rank=4, alpha=6, targets=("all", "experts")))
    _randomize_adapters(model)
    ids = _ids()
    unmerged = model(ids)
    merge_lora(model)
    assert not adapter_names(model) and not any(".lora." in k for k in model.state_dict())
    merged = model(ids)
    assert (merged - unmerged).abs().max() < 1e-10
    assert all(p.requires_grad for p in model.parameters())


def test_adapter_math_reference_twin():
    """y = x W^T + (a/r) (x A^T) B^T, in fp64, for a plain and a fused (SplitLinear) base."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, dtype=torch.float64)
    for base in (torch.nn.Linear(8, 6, dtype=torch.float64),
                 SplitLinear(8, {"a": 4, "b": 2}, bias=True).double()):
        torch.nn.init.normal_(next(iter(base.parameters())), generator=g)
        holder = torch.nn.Module()
        holder.proj = base
        holder.lora_targets = lambda: {"proj": "proj"}
        lora = LoRA(8, {"a": 4, "b": 2} if isinstance(base, SplitLinear) else 6, rank=3,
                    scaling=0.5).double()
        a = torch.randn(3, 8, generator=g, dtype=torch.float64)
        b = torch.randn(6, 3, generator=g, dtype=torch.float64)
        with torch.no_grad():
            lora.A.weight.copy_(a)
            if isinstance(lora.B, SplitLinear):
                lora.B.weight_a.copy_(b[:4])
                lora.B.weight_b.copy_(b[4:])
            else:
                lora.B.weight.copy_(b)
        w = base.fused_weight() if isinstance(base, SplitLinear) else base.weight
        bias = base.fused_bias() if isinstance(base, SplitLinear) else base.bias
        want = x @ w.T + bias + 0.5 * (x @ a.T) @ b.T
        got = base(x) + lora(x)
        assert (got - want).abs().max() < 1e-12


def test_unknown_target_is_one_line_error():
    model = tiny("M*")
    with pytest.raises(ConfigError) as err:
        add_lora(model, LoRAConfig(rank=2, targets=("q_proj", "qkv", "gate_proj")))
    assert str(err.value) == (
        "--lora-targets qkv gate_proj: no such projection in this model (available: all, "
        "in_proj, k_proj, o_proj, out_proj, q_proj, v_proj)")


def test_lora_config_from_recipe():
    from composer.train.recipe import Recipe

    assert lora_config(Recipe()) is None
    cfg = lora_config(Recipe(lora_rank=8, lora_alpha=16.0, lora_targets=["q_proj"]))
    assert cfg == LoRAConfig(rank=8, alpha=16.0, targets=("q_proj",)) and cfg.scaling == 2.0
    assert LoRAConfig(rank=4).scaling == 1.0


def test_per_module_ranks_and_scalings():
    model = tiny("*")
    add_lora(model, LoRAConfig(rank=2, alpha=2, targets=("q_proj", "v_proj")),
             ranks={"layers.0.mixer.v_proj": 5}, scalings={"q_proj": 0.25})
    mixer = model.layers["0"].mixer
    assert mixer.q_proj.lora.rank == 2 and mixer.q_proj.lora.scaling == 0.25
    assert mixer.v_proj.lora.rank == 5 and mixer.v_proj.lora.scaling == 1.0
    assert not hasattr(mixer.k_proj, "lora")


def _train(extra: dict) -> dict:
    from tests.helpers import train_case

    recipe = {"model": {"pattern": PATTERN, "set": dict(s.split("=") for s in TINY)},
              "tokens": "synthetic", "seq_len": 16, "steps": 1, "global_batch_size": 4,
              "lr": 1e-2, "device": "cpu", "precision": "fp32", "lora_rank": 4,
              "lora_targets": ["all", "experts"], **extra}
    return train_case(recipe)


def test_training_step_changes_only_adapters():
    before = _train({"steps": 0})["params"]
    after = _train({})["params"]
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    adapters = {k for k in before if ".lora." in k}
    bs = {k for k in adapters if k.endswith(".B") or ".B.weight" in k}
    assert changed <= adapters
    assert bs <= changed  # B starts at zero and moves first (A's gradient is B^T g = 0)


def test_base_from_portable_checkpoint_adapters_initialised(tmp_path):
    """A loaded base holds no adapters: they are initialised (seeded, by name) and the
    adapted model starts exactly as the base; the same seed gives the same adapters."""
    from composer.build.builder import open_portable, save
    from composer.parallel.mesh import ParallelConfig, build_parallel_dims
    from composer.run import build_sharded

    base = tiny()
    save(base, tmp_path / "base")
    ids = _ids()
    want = base(ids)
    dims = build_parallel_dims(ParallelConfig(), "cpu")
    got = []
    for _ in range(2):
        cfg, tensors = open_portable(tmp_path / "base")
        try:
            got.append(build_sharded(cfg, dims, seed=5, tensors=tensors,
                                     lora=LoRAConfig(rank=2, targets=("all", "experts"))))
        finally:
            tensors.close()
    model = got[0]
    assert torch.equal(model(ids), want)
    sd, again = lora_state_dict(model), lora_state_dict(got[1])
    assert sd and all(torch.equal(v, again[k]) for k, v in sd.items())
    a = sd["layers.1.mixer.q_proj.lora.A.weight"]
    assert a.abs().max() <= 1 / math.sqrt(32) and a.std() > 0
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".lora." not in n)


def test_lora_run_is_read_with_its_adapters(tmp_path):
    from composer.parallel.mesh import ParallelConfig
    from composer.run import has_adapters, prepare

    _train({"save": str(tmp_path / "run")})
    assert has_adapters(tmp_path / "run")
    own, _, _, _ = prepare(str(tmp_path / "run"), ParallelConfig(), device="cpu")
    lora = LoRAConfig(rank=4, targets=("all", "experts"))
    model, _, _, step = prepare(str(tmp_path / "run"), ParallelConfig(), device="cpu", lora=lora)
    assert step == 1 and lora_state_dict(model)["layers.3.mixer.experts.lora.up_proj.B"].any()
    # without LoRA settings the run's own (its recipe) are used: never read as its base alone
    got = lora_state_dict(own)
    assert got.keys() == lora_state_dict(model).keys()
    assert all(torch.equal(v, lora_state_dict(model)[k]) for k, v in got.items())


def test_cli_train_lora_from_a_portable_base(tmp_path, capsys):
    """``composer train BASE --lora-rank 4``: the step changes adapters only (the run's saved
    base equals the portable one); an unknown target is the one-line error, exit 2."""
    from composer.build.builder import save
    from composer.cli import main
    from composer.parallel.checkpoint import latest_step
    from composer.parallel.mesh import ParallelConfig
    from composer.run import prepare

    save(tiny(), tmp_path / "base")
    args = ["train", str(tmp_path / "base"), "--tokens", "synthetic", "--seq-len", "16",
            "--steps", "1", "--batch-size", "4", "--device", "cpu", "--precision", "fp32",
            "--lora-rank", "4", "--lora-alpha", "8"]
    assert main([*args, "--lora-targets", "q_proj", "qkv"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["composer: error: --lora-targets qkv: no such projection in this model "
                   "(available: all, a_proj, b_proj, down_proj, experts, gate_proj, in_proj, "
                   "k_proj, kv_a_proj, kv_b_proj, o_proj, out_proj, q_a_proj, q_b_proj, "
                   "q_proj, up_proj, v_proj, z_proj)"]
    assert main([*args, "--save", str(tmp_path / "run")]) == 0
    assert latest_step(tmp_path / "run").name.endswith("1")
    lora = LoRAConfig(rank=4, alpha=8)
    trained, _, _, _ = prepare(str(tmp_path / "run"), ParallelConfig(), device="cpu", lora=lora)
    base = tiny().state_dict()
    state = trained.state_dict()
    assert {k for k in state if ".lora." not in k} == set(base)
    assert all(torch.equal(state[k], v) for k, v in base.items())
    assert any(v.any() for k, v in lora_state_dict(trained).items() if ".B." in k)


def test_adapters_on_a_run_and_loaded_tensors(tmp_path):
    """A run's weights as a base (``load_checkpoint(skip=is_adapter)``, then the adapters
    initialised), and adapter tensors loaded by key (a fused B whole), as a PEFT import does."""
    from composer.build.init import init_weights
    from composer.lora import is_adapter, load_lora_state_dict
    from composer.parallel.checkpoint import load_checkpoint
    from composer.parallel.mesh import ParallelConfig, build_parallel_dims
    from composer.run import build_sharded
    from tests.helpers import train_case

    recipe = {"model": {"pattern": "M*", "set": dict(s.split("=") for s in TINY)},
              "tokens": "synthetic", "seq_len": 16, "steps": 1, "global_batch_size": 4,
              "device": "cpu", "precision": "fp32", "save": str(tmp_path / "run")}
    base = train_case(recipe)["params"]
    cfg = apply_overrides(ModelConfig(pattern="M*"), TINY).validate()
    dims = build_parallel_dims(ParallelConfig(), "cpu")
    model = build_sharded(cfg, dims, seed=None, lora=LoRAConfig(rank=2))
    assert load_checkpoint(tmp_path / "run", model, skip=is_adapter) == 1
    init_weights(model, seed=0, only=is_adapter)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in base.items())
    sd = {k: torch.randn(v.shape) for k, v in lora_state_dict(model).items()}
    load_lora_state_dict(model, sd)
    assert all(torch.equal(v, sd[k]) for k, v in lora_state_dict(model).items())
    with pytest.raises(ValueError, match="missing"):
        load_lora_state_dict(model, dict(list(sd.items())[1:]))


def test_cached_decoding_sees_the_adapters():
    """The hooks act in every forward, cached decoding's too (Mamba-2 / GDN states, K/V); MLA's
    absorbed decoding reads kv_b_proj's weight, so it decodes merged (merge_lora)."""
    from composer.inference.decode import generate

    model = tiny("M*-EG", dtype=torch.float64)
    add_lora(model, LoRAConfig(rank=4, targets=("all", "experts")))
    _randomize_adapters(model, seed=4)
    prompt = _ids()[:, :5]
    cached = generate(model, prompt, 6)
    assert torch.equal(cached, generate(model, prompt, 6, use_cache=False))
    merged = copy.deepcopy(model)
    merge_lora(merged)
    assert torch.equal(generate(merged, prompt, 6), cached)
    mla = tiny("+", dtype=torch.float64)
    add_lora(mla, LoRAConfig(rank=4))
    _randomize_adapters(mla, seed=4)
    full = generate(mla, prompt, 6, use_cache=False)
    merge_lora(mla)
    assert torch.equal(generate(mla, prompt, 6), full)
