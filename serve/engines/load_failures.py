"""Engine starts that failed for a reason a retry would meet again: out of memory while loading, a file the model
needs that is not there, an architecture the engine does not support. Read from what a failed start reports (the
engine's exit and its log tail, `serve.replica.deployment.EngineProcess.wait_ready`).

A study queues a baseline that did not complete again (a cold node's first start timing out, a node failing), and
the production endpoint retries an engine start that failed: both waste a whole start (up to `start_timeout_s` plus
the cold-start allowance, minutes of every GPU of the replica) on a failure of this kind, so neither retries one; the
trial and the endpoint record the cause instead. Only an engine that exited before it was ready is classified: a
start that timed out, or a node check that failed, says nothing of the kind. Pure.
"""

from __future__ import annotations

import re

__all__ = ["EXITED_MARKER", "REPEATS_MARKER", "CAUSES", "repeating_cause", "cause_in_reason", "with_cause"]

# How `EngineProcess.wait_ready` reports an engine that exited before it was ready.
EXITED_MARKER = "engine exited with code"
# How a recorded reason (a trial's, the endpoint's error) names a classified failure: `with_cause` writes it and
# `cause_in_reason` reads it back, so the classification survives Serve's and Tune's error texts.
REPEATS_MARKER = "the engine's load failed in a way a retry would repeat"

# cause -> what a log says (SGLang 0.5.23's, torch's and transformers' own words; the CPU engine's and llama.cpp's).
CAUSES: dict[str, tuple[str, ...]] = {
    "out of memory at load": (
        r"CUDA out of memory", r"OutOfMemoryError", r"CUDA error: out of memory", r"Not enough memory\. Please try",
        r"\bMemoryError\b", r"Cannot allocate memory", r"failed to allocate", r"out of memory"),
    "a missing file": (
        r"FileNotFoundError", r"No such file or directory", r"no file named", r"does not appear to have a file named",
        r"Cannot find any model weights", r"is not a local folder and is not a valid model identifier",
        r"is a directory without config\.json", r"is neither a known id", r"failed to open", r"Can't load the"),
    "an unsupported architecture": (
        r"are not supported for now", r"does not recognize this architecture", r"[Uu]nsupported (model )?architecture",
        r"unknown model architecture"),
}
_COMPILED = {cause: re.compile("|".join(patterns)) for cause, patterns in CAUSES.items()}


def repeating_cause(report: str) -> str | None:
    """The cause (a key of `CAUSES`) of a failed start whose `report` says the engine exited before it was ready
    and whose log names one of them; None for any other failure (a timeout, a node check, a crash with no cause
    named). The log's last lines decide: a warning early in a log that loaded on must not."""
    if EXITED_MARKER not in report:
        return None
    tail = report.split(EXITED_MARKER, 1)[1].splitlines()[-40:]
    for line in reversed(tail):
        for cause, pattern in _COMPILED.items():
            if pattern.search(line):
                return cause
    return None


def with_cause(report: str, cause: str) -> str:
    """`report` prefixed with the classification, as a recorded reason carries it."""
    return f"{REPEATS_MARKER} ({cause}): {report}"


def cause_in_reason(reason: str) -> str | None:
    """The cause a reason written by `with_cause` names; None for any other reason."""
    if REPEATS_MARKER not in reason:
        return None
    rest = reason.split(REPEATS_MARKER, 1)[1]
    match = re.match(r" \(([^)]*)\)", rest)
    return match.group(1) if match and match.group(1) in CAUSES else None
