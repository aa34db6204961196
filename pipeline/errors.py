"""One error root for everything the pipeline tells a user, and the formatting of pydantic errors into our words."""

from __future__ import annotations

import difflib

from pydantic import ValidationError


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose; the CLI prints these without a traceback."""


class ConfigError(PipelineError):
    """A study file, search-space file or command-line value is wrong. The message names source, key, value, fix."""


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
        else:
            lines.append(f"  - {loc}: {item['msg']} (got {value!r})")
    return "\n".join(lines)
