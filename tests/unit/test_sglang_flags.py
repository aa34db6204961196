"""Our SGLang flags against SGLang's real parsers: 0.5.23 installed --no-deps (CI), and 0.5.22 side by side in a
`pip install --no-deps --target` folder (infra/install-sglang-parser.sh puts it under ~/.cache/specdec-tuner/sglang/);
skipped where absent.

Flag rendering: every value of every parameter of every branch of every bundled space (others at their defaults),
plus seeded random full points, must parse with zero unrecognized or ambiguous flags. argparse checks each flag on
its own, so covering every (flag, value) pair covers every point's flags. Flags are rendered from the ServerArgs
fields of the version that parses them (never from a version number). Resolution: a table of cases where SGLang
rewrites or rejects settings is checked against what our validation says.

Each preflight is a subprocess that imports SGLang's argument code (6-12 s on 2 cores), so the module asks once per
question kind: one parse of every argv per SGLang (the installed one's with the removed flags' argvs too), one
resolution of every resolution case (`parsed`, `resolved`); each test asserts on its own argvs' answers.
"""

import json
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest

from pipeline.config import SEARCH_SPACES_DIR, load_study
from pipeline.search.space import (CategoricalParam, FixedParam, IntParam, default_value, define_by_run, evaluate_bound,
                            load_space, resolve)
from serve.engines.base import ConfigRejected, ReplicaConfig
from serve.engines.spec_flags import SETTINGS, UnsupportedSetting, render_spec
from serve.engines.sglang.engine import (SglangEngine, installed_version, launcher, run_preflight, server_arg_fields,
                                  sglang_argv)
from serve.spec import EagleSpec, NgramSpec, StandaloneSpec, validate_spec
from tests.sglang_servers import unkept_verdicts

needs_sglang = pytest.mark.skipif(installed_version() is None, reason="sglang is not installed (CI installs it --no-deps)")
SIDE_BY_SIDE = Path(os.environ.get("SPECDEC_SGLANG_PARSERS", Path.home() / ".cache/specdec-tuner/sglang"))
TESTED_VERSIONS = ("0.5.22", "0.5.23")


def sglang_path(version):
    """None = the installed SGLang when it is this version; else the side-by-side folder (skip if absent)."""
    if installed_version() == version:
        return None
    if version == TESTED_VERSIONS[-1]:
        pytest.skip(f"sglang {version} is not installed (CI installs it --no-deps)")
    folder = SIDE_BY_SIDE / version
    if not (folder / "sglang").is_dir():
        pytest.skip(f"sglang {version} parser absent: bash infra/install-sglang-parser.sh (installs it in {folder})")
    return str(folder)
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
              "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}


def domain(p, values):
    if isinstance(p, FixedParam):
        return [p.value]
    if isinstance(p, CategoricalParam):
        return list(p.choices)
    if isinstance(p, IntParam):
        low, high = int(evaluate_bound(p.low, values)), int(evaluate_bound(p.high, values))
        return list(range(low, high + 1, p.step))
    return [evaluate_bound(p.low, values), evaluate_bound(p.high, values)]


def points_of(space):
    """Every value of every parameter (others at defaults) for each speculative branch."""
    for algorithm in space.algorithms:
        params = space.params_for(algorithm)
        for i, (optuna_name, name, p) in enumerate(params):
            values: dict[str, Any] = {}
            base = {"algorithm": algorithm}
            for j, (o2, n2, p2) in enumerate(params[:i]):
                values[n2] = default_value(p2, values)
                base[o2] = values[n2]
            for value in domain(p, values):
                point, vals = dict(base), dict(values)
                point[optuna_name], vals[name] = value, value
                for o2, n2, p2 in params[i + 1:]:
                    vals[n2] = default_value(p2, vals)
                    low = domain(p2, vals)
                    vals[n2] = vals[n2] if vals[n2] in low else low[0]
                    point[o2] = vals[n2]
                yield point


def random_points(space, count, seed):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    sample = define_by_run(space)
    for _ in range(count):
        trial = study.ask()
        constants = sample(trial)
        yield {**trial.params, **constants}


def all_argvs(tmp_path, available=None):
    study = load_study(None, {"engine.kind": "sglang", "model.target": str(tmp_path),
                              "model.drafts": {a: str(tmp_path) for a in ("eagle", "eagle3", "standalone")}})
    argvs = {}
    for path in sorted(SEARCH_SPACES_DIR.glob("*.yaml")):
        if path.name.startswith(("llama-cpp-", "vllm-")):
            continue  # their own algorithms, not SGLang's: tests/unit/test_llama_cpp_spec.py, test_vllm_flags.py
        space = load_space(path)
        points = list(points_of(space)) + list(random_points(space, 60, seed=0))
        for point in points:
            resolution = resolve(space, point, study)
            assert resolution.valid, (path.name, point, resolution.violations)
            assert resolution.config is not None
            cfg = ReplicaConfig(engine="sglang", device="cuda", model=str(tmp_path), spec=resolution.config.spec)
            argv = sglang_argv(cfg, "127.0.0.1", 30000, available)
            argvs[json.dumps(argv)] = (path.name, point)
    return argvs


def test_every_bundled_point_renders_with_exact_names(tmp_path):
    argvs = all_argvs(tmp_path)
    assert len(argvs) > 200
    table_flags = {s.flag for s in SETTINGS}
    for key in argvs:
        argv = json.loads(key)
        assert argv[0] != "sglang", argv  # never a bare name looked up on PATH
        assert {a for a in argv if a.startswith("--speculative")} <= table_flags, argv
        if "NGRAM" in argv:  # SGLang derives steps/topk for NGRAM; passing them inflates the KV reservation
            assert "--speculative-num-steps" not in argv and "--speculative-eagle-topk" not in argv


# Flags SGLang removed (a prefix of a flag it still has: ambiguous; a flag it dropped: unrecognized), parsed by the
# installed SGLang in the same preflight as the bundled points' argvs.
REMOVED = (["--cuda-graph-max-bs", "8"], ["--speculative-ngram-branch-length", "4"])


@pytest.fixture(scope="module")
def parsed(tmp_path_factory) -> Callable[[str | None], tuple[dict, list, list]]:
    """`parsed(sglang_path)`: (the bundled points' argvs rendered from that SGLang's fields, its parser's verdict on
    each, its verdict on each `REMOVED` argv -- the installed SGLang's only, else []), asked once per SGLang for the
    module."""
    model = tmp_path_factory.mktemp("model")
    asked: dict[str | None, tuple[dict, list, list]] = {}

    def ask(path: str | None) -> tuple[dict, list, list]:
        if path not in asked:
            fields = server_arg_fields(path)
            assert fields and "speculative_ngram_max_trie_depth" in fields  # 0.5.22 too: the match-window flags are older
            argvs = all_argvs(model, fields)
            removed = [["sglang", "serve", "--model-path", str(model), *flags] for flags in REMOVED] if path is None \
                else []
            with unkept_verdicts():  # every argv names this module's temporary folder
                results = run_preflight([json.loads(k) for k in argvs] + removed, parse_only=True, sglang_path=path)
            assert results is not None and len(results) == len(argvs) + len(removed)
            asked[path] = (argvs, results[:len(argvs)], results[len(argvs):])
        return asked[path]

    return ask


@pytest.mark.parametrize("version", TESTED_VERSIONS)
def test_every_bundled_point_parses_with_each_tested_sglang(parsed, version):
    argvs, results, _ = parsed(sglang_path(version))
    bad = [(argvs[k], r.error) for k, r in zip(argvs, results) if not r.ok]
    assert bad == [], bad[:5]


@pytest.mark.parametrize("version", TESTED_VERSIONS)
def test_every_table_setting_is_a_server_arg_of_each_tested_sglang(version):
    path = sglang_path(version)
    fields = server_arg_fields(path)
    assert fields is not None
    assert {s.server_arg for s in SETTINGS} <= fields


def test_a_setting_the_installed_sglang_lacks_is_refused_before_launch():
    # As an SGLang without the trie-depth flag would be: the point is refused with the field, the flag and the fix,
    # instead of launching with a flag SGLang answers "unrecognized arguments" to (every NGRAM trial lost).
    fields = {s.server_arg for s in SETTINGS} - {"speculative_ngram_max_trie_depth"}
    config = ReplicaConfig(engine="sglang", device="cuda", model="/m", spec=NgramSpec(max_trie_depth=9))
    with pytest.raises(UnsupportedSetting) as info:
        sglang_argv(config, "127.0.0.1", 1, fields)
    message = str(info.value)
    assert "spec.max_trie_depth=9" in message and "--speculative-ngram-max-trie-depth" in message
    assert "sglang==0.5.23" in message
    # A spec that does not need the missing setting renders fine with the same fields.
    assert "--speculative-algorithm" not in sglang_argv(ReplicaConfig(engine="sglang", device="cuda", model="/m"), "h", 1, fields)


def test_the_engine_turns_a_missing_setting_into_a_rejected_config(monkeypatch):
    import serve.engines.sglang.engine as sglang

    monkeypatch.setattr(sglang, "server_arg_fields", lambda path=None, python=None: frozenset({"speculative_algorithm"}))
    with pytest.raises(ConfigRejected, match="speculative-num-draft-tokens"):
        SglangEngine().argv(ReplicaConfig(engine="sglang", device="cuda", model="/m", spec=NgramSpec()), "127.0.0.1", 1)


def test_launcher_is_the_script_next_to_the_interpreter_never_a_name_on_path(tmp_path):
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    python = bindir / "python"
    assert launcher(str(python)) == [str(python), "-m", "sglang.launch_server"]
    script = bindir / "sglang"
    script.write_text("#!/bin/sh\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    assert launcher(str(python)) == [str(script), "serve"]
    argv = sglang_argv(ReplicaConfig(engine="sglang", device="cuda", model="/m"), "127.0.0.1", 5)
    assert argv[0] in (str(Path(sys.executable).parent / "sglang"), sys.executable)


@needs_sglang
def test_removed_flags_are_rejected_by_sglang(parsed):
    _, _, results = parsed(None)
    assert "ambiguous option" in (results[0].error or "")
    assert "unrecognized arguments" in (results[1].error or "")


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> tuple[str, dict]:
    """(a tiny model folder with a corpus file, {case: (spec, argv, SGLang's resolution of it)}) for the resolution
    tests below, resolved by the installed SGLang in one preflight."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    corpus = folder / "corpus.jsonl"
    corpus.write_text('"def add(a, b):\\n    return a + b"\n')
    model = str(folder)
    specs = {"ngram": NgramSpec(num_draft_tokens=16, max_bfs_breadth=4, min_bfs_breadth=2),
             "chain_fix": StandaloneSpec(draft_model=model, num_steps=3, topk=1, num_draft_tokens=8),
             "partial": EagleSpec(draft_model=model, num_steps=3),
             "corpus_good": NgramSpec(num_draft_tokens=8, external_corpus=str(corpus), external_sam_budget=3),
             "corpus_too_big": NgramSpec(num_draft_tokens=4, external_corpus=str(corpus), external_sam_budget=5)}
    argvs = [sglang_argv(ReplicaConfig(engine="sglang", device="cuda", model=model, spec=s), "127.0.0.1", 30000)
             for s in specs.values()]
    with unkept_verdicts():  # every argv names this module's temporary folder
        results = run_preflight(argvs) or []
    assert len(results) == len(specs)
    return model, {case: (spec, argv, result) for (case, spec), argv, result in zip(specs.items(), argvs, results)}


@needs_sglang
def test_sglang_resolution_matches_our_rules(resolved):
    model, cases = resolved
    (ngram, _, r_ngram), (chain_fix, _, r_chain), (partial, _, r_partial) = (cases[c] for c in
                                                                              ("ngram", "chain_fix", "partial"))

    # NGRAM: SGLang copies max_bfs_breadth into topk and derives steps = draft // breadth; sets 48 running requests.
    assert r_ngram.ok, r_ngram.error
    assert r_ngram.resolved["speculative_eagle_topk"] == 4 and r_ngram.resolved["speculative_num_steps"] == 4
    assert r_ngram.resolved["max_running_requests"] == 48
    assert validate_spec(ngram) == []

    # topk=1: SGLang silently shortens draft to steps+1; we refuse the point before it is deployed.
    chain_config = ReplicaConfig(engine="sglang", device="cuda", model=model, spec=chain_fix)
    assert r_chain.ok and r_chain.diffs(chain_config) == {"num_draft_tokens": (8, 4)}
    assert [v.field for v in validate_spec(chain_fix)] == ["spec.num_draft_tokens"]

    # Partial EAGLE params: SGLang fails without naming the rule; our validation names it.
    assert not r_partial.ok and r_partial.stage == "resolve"
    assert "all set or all unset" in str(validate_spec(partial)[0])


@needs_sglang
def test_external_corpus_flags_resolve_and_sglangs_budget_rule_is_ours(resolved):
    _, cases = resolved
    (good, good_argv, r_good), (too_big, _, r_big) = cases["corpus_good"], cases["corpus_too_big"]
    assert "--speculative-ngram-external-corpus-path" in good_argv
    assert r_good.ok, r_good.error
    assert r_good.resolved["speculative_ngram_external_sam_budget"] == 3
    assert not r_big.ok and r_big.stage in ("resolve", "check") and "external_sam_budget" in (r_big.error or "")
    assert validate_spec(good) == [] and [v.field for v in validate_spec(too_big)] == ["spec.external_sam_budget"]
