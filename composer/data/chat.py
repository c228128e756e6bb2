"""Chat rows to tokens and a loss mask: what ``composer data prepare --format chat`` runs on
each row (:mod:`composer.data.chat_prepare` drives the files and the pool).

Rows (one JSON object per line):

- ``{"messages": [{"role": ..., "content": ...}, ...]}``: roles ``system``, ``user``,
  ``assistant``, ``tool``; ``content`` a string (an assistant message with ``tool_calls`` may
  leave it out), or a list of parts ``{"type": "text", "text": ...}`` / ``{"type": "image"}``
  (a row's ``"images"``: :mod:`composer.data.chat_images`). Other keys of a message
  (``tool_calls``, ``reasoning_content``, ``name``...) reach the template as they are; keys
  whose value is null are dropped and reasoning fields aliased, as ``transformers`` does
  before rendering.
- ``{"prompt": ..., "completion": ...}``: each a string or a list of messages; a string prompt
  is one user message, a string completion one assistant message. The conversation is the
  prompt's messages followed by the completion's.

Rendering is the tokenizer's ``chat_template`` (or ``--chat-template FILE``) as
``transformers.apply_chat_template`` renders it (:meth:`HFTokenizer.render_chat`); the
conversation is rendered once in full and tokenised once, so its tokens are exactly what
``apply_chat_template(messages, tokenize=True)`` gives. The byte tokenizer has no template and
is refused.

The loss mask (``mask[t] = 1``: token ``t`` is a supervised target) marks every token whose
character span overlaps a supervised character span of the rendering:

- A template with ``{% generation %}`` blocks: the spans those blocks render, exactly as
  ``return_assistant_tokens_mask=True`` marks them (the same tracking and the same
  token/span overlap rule).
- Any other template, by incremental rendering: for assistant message ``i``,
  ``P = render(messages[:i], add_generation_prompt=True)`` and
  ``R = render(messages[:i + 1])``; ``R`` must start with ``P`` and the full rendering with
  ``P`` (else a one-line error: the template is not prefix-preserving). The new text
  ``R[len(P):]`` is the turn; the generation prompt (the role header) is never in it. Of the
  new text, supervised is from the message's content to the end of its end-of-turn token:
  whitespace after the last non-space character (ChatML's ``"\\n"`` after ``<|im_end|>``) is
  not, since generation stops at the end-of-turn token and never produces it. What the
  template writes before the content is not supervised either (Qwen3's
  ``<think>\\n\\n</think>\\n\\n`` in a turn without reasoning): it is found by rendering
  the same turn with empty content and no reasoning fields, and cut only when the new text
  starts with exactly that and the content follows verbatim. Otherwise (a turn with
  reasoning, which Qwen3 renders as ``<think>\\n...\\n</think>\\n\\n`` before the answer)
  the whole new text is supervised, reasoning included. So the supervised tokens decode to
  each assistant content plus its end-of-turn token. A turn the template renders differently
  once later messages follow (Qwen3 drops the reasoning block, empty or not, of the turns
  before the last user message) is matched by the longest end of its text that the full
  rendering has there: its answer (or tool calls) and end-of-turn token are supervised;
  when no end of it matches, the row is an error.

Mask modes (``--mask``):

- ``assistant`` (default): every assistant turn.
- ``last-turn``: only the last assistant turn.
- ``completion``: for prompt/completion rows, the assistant turns of the completion; for
  messages rows, the last assistant turn (the usual reading of "the completion" of a chat).
- ``none``: every token.

A row with no supervised token is an error (a row that teaches nothing is most often a
mistake in the data); with ``--skip-bad-rows`` it is counted and skipped like every other bad
row.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from composer.data.indexed import DataError
from composer.data.tokenizer import ByteTokenizer, HFTokenizer, _compile, _one_line

ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "image")
MASK_MODES = ("assistant", "last-turn", "completion", "none")
TRUNCATE_SIDES = ("right", "left", "error")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Span = tuple[int, int]


class RowError(DataError):
    """A row that cannot be used (the message names what is wrong, not where)."""


def has_generation_tags(template: str) -> bool:
    """Whether ``template`` marks assistant output with ``{% generation %}`` (the test
    ``transformers`` makes)."""
    return _GENERATION_TAG.search(template) is not None


def _message(raw: Any, n: int) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise RowError(f"message {n} is {type(raw).__name__}, not an object")
    message = {k: v for k, v in raw.items() if v is not None}  # as transformers normalises
    role = message.get("role")
    if role is None:
        raise RowError(f"message {n} has no role")
    if role not in ROLES:
        raise RowError(f"message {n} has an unknown role {role!r} (roles: {', '.join(ROLES)})")
    content = message.get("content")
    if content is None and not (role == "assistant" and message.get("tool_calls")):
        raise RowError(f"message {n} ({role}) has no content")
    if isinstance(content, list):
        _check_parts(content, f"message {n} ({role})")
    elif content is not None and not isinstance(content, str):
        raise RowError(f"message {n} ({role}): content is {type(content).__name__}, "
                       "not a string or a list of parts")
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    if reasoning is not None:  # transformers' _alias_reasoning_fields
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _check_parts(parts: list[Any], where: str) -> None:
    """A list content: ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts, as
    multimodal templates read them (an image part takes the row's next image)."""
    for k, part in enumerate(parts, 1):
        if not isinstance(part, dict):
            raise RowError(f"{where}: part {k} is {type(part).__name__}, not an object")
        kind = part.get("type")
        if kind not in PART_TYPES:
            raise RowError(f"{where}: part {k} has type {kind!r} (types: "
                           f"{', '.join(PART_TYPES)})")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise RowError(f"{where}: part {k} (text) has no 'text' string")


def _messages(value: Any, field: str, role: str) -> list[Any]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise RowError(f"{field!r} is {type(value).__name__}, not a string or a list of messages")


def parse_row(record: Any) -> tuple[list[dict[str, Any]], int | None]:
    """A row's messages, and for a prompt/completion row the index of the completion's first
    message (None for a messages row)."""
    if not isinstance(record, dict):
        raise RowError(f"a row is a JSON object, not {type(record).__name__}")
    if "messages" in record:
        if not isinstance(record["messages"], list):
            raise RowError(f"'messages' is {type(record['messages']).__name__}, not a list of "
                           "messages")
        raw, start = record["messages"], None
    elif "prompt" in record and "completion" in record:
        prompt = _messages(record["prompt"], "prompt", "user")
        raw = prompt + _messages(record["completion"], "completion", "assistant")
        start = len(prompt)
    else:
        raise RowError("no 'messages' and no 'prompt'/'completion' keys")
    if not raw:
        raise RowError("no messages")
    return [_message(m, n) for n, m in enumerate(raw, 1)], start


class ChatEncoder:
    """Rows to (token ids, 0/1 mask) with ``tok`` and ``template`` (the tokenizer's own when
    None) under mask ``mode``; ``kwargs`` reach the template."""

    def __init__(self, tok: ByteTokenizer | HFTokenizer, template: str | None = None,
                 mode: str = "assistant", **kwargs: Any) -> None:
        if isinstance(tok, ByteTokenizer):
            raise DataError("--format chat needs a tokenizer with a chat template; the byte "
                            "tokenizer has none")
        if mode not in MASK_MODES:
            raise DataError(f"mask mode {mode!r}: expected one of {', '.join(MASK_MODES)}")
        self.tok, self.mode, self.kwargs = tok, mode, kwargs
        self.template = tok.chat_template() if template is None else template
        self.generation = has_generation_tags(self.template)
        try:
            _compile(self.template)
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"the chat template does not compile ({_one_line(e)})") from None

    def render(self, messages: list[dict[str, Any]],
               add_generation_prompt: bool = False) -> tuple[str, list[Span]]:
        try:
            return self.tok.render_chat(messages, add_generation_prompt, self.template,
                                        **self.kwargs)
        except DataError as e:
            raise RowError(str(e).removeprefix(f"tokenizer {self.tok.name}: ")) from None

    def _turns(self, messages: list[dict[str, Any]], start: int | None) -> list[int]:
        """The assistant messages whose turns the mode supervises."""
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.mode == "last-turn" or (self.mode == "completion" and start is None):
            return turns[-1:]
        if self.mode == "completion":
            return [i for i in turns if i >= start]
        return turns

    def _generation_spans(self, messages: list[dict[str, Any]], text: str,
                          spans: list[Span], turns: list[int]) -> list[Span]:
        """The generation spans of the supervised turns: all of them in ``assistant`` mode,
        else those rendered after the messages before the first supervised turn."""
        if self.mode == "assistant":
            return spans
        if not turns:
            return []
        before = self.render(messages[:turns[0]])[0]
        if not text.startswith(before):
            raise RowError(f"message {turns[0] + 1}: the chat template renders the messages "
                           "before it differently from the whole conversation")
        return [s for s in spans if s[0] >= len(before)]

    def _turn_span(self, messages: list[dict[str, Any]], i: int, full: str) -> Span:
        """Message ``i``'s supervised characters in ``full``, by incremental rendering."""
        prompt = self.render(messages[:i], add_generation_prompt=True)[0]
        with_turn = self.render(messages[:i + 1])[0]
        if not with_turn.startswith(prompt) or not full.startswith(prompt):
            raise RowError(f"message {i + 1}: the chat template is not prefix-preserving (the "
                           "conversation before this assistant turn, with the generation "
                           "prompt, does not start the rendering with it); give one with "
                           "{% generation %} markers (--chat-template)")
        new = with_turn[len(prompt):]
        body_end = len(new.rstrip())
        lead = self._lead(messages, i, prompt, new)
        after = full[len(prompt):]
        if after.startswith(new[:body_end]):
            return len(prompt) + lead, len(prompt) + body_end
        cut = _rendered_end(new[:body_end], after)
        if cut is not None:  # what only a last turn carries is left out here
            return len(prompt), len(prompt) + body_end - cut
        raise RowError(f"message {i + 1}: the chat template renders this assistant turn "
                       "differently once later messages follow; give one with "
                       "{% generation %} markers (--chat-template)")

    def _lead(self, messages: list[dict[str, Any]], i: int, prompt: str, new: str) -> int:
        """How much of the new text the template writes before the content: what it writes
        before an empty content (reasoning fields left out), when the new text starts with
        exactly that and the content follows verbatim; else 0 (the template rewrote the
        content, or wrote something of the message's own before it: supervised whole)."""
        content = messages[i].get("content")
        stripped = content.strip() if isinstance(content, str) else ""
        where = new.find(stripped) if stripped else -1
        if where <= 0:
            return 0
        tail = new[where + len(stripped):]
        bare = {k: v for k, v in messages[i].items() if k not in REASONING_FIELDS}
        try:
            empty = self.render([*messages[:i], {**bare, "content": ""}])[0]
        except RowError:  # a template that refuses empty content: nothing to compare with
            return 0
        if not empty.startswith(prompt) or not empty.endswith(tail):
            return 0
        lead = empty[len(prompt):len(empty) - len(tail)]
        return len(lead) if len(lead) <= where and new.startswith(lead) else 0

    def encode(self, messages: list[dict[str, Any]],
               start: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The conversation's token ids (int64) and mask (uint8)."""
        turns = self._turns(messages, start)
        text, spans = self.render(messages)
        ids, offsets = self.tok.encode_offsets(text)
        if self.mode == "none":
            mask = np.ones(len(ids), dtype=np.uint8)
        else:
            if self.generation:
                chars = self._generation_spans(messages, text, spans, turns)
            else:
                chars = [self._turn_span(messages, i, text) for i in turns]
            mask = token_mask(offsets, sorted(chars))
        if not mask.any():
            raise RowError("no supervised token" + ("" if turns else
                                                   " (no assistant message to supervise)"))
        return np.asarray(ids, dtype=np.int64), mask


def _rendered_end(turn: str, after: str) -> int | None:
    """The least ``k`` such that ``after`` starts with ``turn[k:]``, a part with more than
    whitespace: how much of a turn's last-turn text the template leaves out of it once later
    messages follow (Qwen3: the reasoning block); None when no such part."""
    if not after:
        return None
    k = turn.find(after[0])
    while k != -1:
        if turn[k:].strip() and after.startswith(turn[k:]):
            return k
        k = turn.find(after[0], k + 1)
    return None


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> np.ndarray:
    """1 for each token overlapping one of ``spans`` (sorted character spans): the single
    pass ``transformers`` makes for ``return_assistant_tokens_mask``."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    k = 0
    for t, (lo, hi) in enumerate(offsets):
        while k < len(spans) and lo >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if hi > spans[k][0]:
            mask[t] = 1
    return mask


def truncate(ids: np.ndarray, mask: np.ndarray, seq_len: int,
             side: str) -> tuple[np.ndarray, np.ndarray]:
    """A conversation cut to ``seq_len`` tokens: ``right`` keeps the first ``seq_len``,
    ``left`` the last; ``error`` refuses a longer one (a :class:`RowError` with both
    lengths). Shorter ones come back unchanged."""
    if side not in TRUNCATE_SIDES:
        raise DataError(f"truncate {side!r}: expected one of {', '.join(TRUNCATE_SIDES)}")
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    if len(ids) <= seq_len:
        return ids, mask
    if side == "error":
        raise RowError(f"{len(ids)} tokens, longer than --seq-len {seq_len} "
                       "(--truncate right|left cuts it)")
    if side == "right":
        return ids[:seq_len], mask[:seq_len]
    return ids[len(ids) - seq_len:], mask[len(mask) - seq_len:]
