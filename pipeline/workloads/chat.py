"""Chat rows of a workload: OpenAI `messages` (JSONL, Parquet) and ShareGPT-style JSON, checked and normalised.

A chat prompt is the conversation up to the turn the model answers: a list of `{"role", "content"}` with roles
`system`, `user`, `assistant`, the last one `user`. ShareGPT files (`.json`: a list of `{"id"?, "conversations":
[{"from": "human"|"gpt"|"system", "value"}]}`) become the same: `human` -> user, `gpt` -> assistant; a trailing `gpt`
turn is the recorded answer (`output`, used to build a corpus), not part of the prompt. Pure: no I/O but `read_sharegpt`.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ROLES", "Messages", "check_messages", "read_sharegpt", "readable"]

ROLES = ("system", "user", "assistant")
Messages = tuple[tuple[str, str], ...]  # ((role, content), ...): hashable, so a Prompt stays frozen
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system"}


def check_messages(value: object, where: str, error: type[Exception]) -> Messages:
    """`value` (a list, or its JSON text as Parquet may store it) as Messages; `error(message)` names `where`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: field 'messages' is a string but not JSON ({exc.msg})") from exc
    if not isinstance(value, list) or not value:
        raise error(f"{where}: field 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects, "
                    f"got {type(value).__name__}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise error(f"{where}: messages[{i}] must be an object with 'role' and 'content' only, got {message!r}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise error(f"{where}: messages[{i}].role must be one of {list(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise error(f"{where}: messages[{i}].content must be a string, got {type(content).__name__}")
        out.append((role, content))
    if out[-1][0] != "user":
        raise error(f"{where}: the last message must be the user's (the model answers it), got role "
                    f"{out[-1][0]!r}; put the recorded answer in 'output'")
    return tuple(out)


def readable(messages: Messages) -> str:
    """A plain-text view (logs, digests); never what the model sees: the engine's chat template renders that."""
    return "\n".join(f"{role}: {content}" for role, content in messages)


def read_sharegpt(path: Path, error: type[Exception]) -> list[tuple[str, str, object]]:
    """(where, default id, row) per conversation, rows in the workload's own field names."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not a ShareGPT JSON file ({exc}); expected a list of {{\"conversations\": [...]}}") \
            from exc
    if not isinstance(data, list):
        raise error(f"{path}: a ShareGPT file is a JSON list of conversations, got {type(data).__name__}")
    rows: list[tuple[str, str, object]] = []
    for i, item in enumerate(data, start=1):
        where = f"{path}: conversation {i}"
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or not turns:
            raise error(f"{where}: field 'conversations' must be a non-empty list of {{\"from\", \"value\"}}")
        messages = []
        for j, turn in enumerate(turns):
            role = _SHAREGPT_ROLES.get(str(turn.get("from"))) if isinstance(turn, dict) else None
            if role is None or not isinstance(turn.get("value"), str):
                raise error(f"{where}: conversations[{j}] must be {{\"from\": one of "
                            f"{sorted(_SHAREGPT_ROLES)}, \"value\": string}}, got {turn!r}")
            messages.append({"role": role, "content": turn["value"]})
        row: dict = {}
        if messages[-1]["role"] == "assistant" and len(messages) > 1:
            row["output"] = messages.pop()["content"]
        row["messages"] = messages
        if isinstance(item, dict) and item.get("id") is not None:
            row["id"] = item["id"]
        rows.append((where, f"{path.stem}:{i}", row))
    return rows
