"""Zamba2's hybrid layer (Zyphra, Glorioso et al. 2024, "Zamba2", §2 and Fig. 2; transformers'
``Zamba2HybridLayer``): a Mamba-2 layer whose input first receives the output of a *shared*
transformer block.

With ``x`` the residual stream, ``e`` the model's input embeddings and ``norm`` the layer's norm:

    T(x, e) = mlp(ff_norm(attn(input_norm([x; e]))))       (no residual inside T)
    out     = x + mamba(norm(x + linear(T(x, e))))

``attn`` attends over the ``2 * d_model`` wide ``[x; e]`` (heads ``2 * d_model / n_heads`` wide,
scores scaled by ``(d_head / 2) ** -0.5``, transformers' choice) and projects back to
``d_model``; ``mlp`` is a gated MLP. The block ``T`` (``mixer.block``: ``input_norm``, ``attn``,
``ff_norm``, ``mlp``) is what a pattern's shared layer shares (``shared_part = "block"``:
``{a:Z} ... {a}`` uses one block at several depths); each use keeps its own ``linear``, its own
Mamba-2 mixer (``mixer.mamba``, :class:`~composer.blocks.mamba2.Mamba2Mixer`) and its own
low-rank adapters (transformers' per-site adapter lists, "formally LoRA but in the base model"):
``q/k/v += up(down(h))`` on the attention's normed input (``zamba.attention_adapters``) and
``[gate; up] += up(down(y))`` on the MLP's (always, as transformers builds them).

The layer reads the un-normed ``x`` and its norm (``takes_residual``) and the embeddings
(``uses_embeddings``) through :func:`composer.blocks.protocol.call_mixer`. Packed documents:
both the attention and the Mamba-2 mixer isolate them. Decoding keeps the attention's keys and
values and the Mamba-2 state (:class:`ZambaState`). Tensor parallel: the block's attention
(heads of the ``W`` wide input) and MLP and the Mamba-2 mixer split by their own plans; the two
:class:`~composer.blocks.plan.PartialSum` marks of the block (``attn_sum``, ``out_sum``) are
where the parallel layer sums a row-parallel output before the block goes on; the adapters'
``up`` split like their base (:meth:`ZambaMixer.parallel_plan`). Pipeline parallel: a stage that
holds ``Z`` recomputes the embeddings from the token ids (``composer/parallel/pipeline.py``).
Context parallelism refuses the kind in one line (no time-mixing op declared).

Shape legend: B batch, T time, D d_model, W = 2 * D the block's input width, R adapter rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from composer.blocks.attention import Attention, attention_ref
from composer.blocks.cache import KVState, RecurrentState, Step
from composer.blocks.kind import LayerKind
from composer.blocks.mamba2 import Mamba2Mixer, mamba2_ref
from composer.blocks.mlp import MLP, activation_ref, is_gated
from composer.blocks.norm import RMSNorm
from composer.blocks.plan import Init, Inside, Normal, ParallelPlan, PartialSum, init_module
from composer.blocks.split import SplitLinear
from composer.config import ConfigError, ModelConfig, positive
from composer.kernels.linear import Linear

# ---------------------------------------------------------------- the kind's config section


@dataclass
class ZambaConfig:
    adapter_rank: int = 8
    """Rank of the per-site adapters (transformers' ``adapter_rank``)."""
    attention_adapters: bool = True
    """Adapters on q, k and v (``use_shared_attention_adapter``); the MLP's are always there."""


def validate_zamba(z: ZambaConfig, cfg: ModelConfig) -> None:
    positive(z, "zamba.", ("adapter_rank",))
    a, mlp = cfg.attention, cfg.mlp
    if a is None or mlp is None or cfg.mamba is None:
        raise ConfigError("pattern symbol 'Z' needs the attention, mlp and mamba sections")
    if a.qk_norm or a.output_gate or a.mrope_section is not None:
        raise ConfigError("zamba: the shared block's attention has no qk-norm, output gate or "
                          "M-RoPE")
    if not is_gated(mlp.activation):
        raise ConfigError(f"zamba: the shared block's MLP is gated (its adapter adds to "
                          f"[gate; up]); mlp.activation {mlp.activation!r} is not")


@dataclass
class ZambaState:
    """The decoding state of one hybrid layer: the shared block's keys and values at this site
    and the layer's Mamba-2 state."""

    kv: KVState
    ssm: RecurrentState


class LowRank(nn.Module):
    """``up(down(x))``: one per-site adapter (``down [R, in]``, ``up [out, R]``). ``parts``:
    ``up``'s rows are the parts of a fused output (the MLP's ``[gate; up]``), kept as named
    parts (:class:`~composer.blocks.split.SplitLinear`) so that tensor parallelism splits each
    like the projection it adds to; the state dict still holds one ``up.weight``."""

    def __init__(self, d_in: int, rank: int, d_out: int,
                 parts: dict[str, int] | None = None) -> None:
        super().__init__()
        self.down = Linear(d_in, rank, bias=False)
        self.up: nn.Module = (Linear(rank, d_out, bias=False) if parts is None
                              else SplitLinear(rank, parts, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class SharedBlock(nn.Module):
    """``T(x, e)``: ``input_norm [W]``, ``attn`` (:class:`~composer.blocks.attention.Attention`
    over ``W`` inputs), ``ff_norm [D]``, ``mlp`` (:class:`~composer.blocks.mlp.MLP`). The
    adapters are the caller's (one set per site)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.input_norm = RMSNorm(2 * d, cfg.norm_eps)
        self.attn = Attention(cfg, d_in=2 * d)
        self.ff_norm = RMSNorm(d, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.attn_sum = PartialSum()  # the attention's output, whole before ff_norm
        self.out_sum = PartialSum()  # the MLP's, whole before linear and the norm

    def parallel_plan(self) -> ParallelPlan:
        """The attention's and the MLP's own plans (heads, hidden units); the norms replicated,
        read inside the mixer (partial gradients); the two sub-layers' outputs summed inside."""
        return ParallelPlan(partial=("input_norm.weight", "ff_norm.weight"),
                            partial_sums=("attn_sum", "out_sum"))

    def forward(self, x_BTD: torch.Tensor, e_BTD: torch.Tensor, adapters: nn.ModuleDict, *,
                doc_ids: torch.Tensor | None = None, step: Step | None = None) -> torch.Tensor:
        h_BTW = self.input_norm(torch.cat([x_BTD, e_BTD], dim=-1))
        a = self.attn
        b, t, _ = h_BTW.shape
        heads = []
        for name in ("q", "k", "v"):
            p_BTX = getattr(a, f"{name}_proj")(h_BTW)
            if name in adapters:
                p_BTX = p_BTX + adapters[name](h_BTW)
            heads.append(p_BTX.view(b, t, -1, a.d_head).transpose(1, 2))
        o_BHTE = a.core(*heads, a.rotary, a.scale, doc_ids=doc_ids, step=step)
        y_BTD = self.ff_norm(self.attn_sum(a._output(o_BHTE, None)))
        m = self.mlp
        g_BTF, u_BTF = m.gate_proj(y_BTD), m.up_proj(y_BTD)
        ag_BTF, au_BTF = adapters["mlp"](y_BTD).chunk(2, dim=-1)
        return self.out_sum(m.down_proj(m.act(g_BTF + ag_BTF) * (u_BTF + au_BTF)))


class ZambaMixer(nn.Module):
    """``layers.i.mixer.{block.*, linear, mamba.*, q_adapter, k_adapter, v_adapter,
    mlp_adapter}`` (each adapter ``.down``/``.up``); ``block`` is the shared part."""

    shared_part = "block"
    uses_doc_ids = True
    uses_embeddings = True
    takes_residual = True
    keep_fp32 = ("mamba.A_log",)

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        z, mlp = cfg.zamba, cfg.mlp
        assert z is not None and mlp is not None
        d, r = cfg.d_model, z.adapter_rank
        self.init_std = cfg.init_std
        self.block = SharedBlock(cfg)
        self.linear = Linear(d, d, bias=False)
        self.mamba = Mamba2Mixer(cfg, layer_idx)
        self.adapters = nn.ModuleDict()
        if z.attention_adapters:
            a = self.block.attn
            for name in ("q", "k", "v"):
                out = getattr(a, f"{name}_proj").out_features
                self.adapters[name] = LowRank(2 * d, r, out)
        self.adapters["mlp"] = LowRank(d, r, 2 * mlp.d_ff, {"gate": mlp.d_ff, "up": mlp.d_ff})

    def init_rules(self) -> dict[str, Init]:
        std = Normal(self.init_std)
        return {"linear.weight": std, "adapters.*.down.weight": std,
                "adapters.*.up.weight*": std}

    def parallel_plan(self) -> ParallelPlan:
        """Tensor parallel (the block's modules and ``mamba`` declare their own plans): each
        adapter's ``down`` replicated (it reads the whole normed input; partial gradients),
        its ``up`` split like the projection it adds to: q by heads, k and v by kv heads (or
        replicated, each rank keeping its head), the MLP's ``[gate; up]`` part by part as
        ``gate_proj`` and ``up_proj``; ``linear`` replicated on the block's whole output."""
        heads = {f"adapters.{n}.up": self.block.attn.n_kv_heads for n in ("k", "v")
                 if n in self.adapters}
        return ParallelPlan(colwise=("adapters.q.up",) if "q" in self.adapters else (),
                            heads=heads, shard={"adapters.mlp.up.weight_*": 0},
                            partial=("adapters.*.down.weight", "linear.weight"))

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

    def forward(self, x_BTD: torch.Tensor, *, norm: nn.Module, embeddings: torch.Tensor,
                doc_ids: torch.Tensor | None = None, step: Step | None = None) -> torch.Tensor:
        """``mamba(norm(x + linear(T(x, e))))``; the layer adds ``x``. With ``step`` both the
        block's attention and the Mamba-2 mixer continue from ``step.state``."""
        kv = ssm = None
        if step is not None:
            kv, ssm = Step(step.state.kv, step.ctx), Step(step.state.ssm, step.ctx)
        t_BTD = self.block(x_BTD, embeddings, self.adapters, doc_ids=doc_ids, step=kv)
        h_BTD = norm(x_BTD + self.linear(t_BTD))
        return self.mamba(h_BTD, doc_ids=doc_ids, step=ssm)

    def init_cache(self, batch: int, max_len: int, device: torch.device,
                   dtype: torch.dtype) -> ZambaState:
        return ZambaState(self.block.attn.init_cache(batch, max_len, device, dtype),
                          self.mamba.init_cache(batch, max_len, device, dtype))

    @staticmethod
    def layout_rules(cfg: ModelConfig) -> list[Inside]:
        """The shared block's attention and MLP and the Mamba-2 mixer split as they do alone
        (the 2 * d_model wide attention by heads); a broken rule names the kind."""
        where = "'Z' (Zamba2 hybrid layer)"
        return [Inside(where, rule) for rule in (*Attention.layout_rules(cfg),
                                                 *MLP.layout_rules(cfg),
                                                 *Mamba2Mixer.layout_rules(cfg))]

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """The block (attention over ``W`` inputs, the MLP), the adapters, ``linear`` and the
        Mamba-2 mixer; the attention's projections are counted from their real widths."""
        a, z, mlp = cfg.attention, cfg.zamba, cfg.mlp
        d, r, f = cfg.d_model, z.adapter_rank, mlp.d_ff
        e, h, kv = a.d_head or 2 * d // a.n_heads, a.n_heads, a.n_kv_heads or a.n_heads
        attn = 2 * (2 * d * e * (h + 2 * kv) + h * e * d) + 4 * h * e * seq_len
        adapters = 2 * r * (d + 2 * f)
        if z.attention_adapters:
            adapters += 2 * r * (2 * d + e * h) + 4 * r * (2 * d + e * kv)
        return (attn + 6 * d * f + adapters + 2 * d * d
                + Mamba2Mixer.flops_per_token(cfg, seq_len))


def zamba_ref(x: torch.Tensor, e: torch.Tensor, w: dict[str, torch.Tensor], cfg: ModelConfig,
              doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-math twin of the whole hybrid layer (``x + mixer(x)``, ``layers.i.*`` names
    relative to the layer: ``norm.weight``, ``mixer.*``); meant for fp64. The attention goes
    through :func:`~composer.blocks.attention.attention_ref` with the adapters folded into the
    q/k/v weights (``W + up @ down``, the same linear map), the rest written out."""
    a, z, mlp = cfg.attention, cfg.zamba, cfg.mlp
    eps = cfg.norm_eps

    def rms(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)

    def lowrank(name: str) -> torch.Tensor:
        return w[f"mixer.adapters.{name}.up.weight"] @ w[f"mixer.adapters.{name}.down.weight"]

    blk = "mixer.block."
    h = rms(torch.cat([x, e], -1), w[blk + "input_norm.weight"])
    aw = {p: w[f"{blk}attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    if z.attention_adapters:
        for n in ("q", "k", "v"):
            aw[f"{n}_proj"] = aw[f"{n}_proj"] + lowrank(n)
    y = rms(attention_ref(h, aw, a, a.d_head, eps, doc_ids=doc_ids), w[blk + "ff_norm.weight"])
    f = mlp.d_ff
    ad = lowrank("mlp")
    gate = y @ (w[blk + "mlp.gate_proj.weight"] + ad[:f]).T
    up = y @ (w[blk + "mlp.up_proj.weight"] + ad[f:]).T
    t = (activation_ref(mlp.activation, gate) * up) @ w[blk + "mlp.down_proj.weight"].T
    u = rms(x + t @ w["mixer.linear.weight"].T, w["norm.weight"])
    mamba_w = {k[len("mixer.mamba."):]: v for k, v in w.items() if k.startswith("mixer.mamba.")}
    return x + mamba2_ref(u, mamba_w, cfg, doc_ids=doc_ids)


KIND = LayerKind("Z", "Zamba2 hybrid", ZambaMixer, "zamba", ZambaConfig, validate_zamba,
                 halo=lambda cfg: cfg.mamba.d_conv - 1)
"""``Z``: Zamba2's hybrid layer (a shared transformer block feeding a Mamba-2 layer); written
``{a:Z} ... {a}`` to share the block."""
