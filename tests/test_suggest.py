""""Did you mean": prefix and shared words before edit distance (composer/suggest.py)."""

import pytest

from composer.suggest import closest
from composer.zoo import presets

MAMBA = ["n_heads", "d_head", "n_groups", "d_state", "d_conv", "chunk_size", "norm_group_size"]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("qwen3-30b", "qwen3-30b-a3b"),       # a prefix, not qwen3-0.6b (one edit away)
        ("llama-3.1-9b", "llama-3.1-8b"),     # most shared words
        ("llama3-8b", "llama-3.1-8b"),
        ("nemotron-nano", "nemotron-nano-9b-v2"),
        ("qwen4-debug", "qwen3-debug"),
        ("glm45", "glm-4.5"),                 # edit distance when no word is shared
        ("nope", None),
    ],
)
def test_presets(name, expected):
    assert closest(name, presets()) == expected


@pytest.mark.parametrize(
    "name, expected",
    [("d_stat", "d_state"), ("n_head", "n_heads"), ("chunksize", "chunk_size"),
     ("dstate", "d_state"), ("x", None)],
)
def test_config_keys(name, expected):
    assert closest(name, MAMBA) == expected


def test_never_the_name_itself_or_nothing():
    assert closest("a", []) is None and closest("", ["a"]) is None
    assert closest("d_state", ["d_state"]) is None
