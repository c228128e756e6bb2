"""The record of one layer kind: everything about it, declared in the kind's own block file.

A pattern symbol maps to one :class:`LayerKind` (``composer/build/registry.py`` collects them).
The record names the symbol, the kind, its mixer class and the config section it reads, with that
section's dataclass, validator and defaults; the rest is declared by the mixer class next to its
code and reached through the record, one hop away (:class:`composer.blocks.protocol.Mixer`):

- ``init_rules()``: each parameter's initialisation (``composer/blocks/plan.py``);
- ``parallel_plan()`` and ``layout_rules(cfg)``: how it splits over tensor / expert parallel ranks
  and what must divide by their sizes;
- ``flops_per_token(cfg, seq_len)`` and ``activation_bytes_per_token(cfg, seq_len, ac, size)``
  (what ``composer plan`` models);
- ``init_cache(...)``: its decoding state (a stateful kind) or ``stateless = True``;
- ``ops``: its time-mixing ops, each naming its context-parallel variant
  (``composer/parallel/context/variants.py``);
- :attr:`LayerKind.halo`: the tokens a convolution reads before a chunk (context parallelism's
  shortest chunk).

A user's kind is one file: its section dataclass, its mixer (and ops), and ``composer.register(
LayerKind(...))``; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from composer.blocks.protocol import declared, has_cache, plan_of, time_ops


@dataclass(frozen=True)
class LayerKind:
    symbol: str
    """The pattern character (``M``)."""
    name: str
    """What ``composer build`` calls it (``Mamba-2``)."""
    mixer: type[nn.Module]
    """Built as ``mixer(cfg, layer_idx)``, inside a residual ``Layer``."""
    section: str | None = None
    """The ``ModelConfig`` section it reads (``mamba``), if any (kinds may share one)."""
    config: type | None = None
    """The section's dataclass, when this kind declares the section (None: it reads one that
    another kind declares, or none)."""
    validator: Callable[[Any, Any], None] | None = None
    """``validator(section, cfg)`` raises a one-line :class:`~composer.config.ConfigError`."""
    default: Callable[[int], Any] | None = None
    """The section for a model ``d_model`` wide (None: the dataclass's defaults); a section with
    a default here follows ``d_model`` while it is untouched."""
    always: bool = False
    """The section is present in a new config even when the pattern does not use it (the four
    classic sections, so that ``--set attention.n_heads=8`` works before ``*`` is added)."""
    halo: Callable[[Any], int] | None = None
    """``halo(cfg)``: inputs before a chunk that its convolution reads (``d_conv - 1``); 0 when
    None."""

    @property
    def section_type(self) -> type | None:
        """The dataclass of the section it reads (its own or another kind's)."""
        from composer.config import section_table

        return section_table()[self.section].cls if self.section else None

    def validate(self, cfg: Any) -> None:
        """Check the kind's config section in ``cfg`` (one-line ``ConfigError``)."""
        from composer.config import ConfigError, section_table

        if self.section is None:
            return
        value = cfg.section(self.section)
        if value is None:
            raise ConfigError(f"pattern symbol {self.symbol!r} needs the '{self.section}' "
                              "section, which is None")
        check = section_table()[self.section].validate
        if check is not None:
            check(value, cfg)

    def halo_width(self, cfg: Any) -> int:
        return self.halo(cfg) if self.halo is not None else 0

    def flops_per_token(self, cfg: Any, seq_len: int) -> int:
        return self.mixer.flops_per_token(cfg, seq_len)

    def activation_bytes_per_token(self, cfg: Any, seq_len: int, ac: str, size: int,
                                   tp: int = 1, sequence_parallel: bool = True, cp: int = 1
                                   ) -> float | None:
        """Bytes one layer of this kind keeps for the backward per token of a rank's sequence
        (``seq_len`` tokens: its share under context parallelism) with ``size``-byte
        activations, under activation checkpointing ``ac``, on one of ``tp`` tensor-parallel
        and one of ``cp`` context-parallel ranks; None when the mixer declares no
        ``activation_bytes_per_token`` (``composer plan`` lists it as unknown).

        The layer's own part is on the residual stream, cut over ``tp`` under sequence
        parallel and whole without: with ``ac`` none the pre-norm's input (in at least fp32:
        the norm computes there, so under bf16 an fp32 copy), ``1/rms`` (fp32) and its scaled
        input (``2 d + 1`` in fp32; a sandwich norm on the mixer's output as much again);
        checkpointed (selective or full) its input alone (``d``: the recompute's argument),
        the norms recomputed. The mixer's part (its input gathered
        over the sequence, so per token of the whole share) is what the mixer declares for
        ``ac``, ``tp`` and ``cp``; under ``full`` that is only what its module holds beyond the
        graph (RoPE tables), the rest recomputed."""
        mixer = declared(self.mixer, "activation_bytes_per_token")
        if mixer is None:
            return None
        d = cfg.d_model
        own = float(size * d)
        if ac == "none":  # the norm computes in >= fp32: its input's fp32 copy and 1/rms
            norm = max(size, 4) * d + 4 + size * d
            own = norm * (2 if cfg.sandwich_norm else 1)  # the mixer output's norm alike
        stream = tp if sequence_parallel else 1
        return own / stream + mixer(cfg, seq_len, ac, size, tp, cp)

    def layout_rules(self, cfg: Any) -> list:
        rules = declared(self.mixer, "layout_rules")
        return list(rules(cfg)) if rules is not None else []

    def example(self, cfg: Any) -> nn.Module:
        """The mixer built on the meta device (to read what its instances declare)."""
        with torch.device("meta"):
            return self.mixer(cfg, 0)

    def parallel_plan(self, cfg: Any) -> Any:
        """The plan the mixer declares for ``cfg``, or None."""
        return plan_of(self.example(cfg))

    @property
    def stateless(self) -> bool:
        return bool(declared(self.mixer, "stateless"))

    @property
    def decoding_state(self) -> Callable[..., Any] | None:
        """The mixer's state factory ``init_cache(self, batch, max_len, device, dtype)``."""
        return self.mixer.init_cache if has_cache(self.mixer) else None

    def context_strategy(self, cfg: Any) -> tuple[str, ...] | None:
        """How context parallelism splits it: ``()`` token-wise, the strategy of each
        time-mixing op (``("halo_conv", "state_passing")``), or None (no cp form)."""
        if self.stateless:
            return ()
        ops = time_ops(self.example(cfg))
        if not ops or any(op.context is None for _, op in ops):
            return None
        return tuple(op.context for _, op in ops)


def cp_rows(seq_len: int, cp: int) -> tuple[int, int]:
    """``(rows, row length)`` a rank's ``seq_len`` tokens run as in a recurrent kind's time
    mixing: its two chunks of the 2N-chunk layout side by side under context parallelism
    (:mod:`composer.parallel.context.recurrent`), one row without; for the activation
    models' per-row terms (chunks, padding, states)."""
    rows = 2 if cp > 1 else 1
    return rows, max(seq_len // rows, 1)


KINDS: dict[str, LayerKind] = {}
"""Pattern symbol -> its record, in registration order (built-in kinds first); filled by the
registry (``composer/build/registry.py``), which collects the records from the block files."""


def kinds_of(cfg: Any) -> list[LayerKind]:
    """The kinds ``cfg``'s pattern uses (its MTP parts too), each once, in order."""
    pattern = cfg.parsed
    return [KINDS[s] for s in pattern.symbols_used() if s in KINDS]


def token_declares(token: str, attr: str) -> bool:
    """Whether a mixer of pattern token ``token`` (a symbol, or a parallel group ``[..]`` of
    symbols) declares ``attr`` (:func:`~composer.blocks.protocol.declared`)."""
    symbols = token[1:-1] if token.startswith("[") else token
    return any(declared(KINDS[s].mixer, attr) for s in symbols if s in KINDS)


def halo(cfg: Any) -> tuple[int, str | None]:
    """The widest convolution halo of the kinds ``cfg`` uses, with the kind's section (or
    name): ``(0, None)`` when none convolves over time."""
    widths = [(kind.halo_width(cfg), kind.section or kind.name) for kind in kinds_of(cfg)]
    return max(widths, default=(0, None), key=lambda w: w[0])
