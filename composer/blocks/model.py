"""HybridModel: embedding -> residual layers (one per pattern symbol) -> final norm -> LM head.

Layers live in a ``ModuleDict`` keyed by their global index, so state-dict keys
(``layers.7.mixer.in_proj.weight``) are the same whatever pipeline stage holds the layer.
With ``labels`` the forward returns the mean next-token cross-entropy instead (labels are aligned
with ``input_ids`` and shifted inside, positions labelled ``-100`` are ignored) plus the MoE
load-balancing losses; the head and the loss then run chunk by chunk
(:func:`composer.blocks.loss.linear_cross_entropy`) and the logits are not kept unless
``return_logits=True``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.loss import IGNORE_INDEX, linear_cross_entropy
from composer.blocks.norm import RMSNorm
from composer.config import ModelConfig


def shift_labels(labels_BT: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t + 1; the last position predicts nothing (ignored)."""
    return F.pad(labels_BT[:, 1:], (0, 1), value=IGNORE_INDEX)


@dataclass
class ModelOutput:
    loss: torch.Tensor
    logits: torch.Tensor | None
    """Only with ``return_logits=True`` (and never under tensor parallelism, where the loss does
    not gather them)."""
    aux_loss: torch.Tensor


class HybridModel(nn.Module):
    """Keys: ``embed.weight``, ``layers.{i}.*``, ``final_norm.weight``, ``lm_head.weight``
    (absent when ``tie_embeddings``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        from composer.specs.registry import build_layer  # the registry imports the blocks

        super().__init__()
        self.config = cfg
        # _weight skips nn.Embedding's own init (reset_parameters does ours); on the meta device
        # that init would import torch._dynamo (~1.5 s)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model,
                                  _weight=torch.empty(cfg.vocab_size, cfg.d_model))
        pattern = cfg.parsed
        self.layers = nn.ModuleDict(
            {str(i): build_layer(cfg, i, sym) for i, sym in enumerate(pattern.layers)})
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tp = None  # a TPContext once tensor parallel (composer.parallel.tensor)

    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.config.tie_embeddings else self.lm_head.weight

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        nn.init.normal_(self.embed.weight, 0.0, self.config.init_std, generator=generator)
        if not self.config.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, 0.0, self.config.init_std, generator=generator)
        self.final_norm.reset_parameters()

    def hidden_states(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        x_BTD = self.embed(input_ids_BT)
        if self.config.embedding_multiplier != 1.0:
            x_BTD = x_BTD * self.config.embedding_multiplier
        for layer in self.layers.values():
            x_BTD = layer(x_BTD)
        return self.final_norm(x_BTD)

    def forward(self, input_ids_BT: torch.Tensor, labels_BT: torch.Tensor | None = None,
                return_logits: bool = False) -> torch.Tensor | ModelOutput:
        if self.tp is not None:
            from composer.parallel.tensor import tp_forward

            return tp_forward(self, input_ids_BT, labels_BT)
        h_BTD = self.hidden_states(input_ids_BT)
        if labels_BT is not None and not return_logits:
            # Shift the labels, not the activations: a slice would copy them.
            loss = linear_cross_entropy(h_BTD.flatten(0, 1), self.output_weight(),
                                        shift_labels(labels_BT).flatten(),
                                        scale=1.0 / self.config.logits_scaling)
            aux = self.aux_loss(h_BTD)
            return ModelOutput(loss=loss + aux, logits=None, aux_loss=aux)
        logits_BTV = F.linear(h_BTD, self.output_weight())
        if self.config.logits_scaling != 1.0:
            logits_BTV = logits_BTV / self.config.logits_scaling
        if labels_BT is None:
            return logits_BTV
        math_dtype = torch.promote_types(logits_BTV.dtype, torch.float32)
        loss = F.cross_entropy(logits_BTV.flatten(0, 1).to(math_dtype),
                               shift_labels(labels_BT).flatten(), ignore_index=IGNORE_INDEX)
        aux = self.aux_loss(logits_BTV)
        return ModelOutput(loss=loss + aux, logits=logits_BTV, aux_loss=aux)

    def aux_loss(self, like: torch.Tensor) -> torch.Tensor:
        """Sum of the auxiliary losses the mixers stored during the last forward."""
        total = like.new_zeros((), dtype=torch.float32)
        for layer in self.layers.values():
            aux = getattr(layer.mixer, "aux_loss", None)
            if aux is not None:
                total = total + aux
        return total
