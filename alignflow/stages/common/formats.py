"""The shapes a row's text comes in, made into one thing: a conversation (torch-free).

A text field of any stage (a prompt, a response, a chosen or rejected answer) is either a
string or a list of `{role, content}` messages (OpenAI chat format). Which one is detected per
value, as TRL does, unless `data.format` forces it:

- `auto`: strings are plain text, lists are conversations;
- `text`: every field must be a string;
- `chat`: strings become one message (a prompt a user turn, a response an assistant turn), so
  the response is rendered by the chat template too;
- `hh`: Anthropic HH-RLHF transcripts, strings of `\\n\\nHuman: …\\n\\nAssistant: …` turns,
  read as conversations.

A conversation's response is its final assistant turn(s): the messages after the last
non-assistant one. Everything before is the prompt. For preference pairs given as two whole
conversations (UltraFeedback-binarized, HH-RLHF) the prompts must be the same messages.

`input_template` builds the prompt from columns (`"{instruction}\\n\\n{input}"`). Rule for
empty values (an empty string or null, such as Alpaca's empty `input`): a paragraph of the
template (text between blank lines) whose placeholders are all empty is left out, then a line
whose placeholders are all empty, and the result is stripped of surrounding whitespace, so no
separator or label dangles.
"""

from __future__ import annotations

import difflib
import math
import re
import string
from typing import Any

FORMATS = ("auto", "text", "chat", "hh")
HH_TURN = re.compile(r"\n\n(Human|Assistant): ?")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def finite_number(value: Any) -> bool:
    """An int or float that is a finite float (a bool is not a number here; neither is 10**400)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class DataError(ValueError):
    """A data problem, naming the source and the row."""


class FilteredRow(DataError):
    """A row a data option leaves out on purpose (e.g. `min_score_gap`): counted, never an error."""


Messages = list[dict[str, str]]


# --------------------------------------------------------------------------- columns


def closest(name: str, candidates) -> str:
    """`; did you mean 'x'?` for the candidate nearest `name`, or nothing."""
    match = difflib.get_close_matches(name, [str(c) for c in candidates], n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


def column(row: Any, key: str, where: str, option: str, hint: str = "") -> Any:
    """`row[key]`, or an error that names the option to set and the closest column."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if key not in row:
        raise DataError(f"{where}: missing key {key!r} (set {option} to the column that holds it{closest(key, row)}{hint}; "
                        f"row has: {', '.join(sorted(row)) or 'no keys'})")
    return row[key]


def placeholders(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def render_template(template: str, row: dict, where: str, option: str) -> str:
    """The template filled from the row's columns; see the module doc for the empty-value rule."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    values = {}
    for name in placeholders(template):
        if name not in row:
            raise DataError(f"{where}: missing key {name!r} (a placeholder of {option}{closest(name, row)}; "
                            f"row has: {', '.join(sorted(row)) or 'no keys'})")
        values[name] = "" if row[name] is None else str(row[name])

    def empty(text: str) -> bool:
        names = placeholders(text)
        return bool(names) and all(not values[n].strip() for n in names)

    paragraphs = [p for p in template.split("\n\n") if not empty(p)]
    kept = ["\n".join(line for line in p.split("\n") if not empty(line)) for p in paragraphs]
    return "\n\n".join(p for p in kept if p.strip()).format(**values).strip()


# --------------------------------------------------------------------------- conversations


def whole_conversation(value: Any) -> bool:
    """A conversation that brings its own prompt: its first turn is not the assistant's."""
    return is_messages(value) and value[0].get("role") != "assistant"


def is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def messages(value: Any, role: str, fmt: str, where: str, field: str) -> Messages:
    """The value as a conversation: a string is one `role` message (an HH transcript is parsed)."""
    if isinstance(value, str):
        if fmt == "hh" and (HH_TURN.search("\n\n" + value.lstrip("\n")) or role != "assistant"):
            return hh_messages(value, where, field)
        return [{"role": role, "content": value}]  # under hh, an answer column may be the bare answer
    if not is_messages(value) or not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        raise DataError(f"{where}: {field!r} must be a string or a list of {{role, content}} messages (got {_shown(value)})")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def text_or_messages(value: Any, fmt: str, where: str, field: str, role: str = "user", allow_empty: bool = False) -> str | Messages:
    """A field's value as text (a string) or a conversation, following `data.format`; a string made a
    conversation is one `role` turn."""
    if isinstance(value, str) and not allow_empty and not value.strip():
        raise DataError(f"{where}: {field!r} is empty")
    if isinstance(value, str) and fmt in ("auto", "text"):
        return value
    if fmt == "text":
        raise DataError(f"{where}: {field!r} must be a string when data.format is text (got {_shown(value)})")
    return messages(value, role, fmt, where, field)


def hh_messages(text: str, where: str, field: str) -> Messages:
    """`\\n\\nHuman: a\\n\\nAssistant: b` -> [user a, assistant b]."""
    parts = HH_TURN.split(text if text.startswith("\n\n") else "\n\n" + text)
    if parts[0].strip() or len(parts) < 3:
        raise DataError(f"{where}: {field!r} is not an HH transcript (turns start with '\\n\\nHuman: ' or '\\n\\nAssistant: ') "
                        f"(starts {text[:40]!r})")
    turns = [{"role": HH_ROLES[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts), 2)]
    if len(turns) > 1 and turns[-1] == {"role": "assistant", "content": ""}:
        turns.pop()  # an HH prompt ends with an open "\n\nAssistant:": the header of the turn to answer
    return turns


def split_response(conversation: Messages, where: str, field: str) -> tuple[Messages, Messages]:
    """(prompt, response): the response is the final assistant turn(s)."""
    start = len(conversation)
    while start > 0 and conversation[start - 1]["role"] == "assistant":
        start -= 1
    if start == len(conversation):
        raise DataError(f"{where}: {field!r} does not end with an assistant turn (roles: {[m['role'] for m in conversation]})")
    if start == 0:
        raise DataError(f"{where}: {field!r} has no prompt: every turn is the assistant's; give a prompt column or a user turn")
    if any(not m["content"].strip() for m in conversation[start:]):
        raise DataError(f"{where}: empty response (an empty final assistant turn in {field!r})")
    return conversation[:start], conversation[start:]


def conversation(prompt: Any, response: Any, fmt: str, where: str, fields: tuple[str, str]) -> tuple[Messages, Messages]:
    """(prompt, response) messages of a prompt column and a response column. A response that is a
    whole conversation (its first turn is not the assistant's) brings its own prompt, and then the
    prompt column, if any, is not read (pass `prompt=None`)."""
    reply = messages(response, "assistant", fmt, where, fields[1])
    if reply[0]["role"] != "assistant" or prompt is None:
        return split_response(reply, where, fields[1])
    asked = messages(prompt, "user", fmt, where, fields[0])
    if asked[-1]["role"] == "assistant":
        raise DataError(f"{where}: {fields[0]!r} ends with an assistant turn: a prompt ends with the turn the response answers")
    return split_response(asked + reply, where, fields[1])


def shared_prompt(chosen: tuple[Messages, Messages], rejected: tuple[Messages, Messages], where: str, fields: tuple[str, str]) -> Messages:
    """The prompt of two whole conversations, which must be the same up to the last assistant turn."""
    (a, _), (b, _) = chosen, rejected
    if a != b:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise DataError(f"{where}: {fields[0]!r} and {fields[1]!r} differ before the last assistant turn (at message {at + 1}): "
                        "a pair must be two answers to one prompt")
    return a


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
