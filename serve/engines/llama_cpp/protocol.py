"""SGLang's native `/generate` <-> llama-server's `/completion`, both ways. Pure: no I/O.

The tuner speaks SGLang's protocol (docs/design.md, "Engines"); llama-server speaks its own. This module is the whole mapping.

Speculative counters. llama-server reports per request `timings.draft_n` (draft tokens proposed) and
`timings.draft_n_accepted` (of those, accepted); it reports no verify-step count. SGLang's names are derived:
- `spec_num_proposed_drafts` = draft_n; `spec_num_correct_drafts` = draft_n_accepted (raw counts, same meaning);
- `spec_verify_ct` = completion_tokens - 1 - draft_n_accepted: the first token comes from the prompt pass, and every
  decode step (one target forward, with or without a draft) emits its accepted drafts plus one token of its own;
- `spec_accept_length` = completion_tokens / spec_verify_ct, SGLang's own definition (it includes the prefill token,
  so it runs slightly high, exactly as SGLang's does).
As in SGLang, the keys appear only when speculation is on and the request had a decode step.
"""

from __future__ import annotations

from typing import Any


class BadRequest(ValueError):
    """A /generate body the shim cannot translate; the message names the field."""


def completion_body(body: dict[str, Any]) -> dict[str, Any]:
    """llama-server `/completion` body for an SGLang `/generate` body."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompt = body.get("text") if body.get("text") is not None else body.get("input_ids")
    if prompt is None or isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        raise BadRequest("give 'text' (a string) or 'input_ids' (a list of token ids); batches are not supported")
    params = body.get("sampling_params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    max_new = params.get("max_new_tokens", 128)
    if not isinstance(max_new, int) or max_new < 1:
        raise BadRequest(f"sampling_params.max_new_tokens must be an integer >= 1, got {max_new!r}")
    temperature = float(params.get("temperature", 1.0))
    out: dict[str, Any] = {
        "prompt": prompt, "n_predict": max_new, "temperature": temperature, "stream": bool(body.get("stream")),
        # No prompt-cache reuse: a prompt computed partly from another request's cached prefix is batched
        # differently and may round differently, which breaks greedy equality with the baseline (seen in studies).
        "return_tokens": True, "cache_prompt": False,
        # SGLang's sampling defaults, not llama.cpp's (top_k 40, top_p 0.95, min_p 0.05): same distribution
        "top_k": max(0, int(params.get("top_k", -1))), "top_p": float(params.get("top_p", 1.0)),
        "min_p": float(params.get("min_p", 0.0)),
    }
    if params.get("stop"):
        out["stop"] = [params["stop"]] if isinstance(params["stop"], str) else list(params["stop"])
    if params.get("ignore_eos"):
        out["ignore_eos"] = True
    if "seed" in params:
        out["seed"] = int(params["seed"])
    return out


def finish_reason(final: dict[str, Any]) -> dict[str, Any]:
    """SGLang's finish_reason object from llama-server's `stop_type` ("eos" | "limit" | "word")."""
    kind = final.get("stop_type")
    if kind == "limit":
        return {"type": "length", "length": int(final.get("tokens_predicted", 0))}
    if kind == "word":
        return {"type": "stop", "matched": final.get("stopping_word", "")}
    return {"type": "stop", "matched": None}  # eos: llama-server does not say which id


def spec_counters(completion_tokens: int, timings: dict[str, Any]) -> dict[str, Any]:
    """SGLang's four spec keys from llama-server's timings (see the module docstring); {} without a decode step."""
    proposed = int(timings.get("draft_n", 0) or 0)
    accepted = int(timings.get("draft_n_accepted", 0) or 0)
    verify = completion_tokens - 1 - accepted
    if verify <= 0:
        # A final step whose accepted drafts ran past max_new_tokens can leave fewer tokens than it accepted.
        verify = 1 if completion_tokens > 1 else 0
    if verify == 0:
        return {}
    return {"spec_verify_ct": verify, "spec_accept_length": completion_tokens / verify,
            "spec_num_correct_drafts": accepted, "spec_num_proposed_drafts": proposed}


def meta_info(final: dict[str, Any], speculative: bool, e2e_latency: float) -> dict[str, Any]:
    """SGLang's `meta_info` from llama-server's last `/completion` answer (or last stream event)."""
    completion = int(final.get("tokens_predicted", 0))
    meta: dict[str, Any] = {
        "prompt_tokens": int(final.get("tokens_evaluated", 0)), "completion_tokens": completion,
        "cached_tokens": int((final.get("timings") or {}).get("cache_n", 0) or 0),
        "finish_reason": finish_reason(final), "e2e_latency": e2e_latency,
    }
    if speculative:
        meta.update(spec_counters(completion, final.get("timings") or {}))
    return meta


def progress_meta(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """meta_info of a streamed event before the last (counters arrive with the last, as in SGLang)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "finish_reason": None}

