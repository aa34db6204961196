"""Readable names for trial configs: one short, stable label per `TrialConfig`, used as the MLflow run name and in the
console, the report, the plots and `python -m pipeline.compare` (the Tune trial id stays on the run as a tag).

A label is a function of the config alone (the same config gets the same label in every study and process) and
names every setting, so two different configs never share one: each spec field is either always shown, shown when
it differs from its default, or (a field this module does not know yet) shown as `field=value` when it differs from
its default. The concurrency a config is measured at is not part of it (finalists are the same config at each level).
Pure.

Examples: `none`; `ngram PROB d10 b1 depth14 warm8` (match type, draft tokens, max BFS breadth -- `b2-4` when the
min breadth is not 1 --, trie depth, warm-up requests; `cap100k` for a capacity other than SGLang's 10M; `corpus:<name>
sam<budget>` with an external corpus); `eagle3 s3 k1 d4 @<draft>` (steps, topk, draft tokens, draft model; `auto` when
the engine chooses the shape); `llama ngram-mod match24 min48 max64 warm4`; `llama draft n3 @<draft>`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePath
from typing import Any

from pipeline.config import TrialConfig
from serve.spec import FrozenModel

# (tokens, the fields they name) for one spec; fields not named are shown by the generic rule.
_Formatted = tuple[list[str], set[str]]


def _num(value: Any) -> str:
    """Ints as written, floats by their shortest exact repr: two different values never print alike."""
    return repr(value) if isinstance(value, float) else str(value)


def _count(value: int) -> str:
    """100000 -> 100k, 10000000 -> 10M, 1500 -> 1500: exact multiples only, so the text is still unambiguous."""
    for size, suffix in ((1_000_000, "M"), (1_000, "k")):
        if value >= size and value % size == 0:
            return f"{value // size}{suffix}"
    return str(value)


def _file_name(value: Any) -> str:
    """A model or corpus as a label names it: the last path part without a file suffix (`warmup`, an id as given)."""
    text = str(value).rstrip("/")
    path = PurePath(text)
    return path.stem if path.suffix in (".jsonl", ".json", ".gguf", ".txt", ".parquet") else path.name or text


def _ngram(spec: FrozenModel) -> _Formatted:
    s: Any = spec
    breadth = f"b{s.max_bfs_breadth}" if s.min_bfs_breadth == 1 else f"b{s.min_bfs_breadth}-{s.max_bfs_breadth}"
    tokens = [s.match_type, f"d{s.num_draft_tokens}", breadth, f"depth{s.max_trie_depth}"]
    named = {"match_type", "num_draft_tokens", "min_bfs_breadth", "max_bfs_breadth", "max_trie_depth"}
    if s.capacity != type(spec).model_fields["capacity"].default:
        tokens.append(f"cap{_count(s.capacity)}")
    named.add("capacity")
    if s.external_corpus is not None:
        tokens += [f"corpus:{_file_name(s.external_corpus)}", f"sam{s.external_sam_budget}"]
        named |= {"external_corpus", "external_sam_budget"}
    return tokens, named


def _draft_model(spec: FrozenModel) -> _Formatted:
    s: Any = spec
    shape = [s.num_steps, s.topk, s.num_draft_tokens]
    tokens = ["auto"] if all(v is None for v in shape) else [
        f"s{_num(s.num_steps)}", f"k{_num(s.topk)}", f"d{_num(s.num_draft_tokens)}"]
    if s.draft_model:
        tokens.append(f"@{_file_name(s.draft_model)}")
    return tokens, {"num_steps", "topk", "num_draft_tokens", "draft_model"}


def _llama_lookup(spec: FrozenModel) -> _Formatted:
    s: Any = spec
    tokens = [f"n{s.size_n}", f"m{s.size_m}"] + ([f"hits{s.min_hits}"] if s.min_hits != 1 else [])
    return tokens, {"size_n", "size_m", "min_hits"}


def _llama_mod(spec: FrozenModel) -> _Formatted:
    s: Any = spec
    return [f"match{s.n_match}", f"min{s.n_min}", f"max{s.n_max}"], {"n_match", "n_min", "n_max"}


def _llama_cache(spec: FrozenModel) -> _Formatted:
    s: Any = spec
    tokens = (["dynamic"] if s.dynamic_cache else []) + (
        [f"static:{_file_name(s.static_cache)}"] if s.static_cache else [])
    return tokens or ["no-cache"], {"dynamic_cache", "static_cache"}


def _llama_draft(spec: FrozenModel) -> _Formatted:
    s: Any = spec
    tokens = [f"n{s.draft_n_max}"] + ([f"min{s.draft_n_min}"] if s.draft_n_min else [])
    fields = type(spec).model_fields
    tokens += [f"{short}{_num(getattr(s, name))}" for name, short in (("p_min", "pmin"), ("p_split", "psplit"))
               if getattr(s, name) != fields[name].default]
    if s.draft_model:
        tokens.append(f"@{_file_name(s.draft_model)}")
    return tokens, {"draft_n_max", "draft_n_min", "p_min", "p_split", "draft_model"}


def _plain(spec: FrozenModel) -> _Formatted:
    return [], set()


# algorithm -> (the label's first words, the formatter of its fields)
_FORMATS: dict[str, tuple[str, Callable[[FrozenModel], _Formatted]]] = {
    "none": ("none", _plain), "ngram": ("ngram", _ngram),
    "eagle": ("eagle", _draft_model), "eagle3": ("eagle3", _draft_model), "standalone": ("standalone", _draft_model),
    "llama_ngram_simple": ("llama ngram-simple", _llama_lookup), "llama_ngram_map_k": ("llama ngram-map-k",
                                                                                      _llama_lookup),
    "llama_ngram_map_k4v": ("llama ngram-map-k4v", _llama_lookup), "llama_ngram_mod": ("llama ngram-mod", _llama_mod),
    "llama_ngram_cache": ("llama ngram-cache", _llama_cache), "llama_draft": ("llama draft", _llama_draft),
}
_NOT_SHOWN = {"algorithm"}  # the label's first word


def _rest(model: FrozenModel, named: set[str]) -> list[str]:
    """`field=value` for every field not named yet that differs from its default (new fields stay distinct)."""
    out = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if name in named or name in _NOT_SHOWN or info.is_required() or value == info.get_default(
                call_default_factory=True):
            continue
        out.append(f"{name}={_num(value)}")
    return out


def config_label(config: TrialConfig) -> str:
    """The config's label (module docstring). The baseline is `none` (its warm-up is the study's, not a setting it is
    chosen by); a speculative config shows its warm-up length always (`warm0` included: it decides what an n-gram
    trie holds when measuring starts), a thread count (`t2`) and `max_running_requests` (`mrr16`) when set."""
    spec: Any = config.spec
    head, formatter = _FORMATS.get(spec.algorithm, (spec.algorithm, _plain))
    tokens, named = formatter(spec)
    if getattr(spec, "threads", None) is not None:
        tokens.append(f"t{spec.threads}")
        named = named | {"threads"}
    tokens += _rest(spec, named)
    if spec.algorithm != "none":
        tokens.append(f"warm{config.warmup_requests}")
    if config.max_running_requests is not None:
        tokens.append(f"mrr{config.max_running_requests}")
    tokens += _rest(config, {"spec", "warmup_requests", "max_running_requests", "concurrency"})
    return " ".join([head, *tokens])


def params_label(params: Mapping[str, Any]) -> str:
    """A label for a sampled point that never became a config (its values failed validation): the algorithm and the
    sampled values, `name=value` (Optuna's branch prefixes dropped)."""
    algorithm = str(params.get("algorithm", "?"))
    head = _FORMATS.get(algorithm, (algorithm, _plain))[0]
    values = [f"{str(k).rsplit('.', 1)[-1]}={_num(v)}" for k, v in params.items() if k != "algorithm"]
    return " ".join([head, *values, "(invalid)"])


def slug(label: str) -> str:
    """The label in the characters a Serve app name, a route, a folder and an MLflow run name all take: spaces become
    `-`, anything else outside [A-Za-z0-9._-] `_` (`ngram PROB d10 b1 depth14 warm8` ->
    `ngram-PROB-d10-b1-depth14-warm8`)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", label.replace(" ", "-"))


def unique_names(names: Sequence[str], suffixes: Sequence[str]) -> list[str]:
    """`names` with every repeat after the first made distinct by ` #<suffix>` (its trial id): a sampler may propose
    one config twice, and two bars, rows or finalists must never read alike. Pure; order kept."""
    seen: set[str] = set()
    out = []
    for name, suffix in zip(names, suffixes):
        unique = name if name not in seen else f"{name} #{suffix}"
        while unique in seen:
            unique += "'"
        seen.add(unique)
        out.append(unique)
    return out
