"""Mamba-2 (``Mamba2ForCausalLM``): every layer a Mamba-2 mixer ``M``.

One HF layer is one of our layers (one pattern symbol): pre-norm ``backbone.L.norm`` then
``backbone.L.mixer.*``, whose names are ours. Embeddings ``backbone.embeddings``, final norm
``backbone.norm_f``. The Hub layout is written; on read ``backbone.embedding.`` (mamba_ssm,
Mamba2's load hook) is accepted.

Quirks of transformers 5.24 that decide the mapping (checked in its source): ``Mamba2Mixer``
uses ``time_step_limit`` (our ``dt_limit``); Mamba2 sizes its mixer as ``expand * hidden_size``
(an int ``expand``) and norms the gate per group of ``d_inner / n_groups``
(:mod:`composer.convert.mamba_common` has the fields it shares with Nemotron-H).
"""

from __future__ import annotations

import math
from typing import Any

from composer.config import ConfigError, ModelConfig, d_inner_of
from composer.convert.base import (
    Adapter,
    common_to_hf,
    layer_pattern_error,
    mamba_links,
    require,
)
from composer.convert.mamba_common import check_plain, mamba_common_to_hf, mamba_from_hf
from composer.convert.plan import Link

# Defaults of transformers 5.24's Mamba2Config: a field missing from config.json means these.
MAMBA2_DEFAULTS: dict[str, Any] = dict(
    num_heads=128, head_dim=64, state_size=128, layer_norm_epsilon=1e-5, expand=2, conv_kernel=4,
    n_groups=8, use_bias=False, use_conv_bias=True, hidden_act="silu", initializer_range=0.1,
    time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4,
    time_step_limit=(0.0, math.inf), chunk_size=256, tie_word_embeddings=False)


class Mamba2Adapter(Adapter):
    family = "mamba2"
    symbols = "M"
    max_positions = None
    architectures = ("Mamba2ForCausalLM",)
    model_type = "mamba2"

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = {**MAMBA2_DEFAULTS, **hf}
        d_model, n_layers = require(hf, "hidden_size"), require(hf, "num_hidden_layers")
        n_heads, d_head = h["num_heads"], h["head_dim"]
        if h["expand"] * d_model != n_heads * d_head:
            raise ConfigError(f"config.json: expand * hidden_size ({h['expand']} * {d_model}) "
                              f"must equal num_heads * head_dim ({n_heads} * {d_head}); "
                              "transformers sizes the Mamba2 mixer from both")
        lo, hi = h["time_step_limit"] or MAMBA2_DEFAULTS["time_step_limit"]
        mamba = mamba_from_hf(h, n_heads, d_head, h["state_size"], (float(lo), float(hi)),
                               "hidden_act")
        return ModelConfig(
            pattern="M" * n_layers, d_model=d_model, vocab_size=require(hf, "vocab_size"),
            tie_embeddings=bool(h["tie_word_embeddings"]),
            norm_eps=float(h["layer_norm_epsilon"]), init_std=float(h["initializer_range"]),
            attention=None, mamba=mamba, mlp=None, moe=None)

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        pattern = cfg.parsed
        if pattern.mtp or set(pattern.layers) != {"M"}:
            raise layer_pattern_error(self.family, cfg.pattern, "every Mamba2 layer is 'M'")
        check_plain(cfg, self.family)
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        m = mamba_common_to_hf(cfg, self.family, out)
        d_inner = d_inner_of(m)
        if d_inner % cfg.d_model:
            raise ConfigError(f"Mamba2 sizes its mixer as expand * hidden_size with an integer "
                              f"expand; n_heads * d_head ({d_inner}) is not a multiple of "
                              f"d_model ({cfg.d_model})")
        out.update(num_hidden_layers=pattern.n_layers, num_heads=m.n_heads, head_dim=m.d_head,
                   state_size=m.d_state, expand=d_inner // cfg.d_model,
                   time_step_limit=list(m.dt_limit), layer_norm_epsilon=cfg.norm_eps,
                   hidden_act="silu")
        return out

    def normalize(self, name: str) -> str:
        # mamba_ssm checkpoints say ``embedding``; Mamba2Model's load hook renames it too.
        return name.replace("backbone.embedding.", "backbone.embeddings.")

    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "backbone.embeddings.weight"),
                 Link("final_norm.weight", "backbone.norm_f.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        for i in range(cfg.parsed.n_layers):
            links.append(Link(f"layers.{i}.norm.weight", f"backbone.layers.{i}.norm.weight"))
            links += mamba_links(f"layers.{i}.mixer", f"backbone.layers.{i}.mixer", cfg.mamba)
        return links
