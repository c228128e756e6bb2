"""The built-in chat set: short templated conversations and a byte-level ChatML tokenizer, shipped
in the package so that ``composer train --config sft-debug`` shows the masked loss fall with no
download.

License: written for this project (every word list, table and phrasing below is ours, no
third-party text), under the package's own license, Apache-2.0 (pyproject.toml). The generated
files (``builtin/chat/``) are under the same license.

The tasks are templated so that a tiny model learns them in a minute or two on a CPU: the answer
is a function of the question (arithmetic, echo, reverse, uppercase, count the letters, repeat a
word, the capital of an invented country from a fixed table), asked in several phrasings, some
conversations multi-turn, some with a system prompt. Everything comes from one seeded
``random.Random``, so the files are byte-identical on every regeneration::

    python -m composer.data.chatset           # rewrites chat.jsonl and tokenizer/
    python -m composer.data.chatset --prepare # ... and the prepared dataset PREFIX (chat.bin ...)

The tokenizer is byte-level: ids 0-255 are the bytes (GPT-2's byte-to-unicode alphabet, no
merges), then ``<|endoftext|>`` 256, ``<|im_start|>`` 257, ``<|im_end|>`` 258 (a vocabulary of
259). Its ChatML ``chat_template`` wraps each assistant turn's content and its ``<|im_end|>`` in
``{% generation %}`` markers, so the loss mask is exactly those tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BUILTIN_CHAT = Path(__file__).parent / "builtin" / "chat"
JSONL = BUILTIN_CHAT / "chat.jsonl"
TOKENIZER = BUILTIN_CHAT / "tokenizer"
PREFIX = BUILTIN_CHAT / "chat"
"""The prepared dataset (``chat.bin``, ``.idx``, ``.mask.*``, ``.chat.json``, ``.tokenizer/``);
``data: builtin:chat`` in a recipe names it (:func:`resolve_builtin`)."""
BUILTIN_NAMES = {"builtin:chat": PREFIX}
SEED = 23
N_CONVERSATIONS = 1200
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MAX_TOKENS = 256
"""No conversation is longer (the recipe's ``seq_len``): nothing is truncated."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WORDS = (
    "apple river stone cloud garden window candle forest silver bridge lantern meadow pepper "
    "harbor pencil rabbit orange planet marble summer winter castle feather basket mirror "
    "tunnel violin copper island kettle ladder magnet needle oyster pillow quartz rocket "
    "saddle ticket velvet wagon yellow zipper anchor button cactus dragon engine falcon "
    "guitar helmet jacket kitten lemon muffin noodle parrot puzzle rainbow shadow spider "
    "tiger turtle wallet whistle blanket cherry dolphin eagle garlic hammer igloo jungle "
    "koala lizard mango nest otter pirate quilt robot sunset tomato umbrella valley walrus"
).split()

# An invented atlas: no real place, so the answers can only be learnt from this set.
CAPITALS = {
    "Veloria": "Amberhold", "Tarnis": "Quillport", "Orvane": "Saltmere", "Duskara": "Fenwick",
    "Brimholt": "Cobbleton", "Zephyrine": "Larkspur", "Mornavia": "Glenmoor", "Castrel": "Ivybrook",
    "Halvenor": "Stonereach", "Pellucia": "Marrowdale", "Quendra": "Thistlegate",
    "Ravenmark": "Oakhollow", "Sundral": "Brightwater", "Ulmaris": "Copperfield",
    "Vantorin": "Mistvale", "Wyndell": "Harrowgate",
}

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in one short sentence.",
    "You answer questions about words, numbers and the atlas of invented countries.",
)


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    op = rng.choice("+-")
    a, b = (a, b) if op == "+" or a >= b else (b, a)  # no negative results
    value = a + b if op == "+" else a - b
    ask = rng.choice(("What is {e}?", "Compute {e}.", "{e} = ?", "Please work out {e}.",
                      "Can you tell me what {e} is?"))
    return ask.format(e=f"{a} {op} {b}"), f"{a} {op} {b} = {value}."


def _echo(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    ask = rng.choice(("Repeat after me: {w}", "Say '{w}'.", "Echo the word {w}.",
                      "Please write back: {w}"))
    return ask.format(w=word), word


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    ask = rng.choice(("Reverse the word '{w}'.", "Spell {w} backwards.",
                      "What is '{w}' written backwards?", "Write {w} in reverse."))
    return ask.format(w=word), word[::-1]


def _uppercase(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    ask = rng.choice(("Uppercase: {w}", "Write '{w}' in capital letters.",
                      "Make {w} uppercase.", "Shout the word {w}."))
    return ask.format(w=word), word.upper()


def _count(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    ask = rng.choice(("How many letters are in '{w}'?", "Count the letters of {w}.",
                      "How long is the word {w}?"))
    return ask.format(w=word), f"'{word}' has {len(word)} letters."


def _repeat(rng: random.Random) -> tuple[str, str]:
    word, n = rng.choice(WORDS), rng.randint(2, 4)
    times = {2: "twice", 3: "three times", 4: "four times"}[n]
    ask = rng.choice(("Say {w} {t}.", "Write '{w}' {t}.", "Repeat {w} {t}, please."))
    return ask.format(w=word, t=times), " ".join([word] * n)


def _capital(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(sorted(CAPITALS))
    ask = rng.choice(("What is the capital of {c}?", "Name the capital city of {c}.",
                      "Which city is the capital of {c}?", "{c}: capital?"))
    return ask.format(c=country), f"The capital of {country} is {CAPITALS[country]}."


TASKS = (_arithmetic, _echo, _reverse, _uppercase, _count, _repeat, _capital)


def n_tokens(messages: list[dict[str, str]]) -> int:
    """The conversation's length in the shipped tokenizer: ChatML wraps each message as
    ``<|im_start|>ROLE\nCONTENT<|im_end|>\n`` and every other byte is one token."""
    return sum(len(m["role"].encode()) + len(m["content"].encode()) + 4 for m in messages)


def conversation(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """One conversation: an optional system prompt (one in four), then one to three turns (a
    turn that would make it longer than :data:`MAX_TOKENS` is left out)."""
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
        question, answer = rng.choice(TASKS)(rng)
        turn = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if n_tokens(messages + turn) > MAX_TOKENS:
            break
        messages += turn
    return {"messages": messages}


def conversations(n: int = N_CONVERSATIONS, seed: int = SEED) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


def jsonl_text(rows: list[dict[str, Any]]) -> str:
    """The file's exact text: one compact JSON row per line (the byte-identity test compares
    it)."""
    return "".join(json.dumps(r, ensure_ascii=True, separators=(",", ":")) + "\n" for r in rows)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map: byte ``b`` is the printable character ``alphabet[b]``
    (``tokenizers``' ByteLevel pre-tokenizer maps bytes the same way)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json``: what composer's HFTokenizer and transformers'
    AutoTokenizer read (the eos token ends an assistant turn, so generation stops there)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "name_or_path": "composer-builtin-chat",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(folder: str | Path = TOKENIZER) -> Path:
    """The byte-level tokenizer in ``folder`` (``tokenizer.json`` + ``tokenizer_config.json``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {char: b for b, char in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # no regex split: with no merges it would change nothing but the speed
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1) + "\n",
                                               encoding="utf-8")
    return out


def build(folder: str | Path = BUILTIN_CHAT) -> dict[str, Any]:
    """Write ``chat.jsonl`` and ``tokenizer/`` into ``folder``; their counts."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rows = conversations()
    (out / JSONL.name).write_text(jsonl_text(rows), encoding="utf-8")
    write_tokenizer(out / TOKENIZER.name)
    turns = sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in rows)
    return {"conversations": len(rows), "assistant_turns": turns,
            "bytes": (out / JSONL.name).stat().st_size}


def prepare(folder: str | Path = BUILTIN_CHAT) -> dict[str, Any]:
    """Prepare ``chat.jsonl`` with the shipped tokenizer into the dataset PREFIX ``chat``
    (tokens, mask, ``chat.json``, ``chat.tokenizer/``; format in :mod:`composer.data.masked`)."""
    out = Path(folder)
    from composer.data.chat_prepare import prepare_chat

    # from inside the folder: the shipped record names its inputs relative to it, not as paths
    # of the machine that made it
    with _chdir(out):
        return prepare_chat([JSONL.name], PREFIX.name, tokenizer=os.path.join(".", TOKENIZER.name),
                            mask="assistant", force=True)


@contextlib.contextmanager
def _chdir(folder: Path) -> Iterator[None]:  # contextlib.chdir is Python 3.11+ only
    old = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(old)


def resolve_builtin(prefix: str) -> str:
    """A shipped dataset's name (``builtin:chat``) as its PREFIX; any other prefix unchanged."""
    return str(BUILTIN_NAMES[prefix]) if prefix in BUILTIN_NAMES else prefix


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m composer.data.chatset",
                                     description="regenerate the built-in chat set")
    parser.add_argument("--out", default=str(BUILTIN_CHAT), help="folder (default: the package's)")
    parser.add_argument("--prepare", action="store_true",
                        help="also prepare the masked dataset PREFIX chat from it")
    args = parser.parse_args(argv)
    report = build(args.out)
    if args.prepare:
        report["prepared"] = prepare(args.out)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
