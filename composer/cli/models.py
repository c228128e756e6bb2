"""``composer build`` and ``composer zoo``: a model from a pattern or preset, its parameter and
FLOP statistics, its pipeline stages, and the presets."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from typing import Any

from composer.cli.base import DEFAULT_PATTERN, UsageError
from composer.config import ConfigError, ModelConfig, apply_overrides
from composer.pattern import PatternError, parse_pattern

INIT_TOKENS = 32
"""Initialising costs a few dozen operations per parameter (a normal draw, a scale): about a
forward over this many tokens, for the thread count (:mod:`composer.threads`)."""


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def resolve_config(args: argparse.Namespace) -> ModelConfig:
    from composer.zoo import get_preset

    if args.preset and args.pattern is not None:
        raise UsageError("give --pattern or --preset, not both")
    if args.preset:
        cfg = get_preset(args.preset).config()
    else:  # an explicitly empty --pattern "" is an error, not the default
        pattern = DEFAULT_PATTERN if args.pattern is None else args.pattern
        try:  # a bad pattern is refused before the layer kinds (and torch) load
            parse_pattern(pattern)
        except PatternError as exc:
            raise ConfigError(str(exc)) from None
        cfg = ModelConfig(pattern=pattern)
    apply_overrides(cfg, args.set or [])
    return cfg.validate()


def stats_dict(cfg: ModelConfig, seq_len: int) -> dict[str, Any]:
    from composer.build.builder import build_model, model_stats

    stats = model_stats(build_model(cfg, device="meta"), seq_len=seq_len)
    return {
        "pattern": cfg.parsed.format(),
        "n_layers": stats.n_layers,
        "layer_counts": stats.layer_counts,
        "params_by_kind": stats.params_by_kind,
        "n_params": stats.n_params,
        "n_active_params": stats.n_active_params,
        "flops_per_token": stats.flops_per_token,
        "forward_flops_per_token": stats.forward_flops_per_token,
        "seq_len": seq_len,
        "bf16_bytes": stats.bf16_bytes,
        **({"vision": stats.vision} if stats.vision is not None else {}),
    }


def print_stats(info: dict[str, Any]) -> None:
    from composer.build.registry import layer_kind

    rows = [("pattern", info["pattern"]), ("layers", str(info["n_layers"]))]
    for sym, n in info["layer_counts"].items():
        rows.append((f"  {sym} {layer_kind(sym).name}", str(n)))
    rows.append(("parameters", ""))
    for kind, n in info["params_by_kind"].items():
        rows.append((f"  {kind}", f"{n:,}"))
    rows += [
        ("total parameters", f"{info['n_params']:,} ({_human(info['n_params'])})"),
        ("active parameters", f"{info['n_active_params']:,} ({_human(info['n_active_params'])})"),
        (f"FLOPs/token (train, seq {info['seq_len']})", _human(info["flops_per_token"])),
        ("FLOPs/token (forward)", _human(info["forward_flops_per_token"])),
        ("weights in bf16", _bytes(info["bf16_bytes"])),
    ]
    vis = info.get("vision")
    if vis:
        rows += [("vision tower", ""), ("  pattern", vis["pattern"]),
                 ("  layers", str(sum(vis["layer_counts"].values())))]
        rows += [(f"    {k}", str(n)) for k, n in vis["layer_counts"].items()]
        rows.append(("  parameters", ""))
        rows += [(f"    {k}", f"{n:,}") for k, n in vis["params_by_part"].items()]
        side, grid = vis["image_pixels"], vis["image_grid_thw"]
        rows += [("  total parameters", f"{vis['n_params']:,} ({_human(vis['n_params'])})"),
                 (f"  FLOPs/image (forward, {side[0]}x{side[1]} px)",
                  f"{_human(vis['forward_flops_per_image'])} (grid {grid[1]}x{grid[2]} "
                  f"patches, {vis['image_tokens']} tokens)")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if info.get("stages"):
        print(f"\npipeline stages (--pp {info['pp']}; rank r holds stages r, r + pp, ...)")
        print(f"{'stage':>5} {'rank':>4} {'layers':>9} {'params':>9} {'FLOPs/token':>12}  pattern")
        for st in info["stages"]:
            first, last = st["first_layer"], st["first_layer"] + st["n_layers"] - 1
            print(f"{st['stage']:>5} {st['rank']:>4} {f'{first}-{last}':>9} "
                  f"{_human(st['n_params']):>9} {_human(st['flops_per_token']):>12}  "
                  f"{st['layers']}")


def stages_dict(cfg: ModelConfig, pp: int, seq_len: int) -> list[dict[str, Any]]:
    from composer.build.stages import split_stages

    return [{"stage": st.index, "rank": st.index % pp, "layers": st.pattern,
             "first_layer": st.layers[0], "n_layers": len(st.layers), "n_params": st.n_params,
             "flops_per_token": st.flops_per_token}
            for st in split_stages(cfg, pp, seq_len)]


def cmd_build(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    info = stats_dict(cfg, args.seq_len)
    if args.pp is not None:
        info["pp"] = args.pp
        info["stages"] = stages_dict(cfg, args.pp, args.seq_len)
    if args.out:
        from composer.threads import use_threads
        from composer.zoo import get_preset

        start = time.perf_counter()
        use_threads(info["n_params"], INIT_TOKENS)
        family = get_preset(args.preset).family if args.preset else None
        info["files"] = write_built(cfg, args.out, args.seed, args.force,
                                    getattr(args, "max_shard_size", None), family)
        info["out"] = str(args.out)
        info["build_seconds"] = round(time.perf_counter() - start, 3)
    if args.json:
        print(json.dumps(info))
    else:
        print_stats(info)
        if args.out:
            print(f"wrote {args.out} ({', '.join(info['files'])}) "
                  f"in {info['build_seconds']:.2f}s")
    return 0


CONFIG_ALLOWANCE = 2**20
"""Bytes allowed for ``config.yaml``, ``origin.json`` and the file system's rounding."""


def write_built(cfg: ModelConfig, folder: str, seed: int, force: bool, max_shard_size: str | None,
                family: str | None) -> list[str]:
    """Initialise ``cfg`` from ``seed`` straight into a portable checkpoint in ``folder``, row block
    by row block (:func:`~composer.build.init.initial_pieces`): memory is bounded by a block,
    never the model, and the bytes equal ``composer.save(build_model(cfg, seed=seed))``'s. The
    free disk is checked against the files' exact size first. Returns the files' names."""
    import errno
    from pathlib import Path

    from composer.build.builder import build_model, write_portable
    from composer.build.init import initial_pieces
    from composer.portable import (
        DEFAULT_MAX_SHARD,
        DTYPE_NAMES,
        INDEX_NAME,
        PlannedTensor,
        ShardedWriter,
        check_destination,
        check_free_space,
        parse_size,
    )

    try:
        max_shard = parse_size(max_shard_size) if max_shard_size else DEFAULT_MAX_SHARD
    except ValueError as exc:
        raise UsageError(f"--max-shard-size: {exc}") from None
    out = Path(folder)
    check_destination(out, force)
    model = build_model(cfg, device="meta")
    plan = [(k, v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()]
    writer = ShardedWriter(out, [PlannedTensor(k, DTYPE_NAMES[d], s) for k, d, s in plan],
                           max_shard)  # the same split write_portable makes, for the sizes
    check_free_space(out, writer.total_bytes() + CONFIG_ALLOWANCE)
    try:
        write_portable(out, cfg, plan, _counted(initial_pieces(model, seed),
                                                writer.total_bytes(), f"build {out}"),
                       force, max_shard, family)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise UsageError(f"the disk filled up while writing {out}; nothing was kept") from None
    if len(writer.files) == 1:
        return ["config.yaml", *writer.files]
    return ["config.yaml", f"{len(writer.files)} safetensors shards", INDEX_NAME]


def _counted(pieces: Iterator[tuple[str, Any]], total: int,
             label: str) -> Iterator[tuple[str, Any]]:
    """``pieces`` with a byte-counting progress bar on stderr (a terminal only, after 1 s):
    a large model takes hours."""
    import sys

    from tqdm.auto import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc=label, delay=1.0, leave=False,
              file=sys.stderr, dynamic_ncols=True, disable=not sys.stderr.isatty()) as bar:
        for key, piece in pieces:
            yield key, piece
            bar.update(piece.numel() * piece.element_size())


def cmd_zoo_list(args: argparse.Namespace) -> int:
    from composer.build.builder import build_model, model_stats
    from composer.zoo import presets

    items = []
    for preset in presets().values():
        stats = model_stats(build_model(preset.config(), device="meta"))
        items.append({"name": preset.name, "family": preset.family, "hf_id": preset.hf_id,
                      "pattern": preset.config().parsed.format(), "n_params": stats.n_params,
                      "n_active_params": stats.n_active_params})
    if args.json:
        print(json.dumps(items))
        return 0
    width = max(len(i["name"]) for i in items)
    print(f"{'name':<{width}}  {'family':<10} {'params':>8} {'active':>8}  hf id")
    for i in items:
        print(f"{i['name']:<{width}}  {i['family']:<10} {_human(i['n_params']):>8} "
              f"{_human(i['n_active_params']):>8}  {i['hf_id']}")
    return 0


def cmd_zoo_show(args: argparse.Namespace) -> int:
    import yaml

    from composer.zoo import get_preset

    preset = get_preset(args.name)
    cfg = preset.config()
    info = stats_dict(cfg, args.seq_len)
    if args.json:
        print(json.dumps({"name": preset.name, "family": preset.family, "hf_id": preset.hf_id,
                          "source": preset.source, "config": cfg.to_dict(), **info}))
        return 0
    print(f"{preset.name}  ({preset.family}; {preset.hf_id})\nsource: {preset.source}\n")
    print_stats(info)
    print("\nconfig:")
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    return 0
