"""``generate``: prefill once, then one token per step from the inference cache.

The prompt runs through the model once (the chunked scans, returning their final states; the
attention keys and values written to a preallocated cache), then each step feeds the last token
only: attention reads the cache, Mamba-2 and gated-delta-net layers take one step of their
recurrence (:mod:`composer.blocks.cache`). ``use_cache=False`` recomputes the whole sequence at
every step instead (the reference the cached path is tested against, and the fallback for a
user mixer without a cache).

Choosing the next token from the last logits ``z`` (``[B, vocab]``): ``temperature == 0`` is
greedy (``argmax``); otherwise ``z / temperature``, then ``top_k`` keeps the ``k`` largest,
``top_p`` the smallest set of most likely tokens whose probability reaches ``p`` (nucleus
sampling, Holtzman et al. 2020; the most likely token always stays), and a token is drawn from
the softmax with a generator seeded by ``seed`` (reproducible; without a seed, torch's global
generator).

Batches of prompts of different lengths are left-padded with ``attention_mask`` (1 for prompt
tokens): each row's positions, attention and recurrent states are those of its prompt alone.
A row that emits an ``eos_token_id`` is finished: later positions hold ``pad_token_id`` (default:
the first eos id), and generation stops when every row is finished.

``return_logprobs=True`` also gives each new token's log-probability under the distribution it
was drawn from (after temperature, before top-k / top-p: what a policy-gradient objective divides
by), computed from the same logits; the training path gives the same numbers
(``HybridModel.token_logprobs`` on the whole sequence, padding as an earlier document) up to
fp32 rounding (tests/inference/test_consistency.py).

``sync_group`` (data-parallel rollouts on a sharded model): every rank of the group takes the
same number of decoding steps, so the collectives inside each step (FSDP's gathers, tensor
parallelism's reductions) stay matched; a rank whose rows are all finished keeps stepping with
padding until every rank is (one all-reduce of a flag per step). Each rank still returns only the
columns its own rows needed, so its output is what it would generate alone. Every rank of the
group must pass the same ``max_new_tokens`` and eos ids.

Sharded models (FSDP2, tensor parallelism) generate as one process does: each tensor-parallel
rank caches its own heads (:func:`new_cache`), the caches are in the compute dtype (bf16 under
FSDP's mixed precision), and a sharded model decodes under ``no_grad`` rather than inference mode
(FSDP2 reuses the buffers it gathers weights into). The returned tensors are ordinary ones, so
a rollout can be trained on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from composer.blocks.cache import InferenceCache
from composer.blocks.model import HybridModel


def _check(input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None,
           temperature: float, top_k: int | None, top_p: float | None, vocab: int) -> None:
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids must be integer token ids shaped (batch, length), got "
                         f"{input_ids.dtype} {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"empty prompt: input_ids has shape {tuple(input_ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token id {hi if hi >= vocab else lo} is outside the model's "
                         f"vocabulary [0, {vocab})")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must be shaped like input_ids "
                             f"{tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
        # (that it is left padding is checked where the cache reads it: InferenceCache.advance)
        if not bool(attention_mask.bool().any(1).all()):
            raise ValueError("attention_mask: a row has no prompt tokens (all padding)")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def filter_logits(logits_BV: torch.Tensor, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """``logits`` with the tokens outside the top ``k`` and outside the nucleus ``p`` at
    ``-inf`` (module docstring)."""
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(-1)
        # drop a token when the ones more likely than it already reach p (the first stays)
        drop_BV = probs_BV.cumsum(-1) - probs_BV >= top_p
        logits_BV = logits_BV.masked_fill(drop_BV.scatter(-1, order_BV, drop_BV),
                                          float("-inf"))
    return logits_BV


def next_token(logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row ``[B]`` from the last logits (module docstring)."""
    if temperature == 0.0:
        return logits_BV.argmax(-1)
    logits_BV = filter_logits(logits_BV.float() / temperature, top_k, top_p)
    return torch.multinomial(logits_BV.softmax(-1), 1, generator=generator)[:, 0]


def _eos_ids(eos_token_id: int | Sequence[int] | None, device: torch.device) -> torch.Tensor:
    if eos_token_id is None:
        return torch.empty(0, dtype=torch.long, device=device)
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


@dataclass
class Generated:
    """What ``generate(..., return_logprobs=True)`` returns."""

    ids: torch.Tensor
    """``(B, T + n)`` token ids, as ``generate`` returns them otherwise."""
    logprobs: torch.Tensor
    """``(B, n)`` (>= fp32): each new token's log-probability under the distribution it was
    drawn from, after temperature and before top-k / top-p (``log_softmax(z / temperature)``,
    ``log_softmax(z)`` when greedy); 0 after the row's eos."""
    finished: torch.Tensor
    """``(B,)`` bool: the row emitted an eos."""


def _all_done(done_B: torch.Tensor, sync_group: dist.ProcessGroup | None) -> bool:
    """Whether every row is finished, on every rank of ``sync_group`` (one all-reduce)."""
    if sync_group is None:
        return bool(done_B.all())
    busy = (~done_B).any().to(torch.int32).reshape(1)
    dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=sync_group)
    return not bool(busy)


def generate(model: HybridModel, input_ids: torch.Tensor, max_new_tokens: int, *,
             attention_mask: torch.Tensor | None = None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
             seed: int | None = None, on_token: Callable[[torch.Tensor], None] | None = None,
             use_cache: bool = True, vocab_limit: int | None = None,
             return_logprobs: bool = False,
             sync_group: dist.ProcessGroup | None = None,
             pixel_values: torch.Tensor | None = None,
             image_grid_thw: torch.Tensor | None = None) -> torch.Tensor | Generated:
    """Continue each row of ``input_ids`` ``(B, T)`` by up to ``max_new_tokens`` tokens;
    returns ``(B, T + n)`` token ids, ``n <= max_new_tokens`` (fewer when every row ended with
    an eos), or with ``return_logprobs`` a :class:`Generated` (the ids, each new token's
    log-probability, which rows finished). ``on_token`` gets each new column ``(B,)`` as it is
    produced (streaming). See the module docstring for sampling, padding, eos and
    ``sync_group``. ``vocab_limit``: only ids below it are generated (a vocabulary padded past
    its tokenizer's; the log-probabilities are then over those ids). ``pixel_values`` and
    ``image_grid_thw`` (a vision-language model;
    :func:`composer.vision.preprocess.preprocess_images` makes them): the images of the
    prompts' placeholder tokens, run with the prefill; the cache keeps their M-RoPE offsets
    for the decoding steps."""
    _check(input_ids, max_new_tokens, attention_mask, temperature, top_k, top_p,
           model.config.vocab_size)
    if vocab_limit is not None and not 1 <= vocab_limit <= model.config.vocab_size:
        raise ValueError(f"vocab_limit must be in [1, {model.config.vocab_size}], got "
                         f"{vocab_limit}")
    images = None
    if pixel_values is not None or image_grid_thw is not None:
        if not use_cache:
            raise ValueError("images need the cached prefill (use_cache=True)")
        images = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    device = model.embed.weight.device
    ids_BT = input_ids.to(device)
    mask_BT = None if attention_mask is None else attention_mask.to(device).bool()
    if mask_BT is not None and bool(mask_BT.all()):
        mask_BT = None
    eos_E = _eos_ids(eos_token_id, device)
    pad = pad_token_id if pad_token_id is not None else (int(eos_E[0]) if len(eos_E) else 0)
    generator = None
    if seed is not None and temperature > 0:
        generator = torch.Generator(device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        with _no_grad(model):
            columns, logps, done_B = _decode(
                model, ids_BT, mask_BT, max_new_tokens, use_cache,
                lambda z_BV: next_token(z_BV, temperature, top_k, top_p, generator),
                vocab_limit, eos_E, pad, on_token,
                (lambda z_BV, t_B, d_B: _sampled_logp(z_BV, t_B, temperature, d_B))
                if return_logprobs else None, sync_group, images or {})
    finally:
        model.train(was_training)
    # made here, outside inference mode: a caller may train on them (a tensor made under
    # inference mode cannot be saved for backward)
    ids = torch.cat([ids_BT, *(c[:, None] for c in columns)], 1)
    if not return_logprobs:
        return ids
    return Generated(ids, torch.stack(logps, 1), done_B.clone())


def _decode(model, ids_BT, mask_BT, max_new_tokens, use_cache, pick, vocab_limit, eos_E, pad,
            on_token, score, sync_group, images):
    """The prefill and decoding steps: the new columns ``(B,)`` this rank's rows need, their
    log-probs (with ``score``) and which rows finished."""
    columns, logps = [], []
    done_B = torch.zeros(ids_BT.shape[0], dtype=torch.bool, device=ids_BT.device)
    n_local = 0  # columns this rank's rows need (fewer than the steps under sync_group)
    if use_cache:
        cache = new_cache(model, ids_BT.shape[0], ids_BT.shape[1] + max_new_tokens)
        images = {k: None if v is None else v.to(ids_BT.device) for k, v in images.items()}
        logits_BV = model.forward_cached(ids_BT, cache, attention_mask=mask_BT, **images)
    else:
        logits_BV = _full_forward(model, ids_BT, mask_BT)
    for step in range(max_new_tokens):
        if vocab_limit is not None:  # a slice keeps ids as they are: rows 0..limit-1
            logits_BV = logits_BV[:, :vocab_limit]
        token_B = pick(logits_BV).masked_fill(done_B, pad)
        if not len(eos_E) or not bool(done_B.all()):
            n_local = step + 1
        if score is not None:
            logps.append(score(logits_BV, token_B, done_B))
        columns.append(token_B)
        if on_token is not None and step < n_local:
            on_token(token_B)
        if len(eos_E):
            done_B = done_B | torch.isin(token_B, eos_E)
            if _all_done(done_B, sync_group):
                break
        if step + 1 == max_new_tokens:
            break
        if use_cache:
            logits_BV = model.forward_cached(token_B[:, None], cache)
        else:
            ids_so_far = torch.cat([ids_BT, torch.stack(columns, 1)], 1)
            mask_so_far = None if mask_BT is None else F.pad(mask_BT, (0, len(columns)),
                                                             value=True)
            logits_BV = _full_forward(model, ids_so_far, mask_so_far)
    return columns[:n_local], logps[:n_local], done_B


def _sharded(model: HybridModel) -> list[tuple[torch.nn.Module, str, Any]]:
    """Every DTensor parameter (module, name, parameter). No DTensor exists before
    ``torch.distributed.tensor`` is imported, and importing it here would cost ~0.5 s."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return []
    return [(m, name, p) for m in model.modules() for name, p in m._parameters.items()
            if isinstance(p, dtensor.DTensor)]


def _no_grad(model: HybridModel):
    """``inference_mode``, but ``no_grad`` for a sharded model: FSDP2 allocates its gathered
    weights' buffers on the first gather and reuses them, and buffers made under inference mode
    could not be written by a later training step."""
    return torch.no_grad() if _sharded(model) else torch.inference_mode()


def _tp_local_shape(p: Any) -> torch.Size:
    """The shape of ``p`` on this tensor-parallel rank: its global shape cut along the ``tp``
    mesh dimension only (torch.chunk semantics, as DTensor splits), whatever else shards it
    (FSDP's dp shards are gathered before any forward)."""
    from torch.distributed.tensor import Shard

    shape = list(p.shape)
    for mesh_dim, (name, placement) in enumerate(zip(p.device_mesh.mesh_dim_names or (),
                                                     p.placements, strict=True)):
        if name == "tp" and isinstance(placement, Shard):
            n, size = shape[placement.dim], p.device_mesh.size(mesh_dim)
            chunk = -(-n // size)
            rank = p.device_mesh.get_local_rank(mesh_dim)
            shape[placement.dim] = max(0, min(chunk, n - rank * chunk))
    return torch.Size(shape)


def _compute_dtype(model: HybridModel) -> torch.dtype:
    """The dtype the forward computes in: a mixed-precision FSDP2 model's compute copies' (its
    weights are fp32 masters), else its weights'."""
    fsdp_state = getattr(model, "_get_fsdp_state", None)
    policy = getattr(fsdp_state(), "_mp_policy", None) if fsdp_state is not None else None
    if policy is not None and policy.param_dtype is not None:
        return policy.param_dtype
    return model.embed.weight.dtype


def new_cache(model: HybridModel, batch: int, max_len: int) -> InferenceCache:
    """``model.new_cache``, on a sharded model too. Each mixer sizes its state from its weights
    (a tensor-parallel rank holds a slice of the heads and caches only those), and outside a
    forward those are DTensors of global shape; while the cache is made, each reads as an
    empty meta tensor of its shape on this tp rank (only shapes are read)."""
    sharded = _sharded(model)
    if not sharded:
        return model.new_cache(batch, max_len)
    device, dtype = model.embed.weight.device, _compute_dtype(model)
    for module, name, p in sharded:
        module.__dict__[name] = torch.empty(_tp_local_shape(p), dtype=p.dtype, device="meta")
    try:
        return model.new_cache(batch, max_len, device=device, dtype=dtype)
    finally:
        for module, name, _ in sharded:
            module.__dict__.pop(name, None)


def _sampled_logp(logits_BV: torch.Tensor, token_B: torch.Tensor, temperature: float,
                  done_B: torch.Tensor) -> torch.Tensor:
    """``log_softmax(z / temperature)[token]`` per row (>= fp32), 0 for finished rows."""
    z_BV = logits_BV.to(torch.promote_types(logits_BV.dtype, torch.float32))
    if temperature > 0:
        z_BV = z_BV / temperature
    logp_B = z_BV.log_softmax(-1).gather(1, token_B[:, None])[:, 0]
    return logp_B.masked_fill(done_B, 0.0)


def _full_forward(model: HybridModel, ids_BT: torch.Tensor,
                  mask_BT: torch.Tensor | None) -> torch.Tensor:
    """Last-position logits of the whole sequence; left padding is an earlier document."""
    doc_ids = None if mask_BT is None else mask_BT.long()
    return model(ids_BT, doc_ids=doc_ids)[:, -1]
