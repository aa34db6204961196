"""vLLM's side of the verify-cost probe (pipeline/measure/shape.py, dialect `openai`): its request body, its answer's
check, its prefix-cache hits, and how its table is read.

- Calls go to vLLM's own `/v1/completions` (the shim forwards it): a list of token-id prompts in one call, which its
  scheduler takes into one step; `prompt_logprobs: 0` asks for the logits of every prompt row.
- vLLM's answer carries no cached-token count (that takes `--enable-prompt-tokens-details`), so the prefix-cache hits
  of a call are vLLM's `/metrics` counter read before and after it, outside its timing (`cache_hits`).
- The table is read as lines (`as_lines`): a verify row costs vLLM a few ms (SmolLM2-135M fp32 on 2 vCPUs), while one
  call on the shared box varied by tens of ms (at load ~8, 12 calls of one 9-token extend took 61-220 ms, the
  fastest of 5 passes still moved by ~20 ms), so each width column and the LM head are read as their least-squares
  lines over every width (row count), slopes held at >= 0 (more rows never compute less); a column starts at its
  plain step (the decode steps' difference, not one extend's). The cells as measured stay in the record (`ms_measured`, `lm_head_measured`); a slope that
  came out below 0 is the calls' noise, and `line_problem` says so (the probe measures again).
Pure apart from `cache_hits`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

__all__ = ["HITS", "VLLM_PASSES", "VLLM_WIDTHS", "as_lines", "cache_hits", "check_completion", "completion_body",
           "line_problem"]

# vLLM's verify widths are 1 + a draft of at most K tokens: every width of K <= 8 is measured, and two beyond it
VLLM_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)
VLLM_PASSES = 5  # its rows are differences of a few ms
HITS = "vllm:prefix_cache_hits_total"


def completion_body(prompts: list[list[int]], generate: int, rows: bool) -> dict[str, Any]:
    """`/v1/completions` for these token-id prompts; the model left out (vLLM's one served model)."""
    out: dict[str, Any] = {"prompt": prompts, "max_tokens": generate, "temperature": 0.0, "ignore_eos": True,
                           "stream": False}
    if rows:
        out["prompt_logprobs"] = 0
    return out


def check_completion(batch: int, width: int, generate: int, context: int, rows: bool, answer: Any,
                     cached: float | None) -> str | None:
    """Why vLLM's answer to a call of `batch` prompts (each its `context` plus `width` tokens) is no sample (None
    when it is one); `cached`: the hits its `/metrics` counted during the call. A fresh prompt (context 0) is
    shorter than vLLM's block: it has no hit to check."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != batch:
        return f"expected {batch} choice(s), got {answer!r:.200}"
    generated = (answer.get("usage") or {}).get("completion_tokens")
    if generated != batch * generate:
        return f"the requests generated {generated} token(s), not {batch} x {generate}"
    if rows and any(len(c.get("prompt_logprobs") or ()) != context + width for c in choices):
        return f"a request returned no prompt logprobs for its {context + width} prompt tokens"
    if context and cached != batch * context:
        return f"cache miss: {cached} cached prompt token(s), not the contexts' {batch} x {context}"
    return None


def cache_hits(client: httpx.Client) -> float | None:
    """vLLM's prefix-cache hits so far (tokens, its `/metrics`); None when it does not answer with them."""
    try:
        text = client.get("/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    found = [float(line.rsplit(None, 1)[-1]) for line in text.splitlines() if line.startswith(HITS)]
    return sum(found) if found else None


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs (free intercept: no one point anchors it)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def as_lines(table: dict[str, Any]) -> dict[str, Any]:
    """The table with its width columns and LM head read as lines (module docstring); the slopes (ms a row, before
    they are held at >= 0) in `slopes`."""
    widths, rows = table["widths"], table["lm_head_rows"]
    query = [_slope(widths, cells) for cells in table["ms"]]
    head = _slope(rows, table["lm_head_ms"])
    # the LM head's intercept cancels in the cost model (lm_head(rows) - lm_head(batch)): the line through 0
    return {**table, "ms_measured": table["ms"], "lm_head_measured": table["lm_head_ms"],
            "ms": [[round(cells[0] + max(0.0, s) * (w - widths[0]), 3) for w in widths]
                   for cells, s in zip(table["ms"], query)],
            "lm_head_ms": [round(max(0.0, head) * r, 3) for r in rows],
            "slopes": {"query_row_ms": [round(s, 3) for s in query], "lm_head_row_ms": round(head, 3)}}


def line_problem(table: dict[str, Any]) -> str | None:
    """Why a table read as lines cannot be trusted (None when it can): a slope below 0, which only calls whose own
    costs swamped the differences give."""
    slopes = table.get("slopes") or {}
    if slopes.get("lm_head_row_ms", 0.0) <= 0 or any(s < 0 for s in slopes.get("query_row_ms", ())):
        return (f"a row measured at no cost (slopes {slopes}): the calls' own costs swamped the differences")
    return None
