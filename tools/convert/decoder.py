"""The shared base of the Llama-shaped decoder families (Llama 3.x, Qwen3, Qwen3-MoE, Mixtral,
MiniMax-M2, GLM-4.5): :class:`DecoderAdapter`, plus the expert links and MoE checks they share
(DeepSeek-V3 and Qwen3-Next use :func:`expert_links` too).

Each HF layer ``L`` is two of our layers: ``2L`` is attention (``*``, norm ``input_layernorm``)
and ``2L + 1`` is the MLP or MoE (``-`` or ``E``, norm ``post_attention_layernorm``). Attention
rows stay in HF's rotate-half order (docs/conversion.md): no permutation either way.

MoE experts: on disk per expert (``mlp.experts.{e}.{gate,up,down}_proj`` for Qwen3-MoE,
``block_sparse_moe.experts.{e}.{w1,w3,w2}`` for Mixtral) or fused as transformers 5 holds them in
memory (``mlp.experts.gate_up_proj [E, 2F, D]`` with gate first, ``mlp.experts.down_proj
[E, D, F]``); ours are fused per projection (``experts.gate_proj [E, F, D]``, ...).
"""

from __future__ import annotations

from typing import Any

from composer.config import ConfigError, MLPConfig, ModelConfig, MoEConfig
from composer.convert.base import (
    GATED_TO_HF_ACT,
    Adapter,
    attention_from_hf,
    attention_links,
    attention_to_hf,
    common_to_hf,
    gated_activation,
    gated_mlp_links,
    layer_pattern_error,
    require,
)
from composer.convert.plan import Link


def expert_links(ours: str, hf_moe: str, n_experts: int, d_ff: int, fused: bool,
                 names: dict[str, str]) -> list[Link]:
    """Links for gated experts. ``names`` maps gate/up/down to the per-expert HF names."""
    links = []
    for e in range(n_experts):
        if fused:
            links += [Link(f"{ours}.experts.gate_proj", f"{hf_moe}.experts.gate_up_proj",
                           (e,), (e, (0, d_ff))),
                      Link(f"{ours}.experts.up_proj", f"{hf_moe}.experts.gate_up_proj",
                           (e,), (e, (d_ff, 2 * d_ff))),
                      Link(f"{ours}.experts.down_proj", f"{hf_moe}.experts.down_proj",
                           (e,), (e,))]
        else:
            for proj in ("gate", "up", "down"):
                links.append(Link(f"{ours}.experts.{proj}_proj",
                                  f"{hf_moe}.experts.{e}.{names[proj]}.weight", (e,), ()))
    return links


class DecoderAdapter(Adapter):
    """Shared by the decoder families; subclasses set the differences."""

    qk_norm = False
    moe_key = "mlp"
    expert_names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

    # ---- config
    def is_sparse(self, hf: dict[str, Any], layer: int) -> bool:
        return False

    def moe_from_hf(self, hf: dict[str, Any]) -> MoEConfig | None:
        return None

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        n_layers = require(hf, "num_hidden_layers")
        sparse = [self.is_sparse(hf, i) for i in range(n_layers)]
        moe = self.moe_from_hf(hf) if any(sparse) else None
        mlp = None
        if not all(sparse):
            mlp = MLPConfig(d_ff=require(hf, "intermediate_size"),
                            activation=gated_activation(hf.get("hidden_act", "silu")),
                            bias=bool(hf.get("mlp_bias", False)))
        return ModelConfig(
            pattern="".join("*E" if s else "*-" for s in sparse),
            d_model=require(hf, "hidden_size"),
            vocab_size=require(hf, "vocab_size"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            init_std=float(hf.get("initializer_range", 0.02)),
            attention=attention_from_hf(hf, qk_norm=self.qk_norm),
            mamba=None, mlp=mlp, moe=moe)

    def layer_kinds(self, cfg: ModelConfig) -> list[bool]:
        """Per HF layer, whether it is sparse; raises if the pattern is not ``(*-|*E)*``."""
        layers = cfg.parsed.layers
        pairs = ["".join(layers[i:i + 2]) for i in range(0, len(layers), 2)]
        if len(layers) % 2 or any(p not in ("*-", "*E") for p in pairs):
            raise layer_pattern_error(self.family, cfg.pattern, "every layer must be '*-' or '*E'")
        return [p == "*E" for p in pairs]

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        sparse = self.layer_kinds(cfg)
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        out.update(num_hidden_layers=len(sparse), rms_norm_eps=cfg.norm_eps)
        attention_to_hf(cfg, out)
        if cfg.mlp is not None and not all(sparse):
            if cfg.mlp.activation not in GATED_TO_HF_ACT:
                raise ConfigError(f"{self.family} needs a gated MLP, not {cfg.mlp.activation!r}")
            out.update(intermediate_size=cfg.mlp.d_ff, hidden_act=GATED_TO_HF_ACT[
                cfg.mlp.activation], mlp_bias=cfg.mlp.bias)
        if any(sparse):
            self.moe_to_hf(cfg, sparse, out)
        for key in ("dtype", "torch_dtype"):
            out.pop(key, None)
        return out

    def moe_to_hf(self, cfg: ModelConfig, sparse: list[bool], out: dict[str, Any]) -> None:
        raise layer_pattern_error(self.family, cfg.pattern, "this family has no MoE layers")

    # ---- tensors
    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.norm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        for i, is_sparse in enumerate(self.layer_kinds(cfg)):
            hf, a, m = f"model.layers.{i}", f"layers.{2 * i}", f"layers.{2 * i + 1}"
            links.append(Link(f"{a}.norm.weight", f"{hf}.input_layernorm.weight"))
            links.append(Link(f"{m}.norm.weight", f"{hf}.post_attention_layernorm.weight"))
            links += attention_links(f"{a}.mixer", f"{hf}.self_attn", cfg.attention)
            if is_sparse:
                moe = cfg.moe
                hf_moe = f"{hf}.{self.moe_key}" if not fused_experts else f"{hf}.mlp"
                links.append(Link(f"{m}.mixer.router.weight", f"{hf_moe}.gate.weight"))
                links += expert_links(f"{m}.mixer", hf_moe, moe.n_experts, moe.d_ff,
                                      fused_experts, self.expert_names)
            else:
                links += gated_mlp_links(f"{m}.mixer", f"{hf}.mlp", cfg.mlp.bias)
        return links



def check_softmax_moe(family: str, cfg: ModelConfig) -> None:
    moe = cfg.moe
    unsupported = []
    if moe.score_func != "softmax":
        unsupported.append(f"score_func={moe.score_func}")
    for name in ("router_bias", "expert_bias"):
        if getattr(moe, name):
            unsupported.append(name)
    if moe.swiglu_limit is not None:
        unsupported.append("swiglu_limit")
    if moe.score_correction_bias:
        unsupported.append("score_correction_bias")
    if moe.n_shared_experts:
        unsupported.append("shared experts")
    if moe.routed_scaling_factor != 1.0:
        unsupported.append("routed_scaling_factor")
    if moe.n_expert_groups != 1:
        unsupported.append("expert groups")
    if moe.activation not in GATED_TO_HF_ACT:
        unsupported.append(f"activation {moe.activation}")
    if unsupported:
        raise ConfigError(f"{family} MoE cannot express: {', '.join(unsupported)}")
