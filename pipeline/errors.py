"""Errors the pipeline tells a user, and the formatting of pydantic errors into our words.

`ConfigError` is the one of both floors (`serve.errors`), re-exported here; `UserError` is the common root that the
command lines catch to print a message without a traceback.
"""

from __future__ import annotations

import difflib

from pydantic import ValidationError

from serve.errors import ConfigError, UserError

__all__ = ["ConfigError", "PipelineError", "UserError", "format_validation_error"]


class PipelineError(UserError):
    """A study cannot go on (a folder already holds a study, a resume would mix two studies, ...)."""


def format_validation_error(err: ValidationError, source: str, known: dict[str, list[str]] | None = None) -> str:
    """Turn pydantic's error list into lines that name the file, the dotted key, the value and what to do.

    `known` maps a dotted parent path ("" for the top level) to the keys allowed there, for did-you-mean hints.
    """
    lines = [f"{source}: {err.error_count()} problem(s)"]
    for item in err.errors(include_url=False):
        loc = ".".join(str(part) for part in item["loc"]) or "(top level)"
        kind, value = item["type"], item.get("input")
        if kind == "extra_forbidden":
            key = str(item["loc"][-1])
            parent = ".".join(str(p) for p in item["loc"][:-1])
            hint = ""
            allowed = (known or {}).get(parent)
            if allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else f"; allowed keys: {', '.join(sorted(allowed))}"
            lines.append(f"  - {loc}: unknown key '{key}'{hint}")
        elif kind == "missing":
            lines.append(f"  - {loc}: required key is missing")
        elif kind == "value_error":
            # Our own validators already name the value and the fix; pydantic's prefix adds nothing.
            lines.append(f"  - {loc}: {item['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  - {loc}: {item['msg']} (got {value!r})")
    return "\n".join(lines)
