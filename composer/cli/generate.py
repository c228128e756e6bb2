"""``composer generate SOURCE --prompt TEXT``: continue a prompt with a checkpoint's model.

SOURCE is a portable checkpoint (``config.yaml`` + ``model.safetensors``), a training run
(``composer train --save``: its newest step) or a Hugging Face folder (``config.json`` with
``architectures``: converted into a temporary folder, which needs as much free disk as the model,
and removed once the model is loaded). The model runs in eval mode under
``torch.inference_mode()`` on one process (``--device auto``: CUDA when available).

The tokenizer is ``--tokenizer`` (anything :func:`~composer.data.tokenizer.load_tokenizer`
takes), else the SOURCE's own: a Hugging Face folder's ``tokenizer.json``, a checkpoint's
``tokenizer/`` (a training run's data tokenizer, kept by its export) or ``hf/`` (what conversion
copied from the Hub). The prompt is encoded with the tokenizer's post-processor (Llama-3's BOS),
or, with ``--chat``, rendered as one user message through the chat template and encoded as is.
``--image PATH`` (repeatable; a vision-language model) puts each image's placeholder tokens
before the text (:func:`with_images`).
Decoding stops at the tokenizer's end-of-document id and at ``generation_config.json``'s
``eos_token_id`` (one id or a list; ``config.json``'s without that file); with neither (a
tokenizer without an end-of-document token), it runs to ``--max-new-tokens``, as transformers
does, and says so on stderr. A model vocabulary larger than the tokenizer's (padded, as many
Hugging Face models are) generates only the ids the tokenizer can decode, also said on stderr.

Output: the new text streams to stdout as it is decoded (every id so far decoded, the new
suffix printed, held back while it ends in an incomplete UTF-8 sequence, U+FFFD), then a
newline; one summary line goes to stderr. ``--json`` prints one line of JSON instead. Speeds:
prefill = prompt tokens / (time to the first new token), decode = (new tokens - 1) / (time from
the first new token to the last), CUDA synchronised at each token.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import torch

from composer.blocks.model import HybridModel
from composer.data.indexed import DataError
from composer.data.tokenizer import (
    TOKENIZER_DIR,
    ByteTokenizer,
    HFTokenizer,
    has_tokenizer,
    load_tokenizer,
)
from composer.portable import CONFIG_FILE, is_training_checkpoint

DEFAULT_MAX_NEW_TOKENS = 128
EOS_FILES = ("generation_config.json", "config.json")

Tokenizer = ByteTokenizer | HFTokenizer


class GenerateError(ValueError):
    """A user mistake in ``composer generate``: one line, exit code 2."""


def add_parser(sub: Any) -> None:
    """Register ``generate`` on the ``composer`` command's subparsers."""
    gen = sub.add_parser("generate", help="continue a prompt with a checkpoint (text streams)")
    gen.add_argument("source", help="a portable checkpoint, a `train --save` folder, or a "
                                    "Hugging Face folder")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument("--prompt-file", help="read the prompt from this UTF-8 file (as is)")
    gen.add_argument("--adapter", metavar="DIR", default=None,
                     help="a PEFT LoRA adapter folder, merged into the weights")
    gen.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                     help=f"stop after this many new tokens (default {DEFAULT_MAX_NEW_TOKENS})")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 (default): greedy; > 0: sample from softmax(logits / T)")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the K likeliest")
    gen.add_argument("--top-p", type=float, default=None,
                     help="sample within the smallest set of probability >= P (nucleus)")
    gen.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    gen.add_argument("--chat", action="store_true",
                     help="render the prompt as a user message through the chat template")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image before the prompt (repeatable; a vision-language model)")
    gen.add_argument("--tokenizer", default=None,
                     help="byte, a tokenizer folder, a dataset PREFIX or a hub id "
                          "(default: the SOURCE's)")
    gen.add_argument("--json", action="store_true",
                     help="no streaming; one line of JSON on stdout (text, ids, speeds)")
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                     help="auto (default): CUDA when available")
    gen.set_defaults(func=cmd_generate)


def check_arguments(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise GenerateError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise GenerateError(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise GenerateError(f"--top-p must be in (0, 1], got {args.top_p}")


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompt-file {path}: no such file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise GenerateError(f"--prompt-file {path}: not UTF-8 text") from None
    else:
        text = args.prompt
    if not text:
        raise GenerateError("the prompt is empty")
    return text


def _hf_architectures(folder: Path) -> list[str]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    archs = config.get("architectures") if isinstance(config, dict) else None
    return archs if isinstance(archs, list) else []


def source_kind(source: Path) -> str:
    """``"training"``, ``"portable"`` or ``"hf"``; anything else is an error."""
    if source.is_dir():
        if is_training_checkpoint(source):
            return "training"
        if (source / CONFIG_FILE).is_file():
            return "portable"
        if _hf_architectures(source):
            return "hf"
    raise GenerateError(f"{source}: not a checkpoint (a portable checkpoint has {CONFIG_FILE}, "
                        "a `composer train --save` folder has 'latest', a Hugging Face folder "
                        "has a config.json with architectures)")


def _metadata_folders(source: Path, kind: str) -> list[Path]:
    """Where a SOURCE keeps its tokenizer and generation files, in the order looked at."""
    from composer.convert.api import HF_DIR  # a converted checkpoint's Hugging Face files

    return [source] if kind == "hf" else [source / TOKENIZER_DIR, source / HF_DIR]


def find_tokenizer(source: Path, kind: str, spec: str | None) -> Tokenizer:
    if spec is not None:
        return load_tokenizer(spec)
    folders = _metadata_folders(source, kind)
    for folder in folders:
        if has_tokenizer(folder):
            return load_tokenizer(str(folder))
    looked = " and ".join(f"{f}/" for f in folders)
    raise GenerateError(f"{source}: no tokenizer found (looked in {looked}); give --tokenizer "
                        "(byte, a tokenizer folder, a dataset prefix or a hub id)")


def stop_ids(tok: Tokenizer, source: Path, kind: str) -> list[int]:
    """The tokenizer's end-of-document id, then the ``eos_token_id`` of the SOURCE's
    ``generation_config.json`` (or, without one, ``config.json``)."""
    ids = [] if tok.eod is None else [tok.eod]
    for folder in _metadata_folders(source, kind):
        for name in EOS_FILES:
            path = folder / name
            if not path.is_file():
                continue
            try:
                eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            except (ValueError, AttributeError):
                raise GenerateError(f"{path}: not a JSON object") from None
            ids += [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
            break
    return list(dict.fromkeys(ids))


def encode(tok: Tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        try:
            rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True)
        except DataError as exc:
            raise GenerateError(f"--chat: {exc}") from None
        ids = tok.encode(rendered)
    else:
        ids = tok.encode_prompt(text)
    if not ids:
        raise GenerateError("the prompt encodes to no tokens")
    return ids


def with_images(model: HybridModel, source: Path, kind: str, tok: Tokenizer, text: str,
                chat: bool, paths: list[str]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The prompt's ids with each image's ``<|vision_start|>``, ``t*h*w / merge^2`` x
    ``<|image_pad|>`` and ``<|vision_end|>`` before the text (with ``--chat``: where the chat
    template renders an image in the user message, then expanded), and the images' pixels and
    grids, preprocessed as the SOURCE's ``preprocessor_config.json`` says (else the model's
    patch and merge sizes with Qwen3.5's published settings)."""
    from composer.data.chat_images import expand_placeholders
    from composer.vision.preprocess import ImageSettings, n_placeholders, preprocess_images

    v = model.config.vision
    if v is None:
        raise GenerateError(f"--image: {source} has no vision tower (a text model)")
    settings = ImageSettings(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                             merge_size=v.merge_size)
    for folder in _metadata_folders(source, kind):
        if (folder / "preprocessor_config.json").is_file():
            settings = ImageSettings.from_hf(folder)
            break
    pixels, grid = preprocess_images(list(paths), settings)
    counts = n_placeholders(grid, v.merge_size)
    start, pad, end = v.vision_start_token_id, v.image_token_id, v.vision_end_token_id
    if not chat:
        blocks = [[start, *[pad] * n, *([] if end is None else [end])] for n in counts]
        return [i for b in blocks for i in b] + encode(tok, text, False), pixels, grid
    try:
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": [*[{"type": "image"}] * len(paths),
                                          {"type": "text", "text": text}]}],
            add_generation_prompt=True)
    except DataError as exc:
        raise GenerateError(f"--chat: {exc}") from None
    try:  # the template writes one pad per image: each becomes its image's count
        ids, _ = expand_placeholders(tok.encode(rendered), pad, counts)
    except DataError as exc:
        raise GenerateError(f"--image: {exc}") from None
    return ids.tolist(), pixels, grid


def load_model(source: Path, kind: str, device: str, adapter: str | None = None) -> HybridModel:
    """The SOURCE's model on ``device``, in eval mode (a Hugging Face folder converted into a
    temporary folder first, removed once loaded), with the PEFT ``adapter`` merged if given."""
    from composer.parallel.mesh import ParallelConfig
    from composer.run import prepare

    if kind == "hf":
        from composer.convert import from_hf

        with tempfile.TemporaryDirectory(prefix="composer-generate-") as tmp:
            from_hf(source, Path(tmp) / "checkpoint")
            return load_model(Path(tmp) / "checkpoint", "portable", device, adapter)
    with warnings.catch_warnings():  # DCP's note that it reads in a single process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        model, _, _, _ = prepare(str(source), ParallelConfig(), device=device, adapter=adapter)
    from composer.lora import adapter_modules, merge_lora

    if adapter_modules(model):  # a LoRA run: merged (exact; every cached path reads W alone)
        merge_lora(model)
    return model.eval()


class Stream:
    """Receives each new token id and writes the text as it becomes final: all ids so far are
    decoded and the new suffix printed, held back while the text ends in U+FFFD (an incomplete
    UTF-8 sequence). Nothing after a stop id is taken."""

    def __init__(self, tok: Tokenizer, stop: set[int], out: TextIO) -> None:
        self.tok, self.stop, self.out = tok, stop, out
        self.ids: list[int] = []
        self.printed = 0
        self.ended = False

    def add(self, token_id: int) -> None:
        if self.ended or token_id in self.stop:
            self.ended = True
            return
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._write(text)

    def finish(self) -> None:
        """Write what was held back (a sequence that stayed incomplete), then a newline."""
        self._write(self.tok.decode(self.ids))
        self.out.write("\n")
        self.out.flush()

    def _write(self, text: str) -> None:
        if len(text) > self.printed:
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)


class Clock:
    """The time of the first and the last new token (CUDA synchronised on a CUDA device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = self.start
        self.n_tokens = 0

    def tick(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last = time.perf_counter()
        self.first = self.first or self.last
        self.n_tokens += 1

    def speeds(self, n_prompt: int) -> tuple[float | None, float | None]:
        """(prefill, decode) tokens per second; None where nothing was timed."""
        if self.first is None:
            return None, None
        prefill = n_prompt / max(self.first - self.start, 1e-9)
        span = self.last - self.first
        decode = (self.n_tokens - 1) / span if self.n_tokens > 1 and span > 0 else None
        return round(prefill, 1), None if decode is None else round(decode, 1)


def _generated(out_BT: torch.Tensor, n_prompt: int, stop: set[int]) -> tuple[list[int], str]:
    """The new ids, up to and including the first stop id, and why generation ended."""
    ids = [int(i) for i in out_BT[0, n_prompt:].tolist()]
    for k, token_id in enumerate(ids):
        if token_id in stop:
            return ids[:k + 1], "eos"
    return ids, "length"


def notice(text: str) -> None:
    print(f"composer generate: {text}", file=sys.stderr, flush=True)


def decodable_limit(tok: Tokenizer, vocab: int) -> int:
    """The ids generation may produce: the model's, less those past the tokenizer's vocabulary.
    Hugging Face models often pad their embedding past the tokenizer (to a multiple of 64 or
    128): those rows mean no text, so they are masked, as the tokenizer could not decode them."""
    if vocab <= tok.vocab_size:
        return vocab
    notice(f"the model's vocabulary ({vocab}) is larger than the tokenizer's "
           f"({tok.vocab_size}): ids {tok.vocab_size}..{vocab - 1} have no text and are never "
           "generated")
    return tok.vocab_size


def cmd_generate(args: argparse.Namespace) -> int:
    from composer.inference.decode import generate

    check_arguments(args)
    text = read_prompt(args)
    source = Path(args.source)
    kind = source_kind(source)
    tok = find_tokenizer(source, kind, args.tokenizer)
    prompt_ids = encode(tok, text, args.chat)
    model = load_model(source, kind, args.device, args.adapter)
    images: dict[str, torch.Tensor] = {}
    if args.image:
        prompt_ids, pixels, grid = with_images(model, source, kind, tok, text, args.chat,
                                               args.image)
        images = {"pixel_values": pixels, "image_grid_thw": grid}
    vocab = model.config.vocab_size
    if max(prompt_ids) >= vocab:
        raise GenerateError(f"the prompt's token ids reach {max(prompt_ids)}, past the model's "
                            f"vocabulary of {vocab}; is the tokenizer ({tok.name}) the model's?")
    limit = decodable_limit(tok, vocab)
    stop = [i for i in stop_ids(tok, source, kind) if i < limit]
    if not stop:
        notice(f"tokenizer {tok.name} has no end-of-document token: generating "
               f"--max-new-tokens ({args.max_new_tokens}) tokens")
    device = next(model.parameters()).device
    clock = Clock(device)
    stream = None if args.json else Stream(tok, set(stop), sys.stdout)

    def on_token(col_B: torch.Tensor) -> None:
        clock.tick()
        if stream is not None:
            stream.add(int(col_B[0]))

    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    clock.start = time.perf_counter()
    with torch.inference_mode():
        out_BT = generate(model, input_ids, args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, eos_token_id=stop or None,
                          seed=args.seed, on_token=on_token,
                          vocab_limit=limit if limit < vocab else None, **images)
    wall = time.perf_counter() - clock.start
    new_ids, reason = _generated(out_BT, len(prompt_ids), set(stop))
    prefill, decode = clock.speeds(len(prompt_ids))
    if stream is not None:
        stream.finish()
        rates = f"prefill {prefill or 0:,.0f} tokens/s, decode {decode or 0:,.0f} tokens/s"
        print(f"{len(new_ids)} new tokens ({reason}) in {wall:.2f}s: {rates}", file=sys.stderr)
        return 0
    body = new_ids[:-1] if reason == "eos" else new_ids
    print(json.dumps({"text": tok.decode(body), "token_ids": new_ids,
                      "prompt_token_ids": prompt_ids, "n_prompt_tokens": len(prompt_ids),
                      "n_new_tokens": len(new_ids), "finish_reason": reason,
                      "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode,
                      "wall_s": round(wall, 3)}))
    return 0
