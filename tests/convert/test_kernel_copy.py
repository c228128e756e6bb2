"""Tensors whose bytes do not change are copied file to file by the kernel
(:func:`composer.portable.copy_range`): the same bytes by every way it has (``copy_file_range``,
``sendfile``, ``pread`` + write), and a conversion without a dtype change never reads them into
the process."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from composer.convert import from_hf, to_hf
from composer.portable import CheckpointError, TensorSource, copy_range
from tests.helpers import assert_same_tensors


def _refuse(*args, **kwargs):
    raise OSError(errno.EXDEV, "not between these file systems")


@pytest.mark.parametrize("ways", ["kernel", "sendfile", "pread"])
def test_copy_range_gives_the_same_bytes_every_way(tmp_path, monkeypatch, ways):
    data = os.urandom(3 * 2**20 + 17)
    (tmp_path / "src").write_bytes(data)
    if ways in ("sendfile", "pread"):
        monkeypatch.setattr(os, "copy_file_range", _refuse, raising=False)
    if ways == "pread":
        monkeypatch.setattr(os, "sendfile", _refuse, raising=False)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(dst, b"head")
        copy_range(src, dst, 5, 2**20)  # appends at dst's position, advancing it
        copy_range(src, dst, 2**21, len(data) - 2**21)
        with pytest.raises(CheckpointError, match="ended 1 bytes early"):
            copy_range(src, dst, len(data) - 3, 4)
    finally:
        os.close(src)
        os.close(dst)
    got = (tmp_path / "dst").read_bytes()
    assert got[:4 + 2**20 + len(data) - 2**21] == b"head" + data[5:5 + 2**20] + data[2**21:]


def test_other_errors_are_not_swallowed(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "disk")

    monkeypatch.setattr(os, "copy_file_range", broken, raising=False)
    (tmp_path / "src").write_bytes(b"x" * 64)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError, match="disk"):
            copy_range(src, dst, 0, 64)
    finally:
        os.close(src)
        os.close(dst)


def test_a_conversion_without_dtype_change_copies_every_tensor(tmp_path, monkeypatch):
    """from-hf and to-hf of an fp32 Llama read no tensor's bytes through the process (reading
    is made to fail), and the round trip is byte-exact."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=61,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path / "hf")

    def no_reads(self, name, offset, out):
        raise AssertionError(f"{name} was read, not copied")

    monkeypatch.setattr(TensorSource, "read_into", no_reads)
    from_hf(tmp_path / "hf", tmp_path / "ours")
    to_hf(tmp_path / "ours", tmp_path / "back")
    monkeypatch.undo()
    assert_same_tensors(tmp_path / "hf", tmp_path / "back")
