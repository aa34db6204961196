"""Credentials never leave the process in clear: URLs are masked in everything printed, written or logged.

A study's `storage.url` (e.g. postgresql://tuner:PASSWORD@db/optuna) and `tracking.uri` may carry a password. The
real value is used to connect and nowhere else: `study.yaml`, the banner, `--dry-run` and the MLflow copy of the
resolved study hold the masked form. A resume takes the real value from where the first run did (the study file,
the command line or the environment), never from `study.yaml`.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

MASK = "***"
# Query keys that carry a secret in database and tracking URLs (libpq's `password`, token-style keys of HTTP stores).
SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pwd", "token", "access_token", "secret", "api_key", "apikey"})
URL_KEYS = (("storage", "url"), ("tracking", "uri"))  # the study keys that hold a URL


def mask_url(url: str | None) -> str | None:
    """`url` with the password of its user info and any secret query value replaced by `***`; other text is kept."""
    if not url or "://" not in url:
        return url
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, host = netloc.rsplit("@", 1)
            if ":" in userinfo:
                netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(k.lower() in SECRET_QUERY_KEYS for k, _ in pairs):
                query = urlencode([(k, MASK if k.lower() in SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*")
        if (netloc, query) == (parts.netloc, parts.query):
            return url
        # Rebuilt by hand: urlunsplit would turn sqlite:///x into sqlite:/x.
        return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
                + (f"#{parts.fragment}" if parts.fragment else ""))
    except ValueError:
        # An unparseable URL may still hold a password: show only its scheme.
        return url.split("://", 1)[0] + f"://{MASK}"


def mask_study_dict(data: dict[str, Any]) -> dict[str, Any]:
    """A study's `model_dump` with every URL key masked (a new dict; the input is not changed)."""
    out = dict(data)
    for section, key in URL_KEYS:
        if isinstance(out.get(section), dict) and out[section].get(key):
            out[section] = {**out[section], key: mask_url(out[section][key])}
    return out


def mask_in_text(text: str, urls: list[str | None]) -> str:
    """`text` (e.g. an error message) with each of `urls` replaced by its masked form."""
    for url in urls:
        masked = mask_url(url)
        if url and masked != url:
            text = text.replace(url, masked or "")
    return text
