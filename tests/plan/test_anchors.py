"""Published anchors for ``composer plan``: Megatron-LM's throughput table and its estimator of
weight and optimizer memory (docs/planning.md, "Anchors").

Sources (every number below is one of these):
- THE TABLE: Megatron-LM's README of April 2021 (NVIDIA/Megatron-LM commit 50a4b5fa02,
  ``images/cases_april2021.png``), the same runs as Table 1 of Narayanan et al. 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
  (arXiv 2104.04473): model size, hidden size, layers, parameters (billion), model-parallel
  size, GPUs, batch size, achieved TFLOP/s per GPU, percentage of the theoretical peak, achieved
  aggregate PFLOP/s. Vocabulary 51,200 and sequence length 2,048 for every row (the README).
- THE LAYOUTS: the paper's scripts, ``examples/academic_paper_scripts/sc21/run_table_1.sh``
  (attention heads ``NAH``, ``TP``, ``PP``, micro-batch ``MBS``, global batch ``GBS``, and
  ``--activations-checkpoint-method uniform``: every layer recomputed) and ``CONFIG.sh``
  (``--seq-length 2048``, ``--fp16``). Peak: 312 TFLOP/s, the A100's dense fp16/bf16 rate
  (the paper, section 5).
- THE FORMULAS: the paper's FLOPs per iteration with recomputation, ``F = 96 B s l h^2 (1 +
  s/6h + V/16lh)``, and parameters, ``P = 12 l h^2 (1 + 13/12h + (V + s)/12lh)``; the
  estimator, ``compute_weight_and_optimizer_memory`` in
  ``megatron/training/theoretical_memory_usage.py`` (Megatron-LM at 1bcb3b9e0b, 2026-06),
  transcribed below for its dense path (it is not importable here: ``megatron.training`` is
  not installed).

The GPT configuration composer builds for a row: ``(*-) x l`` (a Megatron transformer layer is
an attention block and an MLP block), ``d_model = h``, ``h / heads`` channels per head, an
ungated GELU MLP of ``4h``, biases on every projection, tied embeddings, vocabulary 51,200.
composer has no learned position embeddings and no LayerNorm biases (RMSNorm): positions are
RoPE (no parameters; its elementwise work is not in either FLOP count, nor is a learned
position's add).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace

import pytest

from composer.build.builder import build_model, model_stats
from composer.config import ModelConfig
from composer.parallel.layout import ParallelConfig
from composer.plan.ranks import STEP_BYTES, rank_classes

VOCAB, SEQ = 51200, 2048
A100_PEAK_TFLOPS = 312


@dataclass(frozen=True)
class Row:
    name: str
    h: int
    layers: int
    heads: int
    params_b: str
    """The table's "number of parameters (billion)", as printed (one decimal)."""
    tp: int
    pp: int
    gpus: int
    batch: int
    micro: int
    tflops: int
    """Achieved teraFLOP/s per GPU."""
    peak_pct: int
    pflops: str
    """Achieved aggregate petaFLOP/s, as printed."""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


# name, hidden, layers, heads, params, TP, PP, GPUs, batch, micro-batch, TFLOP/s, %peak, PFLOP/s
TABLE = [
    Row("1.7B", 2304, 24, 24, "1.7", 1, 1, 32, 512, 16, 137, 44, "4.4"),
    Row("3.6B", 3072, 30, 32, "3.6", 2, 1, 64, 512, 16, 138, 44, "8.8"),
    Row("7.5B", 4096, 36, 32, "7.5", 4, 1, 128, 512, 16, 142, 46, "18.2"),
    Row("18B", 6144, 40, 48, "18.4", 8, 1, 256, 1024, 8, 135, 43, "34.6"),
    Row("39B", 8192, 48, 64, "39.1", 8, 2, 512, 1536, 4, 138, 44, "70.8"),
    Row("76B", 10240, 60, 80, "76.1", 8, 4, 1024, 1792, 2, 140, 45, "143.8"),
    Row("145B", 12288, 80, 96, "145.6", 8, 8, 1536, 2304, 2, 148, 47, "227.1"),
    Row("310B", 16384, 96, 128, "310.1", 8, 16, 1920, 2160, 1, 155, 50, "297.4"),
    Row("530B", 20480, 105, 128, "529.6", 8, 35, 2520, 2520, 1, 163, 52, "410.2"),
    Row("1T", 25600, 128, 160, "1008.0", 8, 64, 3072, 3072, 1, 163, 52, "502.0"),
]
MODEL_PARALLEL = [1, 2, 4, 8, 16, 32, 64, 128, 280, 512]
"""The README table's "model-parallel size" column (TP x PP)."""


def gpt(h: int, heads: int, layers: int, bias: bool = True, tie: bool = True,
        stages: int = 1) -> ModelConfig:
    """The GPT configuration of a row (module docstring); ``stages``: Megatron's uniform
    pipeline split, ``layers / stages`` transformer layers per stage, written with ``|``."""
    stage = f"(*-)x{layers // stages}"
    return ModelConfig.from_dict({
        "pattern": "|".join([stage] * stages), "d_model": h, "vocab_size": VOCAB,
        "tie_embeddings": tie,
        "attention": {"n_heads": heads, "qkv_bias": bias, "out_bias": bias},
        "mlp": {"d_ff": 4 * h, "activation": "gelu", "bias": bias}})


def megatron_flops_per_iteration(row: Row) -> Fraction:
    """The paper's training FLOPs per iteration, with every layer recomputed."""
    b, s, lay, h, v = row.batch, SEQ, row.layers, row.h, VOCAB
    return 96 * b * s * lay * h**2 * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * lay * h))


def megatron_parameters(row: Row) -> int:
    """The paper's parameter count (biases, LayerNorms' weights and biases, learned positions,
    tied embedding; the final LayerNorm is left out)."""
    lay, h = row.layers, row.h
    p = 12 * lay * h**2 * (1 + Fraction(13, 12 * h) + Fraction(VOCAB + SEQ, 12 * lay * h))
    assert p.denominator == 1
    return int(p)


def test_the_table_is_consistent_with_itself():
    """A check of the transcription: aggregate PFLOP/s = TFLOP/s per GPU x GPUs, the
    percentage = TFLOP/s / 312, model-parallel size = TP x PP, within the printed rounding
    (the per-GPU figure is printed to 0.5 TFLOP/s, the aggregate to 0.05 PFLOP/s)."""
    for row, mp in zip(TABLE, MODEL_PARALLEL, strict=True):
        assert row.tp * row.pp == mp and row.gpus % mp == 0, row.name
        assert row.batch % (row.micro * row.dp) == 0, row.name
        aggregate = Fraction(row.pflops) * 1000  # TFLOP/s
        assert abs(aggregate - row.tflops * row.gpus) <= Fraction(1, 2) * row.gpus + 50, row.name
        assert abs(Fraction(row.tflops * 100, A100_PEAK_TFLOPS) - row.peak_pct) <= Fraction(
            1, 2) + Fraction(50, A100_PEAK_TFLOPS), row.name


@pytest.fixture(scope="module")
def stats() -> dict[str, object]:
    """composer's counts of every row's model (built on the meta device, at the table's
    sequence length)."""
    return {row.name: model_stats(build_model(gpt(row.h, row.heads, row.layers), device="meta"),
                                  seq_len=SEQ) for row in TABLE}


@pytest.mark.parametrize("row", TABLE, ids=[r.name for r in TABLE])
def test_parameters_match_the_published_size(row, stats):
    """composer's count plus what composer does not build (the LayerNorms' biases ``2 l h``,
    the learned positions ``s h``) less what the paper's formula leaves out (composer's final
    norm ``h``) is the paper's formula, exactly; printed to one decimal it is the
    published size. composer's own count is below it by ``(s + 2l) h - h``: under 0.3%."""
    n = stats[row.name].n_params
    lay, h = row.layers, row.h
    p = megatron_parameters(row)
    assert n + 2 * lay * h + SEQ * h - h == p
    assert f"{p / 1e9:.1f}" == row.params_b
    assert 0 < (p - n) / p < 0.003


@pytest.mark.parametrize("row", TABLE, ids=[r.name for r in TABLE])
def test_flops_per_iteration_equal_megatrons_formula(row, stats):
    """The plan's training FLOPs under ``--ac full`` (every layer's forward again in the
    backward, the head's not) times the iteration's tokens equal ``96 B s l h^2 (1 + s/6h +
    V/16lh)`` exactly, so the table's TFLOP/s per GPU, ``F / (GPUs x iteration time)``, is
    what the plan's accounting gives for the same iteration time (the acceptance asks 1%)."""
    s = stats[row.name]
    tokens = row.batch * SEQ
    ours = s.training_flops_per_token("full") * tokens
    assert ours == megatron_flops_per_iteration(row)  # exactly: the acceptance asks 1%
    # without recomputation: the model FLOPs, 72 B s l h^2 (1 + s/6h + V/12lh)
    b, lay, h = row.batch, row.layers, row.h
    assert s.flops_per_token * tokens == 72 * b * SEQ * lay * h**2 * (
        1 + Fraction(SEQ, 6 * h) + Fraction(VOCAB, 12 * lay * h))


@pytest.mark.slow
def test_composer_plan_reproduces_the_first_row(capsys):
    """The 1.7B row as published, through ``composer plan --json``: 32 GPUs, tp=pp=1, batch
    512 in micro-batches of 16, every layer recomputed, at the table's achieved 137 TFLOP/s
    as the GPU's rate. With no pipeline and no tensor parallelism the plan's lower bound is
    the compute (and a few exposed bytes), so Megatron's FLOPs per iteration over (GPUs x that
    time) is 137."""
    import json

    from composer.cli import main

    row = TABLE[0]
    argv = ["plan", "--pattern", f"(*-)x{row.layers}", "--set", f"d_model={row.h}",
            "--set", f"vocab_size={VOCAB}", "--set", "tie_embeddings=true",
            "--set", f"attention.n_heads={row.heads}", "--set", "attention.qkv_bias=true",
            "--set", "attention.out_bias=true", "--set", f"mlp.d_ff={4 * row.h}",
            "--set", "mlp.activation=gelu", "--set", "mlp.bias=true",
            "--tp", "1", "--pp", "1", "--cp", "1", "--ep", "1",  # a full layout: no search
            "--gpus", str(row.gpus), "--mem-gib", "80", "--tflops", str(row.tflops),
            "--hbm-tbs", "2", "--nvlink-gbs", "300", "--net-gbs", "25",
            "--seq-len", str(SEQ), "--global-batch-size", str(row.batch),
            "--micro-batch-size", str(row.micro), "--ac", "full", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["dp"] == row.gpus
    seconds = plan["step_time_s"]["lower"]
    achieved = float(megatron_flops_per_iteration(row)) / (row.gpus * seconds) / 1e12
    # the lower bound is the compute plus the few bytes no overlap hides (the gradient norm's
    # and the step statistics' all-reduces over dp: tens of bytes, ~1e-9 of the step)
    assert 0 <= row.tflops - achieved <= 1e-6 * row.tflops
    # the plan's flops_per_token (and its MFU) are model FLOPs: no recomputation
    b, lay, h = row.batch, row.layers, row.h
    assert plan["flops_per_token"] * b * SEQ == 72 * b * SEQ * lay * h**2 * (
        1 + Fraction(SEQ, 6 * h) + Fraction(VOCAB, 12 * lay * h))


# ---------------------------------------------------------------- Megatron's estimator


def megatron_weight_and_optimizer(args: SimpleNamespace) -> tuple[Fraction, Fraction]:
    """(``num_parameters_on_most_loaded_model_shard``, ``weight_and_optimizer_memory``) of
    ``compute_weight_and_optimizer_memory``, its dense path (no experts, no latent attention,
    no MTP), term by term and in its order; Fractions where Megatron divides."""
    assert args.num_experts is None and not args.multi_latent_attention
    assert args.mtp_num_layers is None
    query_projection_size = args.kv_channels * args.num_attention_heads
    query_projection_to_hidden_size_ratio = Fraction(query_projection_size, args.hidden_size)
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    gated_linear_multiplier = Fraction(3, 2) if args.swiglu else 1
    norm_size = 1 if args.normalization == "RMSNorm" else 2
    self_attn_term = 2 * args.hidden_size * args.hidden_size * (
        (1 + Fraction(args.num_query_groups, args.num_attention_heads))
        * query_projection_to_hidden_size_ratio)
    embedding_size = args.hidden_size * args.padded_vocab_size
    final_layernorm = norm_size * args.hidden_size
    dense_mlp_params = 2 * args.hidden_size * args.ffn_hidden_size * gated_linear_multiplier
    layernorm_params = 2 * args.hidden_size * norm_size
    num_dense_layers = args.num_layers
    tp_sharded_params_in_transformer_block = (self_attn_term + dense_mlp_params) \
        * num_dense_layers
    replicated_params_in_transformer_block = layernorm_params * num_dense_layers \
        + final_layernorm
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    tp_sharded_params_on_most_loaded_shard = (
        Fraction(tp_sharded_params_in_transformer_block) / pp + embedding_size) / tp
    replicated_params_on_most_loaded_shard = Fraction(replicated_params_in_transformer_block, pp)
    num_parameters_on_most_loaded_model_shard = (
        tp_sharded_params_on_most_loaded_shard + replicated_params_on_most_loaded_shard)
    if args.untie_embeddings_and_output_weights and pp == 1:
        tp_sharded_params_on_most_loaded_shard += Fraction(embedding_size, tp)
        num_parameters_on_most_loaded_model_shard += Fraction(embedding_size, tp)
    dp = args.data_parallel_size
    per_parameter = 18 if not args.use_distributed_optimizer else 6 + Fraction(12, dp)
    memory = (tp_sharded_params_on_most_loaded_shard + replicated_params_on_most_loaded_shard) \
        * per_parameter
    return num_parameters_on_most_loaded_model_shard, memory


# (tie, gated, tp, pp, world, dp mode): Megatron's distributed optimizer (ZeRO-1) against
# composer's FSDP2 shard mode (ZeRO-3), its plain optimizer against replicate; tied at pp=2,
# untied at pp=1 and pp=2; gated: a Llama-style variant (SwiGLU of 8h/3, 8 key/value heads)
ESTIMATOR_CASES = [(True, False, 2, 2, 8, "shard"), (True, False, 2, 2, 8, "replicate"),
                   (False, False, 2, 1, 8, "shard"), (False, True, 2, 2, 8, "shard")]
GPT_ROW = TABLE[0]
KV_HEADS = 8


@pytest.mark.parametrize(("tie", "gated", "tp", "pp", "world", "mode"), ESTIMATOR_CASES)
def test_weight_and_optimizer_bytes_equal_megatrons_estimator(tie, gated, tp, pp, world, mode):
    """The 1.7B row's GPT in the form Megatron's estimator counts (no linear biases, RMSNorm,
    RoPE; the estimator counts neither biases nor position embeddings), split uniformly over
    the stages as Megatron does. Parameters: composer's most loaded rank (the last stage: the
    head, or the tied head's copy of the embedding, and the final norm) holds Megatron's most
    loaded shard plus ``h (1 - 1/pp)``: the estimator spreads the final norm over the stages
    (``/ pp``), composer counts it on the stage that holds it. Bytes per parameter: Megatron 18
    (bf16 weight 2, fp32 gradient 4, fp32 master 4, Adam moments 8), or ``6 + 12/dp`` with its
    distributed optimizer (the weight and gradient whole, master and moments sharded);
    composer 16 (fp32 master 4, fp32 gradient 4, moments 8: FSDP2 shards all three, so
    ``16/dp``) plus AdamW's 4-byte ``step`` per parameter tensor. composer's bf16 weights exist
    only gathered in flight (``buffers_bytes``, not counted here)."""
    row, dp = GPT_ROW, world // (tp * pp)
    cfg = gpt(row.h, row.heads, row.layers, bias=False, tie=tie, stages=pp)
    d_ff = 8 * row.h // 3 if gated else 4 * row.h
    if gated:
        cfg.attention.n_kv_heads, cfg.mlp.activation, cfg.mlp.d_ff = KV_HEADS, "swiglu", d_ff
    classes = rank_classes(cfg, ParallelConfig(tp=tp, pp=pp, dp_mode=mode), world)
    most = max(classes, key=lambda c: c.bytes.params)
    assert most.stage == pp - 1
    args = SimpleNamespace(
        kv_channels=row.h // row.heads, num_attention_heads=row.heads, hidden_size=row.h,
        group_query_attention=gated, num_query_groups=KV_HEADS if gated else None,
        num_experts=None, swiglu=gated, multi_latent_attention=False, mtp_num_layers=None,
        normalization="RMSNorm", padded_vocab_size=VOCAB,
        untie_embeddings_and_output_weights=not tie, ffn_hidden_size=d_ff,
        num_layers=row.layers, pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp, data_parallel_size=dp,
        use_distributed_optimizer=mode == "shard")
    shard, megatron_bytes = megatron_weight_and_optimizer(args)
    assert isinstance(shard, Fraction) and isinstance(megatron_bytes, Fraction)  # exact
    n = shard + row.h * (1 - Fraction(1, pp))  # composer's last stage, per tp rank
    # every tensor's dim 0 divides by tp and dp here: FSDP2's torch.chunk shards are even
    held = n / dp if mode == "shard" else n
    assert most.bytes.params == 4 * held and most.bytes.grads == 4 * held
    # tensors on the last stage: 4 projections + a norm per attention block, 2 (gated: 3) + a
    # norm per MLP block, the final norm, the embedding (tied: the head's copy of it) or the head
    mlp_tensors = 4 if gated else 3
    tensors = (5 + mlp_tensors) * row.layers // pp + 1 + (2 if not tie and pp == 1 else 1)
    assert most.bytes.optimizer == 8 * held + STEP_BYTES * tensors
    # the mapping: Megatron's bytes at its bytes per parameter, composer's at 16 (/ dp sharded)
    per_parameter = 6 + Fraction(12, dp) if mode == "shard" else 18
    composer_bytes = most.bytes.params + most.bytes.grads + most.bytes.optimizer
    sharded = dp if mode == "shard" else 1
    assert composer_bytes == Fraction(16, sharded) * (megatron_bytes / per_parameter + n - shard) \
        + STEP_BYTES * tensors
