"""from-hf copies the source's tensors by the kernel while torch is imported and the model
checked (:class:`composer.portable.Prefill`), and keeps that copy only when the checked plan is
exactly it: the output is the same, byte for byte, as the planned import writes without the
copy; every strictness error still fires, before anything appears at the destination; the copy
starts before torch is imported."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import composer.convert.api as api
from composer.convert import CheckpointError, from_hf, to_hf
from composer.portable import PlannedTensor, ShardedWriter
from composer.prefill import Prefill
from tests.helpers import assert_same_tensors


class Spy(Prefill):
    """A real :class:`Prefill` that records itself and what :meth:`adopt` answered."""

    made: list[Spy] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: bool | None = None
        Spy.made.append(self)

    def adopt(self, *args, **kwargs) -> bool:
        self.kept = super().adopt(*args, **kwargs)
        return self.kept


@pytest.fixture
def spy(monkeypatch):
    Spy.made = []
    monkeypatch.setattr(api, "Prefill", Spy)
    return Spy.made


def _llama(folder: Path, tie: bool = False, **save) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, tie_word_embeddings=tie))
    model.to(torch.bfloat16).save_pretrained(folder, **save)
    (folder / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _without_prefill(monkeypatch, src: Path, dst: Path, convert=from_hf, **kwargs) -> None:
    with monkeypatch.context() as m:
        m.setattr(api, "_start_prefill", lambda *a: None)
        convert(src, dst, **kwargs)


def test_kept_copy_equals_the_planned_import_byte_for_byte(tmp_path, spy, monkeypatch):
    """A sharded bf16 source into a sharded output, and back: each copy is kept, and every
    file equals the planned conversion's; the round trip is exact, in the source's order."""
    src = _llama(tmp_path / "hf", max_shard_size="20KB")
    assert len(list(src.glob("*.safetensors"))) > 2
    from_hf(src, tmp_path / "fast", max_shard_bytes=30_000)
    assert [p.kept for p in spy] == [True]
    _without_prefill(monkeypatch, src, tmp_path / "planned", max_shard_bytes=30_000)
    fast, planned = _files(tmp_path / "fast"), _files(tmp_path / "planned")
    assert sum(n.startswith("model-") for n in fast) > 1
    assert fast == planned
    to_hf(tmp_path / "fast", tmp_path / "back", max_shard_bytes=40_000)
    assert [p.kept for p in spy] == [True, True]
    _without_prefill(monkeypatch, tmp_path / "fast", tmp_path / "back2", to_hf,
                     max_shard_bytes=40_000)
    assert _files(tmp_path / "back") == _files(tmp_path / "back2")
    assert_same_tensors(src, tmp_path / "back")

    def order(folder: Path) -> list[str]:
        infos = api.TensorSource(folder).tensors.values()
        return [i.name for i in sorted(infos, key=lambda i: (str(i.file), i.start))]

    assert order(tmp_path / "back") == order(src)


def test_a_plan_that_is_not_the_copy_discards_it(tmp_path, spy, monkeypatch):
    """A tied checkpoint that stores its head (ignored) and a cast to fp32 (no copy started):
    the planned import runs, alone, with the same result."""
    src = _llama(tmp_path / "hf", tie=True)
    tensors = load_file(src / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    from_hf(src, tmp_path / "fast")
    assert [p.kept for p in spy] == [False]
    _without_prefill(monkeypatch, src, tmp_path / "planned")
    assert _files(tmp_path / "fast") == _files(tmp_path / "planned")
    assert "lm_head.weight" not in load_file(tmp_path / "fast" / "model.safetensors")
    from_hf(src, tmp_path / "fp32", dtype=torch.float32)
    assert len(spy) == 1


def _wrong_shape(src: Path) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (src / "config.json").write_text(json.dumps(cfg))


def _edit(change):
    def run(src: Path) -> None:
        tensors = load_file(src / "model.safetensors")
        change(tensors)
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})

    return run


@pytest.mark.parametrize("spoil, message", [
    (_wrong_shape, "shape mismatch: 'model.layers.0.mlp.gate_proj.weight' (in "
     "model.safetensors) is [64, 32], 'layers.1.mixer.gate_proj.weight' needs [48, 32]"),
    (_edit(lambda t: t.update(stray=torch.zeros(3, dtype=torch.bfloat16))),
     "unexpected tensor 'stray'"),
    (_edit(lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")),
     "tensor 'model.layers.1.self_attn.k_proj.weight' is missing"),
], ids=["shape", "unexpected", "missing"])
def test_strictness_errors_fire_while_copying(tmp_path, spy, spoil, message):
    src = _llama(tmp_path / "hf")
    spoil(src)
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match=re.escape(message)):
        from_hf(src, tmp_path / "out" / "ckpt")
    assert len(spy) == 1 and spy[0].kept is None  # copying had started; never kept
    assert list((tmp_path / "out").iterdir()) == []  # no destination, no temporary folder


def test_cancel_and_a_different_layout_remove_the_copy(tmp_path):
    data = bytes(range(256)) * 64
    (tmp_path / "src").write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    plan = [PlannedTensor("a", "U8", (4096,)), PlannedTensor("b", "U8", (8192,))]
    sources = [(tmp_path / "src", 100), (tmp_path / "src", 5000)]
    copy = Prefill(ShardedWriter(out, plan, 10**9), sources)
    other = ShardedWriter(out, plan[::-1], 10**9)  # the same tensors in another order
    assert not copy.adopt(other, sources[::-1])
    assert list(out.iterdir()) == []
    copy = Prefill(ShardedWriter(out, plan, 10**9), sources)
    copy.cancel()
    assert list(out.iterdir()) == []
    copy = Prefill(ShardedWriter(out, plan, 10**9, header_reserve=lambda shard: 1000), sources)
    writer = ShardedWriter(out, plan, 10**9, header_reserve=lambda shard: 1000)
    assert copy.adopt(writer, sources)
    copy.cancel()  # a no-op once kept
    raw = (out / "model.safetensors").read_bytes()
    assert len(raw) == 8 + 1000 + 4096 + 8192
    assert raw[-12288:] == data[100:4196] + data[5000:13192]
    assert load_file(out / "model.safetensors")["b"].numpy().tobytes() == data[5000:13192]


SCRIPT = """
import sys
import composer.convert.api as api
from composer.prefill import Prefill
seen = []
class Seen(Prefill):
    def __init__(self, *args):
        seen.append("torch" in sys.modules)
        super().__init__(*args)
api.Prefill = Seen
from composer.cli import main
code = main(["convert", "from-hf", sys.argv[1], sys.argv[2]])
print(code, seen)
"""


def test_the_copy_starts_before_torch_is_imported(tmp_path, monkeypatch):
    """``composer convert from-hf`` in a fresh process: the copy starts with no torch loaded
    (and is kept: the output equals the planned import's)."""
    src = _llama(tmp_path / "hf")
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(tmp_path / "ours")],
                         capture_output=True, text=True, timeout=300)
    assert run.stdout.strip().split("\n")[-1] == "0 [False]", run.stdout + run.stderr
    _without_prefill(monkeypatch, src, tmp_path / "planned")
    assert _files(tmp_path / "ours") == _files(tmp_path / "planned")
