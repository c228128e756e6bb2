"""The Mamba-2 mixer fields shared by the Mamba2 and Nemotron-H converters
(:mod:`composer.convert.mamba2`, :mod:`composer.convert.nemotron_h`): both transformers configs
name them alike (``n_groups``, ``conv_kernel``, ``chunk_size``, ``use_conv_bias``, ``use_bias``,
``time_step_*``) and both norm the gate per group of ``d_inner / n_groups``. Plus the check that a
model has no µP multipliers, which neither class can write."""

from __future__ import annotations

from typing import Any

from composer.config import ConfigError, MambaConfig, ModelConfig


def mamba_from_hf(h: dict[str, Any], n_heads: int, d_head: int, d_state: int,
                   dt_limit: tuple[float, float], act_field: str) -> MambaConfig:
    # transformers uses one activation name for the convolution; ours is always SiLU.
    if h[act_field] not in ("silu", "swish"):
        raise ConfigError(f"config.json: {act_field}={h[act_field]!r} is not supported (the "
                          "Mamba-2 convolution activation is silu)")
    return MambaConfig(
        n_heads=n_heads, d_head=d_head, n_groups=h["n_groups"], d_state=d_state,
        d_conv=h["conv_kernel"], chunk_size=h["chunk_size"], conv_bias=bool(h["use_conv_bias"]),
        proj_bias=bool(h["use_bias"]), dt_min=float(h["time_step_min"]),
        dt_max=float(h["time_step_max"]), dt_init_floor=float(h["time_step_floor"]),
        dt_limit=dt_limit)


def mamba_common_to_hf(cfg: ModelConfig, family: str, out: dict[str, Any]) -> MambaConfig:
    m = cfg.mamba
    assert m is not None
    if m.norm_group_size is not None:
        raise ConfigError(f"{family} normalises the gated RMSNorm per group of d_inner / n_groups; "
                          f"mamba.norm_group_size must be null, not {m.norm_group_size}")
    out.update(n_groups=m.n_groups, conv_kernel=m.d_conv, chunk_size=m.chunk_size,
               use_conv_bias=m.conv_bias, use_bias=m.proj_bias, time_step_min=m.dt_min,
               time_step_max=m.dt_max, time_step_floor=m.dt_init_floor)
    return m


def check_plain(cfg: ModelConfig, family: str) -> None:
    scaled = [f"{name}={getattr(cfg, name)}" for name in
              ("embedding_multiplier", "residual_multiplier", "logits_scaling")
              if getattr(cfg, name) != 1.0]
    if scaled:
        raise ConfigError(f"{family} has no multipliers; cannot write {', '.join(scaled)}")
