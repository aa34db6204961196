"""An engine's `/server_info` answer as a trial records it (`server_info.json` of its MLflow run), parsed once where
it is read: from the engine by `pipeline.trial.engine_pass`, from a run's artifact by
`pipeline.records.trial_runs.run_server_info`. Every later reader takes the typed fields.

It lives on the measurement floor because every room that reads it (trial, records, simulate, decide) stands on
this one. Engines report different keys (SGLang its resolved ServerArgs, the CPU engine its round table and weights,
llama-server its own), and the trial adds its own (`replica_node_id`, `argv`, `preflight`, `node_checks`,
`list_external_corpora`, `internal_states_after`, a probed `verify_cost`): the fields below are the keys the
pipeline reads, and `raw` keeps every key in the engine's order, so the record on disk stays the JSON the engine
gave and an engine's own code (`serve.engines`) can read the keys only it knows.

Parsing is lenient on purpose: a key of an unexpected type leaves its field None (the reader then acts as if the
engine had not reported it, as each reader did before) and stays in `raw` for the record; nothing here fails a
trial.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PlainSteps", "ServerInfo"]


def _text(value: object) -> str | None:
    # the readers printed any non-empty value (a version may be a number); empty means unreported
    return str(value) if value else None


@dataclass(frozen=True)
class PlainSteps:
    """The CPU engine's counters of its lone plain decode steps, cumulative since it started (`internal_states[0]`'s
    `solo_plain_rounds`, `solo_plain_ms`, `solo_plain_context`): two snapshots time a window's steps
    (`pipeline.measure.window.step_ratio`)."""

    rounds: float
    ms: float
    context: float


@dataclass(frozen=True)
class ServerInfo:
    """`/server_info` as the trial recorded it; `raw` holds every key (what `server_info.json` holds)."""

    raw: Mapping[str, Any] = field(default_factory=dict)
    version: str | None = None
    replica_node_id: str | None = None  # the Ray node the engine ran on (the replica's answer, added by the trial)
    weights_mode: str | None = None  # the CPU engine's resolved decode weights: fp32, gguf
    weights_isa: str | None = None  # ... and the kernel's instruction set: avx512, avx2
    max_running_requests: int | None = None
    # the engine's verify-cost record (`sizes`/`relative`, `round_cost`), or the trial's probe of it
    verify_cost: Mapping[str, Any] | None = None
    internal_states: Sequence[Any] | None = None  # SGLang's scheduler state at read-back
    internal_states_after: Sequence[Any] | None = None  # ... after the measurement (its cumulative accept length)

    @classmethod
    def parse(cls, answer: object) -> ServerInfo:
        """The typed view of an answer; anything but a JSON object reports nothing."""
        raw: dict[str, Any] = dict(answer) if isinstance(answer, Mapping) else {}
        cap = raw.get("max_running_requests")
        verify_cost = raw.get("verify_cost")
        return cls(raw=raw, version=_text(raw.get("version")), replica_node_id=_text(raw.get("replica_node_id")),
                   weights_mode=_text(raw.get("weights_mode")), weights_isa=_text(raw.get("weights_isa")),
                   max_running_requests=cap if isinstance(cap, int) else None,
                   verify_cost=verify_cost if isinstance(verify_cost, dict) else None,
                   internal_states=_states(raw.get("internal_states")),
                   internal_states_after=_states(raw.get("internal_states_after")))

    @classmethod
    def from_text(cls, text: str | None) -> ServerInfo:
        """A `server_info.json` artifact; an absent or empty one reports nothing. ValueError for text that is no
        JSON."""
        return cls.parse(json.loads(text)) if text else cls()

    def with_keys(self, **keys: Any) -> ServerInfo:
        """This answer with `keys` added or replaced (a replaced key keeps its place in the record)."""
        return ServerInfo.parse({**self.raw, **keys})

    def as_json(self) -> dict[str, Any]:
        """Every key, as a fresh dict: the artifact's content, and what an engine's own code reads."""
        return dict(self.raw)

    @property
    def has_round_table(self) -> bool:
        """Whether the engine reported a round table of its own (the CPU engine's `verify_cost.round_cost`)."""
        return self.verify_cost is not None and isinstance(self.verify_cost.get("round_cost"), dict)

    @property
    def plain_steps(self) -> PlainSteps | None:
        """The engine's plain-step counters, None from an engine that keeps none (SGLang, llama-server)."""
        state = self.internal_states[0] if self.internal_states else None
        if not isinstance(state, dict):
            return None
        rounds, ms, context = (state.get(k) for k in ("solo_plain_rounds", "solo_plain_ms", "solo_plain_context"))
        if not (isinstance(rounds, (int, float)) and isinstance(ms, (int, float))
                and isinstance(context, (int, float))):
            return None
        return PlainSteps(rounds, ms, context)

    @property
    def weights(self) -> str:
        """`gguf-avx512`: the CPU engine's resolved weights and kernel ISA, '' from an engine without them."""
        return "-".join(part for part in (self.weights_mode, self.weights_isa) if part)


def _states(value: object) -> Sequence[Any] | None:
    return value if isinstance(value, list) else None
