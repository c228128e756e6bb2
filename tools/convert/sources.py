"""Where a Hugging Face checkpoint comes from: a local folder, or a hub id fetched through
huggingface-hub when a connection exists; and how its tensors are read (safetensors, or a
PyTorch ``.bin`` read with ``torch.load(weights_only=True)``, never unpickled freely)."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import TYPE_CHECKING

from composer.portable import CheckpointError, TensorInfo, TensorSource

if TYPE_CHECKING:
    import torch

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]


def resolve_source(src: str) -> Path:
    """A local folder as is; otherwise a hub repo id, downloaded (or found in the cache)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{src} is a file; give the model folder")
    if not HUB_ID.match(src):
        raise CheckpointError(f"{src}: no such folder (and not a hub id like 'org/name')")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise CheckpointError(f"{src}: no such folder, and huggingface-hub is not installed") \
            from None
    try:
        return Path(snapshot_download(src, allow_patterns=HUB_FILES))
    except Exception as exc:  # offline, unknown repo, gated repo, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{src}: no such local folder, and fetching it from the Hugging "
                              f"Face hub failed (offline or no access?): {first}") from None


class BinSource(TensorSource):
    """Tensors of PyTorch ``.bin`` files, loaded with ``weights_only=True`` (no code runs)."""

    def __init__(self, folder: Path, files: list[Path]) -> None:
        import torch

        from composer.portable import DTYPE_NAMES

        self.folder = folder
        self.tensors = {}
        self._data: dict[str, torch.Tensor] = {}
        for path in files:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise CheckpointError(f"{path.name}: refused: not a plain tensor checkpoint "
                                      f"(loaded with weights_only=True; {first[:160]})") from None
            if not isinstance(state, dict):
                raise CheckpointError(f"{path.name}: expected a dict of tensors")
            for name, t in state.items():
                if not isinstance(t, torch.Tensor):
                    raise CheckpointError(f"{path.name}: entry {name!r} is not a tensor")
                if name in self._data:
                    raise CheckpointError(f"tensor {name!r} appears in two .bin files")
                t = t.contiguous()
                self._data[name] = t
                self.tensors[name] = TensorInfo(name, path, DTYPE_NAMES[t.dtype],
                                                tuple(t.shape), 0, t.numel() * t.element_size())

    def renamed(self, new_names: dict[str, str]) -> BinSource:
        out = super().renamed(new_names)
        out._data = {new_names.get(k, k): v for k, v in self._data.items()}
        return out

    def locate(self, name: str) -> None:
        """Unpickled tensors live in memory, not at a place in a file."""
        return None

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        import torch

        t = self._data[name].reshape(-1).view(torch.uint8)
        out[:] = t[offset:offset + out.nbytes].numpy().tobytes()


def open_source(folder: Path) -> TensorSource:
    if any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").exists():
        return TensorSource(folder)
    index = folder / "pytorch_model.bin.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = []
        for shard in dict.fromkeys(weight_map.values()):
            if not (folder / shard).exists():
                raise CheckpointError(f"{index.name} names shard {shard!r}, which is missing")
            files.append(folder / shard)
        return BinSource(folder, files)
    bins = sorted(folder.glob("*.bin"))
    if bins:
        return BinSource(folder, bins)
    raise CheckpointError(f"{folder}: no *.safetensors or *.bin weights")
