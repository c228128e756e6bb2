"""Typed model configuration: nested dataclasses, YAML round trip, dotted overrides, validation.

A model is a layer pattern (DESIGN §3) plus one sub-config per block kind the pattern uses. Sizes
are ``d_*``, counts ``n_*``. Every error is a one-line :class:`ConfigError` (a ``ValueError``).

Which section a symbol needs (:data:`SYMBOL_NEEDS`) and how a section validates
(:data:`SECTIONS`) are tables that ``composer.register`` extends: a user kind may bring its own
section (a dataclass), which then loads, saves, takes ``--set`` overrides and validates like the
built-in ones (it lives at the top level of the YAML, beside ``attention`` and ``mamba``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from composer import settings
from composer.pattern import Pattern, PatternError, parse_pattern
from composer.settings import ConfigError, set_field
from composer.settings import coerce as _coerce
from composer.settings import from_plain as _from_plain
from composer.settings import hints as _hints
from composer.settings import to_plain as _to_plain
from composer.settings import unknown as _unknown  # noqa: F401 - the old name, kept for now

Activation = Literal["swiglu", "geglu", "relu2", "gelu", "gelu_tanh", "silu", "relu"]
GATED_ACTIVATIONS = ("swiglu", "geglu")


class _FromPattern:
    """The default of a section that exists only when the pattern uses it (``mla``, ``gdn``):
    :meth:`ModelConfig.__post_init__` turns it into that section, sized by ``d_model``, or into
    None. An explicit None stays None (and a pattern that needs the section is refused)."""

    def __repr__(self) -> str:
        return "<from the pattern>"


FROM_PATTERN: Any = _FromPattern()


@dataclass
class RopeScaling:
    """Llama-3 style frequency scaling of RoPE (``rope_type: llama3`` in transformers)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass
class AttentionConfig:
    n_heads: int = 4
    n_kv_heads: int | None = None
    """Key/value heads (GQA); ``None`` means ``n_heads`` (MHA), 1 is MQA."""
    d_head: int | None = None
    """Per-head width; ``None`` means ``d_model // n_heads``."""
    position: Literal["rope", "none"] = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rotary_fraction: float = 1.0
    """Fraction of each head's channels that RoPE rotates (Bamba uses 0.5)."""
    qk_norm: bool = False
    qk_norm_scope: Literal["head", "all"] = "head"
    """What the qk-norm RMS runs over: each head's channels (Qwen3, GLM-4.5) or the whole q / k
    projection, all heads at once (MiniMax-M2; its weight is ``n_heads * d_head`` wide)."""
    qkv_bias: bool = False
    out_bias: bool = False
    softmax_scale: float | None = None
    """Score scale; ``None`` means ``1/sqrt(d_head)``."""
    output_gate: bool = False
    """A sigmoid gate on the attention output before ``o_proj`` (Qwen3-Next, Qwen3.5): ``q_proj``
    is twice as wide, per head ``[q_h; g_h]``, and ``o = o * sigmoid(g)`` channel by channel."""


@dataclass
class YarnScaling:
    """YaRN frequency interpolation (Peng et al. 2023; ``rope_type: yarn`` in transformers, as
    DeepSeek-V3 and Kimi-K2 use it). ``mscale`` / ``mscale_all_dim`` follow DeepSeek: the cos/sin
    tables are multiplied by ``attention_factor`` (default ``g(mscale) / g(mscale_all_dim)``, or
    ``g(1)`` unless both are set, with ``g(m) = 0.1 m ln(factor) + 1``), and MLA's softmax scale by
    ``g(mscale_all_dim)^2`` when ``mscale_all_dim`` is set."""

    factor: float = 40.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    """Round the correction range outwards to whole dimensions (transformers' default)."""


@dataclass
class MLAConfig:
    """Multi-latent attention (DeepSeek-V2 §2.1): low-rank q, a compressed kv latent, and one
    shared RoPE key head; per head ``d_head_nope + d_head_rope`` query/key and ``d_head_v``
    value channels."""

    n_heads: int = 4
    q_lora_rank: int | None = None
    """Rank of the query down-projection; ``None`` means a full ``q_proj``."""
    kv_lora_rank: int = 64
    d_head_nope: int = 32
    d_head_rope: int = 16
    d_head_v: int = 32
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    norm_eps: float = 1e-6
    """Epsilon of the two latent RMSNorms (transformers keeps them at 1e-6)."""
    softmax_scale: float | None = None
    """Score scale; ``None`` means ``(d_head_nope + d_head_rope)^-1/2`` times YaRN's mscale^2."""
    max_dense_len: int | None = None
    """Longest sequence this dense block computes exactly; longer ones are refused. Set from
    DeepSeek-V3.2's ``index_topk``: its DSA indexer keeps the top ``index_topk`` keys per query,
    which is every causal key up to that length, and sparse attention is not built. ``None``: no
    limit (plain MLA)."""


@dataclass
class MambaConfig:
    n_heads: int = 8
    d_head: int = 64
    n_groups: int = 1
    d_state: int = 64
    d_conv: int = 4
    chunk_size: int = 64
    norm_group_size: int | None = None
    """Channels per gated-RMSNorm group; ``None`` means ``d_inner // n_groups`` (transformers 5.x,
    Megatron). Set it to ``d_inner`` for the older whole-width normalisation."""
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    a_init_range: tuple[float, float] = (1.0, 16.0)


@dataclass
class GDNConfig:
    """Gated delta net (Yang et al. 2025; Qwen3-Next, Qwen3.5, OLMo-Hybrid linear attention)."""

    n_heads: int = 8
    """Value heads (each with its own decay ``A_log`` / ``dt_bias``, beta and state)."""
    n_kv_heads: int | None = None
    """Query/key heads, shared by ``n_heads / n_kv_heads`` value heads; ``None`` means
    ``n_heads``."""
    d_head_k: int = 64
    d_head_v: int = 64
    d_conv: int = 4
    chunk_size: int = 64
    conv_bias: bool = False
    norm_eps: float = 1e-6
    """Epsilon of the gated per-head output RMSNorm (Qwen3-Next: rms_norm_eps; OLMo-Hybrid 1e-5)."""
    allow_neg_eigval: bool = False
    """beta = 2 * sigmoid(b), in (0, 2) (OLMo-Hybrid's ``linear_allow_neg_eigval``)."""
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    a_init_range: tuple[float, float] = (1.0, 16.0)


@dataclass
class MLPConfig:
    d_ff: int = 1024
    activation: Activation = "swiglu"
    bias: bool = False


@dataclass
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    d_ff: int = 512
    activation: Activation = "swiglu"
    n_shared_experts: int = 0
    d_ff_shared: int | None = None
    """Width of the shared-expert MLP; ``None`` means ``d_ff * n_shared_experts``."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True
    """Divide the top-k weights by their sum."""
    score_correction_bias: bool = False
    """A per-expert fp32 bias added to the scores for choosing experts only (aux-loss-free)."""
    routed_scaling_factor: float = 1.0
    n_expert_groups: int = 1
    topk_groups: int = 1
    aux_loss_coeff: float = 0.0
    """Weight of the switch-style load-balancing loss of each MoE layer, added to the training
    loss (Megatron-Core ``moe_aux_loss_coeff``; :mod:`composer.blocks.moe` has the formula)."""
    aux_loss_scope: Literal["micro_batch", "global_batch"] = "micro_batch"
    """Over which tokens that loss counts the expert loads ``f_e``: ``micro_batch`` (each
    micro-batch's tokens over every data-parallel rank; Megatron ``aux_loss`` counts one rank's
    micro-batch) or ``global_batch`` (the running sum over the step's micro-batches so far,
    Megatron ``global_aux_loss``)."""
    seq_aux_loss_coeff: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss (eq. 17-20; Megatron ``seq_aux_loss``),
    each sequence balanced on its own, averaged over the sequences; 0 = off."""
    bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3 §2.1.2): after each optimizer step the score bias of
    every MoE layer moves by ``rate * sign(mean load - load_e)``, the loads counted over the
    global batch; 0 = off (needs ``score_correction_bias``; Megatron
    ``moe_router_bias_update_rate``, typically 1e-3)."""
    capacity_factor: float | None = None
    """Token dropping: each expert takes at most ``ceil(capacity_factor * N * top_k / E)`` of a
    forward's ``N`` tokens (per rank), those with the highest routing weight; the others skip
    that expert (the residual carries them). It is part of the model: evaluation and generation
    drop too (a decoding step's ``N`` is its batch). ``None``: dropless."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by ``sigmoid(shared_expert_gate(x))``, one scalar per
    token (``shared_expert_gate.weight [1, D]``; Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE)."""


@dataclass
class MTPConfig:
    """Multi-token prediction (the pattern's ``/`` parts; :mod:`composer.blocks.mtp`)."""

    loss_weight: float = 0.1
    """``w`` in ``loss = ce + aux + (w / D) * sum_k ce_k`` over the ``D`` depths (DeepSeek-V3's
    lambda; Megatron's ``mtp_loss_scaling_factor``, default 0.1)."""


@dataclass
class ModelConfig:
    pattern: str = "M-M*-ME"
    d_model: int = 256
    vocab_size: int = 32000
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    init_std: float = 0.02
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    """Logits are divided by this (Granite)."""
    norm_zero_centered: bool = False
    """Every :class:`~composer.blocks.norm.RMSNorm` of the model (layer norms, final norm,
    qk-norms) computes ``rms(x) * (1 + w)`` and stores ``w`` (initialised to 0), as Qwen3-Next /
    Qwen3.5 checkpoints do. Gated mixer norms (Mamba-2, GDN) are not affected."""
    post_norm_layers: tuple[int, ...] = ()
    """0-based indices of the layers that normalise their mixer's *output* before the residual
    add, ``x + norm(mixer(x))`` (OLMo 2/3, OLMo-Hybrid's attention layers); every other layer is
    pre-norm, ``x + mixer(norm(x))``. Empty (the default) means all pre-norm."""
    attention: AttentionConfig | None = field(default_factory=AttentionConfig)
    mamba: MambaConfig | None = field(default_factory=MambaConfig)
    mlp: MLPConfig | None = field(default_factory=MLPConfig)
    moe: MoEConfig | None = field(default_factory=MoEConfig)
    mla: MLAConfig | None = FROM_PATTERN
    """Given when the pattern has ``+`` and none is passed: :func:`default_section`."""
    gdn: GDNConfig | None = FROM_PATTERN
    """Given when the pattern has ``G`` and none is passed: :func:`default_section`."""
    mtp: MTPConfig | None = field(default_factory=MTPConfig)
    """Read only when the pattern has multi-token-prediction parts (``"main/mtp"``)."""
    extra_sections: dict[str, Any] = field(default_factory=dict, repr=False)
    """Sections of user-registered kinds, by name (also reachable as attributes)."""

    def __post_init__(self) -> None:
        used = _used_sections(self.pattern)
        for name in BUILTIN_SECTIONS:
            if getattr(self, name) is FROM_PATTERN:
                setattr(self, name, default_section(name, self.d_model) if name in used else None)
        for name in used - set(BUILTIN_SECTIONS) - set(self.extra_sections):
            self.extra_sections[name] = default_section(name, self.d_model)

    def __getattr__(self, name: str) -> Any:
        extra = self.__dict__.get("extra_sections")
        if extra is not None and name in SECTIONS:
            return extra.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def section(self, name: str) -> Any:
        """The section called ``name`` (``attention``, ``mamba``, ... or a registered one)."""
        return getattr(self, name)

    def set_section(self, name: str, value: Any) -> None:
        if name in BUILTIN_SECTIONS:
            setattr(self, name, value)
        else:
            self.extra_sections[name] = value

    @property
    def parsed(self) -> Pattern:
        return parse_pattern(self.pattern)

    def validate(self) -> ModelConfig:
        """Raise :class:`ConfigError` on the first problem; return ``self``."""
        validate(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def canonical(self) -> ModelConfig:
        """A copy with the flat pattern and the sections the pattern does not use set to None,
        so that two configs that build the same model compare equal."""
        pattern = self.parsed
        used = {SYMBOL_NEEDS[s] for s in pattern.layers + "".join(pattern.mtp)
                if s in SYMBOL_NEEDS} | ({"mtp"} if pattern.mtp else set())
        out = ModelConfig.from_dict(self.to_dict())
        out.pattern = pattern.format()
        for section in BUILTIN_SECTIONS:
            if section not in used:
                setattr(out, section, None)
        out.extra_sections = {k: v for k, v in out.extra_sections.items() if k in used}
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return _from_plain(cls, data, "")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config fields")
        return cls.from_dict(data)


BUILTIN_SECTIONS = ("attention", "mamba", "mlp", "moe", "mla", "gdn", "mtp")
SUBCONFIGS: dict[str, type] = {"rope_scaling": RopeScaling}
"""Nested configs that are not sections (sections are in :data:`SECTIONS`)."""
SYMBOL_NEEDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "+": "mla", "G": "gdn"}
"""Pattern symbol -> the config section it reads (``composer.register`` adds to it)."""


@dataclass(frozen=True)
class Section:
    cls: type
    validate: Callable[[Any, ModelConfig], None] | None = None
    """Raises :class:`ConfigError` for a bad section; gets the section and the whole config."""


SECTIONS: dict[str, Section] = {}
"""Config sections by name, built-in and registered; see :func:`register_section`."""


def default_section(name: str, d_model: int) -> Any:
    """The section ``name`` with its defaults for a model ``d_model`` wide; None for a registered
    section whose dataclass has required fields.

    ``attention``, ``mamba``, ``mlp`` and ``moe`` are their dataclasses' defaults (attention's
    head width is already ``d_model / n_heads``). ``mla`` and ``gdn`` keep the per-head widths of
    their defaults and scale the head count with ``d_model``, so that at ``d_model`` 256 (the
    default) they equal their dataclasses' defaults: GDN's value width is ``2 * d_model`` (as
    Mamba-2's ``expand`` 2), MLA has one 32+16-channel head per 64 model channels and a kv
    latent of ``d_model / 4``."""
    width = d_model if isinstance(d_model, int) and d_model > 0 else 256
    if name == "mla":
        return MLAConfig(n_heads=max(1, width // 64), kv_lora_rank=max(8, width // 4))
    if name == "gdn":
        return GDNConfig(n_heads=max(1, 2 * width // GDNConfig.d_head_v))
    try:
        return SECTIONS[name].cls()
    except TypeError:
        return None


def _used_sections(pattern: Any) -> set[str]:
    """The sections a pattern's symbols read; empty for a pattern that does not parse (the
    validation reports it)."""
    try:
        parsed = parse_pattern(pattern)
    except PatternError:
        return set()
    used = {SYMBOL_NEEDS[s] for s in parsed.layers + "".join(parsed.mtp) if s in SYMBOL_NEEDS}
    return used | ({"mtp"} if parsed.mtp else set())


def register_section(name: str, cls: type,
                     validate: Callable[[Any, ModelConfig], None] | None = None) -> None:
    """Make ``name`` a config section holding a ``cls`` dataclass (for a user-registered kind)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"a config section must be a dataclass, got {cls!r}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    if name in known and name not in BUILTIN_SECTIONS:
        raise ValueError(f"{name!r} is a ModelConfig field, not a section name")
    SECTIONS[name] = Section(cls, validate)


# ---------------------------------------------------------------- plain <-> dataclass
# The engine is composer.settings; a ModelConfig also takes its registered sections as keys.


def _model_keys(found: dict[str, Any]) -> dict[str, Any]:
    found.pop("extra_sections")
    found.update({name: sec.cls | None for name, sec in SECTIONS.items()
                  if name not in BUILTIN_SECTIONS})
    return found


def _model_build(kwargs: dict[str, Any]) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    kwargs["extra_sections"] = {k: kwargs.pop(k) for k in list(kwargs) if k not in known}
    return ModelConfig(**kwargs)


def _model_plain(obj: ModelConfig) -> dict[str, Any]:
    out = {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
           if f.name != "extra_sections"}
    out.update({k: _to_plain(v) for k, v in obj.extra_sections.items()})
    return out


def _model_child(cfg: ModelConfig, name: str) -> Any:
    """A section set by ``--set moe.top_k=2`` while it is None starts from its defaults."""
    if name in SECTIONS:
        return default_section(name, cfg.d_model)
    sub = settings.subconfig(_hints(ModelConfig)[name]) or SUBCONFIGS.get(name)
    return sub() if sub is not None else None


def _set(target: ModelConfig, name: str, value: Any) -> None:
    if name in SECTIONS:
        target.set_section(name, value)
    else:
        setattr(target, name, value)


settings.customize(ModelConfig, keys=_model_keys, build=_model_build, plain=_model_plain,
                   child=_model_child, assign=_set)


# ---------------------------------------------------------------- overrides


def apply_overrides(config: ModelConfig, overrides: list[str]) -> ModelConfig:
    """Apply ``key=value`` strings such as ``attention.n_heads=8`` (values parsed as YAML).

    Setting a field of a sub-config that is ``None`` creates it with its defaults first
    (:func:`default_section`); ``moe=null`` removes one. A new ``pattern`` gets the sections its
    symbols read (unless nulled here); ``mla`` and ``gdn`` sections still at their defaults and
    not touched here follow a new ``d_model``. Unknown keys are rejected with the nearest valid
    key.
    """
    d_model = config.d_model
    derived = {n for n in ("mla", "gdn") if getattr(config, n) == default_section(n, d_model)}
    touched = set()
    for item in overrides:
        key, value = settings.parse_override(item)
        set_field(config, key, value)
        touched.add(key.partition(".")[0])
    if config.d_model != d_model:
        for name in derived - touched:
            config.set_section(name, default_section(name, config.d_model))
    if "pattern" in touched:
        for name in _used_sections(config.pattern) - touched:
            if config.section(name) is None:
                config.set_section(name, default_section(name, config.d_model))
    return config


# ---------------------------------------------------------------- validation


def _positive(obj: Any, prefix: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{prefix}{name} must be positive, got {value}")


def validate(cfg: ModelConfig) -> None:
    """Check a config for consistency; raises :class:`ConfigError` with a one-line reason."""
    hints = _hints(ModelConfig)
    for name, hint in hints.items():  # catches wrong types set by hand
        _coerce(_to_plain(getattr(cfg, name)), hint, name)
    for name in cfg.extra_sections:
        if name not in SECTIONS:
            raise ConfigError(f"unknown config section {name!r}")
    try:
        pattern = parse_pattern(cfg.pattern)
    except PatternError as exc:
        raise ConfigError(str(exc)) from None
    _positive(cfg, "", ("d_model", "vocab_size", "norm_eps", "init_std"))
    n_layers = len(pattern.layers)
    post = list(cfg.post_norm_layers)
    if post != sorted(set(post)) or any(not 0 <= i < n_layers for i in post):
        raise ConfigError(f"post_norm_layers {post} must be increasing layer indices in "
                          f"[0, {n_layers})")
    for sym in sorted(set(pattern.layers + "".join(pattern.mtp))):
        section = SYMBOL_NEEDS.get(sym)
        if section and getattr(cfg, section) is None:
            raise ConfigError(f"pattern symbol {sym!r} needs the '{section}' section, which is "
                              f"None; {_how_to_give(section, cfg.d_model)}")
    if pattern.mtp and cfg.mtp is None:
        raise ConfigError(f"the multi-token-prediction parts ('/{pattern.mtp[0]}') need the "
                          "'mtp' section, which is None")
    for name, section in SECTIONS.items():
        value = cfg.section(name)
        if value is not None and section.validate is not None:
            section.validate(value, cfg)


def _how_to_give(section: str, d_model: int) -> str:
    """The ``--set`` that creates a missing section (any of its keys does, with the rest at
    :func:`default_section`'s values)."""
    default = default_section(section, d_model)
    if default is None:
        return f"give it with --set {section}.KEY=VALUE for each of its fields"
    first = dataclasses.fields(default)[0].name
    return (f"give it one, e.g. --set {section}.{first}={getattr(default, first)} (its other "
            f"keys then take their defaults for d_model {d_model})")


def _validate_attention(a: AttentionConfig, cfg: ModelConfig) -> None:
    d_model = cfg.d_model
    _positive(a, "attention.", ("n_heads", "n_kv_heads", "d_head", "rope_theta", "softmax_scale"))
    kv = a.n_kv_heads or a.n_heads
    if a.n_heads % kv:
        raise ConfigError(f"attention.n_heads ({a.n_heads}) must be divisible by "
                          f"attention.n_kv_heads ({kv})")
    if a.d_head is None and d_model % a.n_heads:
        raise ConfigError(f"d_model ({d_model}) must be divisible by attention.n_heads "
                          f"({a.n_heads}) unless attention.d_head is set")
    d_head = a.d_head or d_model // a.n_heads
    rotary = int(d_head * a.rotary_fraction)
    if not 0.0 < a.rotary_fraction <= 1.0 or rotary % 2:
        raise ConfigError(f"attention.rotary_fraction ({a.rotary_fraction}) must be in (0, 1] "
                          f"and rotate an even number of the {d_head} head channels")


def _validate_mamba(m: MambaConfig, cfg: ModelConfig) -> None:
    _positive(m, "mamba.", ("n_heads", "d_head", "n_groups", "d_state", "d_conv", "chunk_size",
                            "norm_group_size"))
    if m.n_heads % m.n_groups:
        raise ConfigError(f"mamba.n_heads ({m.n_heads}) must be divisible by mamba.n_groups "
                          f"({m.n_groups})")
    d_inner = m.n_heads * m.d_head
    if m.norm_group_size is not None and d_inner % m.norm_group_size:
        raise ConfigError(f"mamba.norm_group_size ({m.norm_group_size}) must divide the inner "
                          f"width n_heads*d_head ({d_inner})")
    if not 0 < m.dt_min <= m.dt_max:
        raise ConfigError(f"mamba.dt_min ({m.dt_min}) must be positive and <= dt_max ({m.dt_max})")
    if m.dt_limit[0] > m.dt_limit[1]:
        raise ConfigError(f"mamba.dt_limit {list(m.dt_limit)} must be increasing")
    if not 0 < m.a_init_range[0] <= m.a_init_range[1]:
        raise ConfigError(f"mamba.a_init_range {list(m.a_init_range)} must be positive, increasing")


def _validate_mlp(mlp: MLPConfig, cfg: ModelConfig) -> None:
    _positive(mlp, "mlp.", ("d_ff",))


def _validate_moe(e: MoEConfig, cfg: ModelConfig) -> None:
    _positive(e, "moe.", ("n_experts", "top_k", "d_ff", "d_ff_shared", "routed_scaling_factor",
                          "n_expert_groups", "topk_groups"))
    if e.top_k > e.n_experts:
        raise ConfigError(f"moe.top_k ({e.top_k}) must be <= moe.n_experts ({e.n_experts})")
    if e.n_shared_experts < 0:
        raise ConfigError(f"moe.n_shared_experts must be >= 0, got {e.n_shared_experts}")
    if e.n_experts % e.n_expert_groups or e.topk_groups > e.n_expert_groups:
        raise ConfigError(f"moe.n_experts ({e.n_experts}) must divide into moe.n_expert_groups "
                          f"({e.n_expert_groups}) and moe.topk_groups ({e.topk_groups}) must not "
                          "exceed it")
    if e.n_expert_groups > 1 and e.top_k > e.topk_groups * (e.n_experts // e.n_expert_groups):
        raise ConfigError(f"moe.top_k ({e.top_k}) exceeds the experts in moe.topk_groups groups")
    for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "bias_update_rate"):
        if getattr(e, name) < 0:
            raise ConfigError(f"moe.{name} must be >= 0, got {getattr(e, name)}")
    if e.bias_update_rate and not e.score_correction_bias:
        raise ConfigError("moe.bias_update_rate needs the score bias it updates "
                          "(moe.score_correction_bias: true)")
    if e.capacity_factor is not None and not e.capacity_factor > 0:
        raise ConfigError(f"moe.capacity_factor must be > 0 (or null: dropless), got "
                          f"{e.capacity_factor}")
    if e.shared_expert_gate and not e.n_shared_experts:
        raise ConfigError("moe.shared_expert_gate needs shared experts (moe.n_shared_experts >= 1)")


def _validate_mla(m: MLAConfig, cfg: ModelConfig) -> None:
    _positive(m, "mla.", ("n_heads", "q_lora_rank", "kv_lora_rank", "d_head_nope", "d_head_rope",
                          "d_head_v", "rope_theta", "norm_eps", "softmax_scale",
                          "max_dense_len"))
    if m.d_head_rope % 2:
        raise ConfigError(f"mla.d_head_rope ({m.d_head_rope}) must be even (RoPE rotates pairs)")
    y = m.rope_scaling
    if y is not None:
        _positive(y, "mla.rope_scaling.", ("factor", "original_max_position", "beta_fast",
                                           "beta_slow", "attention_factor"))


def _validate_gdn(d: GDNConfig, cfg: ModelConfig) -> None:
    _positive(d, "gdn.", ("n_heads", "n_kv_heads", "d_head_k", "d_head_v", "d_conv", "chunk_size",
                          "norm_eps"))
    kv = d.n_kv_heads or d.n_heads
    if d.n_heads % kv:
        raise ConfigError(f"gdn.n_heads ({d.n_heads}) must be divisible by gdn.n_kv_heads ({kv})")
    if not 0 < d.dt_min <= d.dt_max:
        raise ConfigError(f"gdn.dt_min ({d.dt_min}) must be positive and <= dt_max ({d.dt_max})")
    if not 0 < d.a_init_range[0] <= d.a_init_range[1]:
        raise ConfigError(f"gdn.a_init_range {list(d.a_init_range)} must be positive, increasing")


def _validate_mtp(m: MTPConfig, cfg: ModelConfig) -> None:
    if not m.loss_weight >= 0:
        raise ConfigError(f"mtp.loss_weight must be >= 0, got {m.loss_weight}")


register_section("attention", AttentionConfig, _validate_attention)
register_section("mamba", MambaConfig, _validate_mamba)
register_section("mlp", MLPConfig, _validate_mlp)
register_section("moe", MoEConfig, _validate_moe)
register_section("mla", MLAConfig, _validate_mla)
register_section("gdn", GDNConfig, _validate_gdn)
register_section("mtp", MTPConfig, _validate_mtp)


MOE_TRAINING_ONLY = ("aux_loss_scope", "seq_aux_loss_coeff", "bias_update_rate")
"""MoE settings of training alone: they change the losses and the bias updates, never a forward's
outputs, and no Hugging Face config has them (an export leaves them out, an import gives the
defaults)."""


def config_diff(a: ModelConfig, b: ModelConfig) -> str | None:
    """The first dotted field where two configs differ, as ``field: a != b``; None if equal."""
    def walk(x: Any, y: Any, prefix: str) -> str | None:
        if isinstance(x, dict) and isinstance(y, dict):
            for key in x:
                found = walk(x[key], y.get(key), f"{prefix}{key}.")
                if found:
                    return found
            return None
        return None if x == y else f"{prefix.rstrip('.')}: {x!r} != {y!r}"

    return walk(a.to_dict(), b.to_dict(), "")


# ---------------------------------------------------------------- derived sizes


def d_head_of(cfg: ModelConfig) -> int:
    a = cfg.attention
    assert a is not None
    return a.d_head or cfg.d_model // a.n_heads


def d_inner_of(m: MambaConfig) -> int:
    return m.n_heads * m.d_head


def d_ff_shared_of(e: MoEConfig) -> int:
    return e.d_ff_shared if e.d_ff_shared is not None else e.d_ff * e.n_shared_experts


def is_gated(activation: str) -> bool:
    return activation in GATED_ACTIVATIONS
