"""The layer kinds' section dataclasses as the presets call them, loaded on first call.

The dataclasses live in their kinds' block files (``composer/blocks/``), which import torch;
listing or looking up presets must not (``composer zoo list`` stays fast), so a preset module
imports these stand-ins, and a preset's ``config()`` gets the real dataclass instances.
"""

from __future__ import annotations

from typing import Any


class _Section:
    """Calls ``composer.config.<name>(...)`` when called."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from composer import config

        return getattr(config, self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.name}, loaded on first call>"


AttentionConfig = _Section("AttentionConfig")
RopeScaling = _Section("RopeScaling")
MambaConfig = _Section("MambaConfig")
MLPConfig = _Section("MLPConfig")
MoEConfig = _Section("MoEConfig")
MLAConfig = _Section("MLAConfig")
YarnScaling = _Section("YarnScaling")
GDNConfig = _Section("GDNConfig")
ShortConvConfig = _Section("ShortConvConfig")
KDAConfig = _Section("KDAConfig")
ParallelConfig = _Section("ParallelConfig")
BranchScale = _Section("BranchScale")
ZambaConfig = _Section("ZambaConfig")
