"""HybridModel: embedding -> residual layers (one per pattern symbol) -> final norm -> LM head.

The builder (``composer/build/builder.py``) builds the layers from the registry and hands them
over; this module never looks a symbol up. Layers live in a ``ModuleDict`` keyed by their global
index, so state-dict keys (``layers.7.mixer.in_proj.weight``) are the same whatever pipeline stage
holds the layer. With ``labels`` the forward returns the mean next-token cross-entropy instead
(labels are aligned with ``input_ids`` and shifted inside, positions labelled ``-100`` are
ignored) plus the MoE load-balancing losses; the head and the loss then run chunk by chunk
(:func:`composer.blocks.loss.linear_cross_entropy`) and the logits are not kept unless
``return_logits=True``. The readout (head + loss) is its own parameterless module so that the
vocabulary-parallel version can stand in for it (``composer/parallel/tensor.py``).

Packed documents (``doc_ids``, ``(B, T)``, :mod:`composer.kernels.packing`): every token sees only
the earlier tokens of its own document (attention masks, RoPE positions, the Mamba-2 convolution
and state restart: each document gives what it gives alone), and nothing is predicted across a
boundary: the label of each document's first token, the target of the previous document's last
position, is ignored here, so any readout (the vocabulary-parallel one too) gets masked labels.

Multi-token prediction (the pattern's ``/`` parts, :mod:`composer.blocks.mtp`): with labels,
``mtp.{d}.*`` run after the trunk on its normalised output, with this model's embedding and head,
and ``ModelOutput.loss = ce + aux_loss + mtp_loss`` (``ce``: the main next-token cross-entropy,
``aux_loss``: the MoE load-balancing losses of every layer, MTP layers included, ``mtp_loss``:
``(w / D) * sum_k ce_k``). Without labels, and in decoding, the MTP modules never run.

Scoring (:mod:`composer.blocks.logprobs`): ``token_logprobs`` gives each position's log-probability
(and entropy) of a given next-token target, the head run chunk by chunk as for the loss; what
preference optimisation and RL objectives need. :func:`completion_targets` builds the targets that
score only a completion.

Decoding (:mod:`composer.blocks.cache`, :func:`composer.generate`): ``new_cache`` allocates each
layer's state, ``forward_cached`` runs new tokens against it and returns their logits.

Vision-language models (``ModelConfig.vision``; Qwen3.5-VL): ``visual`` is the vision tower
(:class:`composer.vision.tower.VisionTower`, built by the builder and handed over like the
layers). With ``pixel_values`` and ``image_grid_thw`` the tower's features replace the
embeddings of the ``<|image_pad|>`` placeholders, image after image (the count must match: a
one-line error otherwise), and with ``attention.mrope_section`` the attention layers rotate by
the three M-RoPE position rows (:mod:`composer.blocks.mrope`), computed once per forward and
passed down the layers' calls (``positions``; so activation checkpointing recomputes with
them); a decoding cache keeps each row's offset for the tokens after the prompt. Packed
documents (``doc_ids``) count their positions from 0 each. Without images the model is the text
model it was (1-D RoPE).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.cache import InferenceCache, Step
from composer.blocks.logprobs import TokenLogprobs, linear_token_logprobs, logits_scale
from composer.blocks.loss import IGNORE_INDEX, linear_cross_entropy
from composer.blocks.mtp import MTPDepth, MultiTokenPrediction
from composer.blocks.norm import RMSNorm
from composer.blocks.plan import Init, Normal
from composer.blocks.protocol import declared, has_cache
from composer.blocks.vlm import VisionInputs
from composer.config import ModelConfig
from composer.kernels.linear import Linear
from composer.kernels.packing import doc_starts


def shift_labels(labels_BT: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t + 1; the last position predicts nothing (ignored)."""
    return F.pad(labels_BT[:, 1:], (0, 1), value=IGNORE_INDEX)


def mask_doc_boundaries(labels_BT: torch.Tensor, doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """Unshifted labels with each document's first label ignored: after the shift it would be
    the target of the previous document's last token."""
    return labels_BT.masked_fill(doc_starts(doc_ids_BT), IGNORE_INDEX)


def completion_targets(ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Next-token targets that score only the tokens ``mask`` marks (1: a completion token):
    ``targets[:, t] = ids[:, t + 1]`` where ``mask[:, t + 1]``, else ``IGNORE_INDEX``; the last
    column predicts nothing."""
    if mask_BT.shape != ids_BT.shape:
        raise ValueError(f"mask must be shaped like ids {tuple(ids_BT.shape)}, got "
                         f"{tuple(mask_BT.shape)}")
    return shift_labels(ids_BT.masked_fill(~mask_BT.bool(), IGNORE_INDEX))


@dataclass
class ModelOutput:
    """``loss = ce + aux_loss + mtp_loss``, ``ce`` being the main next-token cross-entropy
    (``loss - aux_loss - mtp_loss``)."""

    loss: torch.Tensor
    logits: torch.Tensor | None
    """Only with ``return_logits=True``."""
    aux_loss: torch.Tensor
    """Sum of the MoE load-balancing losses (MTP layers' too), already weighted."""
    mtp_loss: torch.Tensor | None = None
    """The weighted multi-token-prediction term ``(w / D) * sum_k ce_k``; always a tensor once
    built (zero without MTP parts)."""
    mtp_losses: tuple[torch.Tensor, ...] = ()
    """Each depth's unweighted mean cross-entropy ``ce_k`` (detached; NaN for a depth without a
    target)."""

    def __post_init__(self) -> None:
        if self.mtp_loss is None:
            self.mtp_loss = torch.zeros_like(self.aux_loss)


class Readout(nn.Module):
    """Logits, or the next-token loss, from the final hidden states and the output weight."""

    def __init__(self, logits_scaling: float = 1.0) -> None:
        super().__init__()
        self.logits_scaling = logits_scaling

    def forward(self, h_BTD: torch.Tensor, weight_VD: torch.Tensor,
                labels_BT: torch.Tensor | None = None, return_logits: bool = False, *,
                targets_BT: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(loss, logits)``: the loss when labels (or ``targets``, labels already shifted:
        position t's target) are given, the logits when none are or when ``return_logits``."""
        if targets_BT is None and labels_BT is not None:
            # Shift the labels, not the activations: a slice would copy them.
            targets_BT = shift_labels(labels_BT)
        if targets_BT is not None and not return_logits:
            loss = linear_cross_entropy(h_BTD.flatten(0, 1), weight_VD, targets_BT.flatten(),
                                        scale=1.0 / self.logits_scaling)
            return loss, None
        logits_BTV = F.linear(h_BTD, weight_VD)
        if self.logits_scaling != 1.0:
            logits_BTV = logits_BTV / self.logits_scaling
        if targets_BT is None:
            return None, logits_BTV
        math_dtype = torch.promote_types(logits_BTV.dtype, torch.float32)
        loss = F.cross_entropy(logits_BTV.flatten(0, 1).to(math_dtype), targets_BT.flatten(),
                               ignore_index=IGNORE_INDEX)
        return loss, logits_BTV

    def token_logprobs(self, h_BTD: torch.Tensor, weight_VD: torch.Tensor,
                       targets_BT: torch.Tensor, temperature: float = 1.0,
                       entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logp, entropy | None)``, each ``(B, T)``, of ``targets`` under
        ``softmax(logits / temperature)`` (:func:`composer.blocks.logprobs.linear_token_logprobs`:
        chunked, never the whole logits)."""
        return linear_token_logprobs(h_BTD, weight_VD, targets_BT,
                                     logits_scale(self.logits_scaling, temperature), entropy)


def embed_tokens(embed: nn.Module, cfg: ModelConfig, input_ids: torch.Tensor) -> torch.Tensor:
    """The embedding of ``input_ids`` (``(B, T)``), times ``embedding_multiplier`` (the model's
    and a pipeline stage's input)."""
    x_BTD = embed(input_ids)
    if cfg.embedding_multiplier != 1.0 and cfg.embedding_multiplier_in_dtype:
        x_BTD = x_BTD * torch.tensor(cfg.embedding_multiplier, dtype=x_BTD.dtype)
    elif cfg.embedding_multiplier != 1.0:
        x_BTD = x_BTD * cfg.embedding_multiplier
    return x_BTD


def named_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every residual block of a :class:`HybridModel` (or of a module holding its ``layers`` and
    ``mtp``: a pipeline stage) with its state-dict prefix, in the order they run: the main layers
    (``layers.{i}``), then each MTP depth's (``mtp.{d}.layers.{j}``)."""
    out = [(f"layers.{key}", layer) for key, layer in module.layers.items()]
    for d, depth in enumerate(getattr(module, "mtp", None) or ()):
        out += [(f"mtp.{d}.layers.{j}", layer) for j, layer in depth.layers.items()]
    return out


def _set_zero_centered(model: nn.Module, flag: bool) -> None:
    """Apply ``ModelConfig.norm_zero_centered`` to every RMSNorm (layer, final and qk-norms)."""
    for module in model.modules():
        if isinstance(module, RMSNorm) and module.zero_centered != flag:
            module.zero_centered = flag
            with torch.no_grad():
                module.reset_parameters()


def _check_doc_ids(input_ids: torch.Tensor, doc_ids: torch.Tensor | None) -> None:
    if doc_ids is not None and (doc_ids.shape != input_ids.shape or doc_ids.is_floating_point()):
        raise ValueError(f"doc_ids must be integers shaped like input_ids "
                         f"{tuple(input_ids.shape)}, got {doc_ids.dtype} {tuple(doc_ids.shape)}")


class HybridModel(VisionInputs, nn.Module):
    """Keys: ``embed.weight``, ``layers.{i}.*``, ``final_norm.weight``, ``lm_head.weight``
    (absent when ``tie_embeddings``), ``mtp.{d}.*`` (with MTP parts; :mod:`composer.blocks.mtp`),
    ``visual.*`` (a vision-language model's tower: ``ModelConfig.vision``), ``shared.{a}.*``
    (the pattern's shared layers, once each: :mod:`composer.blocks.shared`).
    """

    def __init__(self, cfg: ModelConfig, layers: Mapping[int, nn.Module],
                 mtp_layers: Sequence[Mapping[int, nn.Module]] = (),
                 visual: nn.Module | None = None,
                 shared: Mapping[str, nn.Module] | None = None) -> None:
        super().__init__()
        self.config = cfg
        # _weight skips nn.Embedding's own init (the builder initialises); on the meta device
        # that init would import torch._dynamo (~1.5 s)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model,
                                  _weight=torch.empty(cfg.vocab_size, cfg.d_model))
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.shared = nn.ModuleDict(shared) if shared else None
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.mtp = MultiTokenPrediction(cfg, [MTPDepth(cfg, part) for part in mtp_layers]) \
            if mtp_layers else None
        _set_zero_centered(self, cfg.norm_zero_centered)
        self.readout = Readout(cfg.logits_scaling)
        if visual is not None:
            self.visual = visual  # after the norms: the tower's LayerNorms are not RMSNorms
        elif cfg.vision is not None:
            raise ValueError("the config has a vision section: give the tower (visual=...)")

    def named_layers(self) -> list[tuple[str, nn.Module]]:
        return named_layers(self)

    def all_layers(self) -> list[nn.Module]:
        return [layer for _, layer in named_layers(self)]

    def init_rules(self) -> dict[str, Init]:
        return {"embed.weight": Normal(self.config.init_std),
                "lm_head.weight": Normal(self.config.init_std)}

    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.config.tie_embeddings else self.lm_head.weight

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_tokens(self.embed, self.config, input_ids)

    def run_layers(self, x_BTD: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                   keys: Sequence[str] | None = None,
                   after: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
                   positions: torch.Tensor | None = None,
                   embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream through the layers ``keys`` (default: all, in order);
        ``after(layer, x)`` sees each layer's output (a pipeline stage attaches its aux loss);
        ``positions``: M-RoPE rows ``[3, B, T]`` for the attention layers (images);
        ``embeddings``: the input embeddings, for the mixers that read them
        (``uses_embeddings``)."""
        kwargs = {} if doc_ids is None else {"doc_ids": doc_ids}
        if positions is not None:
            kwargs["positions"] = positions
        if embeddings is not None:
            kwargs["embeddings"] = embeddings
        for key in self.layers.keys() if keys is None else keys:
            layer = self.layers[key]
            x_BTD = layer(x_BTD, **kwargs)
            if after is not None:
                x_BTD = after(layer, x_BTD)
        return x_BTD

    def hidden_states(self, input_ids: torch.Tensor, *,
                      doc_ids: torch.Tensor | None = None,
                      pixel_values: torch.Tensor | None = None,
                      image_grid_thw: torch.Tensor | None = None,
                      tower_stand_in: bool = False) -> torch.Tensor:
        """The final norm's output ``(B, T, D)``: the layers over the embedded inputs (with
        the images' features and M-RoPE positions; :meth:`forward`)."""
        x_BTD = self.embed_inputs(input_ids, pixel_values, image_grid_thw)
        if pixel_values is None and tower_stand_in:
            x_BTD = x_BTD + self.tower_stand_in(x_BTD.dtype)
        mrope = self.mrope_inputs(input_ids, image_grid_thw, doc_ids=doc_ids)
        return self.final_norm(self.run_layers(x_BTD, doc_ids=doc_ids,
                                               positions=None if mrope is None else mrope[0],
                                               embeddings=x_BTD))

    @staticmethod
    def targets_for(labels: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        """Each position's next-token target: the labels shifted, masked at document starts."""
        return shift_labels(labels if doc_ids is None else mask_doc_boundaries(labels, doc_ids))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                doc_ids: torch.Tensor | None = None, return_logits: bool = False,
                targets: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None,
                tower_stand_in: bool = False) -> torch.Tensor | ModelOutput:
        """Logits ``(B, T, vocab)`` for ``input_ids`` ``(B, T)``; with ``labels`` (``(B, T)``,
        aligned with the inputs) a :class:`ModelOutput`. ``doc_ids`` (``(B, T)`` integers, equal
        within a document, non-decreasing along a row) isolates packed documents.

        ``targets`` instead of ``labels``: each position's next-token target, already shifted
        and masked at document boundaries (context parallelism gives each rank chunks of the
        sequence, so a chunk's last target is the first token of another rank's chunk). Multi-
        token prediction, whose shifted inputs need the whole rows, then needs an MTP module
        that reads them elsewhere (``mtp.rows.reads_whole_rows``: context parallelism's).

        ``pixel_values`` ``[N, C*Tp*P*P]`` and ``image_grid_thw`` ``[n, 3]`` (from
        :func:`composer.vision.preprocess.preprocess_images`): the images of the prompts'
        placeholder runs, in order (a vision-language model); with ``doc_ids`` each packed
        document's M-RoPE positions count from 0. ``tower_stand_in``: without images, the tower
        still takes part in the backward (:meth:`tower_stand_in`; training batches of data
        that has images)."""
        if targets is not None and labels is not None:
            raise ValueError("give labels or targets, not both")
        if targets is not None and self.mtp is not None and not self.mtp.rows.reads_whole_rows:
            raise ValueError("targets cannot drive multi-token prediction (it shifts the labels "
                             "itself); give labels")
        _check_doc_ids(input_ids, doc_ids)
        h_BTD = self.hidden_states(input_ids, doc_ids=doc_ids, pixel_values=pixel_values,
                                   image_grid_thw=image_grid_thw, tower_stand_in=tower_stand_in)
        if labels is not None:
            targets = self.targets_for(labels, doc_ids)
        loss, logits = self.readout(h_BTD, self.output_weight(), None, return_logits,
                                    targets_BT=targets)
        if targets is None:
            return logits
        mtp, mtp_losses = self.mtp_loss(h_BTD, input_ids, labels, doc_ids=doc_ids)
        aux = self.aux_loss(loss)  # after the MTP depths: their MoE layers count too
        return ModelOutput(loss=loss + aux + mtp, logits=logits, aux_loss=aux, mtp_loss=mtp,
                           mtp_losses=mtp_losses)

    def token_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor, *,
                       doc_ids: torch.Tensor | None = None, temperature: float = 1.0,
                       entropy: bool = False, pixel_values: torch.Tensor | None = None,
                       image_grid_thw: torch.Tensor | None = None) -> TokenLogprobs:
        """Each position's log-probability of its next-token target under
        ``softmax(logits / temperature)`` (temperature 0: the logits' own, as greedy decoding
        reports it), and with ``entropy`` the distribution's entropy; 0 where the target is
        ``IGNORE_INDEX``. ``targets`` ``(B, T)`` is already shifted (position t's target:
        :func:`completion_targets`); ``doc_ids`` isolates documents as in ``forward`` (a target
        across a boundary is the caller's to ignore). The trunk runs once; multi-token
        prediction does not. The head runs chunk by chunk, its backward recomputing each chunk
        (:mod:`composer.blocks.logprobs`); the readout owns the math so that the vocabulary-
        parallel one can stand in. Images as in ``forward``."""
        _check_doc_ids(input_ids, doc_ids)
        if targets.shape != input_ids.shape or targets.is_floating_point():
            raise ValueError(f"targets must be integers shaped like input_ids "
                             f"{tuple(input_ids.shape)}, got {targets.dtype} "
                             f"{tuple(targets.shape)}")
        bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= self.config.vocab_size))
        if bool(bad.any()):
            raise ValueError(f"target {int(targets[bad][0])} is outside the vocabulary "
                             f"[0, {self.config.vocab_size}) (IGNORE_INDEX is {IGNORE_INDEX})")
        h_BTD = self.hidden_states(input_ids, doc_ids=doc_ids, pixel_values=pixel_values,
                                   image_grid_thw=image_grid_thw)
        logp, ent = self.readout.token_logprobs(h_BTD, self.output_weight(), targets,
                                                temperature, entropy)
        return TokenLogprobs(logp, ent, self.aux_loss(logp))

    def mtp_loss(self, h_BTD: torch.Tensor, input_ids: torch.Tensor,
                 labels: torch.Tensor | None, *,
                 doc_ids: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The weighted MTP term and each depth's cross-entropy from the trunk's normalised
        output ``h_BTD`` (:mod:`composer.blocks.mtp`); zero and ``()`` without MTP parts."""
        if self.mtp is None:
            return h_BTD.new_zeros((), dtype=torch.float32), ()
        return self.mtp(h_BTD, input_ids, labels, embed=self.embed_tokens, readout=self.readout,
                        weight_VD=self.output_weight(), doc_ids=doc_ids)

    def new_cache(self, batch: int, max_len: int, device: torch.device | None = None,
                  dtype: torch.dtype | None = None) -> InferenceCache:
        """An empty :class:`~composer.blocks.cache.InferenceCache` for ``batch`` sequences of up
        to ``max_len`` tokens (prompt + new), on the model's device and in its dtype by
        default. Every mixer must have a cache (``init_cache``) or be ``stateless``."""
        device = device if device is not None else self.embed.weight.device
        dtype = dtype if dtype is not None else self.embed.weight.dtype
        states = {}
        for key, layer in self.layers.items():
            mixer = layer.mixer
            if has_cache(mixer):
                states[int(key)] = mixer.init_cache(batch, max_len, device, dtype)
            elif not declared(mixer, "stateless"):
                raise ValueError(f"layer {key} ({layer.symbol!r}, {type(mixer).__name__}) has no "
                                 "inference cache (init_cache) and is not marked stateless; "
                                 "generate with use_cache=False")
        real_BS = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        return InferenceCache(batch, max_len, states, real_BS)

    def forward_cached(self, input_ids: torch.Tensor, cache: InferenceCache, *,
                       attention_mask: torch.Tensor | None = None,
                       last_only: bool = True, pixel_values: torch.Tensor | None = None,
                       image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``input_ids`` ``(B, T)`` continuing the sequences in ``cache`` (which it
        fills): ``(B, vocab)`` for the last position, or ``(B, T, vocab)`` without
        ``last_only``. ``attention_mask`` (first call only): left padding, 0 for padding.
        Images (``pixel_values``, ``image_grid_thw``) go with the first call (the prompt); the
        cache then keeps the M-RoPE offsets for every later call."""
        images = pixel_values is not None or image_grid_thw is not None
        if images and cache.length:
            raise ValueError("images go with the first call (the prompt), not a later step")
        mrope = self.mrope_inputs(input_ids, image_grid_thw, attention_mask) if images else None
        ctx = cache.advance(input_ids.shape[1], attention_mask)
        if mrope is not None:
            ctx.pos_3BT, cache.rope_deltas_B1 = mrope
        x_BTD = e_BTD = self.embed_inputs(input_ids, pixel_values, image_grid_thw)
        for key, layer in self.layers.items():
            state = cache.layers.get(int(key))
            x_BTD = layer(x_BTD, step=None if state is None else Step(state, ctx),
                          embeddings=e_BTD)
        if last_only:
            x_BTD = x_BTD[:, -1:]
        _, logits = self.readout(self.final_norm(x_BTD), self.output_weight())
        return logits[:, -1] if last_only else logits

    def aux_loss(self, like: torch.Tensor) -> torch.Tensor:
        """Sum of the auxiliary losses the mixers stored during the last forward (the MTP
        depths' layers included)."""
        total = like.new_zeros((), dtype=torch.float32)
        for layer in self.all_layers():
            aux = declared(layer.mixer, "aux_loss")
            if aux is not None:
                total = total + aux
        return total
