"""Our SGLang flags against SGLang's real parser (sglang 0.5.23 installed --no-deps; skipped where it is absent).

Flag rendering: every value of every parameter of every branch of every bundled space (others at their defaults),
plus seeded random full points, must parse with zero unrecognized or ambiguous flags. argparse checks each flag on
its own, so covering every (flag, value) pair covers every point's flags. Resolution: a table of cases where
SGLang rewrites or rejects settings is checked against what our validation says.
"""

import json

import optuna
import pytest

from pipeline.config import SEARCH_SPACES_DIR, load_study
from pipeline.space import CategoricalParam, FixedParam, IntParam, _default, _evaluate, define_by_run, load_space, resolve
from serve.engines.base import ReplicaConfig
from serve.engines.flags import LATEST, TABLES, render_spec, table_for
from serve.engines.sglang import installed_version, run_preflight, sglang_argv
from serve.spec import EagleSpec, NgramSpec, StandaloneSpec, validate_spec

needs_sglang = pytest.mark.skipif(installed_version() is None, reason="sglang is not installed (CI installs it --no-deps)")
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
              "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}


def domain(p, values):
    if isinstance(p, FixedParam):
        return [p.value]
    if isinstance(p, CategoricalParam):
        return list(p.choices)
    if isinstance(p, IntParam):
        low, high = int(_evaluate(p.low, values)), int(_evaluate(p.high, values))
        return list(range(low, high + 1, p.step))
    return [_evaluate(p.low, values), _evaluate(p.high, values)]


def points_of(space):
    """Every value of every parameter (others at defaults) for each speculative branch."""
    for algorithm in space.algorithms:
        params = space.params_for(algorithm)
        for i, (optuna_name, name, p) in enumerate(params):
            values, base = {}, {"algorithm": algorithm}
            for j, (o2, n2, p2) in enumerate(params[:i]):
                values[n2] = _default(p2, values)
                base[o2] = values[n2]
            for value in domain(p, values):
                point, vals = dict(base), dict(values)
                point[optuna_name], vals[name] = value, value
                for o2, n2, p2 in params[i + 1:]:
                    vals[n2] = _default(p2, vals)
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


def all_argvs(tmp_path):
    study = load_study(None, {"engine.kind": "sglang", "model.target": str(tmp_path),
                              "model.drafts": {a: str(tmp_path) for a in ("eagle", "eagle3", "standalone")}})
    argvs = {}
    for path in sorted(SEARCH_SPACES_DIR.glob("*.yaml")):
        space = load_space(path)
        points = list(points_of(space)) + list(random_points(space, 60, seed=0))
        for point in points:
            resolution = resolve(space, point, study)
            assert resolution.valid, (path.name, point, resolution.violations)
            cfg = ReplicaConfig(engine="sglang", model=str(tmp_path), spec=resolution.config.spec)
            argv = sglang_argv(cfg, "127.0.0.1", 30000, LATEST)
            argvs[json.dumps(argv)] = (path.name, point)
    return argvs


def test_every_bundled_point_renders_with_exact_names(tmp_path):
    argvs = all_argvs(tmp_path)
    assert len(argvs) > 200
    for key in argvs:
        argv = json.loads(key)
        assert not set(argv) & set(LATEST.removed), argv
        if "NGRAM" in argv:  # SGLang derives steps/topk for NGRAM; passing them inflates the KV reservation
            assert "--speculative-num-steps" not in argv and "--speculative-eagle-topk" not in argv


@needs_sglang
def test_every_bundled_point_parses_with_sglangs_parser(tmp_path):
    argvs = all_argvs(tmp_path)
    results = run_preflight([json.loads(k) for k in argvs], parse_only=True)
    bad = [(argvs[k], r.error) for k, r in zip(argvs, results) if not r.ok]
    assert bad == [], bad[:5]


@needs_sglang
def test_removed_flags_are_rejected_by_sglang(tmp_path):
    base = ["sglang", "serve", "--model-path", str(tmp_path)]
    results = run_preflight([base + ["--cuda-graph-max-bs", "8"], base + ["--speculative-ngram-branch-length", "4"]],
                            parse_only=True)
    assert "ambiguous option" in results[0].error
    assert "unrecognized arguments" in results[1].error


def test_version_tables():
    assert table_for("0.5.23") is LATEST and table_for("0.6.1") is LATEST and table_for(None) is LATEST
    legacy = table_for("0.5.10.post1")
    assert legacy is TABLES[1]
    flags = render_spec(NgramSpec(max_trie_depth=9), table=legacy)
    assert flags[flags.index("--speculative-ngram-max-match-window-size") + 1] == "9"
    assert "--speculative-ngram-max-trie-depth" not in flags


@needs_sglang
def test_sglang_resolution_matches_our_rules(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    model = str(tmp_path)
    ngram = NgramSpec(num_draft_tokens=16, max_bfs_breadth=4, min_bfs_breadth=2)
    chain_fix = StandaloneSpec(draft_model=model, num_steps=3, topk=1, num_draft_tokens=8)
    partial = EagleSpec(draft_model=model, num_steps=3)
    specs = [ngram, chain_fix, partial]
    argvs = [sglang_argv(ReplicaConfig(engine="sglang", model=model, spec=s), "127.0.0.1", 30000) for s in specs]
    r_ngram, r_chain, r_partial = run_preflight(argvs)

    # NGRAM: SGLang copies max_bfs_breadth into topk and derives steps = draft // breadth; sets 48 running requests.
    assert r_ngram.ok, r_ngram.error
    assert r_ngram.resolved["speculative_eagle_topk"] == 4 and r_ngram.resolved["speculative_num_steps"] == 4
    assert r_ngram.resolved["max_running_requests"] == 48
    assert validate_spec(ngram) == []

    # topk=1: SGLang silently shortens draft to steps+1; we refuse the point before it is deployed.
    assert r_chain.ok and r_chain.diffs(chain_fix, None) == {"speculative_num_draft_tokens": (8, 4)}
    assert [v.field for v in validate_spec(chain_fix)] == ["spec.num_draft_tokens"]

    # Partial EAGLE params: SGLang fails without naming the rule; our validation names it.
    assert not r_partial.ok and r_partial.stage == "resolve"
    assert "all set or all unset" in str(validate_spec(partial)[0])
