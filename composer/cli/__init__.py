"""The ``composer`` command (also ``python -m composer``).

Every subcommand prints a readable table by default and one line of JSON on stdout with
``--json``. Bad input is one line on stderr and exit code 2, never a traceback. A bare
``composer`` prints the help and exits 0 (nothing went wrong; argparse's exit 2 is for errors).
The arguments are parsed before anything heavy is imported: torch loads only for a command that
computes, which first sets its thread count from the size of its work (:mod:`composer.threads`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer.cli.base import (
    DEFAULT_PATTERN,
    Parser,
    UsageError,
    source_params,
    train_work,
    version,
)
from composer.cli.models import cmd_build, cmd_zoo_list, cmd_zoo_show
from composer.cli.plan import GPU_FLAGS, add_gpu_arguments, gpu_of, print_plan
from composer.threads import restore_threads, use_threads

DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "keep": None}


def _print_pairs(pairs: dict[str, Any]) -> None:
    """``key  value`` lines, the keys padded to one width."""
    width = max(map(len, pairs))
    for key, value in pairs.items():
        print(f"{key:<{width}}  {value}")


def _progress_bar(total: int, label: str):
    """A byte-counting progress bar on stderr that shows only if the work takes > 1 s."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=label, delay=1.0, leave=False,
                file=sys.stderr, dynamic_ncols=True, disable=not sys.stderr.isatty())


def _stored_params(src: str) -> int:
    """Elements stored in a portable checkpoint's safetensors headers (no model built, no
    torch); :func:`source_params` for anything else."""
    from composer.portable import CheckpointError, TensorSource

    with contextlib.suppress(CheckpointError, OSError):  # unreadable: the general count says why
        if (Path(src) / "config.yaml").is_file():
            return sum(math.prod(i.shape) for i in TensorSource(Path(src)).tensors.values())
    return source_params(src)


def cmd_convert(args: argparse.Namespace) -> int:
    from composer.config import ConfigError
    from composer.convert import from_hf, to_hf
    from composer.convert.infer import NoFamilyError
    from composer.portable import parse_size
    from composer.threads import available_cpus, intra_op_threads

    if args.dtype not in DTYPE_NAMES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}; got {args.dtype!r}")
    dtype = DTYPE_NAMES[args.dtype]
    try:
        max_shard = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    kwargs: dict[str, Any] = {"force": args.force, "max_shard_bytes": max_shard}
    if dtype:  # a cast: torch now (without one, from-hf copies before torch is imported)
        import torch

        kwargs["dtype"] = getattr(torch, dtype)
    params = _stored_params(args.src)  # casts and copies: work in proportion to the size
    start = time.perf_counter()
    bar = _progress_bar(0, f"convert {args.direction}")
    kwargs["progress"] = bar.update
    try:
        if args.direction == "from-hf":
            threads = intra_op_threads(params, 1, available_cpus())  # set once torch is in
            cfg = from_hf(args.src, args.dst, threads=threads, **kwargs)
            pattern = cfg.parsed.format()
        else:
            use_threads(params, 1)
            hf = to_hf(args.src, args.dst, architecture=args.arch, **kwargs)
            pattern = None
            arch = hf["architectures"][0]
    except NoFamilyError as exc:
        if not args.verbose:
            raise ConfigError(f"{exc} (--verbose lists why)") from None
        print(f"composer: error: {exc}", file=sys.stderr)
        for family, why in exc.others:
            print(f"  {family}: {why}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    info: dict[str, Any] = {"direction": args.direction, "src": str(args.src),
                            "dst": str(args.dst), "seconds": round(seconds, 3)}
    if pattern is not None:
        info["pattern"] = pattern
    else:
        info["architecture"] = arch
    if args.json:
        print(json.dumps(info))
    else:
        what = f"pattern {pattern}" if pattern else arch
        print(f"wrote {args.dst} ({what}) in {seconds:.2f}s")
    return 0


EVAL_LAYOUT = ("tp", "pp", "cp", "ep", "dp", "dp_mode", "sequence_parallel", "compile")
"""The layout flags of ``composer eval`` (:class:`~composer.parallel.layout.ParallelConfig`)."""


def _layout(args: argparse.Namespace):
    from composer.parallel.layout import ParallelConfig

    layout = ParallelConfig(**{k: getattr(args, k) for k in EVAL_LAYOUT})
    if args.activation_checkpointing:
        layout.ac = "full"
    return layout


def cmd_eval(args: argparse.Namespace) -> int:
    from composer.parallel.launch import init_distributed, is_main_process
    from composer.run import check_vocab, evaluate, load_tokens, prepare

    if (args.tokens is None) == (args.data is None):
        raise UsageError("give --tokens FILE.npy or --data PREFIX (one of them)")
    init_distributed(args.device)
    doc_ids = None
    if args.data is not None:
        from composer.data.gpt import sequential_samples
        from composer.data.indexed import IndexedDataset

        if not args.seq_len:
            raise UsageError("--data needs --seq-len (tokens per sample)")
        samples = sequential_samples(IndexedDataset(args.data), args.seq_len, args.max_samples)
        rows = [s[0] for s in samples]
        doc_ids = [s[1] for s in samples] if args.document_isolation else None
    else:
        rows = load_tokens(args.tokens, args.seq_len)
    use_threads(source_params(args.ckpt), args.batch_size * len(rows[0]) if len(rows) else 1)
    model, dims, _, _ = prepare(args.ckpt, _layout(args), device=args.device,
                                adapter=args.adapter)
    check_vocab(rows, model.config, args.tokens or args.data)
    loss, n = evaluate(model, dims, rows, args.batch_size, doc_ids)
    if is_main_process():
        if args.json:
            print(json.dumps({"loss": loss, "n_tokens": n}))
        else:
            print(f"loss {loss:.6f} over {n:,} predicted tokens "
                  f"(tp={dims.tp} ep={dims.ep} dp={dims.dp})")
    return 0


TRAIN_ONLY = {"func", "command", "config", "list_recipes", "json", "source", "dry_run",
              "dry_run_rank", *GPU_FLAGS}


def cmd_train(args: argparse.Namespace) -> int:
    from composer.train.recipe import shipped_recipes

    if not args.dry_run:
        given = [f"--{k.replace('_', '-')}" for k in ("dry_run_rank", *sorted(GPU_FLAGS))
                 if getattr(args, k) is not None]
        if given:
            raise UsageError(f"{given[0]} is for --dry-run (a rank of a world checked here)")
    if args.list_recipes:
        recipes = shipped_recipes()
        if args.json:
            print(json.dumps(recipes))
        else:
            _print_pairs(recipes)
        return 0
    from composer.parallel.launch import init_distributed, is_main_process
    from composer.train.engine import resolve, train

    flags = {k: v for k, v in vars(args).items() if k not in TRAIN_ONLY}
    if flags.pop("activation_checkpointing", False):
        flags.setdefault("ac", "full")
    recipe, resume = resolve(args.source, args.config, flags)
    if args.dry_run:
        return _dry_run(args, recipe, resume)
    use_threads(*train_work(recipe))
    init_distributed(recipe.device, recipe.timeout_s)
    summary = train(recipe, resume, quiet=args.json)
    if is_main_process():
        if args.json:
            print(json.dumps({"steps": summary.steps, "step": summary.step, "loss": summary.loss,
                              "losses": summary.losses, "tokens": summary.tokens,
                              "tokens_per_s": summary.tokens_per_s,
                              "wall_s": round(summary.wall_s, 3), "skipped": summary.skipped,
                              "stopped_by_signal": summary.stopped_by_signal}))
        elif recipe.save:
            print(f"saved step {summary.step} to {recipe.save}")
    return 0


def _dry_run(args: argparse.Namespace, recipe: Any, resume: Any) -> int:
    """``train --dry-run``: the plan and one rank's setup (:mod:`composer.plan.dry_run`)."""
    from composer.plan.dry_run import PlanMismatch, dry_run, summary_line, world_of

    world = world_of(recipe, args.gpus)
    try:
        plan = dry_run(recipe, resume, world, gpu_of(args), args.dry_run_rank)
    except PlanMismatch as exc:
        _report(f"composer: error: {exc}", exc.exit_code)
        return exc.exit_code
    if args.json:
        print(json.dumps(plan))
    else:
        print_plan(plan)
        print(summary_line(plan))
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from composer.data.prepare import prepare

    if args.format in ("chat", "preference"):
        return _data_prepare_chat(args)
    chat_only = [f"--{k.replace('_', '-')}" for k in ("chat_template", "mask", "seq_len",
                                                      "truncate", "image_root", "min_pixels",
                                                      "max_pixels")
                 if getattr(args, k) is not None]
    chat_only += ["--skip-bad-rows"] if args.skip_bad_rows else []
    if chat_only:
        raise UsageError(f"{chat_only[0]} needs --format chat or preference")
    bar = _progress_bar(0, "prepare")
    try:
        stats = prepare(args.inputs, args.out, args.tokenizer, json_key=args.json_key,
                        append_eod=args.append_eod, workers=args.workers, progress=bar.update,
                        force=args.force)
    finally:
        bar.close()
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"wrote {args.out}.bin/.idx: {stats['n_documents']:,} documents, "
              f"{stats['n_tokens']:,} tokens ({stats['dtype']}) in {stats['seconds']:.2f}s, "
              f"{stats['tokens_per_s']:,.0f} tokens/s, {stats['mb_per_s']:.1f} MB/s of text")
    return 0


def _data_prepare_chat(args: argparse.Namespace) -> int:
    from composer.data.chat_prepare import prepare_chat

    if args.append_eod or args.json_key != "text":
        raise UsageError("--append-eod and --json-key are for --format text (a chat row's "
                         "template ends its turns)")
    preference = args.format == "preference"
    if preference and args.mask:
        raise UsageError("--mask is for --format chat (a preference pair's mask is its "
                         "completion: chosen, rejected)")
    bar = _progress_bar(0, "prepare")
    try:
        stats = prepare_chat(args.inputs, args.out, args.tokenizer, args.chat_template,
                             "completion" if preference else args.mask or "assistant",
                             args.skip_bad_rows, args.workers, args.seq_len,
                             args.truncate or "right", progress=bar.update, force=args.force,
                             kind=args.format, image_root=args.image_root,
                             min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    finally:
        bar.close()
    if args.json:
        print(json.dumps(stats))
    elif preference:
        print(f"wrote {args.out}: {stats['pairs']:,} pairs ({stats['documents']:,} "
              f"conversations), {stats['tokens']:,} tokens, {stats['supervised_tokens']:,} "
              f"supervised, {stats['skipped_rows']:,} bad rows skipped, "
              f"{stats['truncated']:,} sides truncated")
    else:
        images = stats.get("images", {}).get("count", 0)
        print(f"wrote {args.out}: {stats['documents']:,} conversations, {stats['tokens']:,} "
              f"tokens, {stats['supervised_tokens']:,} supervised (--mask {stats['mask']}), "
              + (f"{images:,} images, " if images else "")
              + f"{stats['skipped_rows']:,} bad rows skipped, {stats['truncated']:,} truncated")
    return 0


def cmd_data_inspect(args: argparse.Namespace) -> int:
    from composer.data.masked import inspect_chat, is_masked, row
    from composer.data.prepare import inspect

    if args.row is not None:
        print(json.dumps(row(args.prefix, args.row)))
        return 0
    if is_masked(args.prefix):
        info = inspect_chat(args.prefix)
    else:  # the counts under the names a chat dataset reports them by, too
        info = inspect(args.prefix)
        info = {"documents": info["n_documents"], "tokens": info["n_tokens"], **info}
    if args.json:
        print(json.dumps(info))
    else:
        _print_pairs({k: f"{v:,}" if isinstance(v, int) else v for k, v in info.items()})
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from composer.train.plot import plot

    try:
        out = plot(args.run, args.out)
    except ImportError as exc:  # matplotlib is an optional extra
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"out": str(out)}))
    else:
        print(f"wrote {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from composer.export import export
    from composer.portable import parse_size

    if args.adapter and args.merge:
        raise UsageError("give --adapter (a PEFT adapter folder) or --merge, not both")
    if args.base is not None and not args.adapter:
        raise UsageError("--base names the base model of a PEFT adapter; it needs --adapter")
    try:
        max_shard = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    start = time.perf_counter()
    if args.adapter:
        from composer.convert.peft_folders import export_adapter

        export_adapter(args.run, args.out, base=args.base, force=args.force)
        what = "adapter_config.json, adapter_model.safetensors"
    else:
        if args.merge:
            from composer.convert.peft_folders import export_merged as export
        bar = _progress_bar(0, "export")
        try:
            export(args.run, args.out, force=args.force, max_shard_bytes=max_shard,
                   progress=bar.update)
        finally:
            bar.close()
        what = "config.yaml, model.safetensors"
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"run": str(args.run), "out": str(args.out),
                          "seconds": round(seconds, 3)}))
    else:
        print(f"wrote {args.out} ({what}) in {seconds:.2f}s")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from composer.cli.launch import launch

    return launch(args.nproc_per_node, args.argv, args.log_dir)


def _add_layout(p: argparse.ArgumentParser) -> None:
    from composer.parallel.layout import ParallelConfig
    from composer.settings import add_flags

    add_flags(p, ParallelConfig, only=EVAL_LAYOUT, defaults=True)
    p.add_argument("--seq-len", type=int, default=None, help="cut a 1-D token array this long")
    p.add_argument("--json", action="store_true", help="one line of JSON on stdout")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each layer's activations in the backward (less memory)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (default): CUDA when available; under torchrun cuda:LOCAL_RANK")


GENERATE_HELP = "continue a prompt with a checkpoint (text streams)"


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (the root parser's options take no values)."""
    return next((a for a in argv if not a.startswith("-")), None)


def make_parser(argv: Sequence[str] | None = None) -> Parser:
    """The ``composer`` parser. ``generate``'s options live in :mod:`composer.cli.generate`,
    which imports torch: they are added only when ``argv`` runs ``generate`` (``None``: always);
    otherwise ``generate`` is listed with its help line alone."""
    parser = Parser(prog="composer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"composer {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    build = sub.add_parser("build", help="build a model from a pattern or preset and summarise it")
    build.add_argument("--pattern", help=f"layer pattern (default {DEFAULT_PATTERN!r})")
    build.add_argument("--preset", help="a zoo preset name (see `composer zoo list`)")
    build.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a config field, e.g. attention.n_heads=8 (repeatable)")
    build.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    build.add_argument("--seq-len", type=int, default=4096, help="sequence length for FLOPs")
    build.add_argument("--pp", type=int, default=None,
                       help="print the split into pipeline stages for N ranks")
    build.add_argument("--out", help="materialise and write a portable checkpoint here")
    build.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    build.add_argument("--max-shard-size", default="50GB",
                       help="largest --out safetensors file before sharding (default 50GB)")
    build.add_argument("--json", action="store_true", help="one line of JSON on stdout")
    build.set_defaults(func=cmd_build)

    conv = sub.add_parser("convert", help="convert checkpoints to and from Hugging Face format")
    conv_sub = conv.add_subparsers(dest="direction", required=True, parser_class=Parser)
    for direction, help_text in (("from-hf", "Hugging Face folder or hub id -> composer"),
                                 ("to-hf", "composer checkpoint -> Hugging Face folder")):
        c = conv_sub.add_parser(direction, help=help_text)
        c.add_argument("src")
        c.add_argument("dst")
        c.add_argument("--dtype", default="keep",
                       help="float32, bfloat16, float16 or keep (default: each tensor's own)")
        c.add_argument("--force", action="store_true", help="replace a non-empty DST")
        c.add_argument("--max-shard-size", default="50GB",
                       help="split the output into shards of at most this size (default 50GB)")
        c.add_argument("--json", action="store_true", help="one line of JSON on stdout")
        if direction == "to-hf":
            c.add_argument("--arch", help="HF architecture to write (default: the source's, or "
                                          "inferred from the config)")
            c.add_argument("--verbose", action="store_true",
                           help="when no family fits, list every family's reason")
        c.set_defaults(func=cmd_convert, arch=None, verbose=False)

    ev = sub.add_parser("eval", help="mean next-token loss of a checkpoint on tokens or a dataset")
    ev.add_argument("ckpt", help="a portable checkpoint or a `train --save` folder")
    ev.add_argument("--tokens", help="a .npy array of token ids (1-D or 2-D)")
    ev.add_argument("--data", help="an indexed dataset PREFIX (samples of --seq-len + 1 tokens)")
    ev.add_argument("--max-samples", type=int, default=None, help="score at most N samples")
    ev.add_argument("--document-isolation", action="store_true",
                    help="with --data: nothing is seen or predicted across documents")
    ev.add_argument("--batch-size", type=int, default=8, help="sequences per forward per rank")
    ev.add_argument("--adapter", metavar="DIR", default=None,
                    help="a PEFT LoRA adapter folder, merged into the weights before evaluating")
    _add_layout(ev)
    ev.set_defaults(func=cmd_eval)

    tr = sub.add_parser("train", help="train (mixed precision, schedules, exact resume)")
    tr.add_argument("source", nargs="?", default=None,
                    help="a preset, a portable checkpoint, a Hugging Face folder, or a run "
                    "folder to resume")
    tr.add_argument("--config", help="a recipe YAML file or a shipped recipe's name")
    tr.add_argument("--list-recipes", action="store_true", help="list the shipped recipes")
    tr.add_argument("--json", action="store_true",
                    help="no per-step lines; one line of JSON on stdout at the end")
    tr.add_argument("--dry-run", action="store_true",
                    help="check the run up to its first step for one rank of --gpus N on the "
                         "meta device, nothing allocated or written, and print its plan "
                         "(docs/planning.md)")
    tr.add_argument("--dry-run-rank", type=int, default=None, metavar="R",
                    help="the rank to dry-run (default: the plan's worst)")
    add_gpu_arguments(tr, gpus_required=False,
                      gpus_help="--dry-run: the world size (default: the recipe's layout's)")
    from composer.train.recipe import add_arguments

    add_arguments(tr)
    tr.set_defaults(func=cmd_train)

    from composer.cli.plan import add_parser as add_plan

    add_plan(sub)

    data = sub.add_parser("data", help="prepare and inspect Megatron-format indexed datasets")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=Parser)
    dp = data_sub.add_parser("prepare", help="tokenise .jsonl/.jsonl.gz/.txt/.parquet files")
    dp.add_argument("inputs", nargs="+", help="input files (one document per line or file)")
    dp.add_argument("--out", required=True, help="output PREFIX (PREFIX.bin, PREFIX.idx)")
    dp.add_argument("--tokenizer", required=True,
                    help="byte, a local Hugging Face tokenizer folder, or a hub id")
    dp.add_argument("--json-key", default="text", help="the text field (default text)")
    dp.add_argument("--append-eod", action="store_true", help="end each document with EOD")
    dp.add_argument("--workers", type=int, default=1, help="tokenising processes")
    dp.add_argument("--force", action="store_true", help="replace an existing PREFIX")
    dp.add_argument("--format", choices=("text", "chat", "preference"), default="text",
                    help="text (default): a document per row; chat: conversations rendered "
                         "with the chat template, with a loss mask (rows may carry "
                         "\"images\"); preference: "
                         "{prompt, chosen, rejected} rows, two masked conversations each (DPO)")
    dp.add_argument("--chat-template", metavar="FILE", help="chat, preference: a Jinja "
                    "template that overrides the tokenizer's (saved in PREFIX.tokenizer/)")
    dp.add_argument("--mask", choices=("assistant", "last-turn", "completion", "none"),
                    help="chat: the supervised tokens (default assistant: every assistant turn)")
    dp.add_argument("--skip-bad-rows", action="store_true",
                    help="chat, preference: count and skip bad rows instead of stopping at the "
                         "first")
    dp.add_argument("--seq-len", type=int, help="chat, preference: the longest conversation, "
                    "in tokens")
    dp.add_argument("--truncate", choices=("right", "left", "error"),
                    help="chat, preference, with --seq-len: keep the first (right, default) or "
                         "the last (left) tokens of a longer conversation, or refuse it (error)")
    dp.add_argument("--image-root", metavar="DIR", help="chat: the folder relative image "
                    "paths of rows' \"images\" resolve against (default: each input's folder)")
    dp.add_argument("--min-pixels", type=int, help="chat: resize smaller images up to this "
                    "many pixels (default: the tokenizer folder's preprocessor_config.json, "
                    "else 65536)")
    dp.add_argument("--max-pixels", type=int, help="chat: resize larger images down to this "
                    "many pixels (default: as --min-pixels, else 16777216)")
    dp.add_argument("--json", action="store_true", help="one line of JSON on stdout")
    dp.set_defaults(func=cmd_data_prepare)
    di = data_sub.add_parser("inspect", help="documents, sequences, tokens of a dataset")
    di.add_argument("prefix")
    di.add_argument("--row", type=int, metavar="I", help="print document I (input order) as "
                    "JSON token_ids and loss_mask (all ones for a text dataset)")
    di.add_argument("--json", action="store_true", help="one line of JSON on stdout")
    di.set_defaults(func=cmd_data_inspect)

    pl = sub.add_parser("plot", help="draw loss, learning rate and grad norm of a run")
    pl.add_argument("run", help="a folder with metrics.jsonl (--save or --log-dir)")
    pl.add_argument("--out", help="the image to write (default RUN/loss.png)")
    pl.add_argument("--json", action="store_true", help="one line of JSON on stdout")
    pl.set_defaults(func=cmd_plot)

    ex = sub.add_parser("export", help="training checkpoint (any layout) -> portable checkpoint")
    ex.add_argument("run", help="a `composer train --save` folder")
    ex.add_argument("out", help="the portable checkpoint folder to write")
    ex.add_argument("--max-shard-size", default="50GB",
                    help="split model.safetensors into shards of at most this size")
    ex.add_argument("--adapter", action="store_true",
                    help="a LoRA run: write its adapters as a PEFT adapter folder")
    ex.add_argument("--merge", action="store_true",
                    help="a LoRA run: write the merged weights (W + scaling B A)")
    ex.add_argument("--base", metavar="NAME_OR_PATH", default=None,
                    help="with --adapter: base_model_name_or_path (default: what the run was "
                         "trained from)")
    ex.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    ex.add_argument("--json", action="store_true", help="one line of JSON on stdout")
    ex.set_defaults(func=cmd_export)

    if argv is None or _command(argv) == "generate":
        from composer.cli.generate import add_parser as add_generate

        add_generate(sub)
    else:
        sub.add_parser("generate", help=GENERATE_HELP)

    la = sub.add_parser("launch", help="run a command on N local processes (torchrun's job; "
                        "one line per failing rank, Ctrl-C saves)")
    la.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True, metavar="N",
                    help="processes (ranks) to start on this machine")
    la.add_argument("--log-dir", metavar="DIR",
                    help="keep the stderr of ranks 1 to N-1 here (rank 0's is yours)")
    la.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                    help="the composer command and its flags")
    la.set_defaults(func=cmd_launch)

    zoo = sub.add_parser("zoo", help="list and show model presets")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True, parser_class=Parser)
    zl = zoo_sub.add_parser("list", help="list presets")
    zl.add_argument("--json", action="store_true")
    zl.set_defaults(func=cmd_zoo_list)
    zs = zoo_sub.add_parser("show", help="show one preset's config and counts")
    zs.add_argument("name")
    zs.add_argument("--seq-len", type=int, default=4096)
    zs.add_argument("--json", action="store_true")
    zs.set_defaults(func=cmd_zoo_show)
    return parser


def _report(line: str, code: int) -> None:
    """A one-line error on stderr, from rank 0 only; under `composer launch` every rank hands
    it to the launcher, which prints one line per failing rank."""
    if os.environ.get("COMPOSER_LAUNCH_DIR"):
        from composer.cli.launch import hand_over

        if hand_over(line, code):
            return
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)


def _leave_process_group() -> bool:
    """Under torchrun: wait for every rank, then tear the process group down; True if there was
    one. Exiting with it alive lets one rank's exit break another's gloo connections while that
    one is still closing them (seen as "terminate called without an active exception")."""
    dist = sys.modules.get("torch.distributed")  # never initialised if never imported
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    try:
        parser = make_parser(argv)
        if not argv:
            parser.print_help()
            return 0
        args = parser.parse_args(argv)
        if (getattr(args, "seq_len", 1) or 1) <= 0:
            raise UsageError("--seq-len must be positive")
        if args.command == "generate":  # decoding: one token per forward
            use_threads(source_params(args.source), 1)
        code = args.func(args)
        distributed = _leave_process_group()
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        if distributed:
            # Communication threads still alive at interpreter finalisation can abort the
            # process (a thread taking the GIL after finalisation began: SIGABRT, "terminate
            # called without an active exception"), rarely, after all the work is done. The
            # work is done and every rank has passed the barrier: leave without finalising.
            sys.stderr.flush()
            os._exit(code)
        return code
    except BrokenPipeError:  # `composer zoo show X | head`: the reader left; exit quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (UsageError, ValueError, FileExistsError, FileNotFoundError,
            PermissionError) as exc:  # ConfigError, PatternError, CheckpointError are ValueErrors
        _report(f"composer: error: {exc}".replace("\n", " "), 2)
        return 2
    except RuntimeError as exc:
        from composer.train.loop import TrainingHalted

        if not isinstance(exc, TrainingHalted):
            raise
        _report(f"composer: error: {exc}".replace("\n", " "), exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt:
        _report("composer: interrupted", 130)
        return 130
    finally:
        restore_threads()
