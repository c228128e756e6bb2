"""The `composer` command: build, zoo, --json discipline, one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

import composer
from composer.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_build_default_table(capsys):
    code, out, err = run(capsys, "build")
    assert code == 0 and err == ""
    assert "pattern" in out and "M-M*-ME" in out and "total parameters" in out
    assert "weights in bf16" in out and "FLOPs/token" in out


def test_build_json_is_one_line(capsys):
    code, out, _ = run(capsys, "build", "--pattern", "(M-)x2 *E", "--json")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 1
    info = json.loads(lines[0])
    assert info["pattern"] == "M-M-*E"
    assert info["n_layers"] == 6
    assert info["layer_counts"] == {"M": 2, "-": 2, "*": 1, "E": 1}
    model = composer.build_model(composer.ModelConfig(pattern="M-M-*E"), device="meta")
    stats = composer.model_stats(model)
    assert info["n_params"] == stats.n_params
    assert info["n_active_params"] == stats.n_active_params < stats.n_params
    assert info["flops_per_token"] == stats.flops_per_token


def test_build_set_and_seed_and_out(capsys, tmp_path):
    code, out, _ = run(capsys, "build", "--pattern", "M*-", "--set", "d_model=64",
                       "--set", "attention.n_heads=2", "--set", "vocab_size=128", "--seed", "3",
                       "--out", str(tmp_path / "ck"), "--json")
    assert code == 0
    info = json.loads(out)
    model = composer.load(tmp_path / "ck")
    assert model.config.d_model == 64 and model.config.attention.n_heads == 2
    assert sum(p.numel() for p in model.parameters()) == info["n_params"]
    again = composer.build_model(model.config, seed=3)
    assert all((a == b).all() for a, b in zip(model.state_dict().values(),
                                              again.state_dict().values(), strict=True))


def test_build_preset(capsys):
    code, out, _ = run(capsys, "build", "--preset", "llama-3.1-8b", "--json")
    assert code == 0
    assert json.loads(out)["n_params"] == 8_030_261_248


@pytest.mark.slow
def test_zoo_list_and_show(capsys):
    code, out, _ = run(capsys, "zoo", "list", "--json")
    assert code == 0 and len(out.splitlines()) == 1
    items = json.loads(out)
    names = {i["name"] for i in items}
    assert {"nemotron-h-8b", "qwen3-30b-a3b", "mamba2-2.7b", "llama-debug"} <= names
    assert all({"name", "family", "n_params"} <= set(i) for i in items)
    code, out, _ = run(capsys, "zoo", "list")
    assert code == 0 and "nemotron-3-nano-30b-a3b" in out
    code, out, _ = run(capsys, "zoo", "show", "qwen3-0.6b")
    assert code == 0 and "Qwen/Qwen3-0.6B" in out and "qk_norm: true" in out
    code, out, _ = run(capsys, "zoo", "show", "mixtral-8x7b", "--json")
    assert json.loads(out)["config"]["moe"]["n_experts"] == 8


@pytest.mark.parametrize(
    "argv, message",
    [
        (["build", "--set", "attention.n_head=8"], "did you mean 'attention.n_heads'?"),
        (["build", "--set", "d_model=abc"], "d_model expects int, got 'abc'"),
        (["build", "--set", "nonsense"], "must look like key=value"),
        (["build", "--preset", "llama-3.1-9b"], "unknown preset 'llama-3.1-9b'; did you mean"),
        (["build", "--pattern", "M*Q"], "character 'Q' at column 3"),
        (["build", "--pattern", "MD"], "'D' (sparse attention) is recognised but not built yet"),
        (["build", "--pattern", "M", "--preset", "llama-debug"], "not both"),
        (["build", "--set", "moe.top_k=99"], "moe.top_k (99) must be <= moe.n_experts (8)"),
        (["build", "--set", "moe=null"], "needs the 'moe' section"),
        (["build", "--seed", "x"], "invalid int value"),
        (["zoo", "show", "nope"], "unknown preset 'nope'"),
        (["frobnicate"], "invalid choice"),
        (["zoo"], "zoo: the following arguments are required: zoo_command"),
    ],
)
def test_errors_are_one_line_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("composer: ")
    assert message in err
    assert "Traceback" not in err


def test_out_refuses_non_empty_dir(capsys, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    code, _, err = run(capsys, "build", "--pattern", "M", "--out", str(tmp_path / "x"))
    assert code == 2 and "not empty" in err
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_python_dash_m_entry_point(tmp_path):
    # run outside the checkout so the installed package is what gets imported
    proc = subprocess.run([sys.executable, "-m", "composer", "build", "--pattern", "*-", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["pattern"] == "*-"
    bad = subprocess.run([sys.executable, "-m", "composer", "build", "--pattern", "M)"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert bad.stderr.strip().count("\n") == 0


@pytest.mark.slow
def test_train_compile_gives_the_eager_losses(capsys, tmp_path):
    """`--compile` (inductor, the real CPU backend) trains to the same losses as eager."""
    import numpy as np
    import torch

    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 512, (4, 32)))
    argv = ["train", "nemotron-h-debug", "--tokens", str(tmp_path / "tokens.npy"), "--steps",
            "2", "--batch-size", "2", "--json"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    eager = json.loads(out)["losses"]
    from torch._dynamo.utils import counters

    counters.clear()
    try:
        code, out, _ = run(capsys, *argv, "--compile")
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert code == 0 and graphs >= 1  # the layers really went through dynamo
    compiled = json.loads(out)["losses"]
    assert len(compiled) == 2
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_explicitly_empty_pattern_is_an_error(capsys):
    code, out, err = run(capsys, "build", "--pattern", "")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "empty pattern ''" in err


@pytest.mark.slow
def test_output_to_a_closed_pipe_exits_quietly(tmp_path):
    # `composer zoo show NAME | head`: here a reader that leaves before anything is written
    proc = subprocess.run(f"{sys.executable} -m composer zoo show nemotron-h-8b | true",
                          shell=True, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_device_cuda_without_a_gpu_is_a_one_line_error(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here; the error is for machines without a GPU")
    code, out, err = run(capsys, "train", "llama-debug", "--steps", "0", "--save",
                         str(tmp_path / "run"), "--device", "cuda")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--device cuda: no CUDA device is available" in err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------ issue 21: messages, start-up

PATTERN_TAIL = ("; valid symbols: M (Mamba-2), * (attention), - (dense MLP), E (MoE), "
                "G (gated delta net), + (multi-latent attention), D (sparse attention), "
                "C (short convolution), S (Mamba-1), W (sliding-window attention), "
                "K (Kimi delta attention), Z (Zamba2 hybrid); '|' stage boundary, '/' MTP part, "
                "'(...)xN' repetition, '[..]' parallel group, '{a:..}' / '{a}' shared layer")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--steps", "3", "--stpes", "3"], "unrecognized arguments: --stpes"),
        (["build", "--seed", "x"], "build: argument --seed: invalid int value: 'x'"),
        (["zoo"], "zoo: the following arguments are required: zoo_command"),
        (["build", "--set", "mamba.d_stat=3"],
         "unknown config key 'mamba.d_stat'; did you mean 'mamba.d_state'? (valid: n_heads, "
         "d_head, n_groups, d_state, d_conv, chunk_size, norm_group_size, conv_bias, proj_bias, "
         "dt_min, dt_max, dt_init_floor, dt_limit, a_init_range, gated_norm, "
         "norm_before_gate, out_proj_bias, multipliers)"),
        (["zoo", "show", "qwen3-30b"],
         "unknown preset 'qwen3-30b'; did you mean 'qwen3-30b-a3b'? (see `composer zoo list`)"),
        (["build", "--preset", "llama-3.1-9b"],
         "unknown preset 'llama-3.1-9b'; did you mean 'llama-3.1-8b'? (see `composer zoo list`)"),
        (["build", "--pattern", "(M-x2"],
         "unclosed '(' (a ')' must come before the 'x' at column 4): character '(' at column 1 "
         "in pattern '(M-x2'" + PATTERN_TAIL),
        (["build", "--pattern", "G-+E", "--set", "mla=null"],
         "pattern symbol '+' needs the 'mla' section, which is None; give it one, e.g. --set "
         "mla.n_heads=4 (its other keys then take their defaults for d_model 256)"),
    ],
)
def test_exact_error_messages(capsys, argv, message):
    assert run(capsys, *argv) == (2, "", f"composer: error: {message}\n")


def test_the_refusal_names_a_set_that_works(capsys):
    # the key the refusal above names makes the config valid, with the sections of d_model 64
    code, out, err = run(capsys, "build", "--pattern", "G-+E", "--set", "d_model=64",
                         "--set", "mla=null", "--set", "mla.n_heads=4", "--json")
    assert (code, err) == (0, "")
    cfg = composer.ModelConfig(pattern="G-+E", d_model=64)
    cfg.mla.n_heads = 4
    stats = composer.model_stats(composer.build_model(cfg, device="meta"))
    assert json.loads(out)["n_params"] == stats.n_params


def test_build_a_pattern_of_every_kind_with_defaults(capsys):
    code, out, err = run(capsys, "build", "--pattern", "G-+E", "--set", "d_model=64", "--json")
    assert (code, err) == (0, "")
    info = json.loads(out)
    assert info["layer_counts"] == {"G": 1, "-": 1, "+": 1, "E": 1}
    cfg = composer.ModelConfig(pattern="G-+E", d_model=64)
    assert info["n_params"] == composer.model_stats(
        composer.build_model(cfg, device="meta")).n_params


def test_version_and_bare_command(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"composer {version('composer-lm')}\n"
    code, out, err = run(capsys)
    assert (code, err) == (0, "")
    assert out.startswith("usage: composer [-h] [--version]") and "generate" in out


LIGHT = [["--help"], ["--version"], [], ["train", "--steps", "3", "--stpes", "3"],
         ["zoo", "show", "--help"], ["train", "--help"], ["train", "--list-recipes", "--json"],
         ["build", "--pattern", "M)"], ["zoo", "show", "qwen3-30b"]]


def test_light_commands_do_not_import_torch(tmp_path):
    script = (
        "import sys\n"
        "from composer.cli import main\n"
        f"for argv in {LIGHT!r}:\n"
        "    try:\n"
        "        code = main(argv)\n"
        "    except SystemExit as exc:\n"
        "        code = exc.code\n"
        "    print('exit', code, file=sys.stderr)\n"
        "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    exits = [line for line in proc.stderr.splitlines() if line.startswith("exit ")]
    assert exits == ["exit 0", "exit 0", "exit 0", "exit 2", "exit 0", "exit 0", "exit 0",
                     "exit 2", "exit 2"], proc.stderr
    assert proc.stderr.splitlines()[-1] == "torch imported: False", proc.stderr


def test_the_light_parser_lists_generate_as_the_full_one_does():
    # without `generate` on the command line its options (which import torch) are not loaded;
    # the command list must not tell the difference
    from composer.cli import make_parser

    assert make_parser(["build"]).format_help() == make_parser(None).format_help()
