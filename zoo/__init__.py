"""Presets of published models (installed as ``composer.zoo``).

Each family module lists :class:`Preset` objects that reproduce a published configuration and cite
it (the Hugging Face id and the source of the numbers). Every family also has a tiny ``-debug``
flavour for tests. ``get_preset(name).config()`` returns a fresh :class:`ModelConfig`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from composer.config import ConfigError, ModelConfig
from composer.suggest import closest


@dataclass(frozen=True)
class Preset:
    name: str
    family: str
    hf_id: str
    source: str
    make: Callable[[], ModelConfig]

    def config(self) -> ModelConfig:
        return self.make()


def _collect() -> dict[str, Preset]:
    from composer.zoo import (
        deepseek_v3,
        falcon_h1,
        gemma3,
        glm4_moe,
        gpt_oss,
        jamba,
        kimi_linear,
        lfm2,
        llama,
        mamba2,
        minimax_m2,
        mixtral,
        nemotron_h,
        olmo_hybrid,
        qwen3,
        qwen3_next,
        zamba2,
    )

    presets: dict[str, Preset] = {}
    for module in (nemotron_h, llama, qwen3, mixtral, mamba2, deepseek_v3, glm4_moe, minimax_m2,
                   olmo_hybrid, qwen3_next, lfm2, jamba, gemma3, kimi_linear, gpt_oss,
                   falcon_h1, zamba2):
        for preset in module.PRESETS:
            assert preset.name not in presets, preset.name
            presets[preset.name] = preset
    return presets


_PRESETS: dict[str, Preset] | None = None


def presets() -> dict[str, Preset]:
    global _PRESETS
    if _PRESETS is None:
        _PRESETS = _collect()
    return _PRESETS


def get_preset(name: str) -> Preset:
    table = presets()
    if name not in table:
        close = closest(name, table)
        hint = f"; did you mean {close!r}?" if close else ""
        raise ConfigError(f"unknown preset {name!r}{hint} (see `composer zoo list`)")
    return table[name]
