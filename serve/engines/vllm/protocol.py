"""SGLang's native `/generate` <-> vLLM's `/v1/completions`, both ways, and vLLM's `/metrics`. Pure: no I/O.

The tuner speaks SGLang's protocol (docs/design.md, "Engines"); vLLM speaks OpenAI's with its own extensions:
`return_token_ids` (each choice's `token_ids`, streamed as deltas) and, with `--per-request-spec-decode-metrics
detailed`, the response's `metrics.speculative_decoding` (`num_draft_tokens`, `num_accepted_draft_tokens`,
`num_spec_steps`: the steps that verified a draft). SGLang's names are derived as for llama-server
(serve/engines/llama_cpp/protocol.py):
- `spec_num_proposed_drafts` = num_draft_tokens; `spec_num_correct_drafts` = num_accepted_draft_tokens;
- `spec_verify_ct` = completion_tokens - 1 - accepted: the first token comes from the prefill, and every decode step
  (one target forward, with or without a draft) emits its accepted drafts plus one token of its own;
- `spec_accept_length` = completion_tokens / spec_verify_ct, SGLang's own definition.
As in SGLang, the keys appear only when speculation is on and the request had a decode step.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from serve.spec import VllmSuffixSpec


class BadRequest(ValueError):
    """A /generate body the shim cannot translate; the message names the field."""


def completion_body(body: Any, model: str) -> dict[str, Any]:
    """vLLM `/v1/completions` body for an SGLang `/generate` body; `model`: the served model name."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompt = body.get("text") if body.get("text") is not None else body.get("input_ids")
    if prompt is None or isinstance(prompt, list) and (not prompt or not all(isinstance(t, int) for t in prompt)):
        raise BadRequest("give 'text' (a string) or 'input_ids' (a non-empty list of token ids); batches are not "
                         "supported")
    params = body.get("sampling_params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    max_new = params.get("max_new_tokens", 128)
    if not isinstance(max_new, int) or max_new < 1:
        raise BadRequest(f"sampling_params.max_new_tokens must be an integer >= 1, got {max_new!r}")
    stream = bool(body.get("stream"))
    out: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": max_new, "stream": stream, "return_token_ids": True,
        # SGLang's sampling defaults, so the same request means the same distribution on both
        "temperature": float(params.get("temperature", 1.0)), "top_p": float(params.get("top_p", 1.0)),
        "top_k": int(params.get("top_k", -1)), "min_p": float(params.get("min_p", 0.0)),
    }
    if stream:
        out["stream_options"] = {"include_usage": True}
    if params.get("stop"):
        out["stop"] = [params["stop"]] if isinstance(params["stop"], str) else list(params["stop"])
    if params.get("ignore_eos"):
        out["ignore_eos"] = True
    if "seed" in params:
        out["seed"] = int(params["seed"])
    return out


def finish_reason(choice: dict[str, Any], completion_tokens: int) -> dict[str, Any] | None:
    """SGLang's finish_reason object from an OpenAI choice's `finish_reason` ("length" | "stop") and vLLM's
    `stop_reason` (the matched stop string or token id; None for EOS)."""
    kind = choice.get("finish_reason")
    if kind is None:
        return None
    if kind == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": "stop", "matched": choice.get("stop_reason")}


def spec_counters(completion_tokens: int, metrics: dict[str, Any] | None) -> dict[str, Any]:
    """SGLang's four spec keys from vLLM's per-request `metrics.speculative_decoding` (module docstring); {} without
    a decode step or without the metrics."""
    spec = (metrics or {}).get("speculative_decoding")
    if not isinstance(spec, dict):
        return {}
    proposed = int(spec.get("num_draft_tokens", 0) or 0)
    accepted = int(spec.get("num_accepted_draft_tokens", 0) or 0)
    verify = completion_tokens - 1 - accepted
    if verify <= 0:
        # a last step whose accepted drafts ran past max_tokens leaves fewer tokens than it accepted
        verify = 1 if completion_tokens > 1 else 0
    if verify == 0:
        return {}
    out: dict[str, Any] = {"spec_verify_ct": verify, "spec_accept_length": completion_tokens / verify,
                           "spec_num_correct_drafts": accepted, "spec_num_proposed_drafts": proposed,
                           "vllm_spec_steps": int(spec.get("num_spec_steps", 0) or 0)}
    # `detailed`: each spec step's drafted and accepted tokens (the replay's check, pipeline/simulate/vllm_ngram.py)
    for key in ("per_step_drafted", "per_step_accepted"):
        if isinstance(spec.get(key), list):
            out[f"vllm_{key}"] = [int(v) for v in spec[key]]
    return out


def meta_info(choice: dict[str, Any], usage: dict[str, Any], metrics: dict[str, Any] | None, speculative: bool,
              e2e_latency: float) -> dict[str, Any]:
    """SGLang's `meta_info` from vLLM's final choice, its `usage` and its per-request `metrics`."""
    completion = int(usage.get("completion_tokens", 0) or 0)
    details = usage.get("prompt_tokens_details") or {}
    meta: dict[str, Any] = {
        "prompt_tokens": int(usage.get("prompt_tokens", 0) or 0), "completion_tokens": completion,
        "cached_tokens": int(details.get("cached_tokens", 0) or 0),
        "finish_reason": finish_reason(choice, completion), "e2e_latency": e2e_latency,
    }
    if speculative:
        meta.update(spec_counters(completion, metrics))
    return meta


def progress_meta(completion_tokens: int) -> dict[str, Any]:
    """meta_info of a streamed event before the last (counters arrive with the last, as in SGLang)."""
    return {"completion_tokens": completion_tokens, "finish_reason": None}


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_POSITION = re.compile(r'position="(\d+)"')
SPEC_PREFIX = "vllm:spec_decode_"


def spec_metrics(text: str) -> dict[str, float]:
    """vLLM's speculation counters from a `/metrics` page, summed over label sets (engines, model names);
    `..._per_pos_total` keyed `name[position]`. Other samples are left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or not match["name"].startswith(SPEC_PREFIX) or match["name"].endswith("_created"):
            continue
        name = match["name"]
        position = _POSITION.search(match["labels"] or "")
        if position:
            name = f"{name}[{position.group(1)}]"
        try:
            out[name] = out.get(name, 0.0) + float(match["value"])
        except ValueError:
            continue
    return out


def metrics_since(now: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """Counters since `base` (the shim's last flush): vLLM's counters only grow while it runs."""
    return {name: value - base.get(name, 0.0) for name, value in now.items()}



GENERATED = "vllm:generation_tokens_total"


def generated_tokens(text: str) -> float:
    """vLLM's output tokens since its start, from a `/metrics` page (summed over label sets)."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is not None and match["name"] == GENERATED:
            try:
                total += float(match["value"])
            except ValueError:
                continue
    return total


def keeps_requests(spec: Any) -> bool:
    """Whether vLLM's drafter carries anything from one request to the next: suffix decoding's global tree of earlier
    outputs does (unless `suffix_decoding_max_cached_requests` is 0, which turns it off); the n-gram proposer reads
    the request's own tokens only."""
    return isinstance(spec, VllmSuffixSpec) and spec.suffix_decoding_max_cached_requests > 0


def flush_action(spec: Any, generated_since_start: float) -> Literal["reset", "restart"]:
    """What `/flush_cache` must do so that the next request meets an empty engine. `reset`: vLLM's
    `/reset_prefix_cache` (the KV prefix cache). `restart`: a new vLLM process, because vLLM 0.32.0 has no route that
    empties the suffix decoding cache (`/reset_prefix_cache` resets the scheduler's KV blocks only; `/collective_rpc`
    calls worker methods by name and none reaches the drafter), and what the drafter kept from earlier requests would
    feed the next measurement's drafts. A server that has generated nothing since its start holds nothing: reset."""
    return "restart" if keeps_requests(spec) and generated_since_start > 0 else "reset"
