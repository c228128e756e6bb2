"""Which family adapter writes a model: by architecture, or inferred from the config alone.

``to_hf`` of a model without a recorded architecture (one built here) tries every family; when
none fits, :class:`NoFamilyError` names one family's reason, the one the user most likely wants
to fix: the family the model was built as (``origin.json``, or the HF source's architecture),
else the closest family (:func:`closeness`). The other families' reasons ride along in
``others`` (what ``composer convert to-hf --verbose`` prints).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from composer import config
from composer.config import ConfigError, ModelConfig, config_diff
from composer.convert.base import Adapter, without_mtp
from composer.portable import ORIGIN_FILE


class NoFamilyError(ConfigError):
    """No family writes this model exactly. ``str()`` is one short line with the reason of
    ``family`` (recorded or closest); ``others`` holds ``(family, reason)`` for the rest."""

    def __init__(self, family: str, reason: str, recorded: bool,
                 others: list[tuple[str, str]]) -> None:
        which = "the family it was built as" if recorded else "the closest family"
        super().__init__(f"this model cannot be written as {family} ({which}): {reason}; "
                         f"none of the other {len(others)} families fits either")
        self.family, self.reason, self.others = family, reason, others


def adapters() -> list[Adapter]:
    from composer.convert.families import ADAPTERS

    return ADAPTERS


def adapter_for_architecture(arch: str) -> Adapter:
    for adapter in adapters():
        if arch in adapter.architectures:
            return adapter
    supported = sorted(a for ad in adapters() for a in ad.architectures)
    raise ConfigError(f"unsupported architecture {arch!r}; supported: {', '.join(supported)}")


def round_trip_problem(adapter: Adapter, cfg: ModelConfig, base: dict[str, Any]) -> str | None:
    """Why ``cfg`` cannot be written as this family exactly, or None if it can."""
    try:
        back = adapter.config_from_hf(adapter.config_to_hf(cfg, base))
    except ConfigError as exc:
        return str(exc)
    if not cfg.parsed.mtp:  # declared MTP layers without their tensors are not built on import
        back = without_mtp(back)
    if cfg.moe is not None and back.moe is not None:  # no HF field, no change to the forward
        for name in config.MOE_TRAINING_ONLY:
            setattr(back.moe, name, getattr(cfg.moe, name))
    diff = config_diff(cfg.canonical(), back.canonical())
    return f"the HF config would change {diff}" if diff else None


def recorded_family(folder: Path, base: dict[str, Any]) -> str | None:
    """The family a checkpoint was built as: the zoo preset's (``origin.json``, written by
    ``composer build --preset``), else the architecture of its HF source config, if any."""
    path = folder / ORIGIN_FILE
    if path.exists():
        family = json.loads(path.read_text()).get("family")
        if family:
            return family
    for arch in base.get("architectures") or []:
        for adapter in adapters():
            if arch in adapter.architectures:
                return adapter.family
    return None


def closeness(adapter: Adapter, cfg: ModelConfig, problem: str) -> tuple[int, int, int]:
    """A sort key, smallest first: families whose layer kinds cover the model's pattern, then
    those whose refusal is not about the pattern, then those with the fewest kinds the model
    does not use (the family's order in :data:`ADAPTERS` breaks ties)."""
    used = set(cfg.parsed.symbols_used())
    kinds = set(adapter.symbols)
    return (not used <= kinds, "cannot be written as" in problem, len(kinds - used))


def infer_adapter(cfg: ModelConfig, family: str | None = None) -> Adapter:
    """The first family whose config maps to HF and back to exactly ``cfg``; ``family`` (the
    recorded one) is tried first. Raises :class:`NoFamilyError` when none does."""
    reasons: list[tuple[Adapter, str]] = []
    for adapter in sorted(adapters(), key=lambda a: a.family != family):
        problem = round_trip_problem(adapter, cfg, {})
        if problem is None:
            return adapter
        reasons.append((adapter, problem))
    recorded = any(a.family == family for a, _ in reasons)
    if recorded:
        first = reasons[0]
    else:
        order = {a.family: i for i, a in enumerate(adapters())}
        first = min(reasons, key=lambda r: (*closeness(r[0], cfg, r[1]), order[r[0].family]))
    others = [(a.family, why) for a, why in reasons if a is not first[0]]
    raise NoFamilyError(first[0].family, first[1], recorded, others)
