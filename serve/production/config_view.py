"""What `GET /v1/config` shows a user key: the served config without captured text or server paths.

The served config can hold what users must not read: `replica.corpus_documents` (the NGRAM corpus shipped with the
config: captured prompts and answers, once a candidate that used the capture as its corpus was promoted) and paths
of the server (`origin.source` of a `--config-file`, a local model folder, a corpus path, a flag's value). A user
key gets the config with the documents replaced by their count and every absolute path cut to its last part; an
admin key (or a localhost endpoint without keys, which is open on every route) gets it whole
(`serve.production.settings.admin_access`). Pure.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["user_view", "REDACTED_NOTE"]

REDACTED_NOTE = "admin keys only"
# An absolute POSIX or Windows path, alone or as a flag's value (`--x=/srv/y`), up to the next space or comma.
_PATH = re.compile(r"(?<![\w.:/])(?:~?/|[A-Za-z]:\\)[^\s,;\"']*")


def _cut(text: str) -> str:
    def last_part(found: re.Match[str]) -> str:
        parts = [p for p in re.split(r"[/\\]", found.group(0)) if p]
        return f"…/{parts[-1]}" if parts else "…/"

    return _PATH.sub(last_part, text)


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return _cut(value)
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items()}
    return value


def _replicas(config: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = [("replica", config.get("replica"))]
    policy = config.get("policy")
    if isinstance(policy, dict):
        found.append(("policy.high", policy.get("high")))
    return [(where, replica) for where, replica in found if isinstance(replica, dict)]


def user_view(shown: dict[str, Any]) -> dict[str, Any]:
    """`/v1/config`'s answer (the served config's fields plus `origin` and the rest) as a user key sees it."""
    view = _scrub(shown)
    redacted = []
    for where, replica in _replicas(view):
        documents = replica.get("corpus_documents")
        if documents is not None:
            replica["corpus_documents"] = None
            redacted.append(f"{where}.corpus_documents ({len(documents)} documents)")
    if redacted:
        view["redacted"] = {"fields": redacted, "why": f"captured text: {REDACTED_NOTE}"}
    return view
