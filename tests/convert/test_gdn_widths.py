"""Every gated-delta-net family (OLMo-Hybrid, Qwen3-Next, Qwen3.5 dense and MoE) with key heads
unlike value heads and key widths unlike value widths: every width is the one transformers'
module derives from the config (``key_dim = linear_num_key_heads * linear_key_head_dim``,
``value_dim = linear_num_value_heads * linear_value_head_dim``), checked by fp32 logits parity
and a bit-exact round trip of checkpoints that transformers' own ``save_pretrained`` wrote."""

import importlib.util

import pytest
import torch
from safetensors import safe_open

FLA = importlib.util.find_spec("fla") is not None
WIDTHS = {  # (G key heads, H value heads, K key width, V value width)
    "G2-H4-K16-V32": (2, 4, 16, 32),  # the OLMo-Hybrid config: conv 32 + 32 + 128 rows
    "G1-H2-K8-V6": (1, 2, 8, 6),  # conv 8 + 8 + 12 = 28 rows: chunks of 10, 10, 8 on disk
    "G2-H2-K8-V16": (2, 2, 8, 16),  # as many key as value heads, widths unlike
}
COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
# Every expert routed (top-k of k): no top-k choice, so no tie between two experts' scores can
# flip on fp32 noise (a jump outside FP32_PARITY's error model); the expert tensors still count.
MOE = dict(num_experts=2, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24)


def build(family: str, G: int, H: int, K: int, V: int) -> torch.nn.Module:
    import transformers as tf

    gdn = dict(linear_num_key_heads=G, linear_num_value_heads=H, linear_key_head_dim=K,
               linear_value_head_dim=V)
    if family == "olmo-hybrid":
        return tf.OlmoHybridForCausalLM(tf.OlmoHybridConfig(
            **COMMON, **gdn, intermediate_size=48, pad_token_id=None, eos_token_id=None))
    qwen = {**COMMON, **gdn, "head_dim": 16}
    if family == "qwen3-next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**qwen, **MOE, intermediate_size=48))
    if family == "qwen3.5":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**qwen, intermediate_size=48))
    return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**qwen, **MOE))


@pytest.mark.skipif(FLA, reason="flash-linear-attention would make transformers run CUDA kernels")
@pytest.mark.parametrize("widths", list(WIDTHS), ids=list(WIDTHS))
@pytest.mark.parametrize("family", ["olmo-hybrid", "qwen3-next", "qwen3.5", "qwen3.5-moe"])
def test_gdn_widths(check_family, randomize, tmp_path, family, widths):
    G, H, K, V = WIDTHS[widths]
    model = build(family, G, H, K, V).eval()
    randomize(model, seed=sum(WIDTHS[widths]))
    cfg = check_family(model, bf16=False)
    d = cfg.gdn
    assert (d.n_kv_heads, d.n_heads, d.d_head_k, d.d_head_v) == (G, H, K, V)
    if family == "olmo-hybrid":  # transformers writes its conv in torch.chunk thirds
        X = 2 * G * K + H * V
        with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
            rows = [f.get_slice(f"model.layers.0.linear_attn.{x}_conv1d.weight").get_shape()[0]
                    for x in "qkv"]
        assert rows == [len(c) for c in torch.arange(X).chunk(3)]
