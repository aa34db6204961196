"""The one table of speculative settings: our field -> SGLang's ServerArgs field (= its flag, = its `/server_info` key).

Every engine reads speculative settings from here: the SGLang argv renderer, the CPU engine's parser (it accepts
SGLang's flag names on purpose, so one search space means the same thing on both), the preflight diff and the
effective-settings diff after deploy. Nothing else writes a speculative flag name.

Flags are derived from ServerArgs field names the way SGLang's own parser derives them (`_` -> `-`), and rendered
with their exact full names (argparse accepts prefixes, so an abbreviation could silently become another flag).
Which settings an installed SGLang has is read from its `ServerArgs` fields, not inferred from its version number:
0.5.10.post1, 0.5.22 and 0.5.23 all have `speculative_ngram_max_trie_depth` and none of the older match-window flags.
Pure: no sglang, no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from serve.spec import DRAFT_MODEL_ALGORITHMS, NoSpec, SpecConfig

ALGORITHM_NAMES = {"ngram": "NGRAM", "eagle": "EAGLE", "eagle3": "EAGLE3", "standalone": "STANDALONE"}


@dataclass(frozen=True)
class Setting:
    """One row: `field` of the spec (or of the replica, for `max_running_requests`) is SGLang's `server_arg`."""

    field: str
    server_arg: str
    algorithms: tuple[str, ...]  # spec variants that carry the field; () = a replica setting, any algorithm

    @property
    def flag(self) -> str:
        return "--" + self.server_arg.replace("_", "-")


_NGRAM = ("ngram",)
_DRAFTED = tuple(DRAFT_MODEL_ALGORITHMS)
_ADAPTIVE = ("eagle", "eagle3")  # SGLang's adaptive controller runs these only
SETTINGS: tuple[Setting, ...] = (
    Setting("algorithm", "speculative_algorithm", ("ngram", *_DRAFTED)),
    Setting("draft_model", "speculative_draft_model_path", _DRAFTED),
    Setting("num_steps", "speculative_num_steps", _DRAFTED),
    Setting("topk", "speculative_eagle_topk", _DRAFTED),
    Setting("num_draft_tokens", "speculative_num_draft_tokens", ("ngram", *_DRAFTED)),
    Setting("adaptive", "speculative_adaptive", _ADAPTIVE),  # a switch: rendered bare when on, absent when off
    Setting("min_bfs_breadth", "speculative_ngram_min_bfs_breadth", _NGRAM),
    Setting("max_bfs_breadth", "speculative_ngram_max_bfs_breadth", _NGRAM),
    Setting("match_type", "speculative_ngram_match_type", _NGRAM),
    Setting("max_trie_depth", "speculative_ngram_max_trie_depth", _NGRAM),
    Setting("capacity", "speculative_ngram_capacity", _NGRAM),
    Setting("external_corpus", "speculative_ngram_external_corpus_path", _NGRAM),
    Setting("external_sam_budget", "speculative_ngram_external_sam_budget", _NGRAM),
    Setting("external_corpus_max_tokens", "speculative_ngram_external_corpus_max_tokens", _NGRAM),
    Setting("max_running_requests", "max_running_requests", ()),
)
BY_FIELD = {s.field: s for s in SETTINGS}

# Flags the tuner renders itself, from the study and the trial: a user's `engine.extra_flags` must not set them, or
# the engine would run something other than what is recorded. Launch flags first, then every table row.
LAUNCH_FLAGS = ("--model-path", "--model", "--host", "--port", "--tp-size", "--tp", "--dtype", "--threads",
                "--weights", "--device", "--attention-backend", "--nccl-port", "--speculative-adaptive-config")
ENGINE_OWNED_FLAGS: frozenset[str] = frozenset(LAUNCH_FLAGS) | {s.flag for s in SETTINGS}


class UnsupportedSetting(ValueError):
    """The installed engine has no flag for a setting this config needs."""


def _value(setting: Setting, spec: SpecConfig, max_running_requests: int | None) -> Any:
    if setting.field == "algorithm":
        return ALGORITHM_NAMES[spec.algorithm]
    if not setting.algorithms:
        return max_running_requests
    return getattr(spec, setting.field)


def requested(spec: SpecConfig, max_running_requests: int | None = None) -> list[tuple[Setting, Any]]:
    """(setting, value) for everything this config asks of the engine, in table order; None-valued fields (engine's
    auto choice) are not asked, nor a switch that is off (its default). NGRAM never asks steps/topk: SGLang derives
    them (topk := max breadth)."""
    rows = []
    for setting in SETTINGS:
        if setting.algorithms and spec.algorithm not in setting.algorithms:
            continue
        value = _value(setting, spec, max_running_requests)
        if value is not None and value is not False:
            rows.append((setting, value))
    return rows


def render_spec(spec: SpecConfig, max_running_requests: int | None = None,
                available: Iterable[str] | None = None, engine_name: str = "the engine") -> list[str]:
    """Speculative argv for `spec`. `available`: the engine's ServerArgs field names (None = assume all of the table);
    a needed setting the engine lacks raises UnsupportedSetting naming the field, the flag and the fix."""
    have = None if available is None else frozenset(available)
    flags: list[str] = []
    for setting, value in requested(spec, max_running_requests):
        if have is not None and setting.server_arg not in have:
            where = f"spec.{setting.field}" if setting.algorithms else setting.field
            raise UnsupportedSetting(
                f"{where}={value!r} needs {setting.flag}, which {engine_name} does not have (no ServerArgs field "
                f"{setting.server_arg}); install the tested version (pip install 'sglang==0.5.23') or remove "
                f"{where} from the search space")
        flags += [setting.flag] if value is True else [setting.flag, str(value)]
    return flags


def effective_diff(spec: SpecConfig, max_running_requests: int | None, server_args: dict[str, Any],
                   pinned: dict[str, Any] | None = None) -> dict[str, tuple[object, object]]:
    """{field: (requested, effective)} for every requested setting the engine reports differently. Pure.

    `server_args` is `/server_info` or what SGLang's preflight resolved (same flat keys). Settings the engine does
    not report are not diffs (nothing to compare); auto values (None) were not requested. `pinned`: what the
    engine's command line fixes beyond the table, by server-arg name (SGLang's attention backend, its running-request
    cap, the dtype: `Engine.pinned_settings`).
    """
    diffs: dict[str, tuple[object, object]] = {}
    for key, value in (pinned or {}).items():
        if key in server_args and server_args[key] != value:
            diffs[key] = (value, server_args[key])
    # Algorithms outside SGLang's table (llama.cpp's) are reported under their own name.
    wanted = None if isinstance(spec, NoSpec) else ALGORITHM_NAMES.get(spec.algorithm, spec.algorithm)
    if (server_args.get("speculative_algorithm") or None) != wanted:
        diffs["algorithm"] = (wanted, server_args.get("speculative_algorithm"))
    for setting, value in requested(spec, max_running_requests):
        if setting.field == "algorithm" or setting.server_arg not in server_args:
            continue
        if server_args[setting.server_arg] != value:
            diffs[setting.field] = (value, server_args[setting.server_arg])
    return diffs


def server_args_of(spec: SpecConfig) -> dict[str, Any]:
    """The spec under SGLang ServerArgs names (what `/server_info` reports for it), for engines that mirror SGLang."""
    out: dict[str, Any] = {"speculative_algorithm": None if isinstance(spec, NoSpec) else ALGORITHM_NAMES[spec.algorithm]}
    for setting in SETTINGS:
        if setting.algorithms and setting.field != "algorithm":
            out[setting.server_arg] = getattr(spec, setting.field, None)
    return out


def effective_settings(server_info: dict[str, Any]) -> dict[str, Any]:
    """What an SGLang-compatible engine says it runs with, from its `/server_info`: the table's settings, the
    attention backend, dtype and device, the running-request cap it resolved and the one its scheduler enforces
    (`internal_states[0].effective_max_running_requests_per_dp`). Keys it does not report are left out. Pure."""
    keys = [s.server_arg for s in SETTINGS] + ["attention_backend", "dtype", "device", "speculative_eagle_topk",
                                               "speculative_num_steps"]
    found = {k: server_info[k] for k in keys if k in server_info}
    states = server_info.get("internal_states") or [{}]
    state = states[0] if isinstance(states[0], dict) else {}
    if "effective_max_running_requests_per_dp" in state:
        found["effective_max_running_requests_per_dp"] = state["effective_max_running_requests_per_dp"]
    return found
