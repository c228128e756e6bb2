"""LoRA adapters both ways between ours and a PEFT adapter folder, through each family's links.

Ours: for an adapted projection ``<base>`` (its weight ``<base>.weight`` ``[out, in]``, fused
in the state dict like Mamba-2's ``in_proj``), ``<base>.lora.A.weight`` ``[r, in]`` and
``<base>.lora.B.weight`` ``[out, r]`` and a scaling ``s`` (``alpha / r``, per module):
``y = W x + s B A x``. PEFT's: ``base_model.model.<hf module>.lora_A.weight`` ``[r, in]`` and
``.lora_B.weight`` ``[out, r]`` with ``lora_alpha / r`` (``rank_pattern``, ``alpha_pattern``).

The family's :class:`~composer.convert.plan.Link` plan says which rows of which HF weight each row
block of our weight is. Since ``W x`` and ``B A x`` are split by the same output rows, an
adapter follows its weight: on export A is copied to each HF module our module feeds and B is
split by the links' rows; one HF module assembled from several of ours (Granite's shared
``input_linear`` from our gate and up projections) gets their A's stacked (rank the sum) and
their B's placed block-diagonally (each block scaled by its module's scaling over the HF
module's; Qwen3-Next's ``in_proj_qkvz`` from four of ours, interleaved by head group). Import
is the inverse: our module fed by several HF modules whose A's are equal (what the export writes)
keeps the rank; with different A's it gets the stacked A and block-diagonal B; several of ours
fed by one HF module each get its A (so a stacked export comes back with the summed rank and
zero blocks in B: the same update). All exact. Rows of an HF (or our) weight fed by a module
without an adapter get zero B rows. Nemotron-H's HF modules are named as transformers 5 builds
them in memory (``model.``, not the checkpoint's ``backbone.``): what PEFT's keys use.

Only row links can be followed (a column permutation, or a routed expert's slice of a 3-D
tensor, is refused in one line); routed-expert adapters (their 3-D weights: PEFT's
``target_parameters``, not written here) are refused in one line and written by ``--merge``.
Strict like the converters: every PEFT tensor consumed, every shape the config's, PEFT options
that change the forward refused by name.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from composer.config import ConfigError, ModelConfig
from composer.convert.base import Adapter
from composer.convert.plan import Link, assembled_shape, part
from composer.portable import CheckpointError, atomic_folder

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."
A_SUFFIX, B_SUFFIX = ".lora.A.weight", ".lora.B.weight"
IN_MEMORY = {"nemotron-h": ("backbone.", "model.")}
"""Canonical (link) HF prefix -> the prefix of the module names transformers 5 builds in memory,
which PEFT's keys and ``target_modules`` use (Nemotron-H's ``backbone.`` is ``model.``)."""
REFUSED = {"use_dora": "DoRA", "use_rslora": "rank-stabilised scaling",
           "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)", "lora_bias": "LoRA biases",
           "modules_to_save": "modules_to_save", "target_parameters": "target_parameters",
           "trainable_token_indices": "trainable tokens", "layer_replication":
           "layer replication", "use_qalora": "QA-LoRA", "alora_invocation_tokens": "aLoRA",
           "megatron_config": "Megatron layers"}
"""PEFT LoRA options that change the forward away from ``W x + (alpha/r) B A x``."""
EXPERT_ADAPTER = re.compile(r"(.+)\.lora\.([^.]+)\.[AB]")
"""A routed-expert adapter's tensor (``composer/lora.py``: ``<experts>.lora.<weight>.A``)."""
PEFT_MAMBA_TYPES = {"mamba", "mamba2", "falcon_mamba", "nemotron_h", "falcon_h1"}
PEFT_MAMBA_REFUSED = ("out_proj", "conv1d")
"""peft 0.21 refuses LoRA on these modules of these model types (transformers' fused Mamba
kernels read their weights directly); an export that has them is refused here, up front."""


@dataclass
class LoRATensors:
    """Our adapter as plain tensors: ``<base>.lora.A.weight`` / ``.lora.B.weight`` and each
    base's scaling (``alpha / r``)."""

    tensors: dict[str, torch.Tensor]
    scalings: dict[str, float] = field(default_factory=dict)

    def bases(self) -> list[str]:
        return [k.removesuffix(A_SUFFIX) for k in self.tensors if k.endswith(A_SUFFIX)]

    def a(self, base: str) -> torch.Tensor:
        return self.tensors[base + A_SUFFIX]

    def b(self, base: str) -> torch.Tensor:
        return self.tensors[base + B_SUFFIX]

    def ranks(self) -> dict[str, int]:
        return {base: self.a(base).shape[0] for base in self.bases()}


@dataclass(frozen=True)
class _Rows:
    """Rows ``ours`` of our weight of module ``base`` are rows ``hf`` of HF module ``module``."""

    base: str
    module: str
    ours: tuple[int, int]
    hf: tuple[int, int]


def _module(hf_weight: str) -> str:
    return hf_weight.removesuffix(".weight")


def _rows(link: Link, our_shapes: dict[str, tuple[int, ...]],
          hf_shapes: dict[str, tuple[int, ...]]) -> _Rows:
    """The row correspondence of one link of a 2-D weight, or a one-line refusal."""
    base = link.ours.removesuffix(".weight")
    ours_shape, hf_shape = our_shapes[link.ours], hf_shapes[link.hf]
    for idx, shape in ((link.ours_idx, ours_shape), (link.hf_idx, hf_shape)):
        if len(shape) != 2 or not (idx == () or (len(idx) == 1 and not isinstance(idx[0], int))):
            what = "a routed expert's slice" if len(shape) != 2 else "columns, not rows"
            raise ConfigError(f"{base}: its converter maps {link.ours} to {link.hf} by {what}; "
                              "a LoRA adapter on it cannot be a PEFT module (use --merge)")
    ours = link.ours_idx[0] if link.ours_idx else (0, ours_shape[0])
    hf = link.hf_idx[0] if link.hf_idx else (0, hf_shape[0])
    return _Rows(base, _module(link.hf), tuple(ours), tuple(hf))


@dataclass
class LinkMap:
    """The links of one model indexed both ways, the shapes on both sides, and the in-memory
    naming of HF modules."""

    by_ours: dict[str, list[Link]]
    by_hf: dict[str, list[Link]]
    our_shapes: dict[str, tuple[int, ...]]
    hf_shapes: dict[str, tuple[int, ...]]
    family: str
    model_type: str = ""

    def to_memory(self, module: str) -> str:
        old, new = IN_MEMORY.get(self.family, ("", ""))
        return new + module.removeprefix(old) if old and module.startswith(old) else module

    def of_base(self, base: str) -> list[_Rows]:
        """The row maps of our module ``base`` (a one-line error if it has none)."""
        links = self.by_ours.get(base + ".weight")
        if not links:
            raise ConfigError(f"{base}: no Hugging Face weight is made from {base}.weight; "
                              "its adapter cannot be a PEFT module (use --merge)")
        return [_rows(link, self.our_shapes, self.hf_shapes) for link in links]

    def of_module(self, module: str) -> list[_Rows]:
        """The row maps into HF module ``module`` (canonical name)."""
        links = self.by_hf.get(module + ".weight")
        if not links:
            raise CheckpointError(f"unknown module {module!r}: no such weight in this "
                                  f"{self.family} model")
        return [_rows(link, self.our_shapes, self.hf_shapes) for link in links]


def link_map(adapter: Adapter, cfg: ModelConfig, fused_experts: bool = False,
             layout: dict[str, Any] | None = None) -> LinkMap:
    """The family's links for ``cfg`` (with the source's expert layout and on-disk split, as
    recorded in ``conversion.json``) and the shapes on both sides, from a meta model."""
    from composer.build.builder import build_model

    links = adapter.relink(adapter.links(cfg, fused_experts=fused_experts), layout or {})
    meta = build_model(cfg, device="meta")
    our_shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    parts: dict[str, list] = {}
    by_ours: dict[str, list[Link]] = {}
    by_hf: dict[str, list[Link]] = {}
    for link in links:
        _, shape = part(our_shapes[link.ours], link.ours_idx, link.ours)
        parts.setdefault(link.hf, []).append((link.hf_idx, shape))
        by_ours.setdefault(link.ours, []).append(link)
        by_hf.setdefault(link.hf, []).append(link)
    hf_shapes = {name: assembled_shape(p) for name, p in parts.items()}
    return LinkMap(by_ours, by_hf, our_shapes, hf_shapes, adapter.family, adapter.model_type)


# ---------------------------------------------------------------- ours -> PEFT


@dataclass
class HFModule:
    """One HF module's adapter: ``A [r, in]``, ``B [out, r]``, scaling ``alpha / r``."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def alpha(self) -> float:
        alpha = self.scaling * self.rank
        return int(round(alpha)) if abs(alpha - round(alpha)) < 1e-9 * max(1.0, alpha) else alpha


def _check_ours(lmap: LinkMap, lora: LoRATensors) -> None:
    """Every key is an A or a B of a module with both; shapes are the config's."""
    for key in lora.tensors:
        expert = EXPERT_ADAPTER.fullmatch(key)
        if expert:
            raise ConfigError(f"{expert[1]}.{expert[2]}: routed-expert LoRA (on the 3-D "
                              "expert weights) is not exported to PEFT: PEFT adapts those "
                              "through target_parameters, which this export does not write; "
                              "export with --merge")
        if not key.endswith((A_SUFFIX, B_SUFFIX)):
            raise ConfigError(f"adapter tensor {key!r} is not a LoRA A or B of a projection "
                              "(ours are <base>.lora.A.weight / .lora.B.weight)")
        base = key.removesuffix(A_SUFFIX).removesuffix(B_SUFFIX)
        if base + A_SUFFIX not in lora.tensors or base + B_SUFFIX not in lora.tensors:
            raise ConfigError(f"{base}: the adapter has only one of lora.A and lora.B")
        if base not in lora.scalings:
            raise ConfigError(f"{base}: no scaling given for its adapter")
    for base in lora.bases():
        shape = lmap.our_shapes.get(base + ".weight")
        a, b = lora.a(base), lora.b(base)
        if shape is None or len(shape) != 2:
            raise ConfigError(f"{base}: not a projection of this model")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or \
                (b.shape[0], a.shape[1]) != shape:
            raise ConfigError(f"{base}: lora.A {list(a.shape)} and lora.B {list(b.shape)} do not "
                              f"adapt its weight {list(shape)}")


def to_peft(lmap: LinkMap, lora: LoRATensors) -> dict[str, HFModule]:
    """Our adapters as HF modules' adapters (canonical HF module names), in link order."""
    _check_ours(lmap, lora)
    feeders: dict[str, list[_Rows]] = {}
    for base in lora.bases():
        for rows in lmap.of_base(base):
            feeders.setdefault(rows.module, []).append(rows)
    out = {}
    for module, rows in feeders.items():
        bases = list(dict.fromkeys(r.base for r in rows))
        scaling = lora.scalings[bases[0]]
        a = torch.cat([lora.a(base) for base in bases])
        b = torch.zeros(lmap.hf_shapes[module + ".weight"][0], a.shape[0], dtype=a.dtype)
        offset = {}
        for base in bases:
            offset[base] = sum(lora.a(x).shape[0] for x in bases[:bases.index(base)])
        for r in rows:  # a module alone keeps its scale exactly; a stacked one is rescaled
            block = lora.b(r.base)[r.ours[0]:r.ours[1]]
            if lora.scalings[r.base] != scaling:
                block = block * (lora.scalings[r.base] / scaling)
            rank = lora.a(r.base).shape[0]
            b[r.hf[0]:r.hf[1], offset[r.base]:offset[r.base] + rank] = block
        out[module] = HFModule(a, b, scaling)
    for module in out:
        if lmap.model_type in PEFT_MAMBA_TYPES and module.endswith(PEFT_MAMBA_REFUSED):
            raise ConfigError(f"{module}: peft refuses LoRA on a Mamba mixer's "
                              f"{module.rsplit('.', 1)[-1]} in {lmap.model_type} models; "
                              "export with --merge instead (or train without that target)")
    return out


def _target_modules(lmap: LinkMap, modules: list[str]) -> list[str]:
    """Short names (``q_proj``) where every HF module of that name is adapted, else full
    paths; in-memory names either way."""
    names = [lmap.to_memory(m) for m in modules]
    everywhere = [lmap.to_memory(_module(w)) for w in lmap.by_hf if w.endswith(".weight")]
    short = {n.rsplit(".", 1)[-1] for n in names}
    covered = {s for s in short
               if {m for m in everywhere if m.rsplit(".", 1)[-1] == s} ==
               {m for m in names if m.rsplit(".", 1)[-1] == s}}
    out = sorted(covered) + sorted(n for n in names if n.rsplit(".", 1)[-1] not in covered)
    return out


def peft_config(lmap: LinkMap, modules: dict[str, HFModule], base_model: str | None,
                dropout: float = 0.0) -> dict[str, Any]:
    """``adapter_config.json``: the most common rank and alpha, the others by pattern."""
    r = Counter(m.rank for m in modules.values()).most_common(1)[0][0]
    alpha = Counter(m.alpha for m in modules.values()).most_common(1)[0][0]
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": r, "lora_alpha": alpha, "lora_dropout": dropout, "bias": "none",
        "target_modules": _target_modules(lmap, list(modules)),
        "rank_pattern": {lmap.to_memory(k): m.rank for k, m in modules.items() if m.rank != r},
        "alpha_pattern": {lmap.to_memory(k): m.alpha for k, m in modules.items()
                          if m.alpha != alpha},
        "fan_in_fan_out": False, "use_dora": False, "use_rslora": False,
        "modules_to_save": None, "inference_mode": True, "init_lora_weights": True,
    }


def write_peft(out: str | Path, lmap: LinkMap, lora: LoRATensors, base_model: str | None,
               force: bool = False, dtype: torch.dtype | None = None,
               dropout: float = 0.0) -> Path:
    """Write ``lora`` as a PEFT adapter folder at ``out`` (temporary folder renamed into place)."""
    modules = to_peft(lmap, lora)
    if not modules:
        raise ConfigError("the model has no LoRA adapters to export")
    tensors = {}
    for module, m in modules.items():
        key = PREFIX + lmap.to_memory(module)
        for name, t in ((".lora_A.weight", m.a), (".lora_B.weight", m.b)):
            t = t.detach().to("cpu", dtype or t.dtype).contiguous()
            tensors[key + name] = t
    config = peft_config(lmap, modules, base_model, dropout)
    with atomic_folder(Path(out), force) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(out)


# ---------------------------------------------------------------- PEFT -> ours


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's lookup (``peft.utils.other.get_pattern_key``): the first key that matches the
    end of the module name as a regex after a dot."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def check_config(config: dict[str, Any], where: str) -> None:
    """Refuse, in one line, a PEFT adapter whose forward is not ``W x + (alpha/r) B A x``."""
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{where}: peft_type {config.get('peft_type')!r} is not supported "
                          "(only LORA)")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{where}: bias={config['bias']!r} is not supported (only 'none')")
    for key, what in REFUSED.items():
        if config.get(key):
            raise ConfigError(f"{where}: {key}={json.dumps(config[key])}: {what} is not "
                              "supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise ConfigError(f"{where}: {key} must be a positive number, not "
                              f"{config.get(key)!r}")


def read_peft(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``adapter_config.json`` (checked) and the tensors of a PEFT adapter folder."""
    folder = Path(folder)
    path = folder / CONFIG_NAME
    if not path.exists():
        raise ConfigError(f"{folder}: no {CONFIG_NAME}; not a PEFT adapter folder")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    check_config(config, str(path))
    weights = folder / WEIGHTS_NAME
    if not weights.exists():
        raise ConfigError(f"{folder}: no {WEIGHTS_NAME} (adapter_model.bin is not read: it is a "
                          "pickle)")
    return config, load_file(str(weights))


def _peft_modules(config: dict[str, Any], tensors: dict[str, torch.Tensor],
                  normalize: Any, where: str) -> dict[str, HFModule]:
    """PEFT tensors as HF modules (canonical names), ranks and alphas checked."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    memory: dict[str, str] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight", key)
        if m is None:
            raise CheckpointError(f"{where}: unexpected tensor {key!r} (only lora_A/lora_B "
                                  "weights are supported)")
        module = _module(normalize(m.group(1) + ".weight"))
        memory[module] = m.group(1)
        pairs.setdefault(module, {})[m.group(2)] = t
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{where}: module {memory[module]!r} has lora_"
                                  f"{next(iter(ab))} but not lora_{'AB'[next(iter(ab)) == 'A']}")
        a, b = ab["A"], ab["B"]
        r = _pattern_value(config.get("rank_pattern") or {}, memory[module], config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, memory[module],
                               config["lora_alpha"])
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise CheckpointError(f"{where}: module {memory[module]!r}: lora_A {list(a.shape)} "
                                  f"and lora_B {list(b.shape)} do not have rank r={r}")
        out[module] = HFModule(a, b, alpha / r)
    return out


def from_peft(lmap: LinkMap, config: dict[str, Any], tensors: dict[str, torch.Tensor],
              normalize: Any = lambda n: n, where: str = "adapter") -> LoRATensors:
    """A PEFT adapter (config and tensors) as our adapters, exactly; ``normalize`` maps an HF
    weight name to the links' (the family adapter's :meth:`~Adapter.normalize`)."""
    modules = _peft_modules(config, tensors, normalize, where)
    feeds: dict[str, list[_Rows]] = {}
    for module, m in modules.items():
        shape = lmap.hf_shapes.get(module + ".weight")
        if shape is None:
            raise CheckpointError(f"{where}: unknown module {module!r}: no such weight in this "
                                  f"{lmap.family} model")
        if (m.b.shape[0], m.a.shape[1]) != shape:
            raise CheckpointError(f"{where}: shape mismatch: module {module!r} has lora_A "
                                  f"{list(m.a.shape)} and lora_B {list(m.b.shape)}, its weight "
                                  f"is {list(shape)} for this config")
        for rows in lmap.of_module(module):
            feeds.setdefault(rows.base, []).append(rows)
    out = LoRATensors({}, {})
    for base, rows in feeds.items():
        sources = list(dict.fromkeys(r.module for r in rows))
        first = modules[sources[0]]
        same = all(torch.equal(modules[s].a, first.a) and modules[s].scaling == first.scaling
                   for s in sources)
        stack = [sources[0]] if same else sources
        a = torch.cat([modules[s].a for s in stack])
        b = torch.zeros(lmap.our_shapes[base + ".weight"][0], a.shape[0], dtype=first.b.dtype)
        offset = {s: sum(modules[x].rank for x in stack[:i]) for i, s in enumerate(stack)}
        for r in rows:
            block = modules[r.module].b[r.hf[0]:r.hf[1]]
            if modules[r.module].scaling != first.scaling:
                block = block * (modules[r.module].scaling / first.scaling)
            col = offset[r.module] if not same else 0
            b[r.ours[0]:r.ours[1], col:col + modules[r.module].rank] = block
        out.tensors[base + A_SUFFIX] = a
        out.tensors[base + B_SUFFIX] = b
        out.scalings[base] = first.scaling
    return out


def load_peft(folder: str | Path, lmap: LinkMap, adapter: Adapter) -> LoRATensors:
    """A PEFT adapter folder as our adapters for the model of ``lmap``."""
    config, tensors = read_peft(folder)
    return from_peft(lmap, config, tensors, adapter.normalize, str(folder))


def merge(state: dict[str, torch.Tensor], lora: LoRATensors) -> dict[str, torch.Tensor]:
    """``state`` with each adapted weight replaced by ``W + s B A`` (computed in fp32, cast to
    ``W``'s dtype); the same logits as the unmerged model, for eval and generate."""
    out = dict(state)
    for base in lora.bases():
        w = state[base + ".weight"]
        delta = lora.b(base).float() @ lora.a(base).float()
        out[base + ".weight"] = (w.float() + lora.scalings[base] * delta).to(w.dtype)
    return out
