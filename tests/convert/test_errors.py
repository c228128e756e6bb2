"""Bad inputs: one-line error, non-zero exit, no traceback, nothing left behind."""

import json
import pickle
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from composer.cli import main
from composer.convert import adapters, from_hf, to_hf


@pytest.fixture
def llama_folder(tmp_path, randomize) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1))
    randomize(model)
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    return tmp_path / "hf"


def convert(capsys, *argv):
    capsys.readouterr()  # drop what the fixtures printed (transformers' save progress)
    code = main(["convert", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_failure(code, out, err, message, parent: Path):
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("composer: error: "), err
    assert "Traceback" not in err
    assert message in err, err
    leftovers = [p.name for p in parent.iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers


def test_truncated_shard(capsys, llama_folder, tmp_path):
    path = llama_folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "out")
    assert_clean_failure(code, out, err, "model.safetensors: truncated", tmp_path)
    assert not (tmp_path / "out").exists()


def test_shape_mismatch_with_config(capsys, llama_folder, tmp_path):
    cfg = json.loads((llama_folder / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (llama_folder / "config.json").write_text(json.dumps(cfg))
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "out")
    assert_clean_failure(code, out, err, "shape mismatch: 'model.layers.0.mlp.gate_proj.weight' "
                         "(in model.safetensors) is [32, 16], 'layers.1.mixer.gate_proj.weight' "
                         "needs [40, 16]", tmp_path)


def test_unknown_architecture(capsys, llama_folder, tmp_path):
    cfg = json.loads((llama_folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (llama_folder / "config.json").write_text(json.dumps(cfg))
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "out")
    assert_clean_failure(code, out, err, "unsupported architecture 'GPT2LMHeadModel'; supported: "
                         , tmp_path)
    assert "LlamaForCausalLM" in err


def test_unexpected_tensor_name(capsys, llama_folder, tmp_path):
    tensors = load_file(llama_folder / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = torch.zeros(3)
    save_file(tensors, llama_folder / "model.safetensors", metadata={"format": "pt"})
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "out")
    assert_clean_failure(code, out, err, "unexpected tensor 'model.layers.0.mystery.weight'",
                         tmp_path)


def test_missing_tensor(capsys, llama_folder, tmp_path):
    tensors = load_file(llama_folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, llama_folder / "model.safetensors", metadata={"format": "pt"})
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "out")
    assert_clean_failure(code, out, err, "tensor 'model.layers.1.self_attn.k_proj.weight' is "
                         "missing", tmp_path)


def _shard(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half],
             "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, folder / file, metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    index = {"metadata": {"total_size": 0},
             "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_source_converts(llama_folder, tmp_path):
    _shard(llama_folder)
    from_hf(llama_folder, tmp_path / "ours")
    to_hf(tmp_path / "ours", tmp_path / "back", max_shard_bytes=20_000)
    back = tmp_path / "back"
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert (back / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(back)


def test_index_naming_a_missing_shard(capsys, llama_folder, tmp_path):
    _shard(llama_folder)
    (llama_folder / "model-00002-of-00002.safetensors").unlink()
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "out")
    assert_clean_failure(code, out, err, "names shard 'model-00002-of-00002.safetensors', which "
                         "is missing", tmp_path)


def test_non_empty_destination_without_force(capsys, llama_folder, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "out")
    assert_clean_failure(code, out, err, "is not empty; pass --force to replace it", tmp_path)
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "out", "--force")
    assert code == 0 and not (tmp_path / "out" / "mine.txt").exists()


class Payload:
    def __reduce__(self):
        return (Path.write_text, (Path(PAYLOAD_MARK), "pwned"))


PAYLOAD_MARK = "/tmp/composer-pickle-payload-ran"


def test_pickle_payload_never_runs(capsys, llama_folder, tmp_path):
    Path(PAYLOAD_MARK).unlink(missing_ok=True)
    state = load_file(llama_folder / "model.safetensors")
    (llama_folder / "model.safetensors").unlink()
    with open(llama_folder / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": Payload(), **state}, f)
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "out")
    assert_clean_failure(code, out, err, "pytorch_model.bin: refused", tmp_path)
    assert not Path(PAYLOAD_MARK).exists()


def test_plain_bin_checkpoint_is_read(llama_folder, tmp_path):
    state = load_file(llama_folder / "model.safetensors")
    (llama_folder / "model.safetensors").unlink()
    torch.save(state, llama_folder / "pytorch_model.bin")
    from_hf(llama_folder, tmp_path / "ours")
    to_hf(tmp_path / "ours", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_corrupt_header_and_bad_config(capsys, llama_folder, tmp_path):
    path = llama_folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 10**12)
    path.write_bytes(bytes(data))
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "out")
    assert_clean_failure(code, out, err, "header length", tmp_path)
    (llama_folder / "config.json").write_text("{not json")
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "out")
    assert_clean_failure(code, out, err, "config.json: not valid JSON", tmp_path)


def test_missing_source_and_offline_hub(capsys, tmp_path, monkeypatch):
    code, out, err = convert(capsys, "from-hf", tmp_path / "nope", tmp_path / "out")
    assert_clean_failure(code, out, err, "no such folder", tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = convert(capsys, "from-hf", "someorg/some-model-xyz", tmp_path / "out")
    assert_clean_failure(code, out, err, "fetching it from the Hugging Face hub failed", tmp_path)


def test_to_hf_bad_inputs(capsys, llama_folder, tmp_path):
    code, out, err = convert(capsys, "to-hf", llama_folder, tmp_path / "out")
    assert_clean_failure(code, out, err, "no config.yaml; not a composer checkpoint", tmp_path)
    from_hf(llama_folder, tmp_path / "ours")
    code, out, err = convert(capsys, "to-hf", tmp_path / "ours", tmp_path / "x", "--dtype", "f8")
    assert_clean_failure(code, out, err, "--dtype must be one of", tmp_path)
    code, out, err = convert(capsys, "to-hf", tmp_path / "ours", tmp_path / "x", "--arch",
                             "MixtralForCausalLM")
    assert_clean_failure(code, out, err, "cannot be written as mixtral", tmp_path)


def test_json_output_and_dtype(capsys, llama_folder, tmp_path):
    code, out, err = convert(capsys, "from-hf", llama_folder, tmp_path / "ours", "--json",
                             "--dtype", "bfloat16")
    assert code == 0 and len(out.splitlines()) == 1
    assert json.loads(out)["pattern"] == "*-*-"
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in ours.values())
    code, out, _ = convert(capsys, "to-hf", tmp_path / "ours", tmp_path / "back", "--json")
    assert json.loads(out)["architecture"] == "LlamaForCausalLM"
    back = load_file(tmp_path / "back" / "model.safetensors")
    src = load_file(llama_folder / "model.safetensors")
    # the source dtype (fp32) is restored; values went through bf16
    assert all(back[k].dtype == torch.float32 for k in back)
    assert all(torch.equal(back[k], src[k].to(torch.bfloat16).float()) for k in src)


NEMOTRON_TIED = ("this model cannot be written as nemotron-h ({which}): transformers' "
                 "NemotronHForCausalLM never ties lm_head to the embeddings; tie_embeddings must "
                 "be false; none of the other 25 families fits either")


def test_no_family_names_the_recorded_or_closest_one_first(capsys, tmp_path):
    """A model no family writes: one short line with the fixable reason of the family it was
    built as (origin.json), or else of the closest family; every other family's reason only
    under --verbose, one line each."""
    assert main(["build", "--preset", "nemotron-h-debug", "--set", "tie_embeddings=true",
                 "--out", str(tmp_path / "ck")]) == 0
    code, out, err = convert(capsys, "to-hf", tmp_path / "ck", tmp_path / "hf")
    line = "composer: error: " + NEMOTRON_TIED.format(which="the family it was built as")
    assert_clean_failure(code, out, err, line + " (--verbose lists why)\n", tmp_path)
    assert len(err) < 300
    code, out, err = convert(capsys, "to-hf", tmp_path / "ck", tmp_path / "hf", "--verbose")
    lines = err.splitlines()
    assert code == 2 and out == "" and lines[0] == line and len(lines) == 26
    assert lines[1] == ("  llama: pattern 'M-M*-M-' cannot be written as llama: every layer "
                        "must be '*-' or '*E'")
    assert sorted(x.split(":")[0].strip() for x in lines[1:]) == sorted(
        a.family for a in adapters() if a.family != "nemotron-h")
    (tmp_path / "ck" / "origin.json").unlink()  # not recorded: the closest family
    code, out, err = convert(capsys, "to-hf", tmp_path / "ck", tmp_path / "hf")
    assert_clean_failure(code, out, err, "composer: error: " + NEMOTRON_TIED.format(
        which="the closest family") + " (--verbose lists why)\n", tmp_path)
    assert not (tmp_path / "hf").exists()
