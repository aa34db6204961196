"""SGLang 0.5.23's adaptive speculation (`--speculative-adaptive`) as a searched choice of the EAGLE spaces, and the
winner's tuned adaptive config in deploy/ (issue 40, "Also new in 0.5.23").

Checked against SGLang's own code (`speculative/adaptive_spec_params.py`), run on this CPU machine: its default tiers
are ours; where its `adaptive_unsupported_reason` turns adaptive off, our validation refuses the point and the
replica's check refuses the config; SGLang's resolution accepts every adaptive point of search_spaces/eagle3.yaml;
an adaptive winner is served as measured (issue 59), the steps its level table suggests (0 where the baseline won)
said beside it; a spec's candidate steps load with its `_load_adaptive_config`, and the deployed engine command names
them and parses with SGLang's parser.

SGLang's resolution as an sm90 GPU is asked once for the module (`on_sm90`: one preflight subprocess, 6-12 s of
importing SGLang's argument code on 2 cores, instead of one per test); each test asserts on its own argvs' answers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_study
from pipeline.decide.adaptive import default_steps_at, tuned_adaptive_steps
from pipeline.decide.levels import Candidate, LevelInput, RunFigures, decide_levels
from pipeline.search.space import load_space, resolve
from serve.engines.base import ReplicaConfig, child_env
from serve.engines.sglang.engine import ADAPTIVE_CONFIG_FILE, SglangEngine, resolved_problem, sglang_argv, write_adaptive_config
from serve.engines.sglang.check import Preflight, check_adaptive_config, installed_version, run_preflight
from serve.serving import COMMAND_FILE, Provenance, deploy_files, serving_config
from serve.spec import DEFAULT_ADAPTIVE_STEPS, Eagle3Spec, EagleSpec, validate_spec
from tests.sglang_servers import unkept_verdicts

ROOT = Path(__file__).resolve().parents[2]
needs_sglang = pytest.mark.skipif(installed_version() is None,
                                  reason="sglang is not installed (bash infra/install-sglang-parser.sh)")
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
              "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(folder)


def gpu(model: str, spec) -> ReplicaConfig:
    return ReplicaConfig(engine="sglang", device="cuda", model=model, attention_backend="flashinfer", spec=spec)


def off_cases(model: str) -> list[EagleSpec | Eagle3Spec]:
    return [Eagle3Spec(draft_model=model, adaptive=True),  # SGLang: topk 1, the middle candidate
            Eagle3Spec(draft_model=model, adaptive=True, num_steps=3, topk=1, num_draft_tokens=4),
            Eagle3Spec(draft_model=model, adaptive=True, num_steps=3, topk=4, num_draft_tokens=8),  # off: topk 4
            EagleSpec(draft_model=model, adaptive=True, num_steps=2, topk=1, num_draft_tokens=3)]  # 2: no candidate


def eagle3_points(model: str) -> tuple[list[str], list[str]]:
    """The argvs of the eagle3 space's adaptive point and of a static tree point, as the study resolves them."""
    space = load_space(ROOT / "search_spaces" / "eagle3.yaml")
    study = load_study(None, {"engine.kind": "sglang", "model.target": model, "model.drafts": {"eagle3": model}})
    adaptive = resolve(space, {"algorithm": "eagle3", "eagle3.adaptive": True}, study)
    static = resolve(space, {"algorithm": "eagle3", "eagle3.adaptive": False, "eagle3.num_steps": 3,
                             "eagle3.topk": 4, "eagle3.num_draft_tokens": 8}, study)
    assert adaptive.valid and static.valid
    assert adaptive.config is not None and static.config is not None
    return (sglang_argv(gpu(model, adaptive.config.spec), "127.0.0.1", 30000),
            sglang_argv(gpu(model, static.config.spec), "h", 1))


def tuned_replica(model: str, log_dir: Path) -> ReplicaConfig:
    """The adaptive winner of `adaptive_study_decision` with its tuned steps, as a replica runs it."""
    decision, specs = adaptive_study_decision(model)
    tuned = tuned_adaptive_steps(decision, "adaptive", specs)
    return ReplicaConfig(engine="sglang", device="cuda", model=model, attention_backend="flashinfer",
                         spec=specs["adaptive"].model_copy(update={"adaptive_steps": tuned}), log_dir=str(log_dir))


class Sm90:
    """SGLang's resolution of argvs as an sm90 GPU: the argvs given at construction in one preflight, any other argv
    when a test asks it."""

    def __init__(self, argvs: list[list[str]]) -> None:
        self.answers: dict[str, Preflight] = {}
        self.ask(argvs)

    def ask(self, argvs: list[list[str]]) -> list[Preflight]:
        missing = [a for a in argvs if json.dumps(a) not in self.answers]
        if missing:
            with unkept_verdicts():  # every argv names this module's temporary folders
                results = run_preflight(missing, gpu_arch="sm90")
            assert results is not None and len(results) == len(missing)
            self.answers.update(zip(map(json.dumps, missing), results))
        return [self.answers[json.dumps(a)] for a in argvs]


@pytest.fixture(scope="module")
def replica_dir(tmp_path_factory) -> Path:
    """The tuned replica's log folder, where it writes its adaptive config (the file's path is in its argv)."""
    return tmp_path_factory.mktemp("replica")


@pytest.fixture(scope="module")
def on_sm90(model, replica_dir) -> Sm90:
    """Every sm90 question of this module, asked together: the off cases, the eagle3 space's points, and the tuned
    adaptive replica's argv with the adaptive config the replica writes."""
    served = tuned_replica(model, replica_dir)
    path = write_adaptive_config(served)
    assert path is not None
    return Sm90([sglang_argv(gpu(model, s), "127.0.0.1", 30000) for s in off_cases(model)]
                + list(eagle3_points(model)) + [sglang_argv(served, "127.0.0.1", 30000, adaptive_config=path)])


@needs_sglang
def test_our_default_tiers_are_sglangs():
    code = ("import json; from serve.engines.sglang.preflight import _install_stubs; _install_stubs(); "
            "from sglang.srt.speculative.adaptive_spec_params import DEFAULT_ADAPTIVE_CONFIG as c; "
            "print(json.dumps({k: v['candidate_steps'] for k, v in c.items()}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), check=True)
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert {int(k): tuple(v) for k, v in theirs.items()} == DEFAULT_ADAPTIVE_STEPS


@needs_sglang
def test_where_sglang_turns_adaptive_off_our_validation_and_the_replica_refuse_the_point(model, on_sm90):
    cases = off_cases(model)
    on, chain, tree, off_candidates = on_sm90.ask([sglang_argv(gpu(model, s), "127.0.0.1", 30000) for s in cases])
    assert on.ok and on.resolved["speculative_adaptive"] is True and on.resolved["speculative_eagle_topk"] == 1
    assert chain.ok and chain.resolved["speculative_adaptive"] is True and resolved_problem(chain.resolved) is None
    assert validate_spec(cases[0]) == [] and validate_spec(cases[1]) == []
    # SGLang resolves topk 4 with adaptive silently static ("speculative_adaptive disabled: ... only topk=1")
    assert tree.ok and tree.resolved["speculative_adaptive"] is False
    assert "topk=4" in tree.resolved["adaptive_unsupported_reason"]
    assert "turns --speculative-adaptive off" in (resolved_problem(tree.resolved) or "")
    assert [v.field for v in validate_spec(cases[2])] == ["spec.topk"]
    # steps outside the candidates: SGLang refuses at resolution; we refuse before
    assert not off_candidates.ok and "candidate_steps" in (off_candidates.error or "")
    assert [v.field for v in validate_spec(cases[3])] == ["spec.num_steps"]


@needs_sglang
def test_every_adaptive_point_of_the_eagle3_space_resolves_adaptive_in_sglang(model, on_sm90):
    argv, static = eagle3_points(model)
    assert "--speculative-adaptive" in argv and "--speculative-num-steps" not in argv
    results = on_sm90.ask([argv, static])
    assert all(r.ok for r in results), [r.error for r in results]
    assert results[0].resolved["speculative_adaptive"] is True
    assert results[1].resolved["speculative_adaptive"] is False


def runs(tok_s: float) -> tuple[RunFigures, ...]:
    return tuple(RunFigures(tput_tok_s=tok_s + d) for d in (-1.0, 0.0, 1.0))


def adaptive_study_decision(model: str):
    """Three levels: at 1 the adaptive winner and the 5-step chain beat the baseline, at 8 only the 3-step chain
    does, at 32 nothing does."""
    specs = {"adaptive": Eagle3Spec(draft_model=model, adaptive=True),
             "steps3": Eagle3Spec(draft_model=model, num_steps=3, topk=1, num_draft_tokens=4),
             "steps5": Eagle3Spec(draft_model=model, num_steps=5, topk=1, num_draft_tokens=6)}
    figures = {1: {"adaptive": 200.0, "steps3": 90.0, "steps5": 180.0},
               8: {"adaptive": 95.0, "steps3": 150.0, "steps5": 80.0},
               32: {"adaptive": 60.0, "steps3": 70.0, "steps5": 50.0}}
    levels = [LevelInput(level=level, baseline=runs(100.0),
                         candidates=tuple(Candidate(id=i, runs=runs(tok), equivalent=True, spec=specs[i])
                                          for i, tok in row.items()))
              for level, row in figures.items()]
    return decide_levels(levels), specs


def test_the_tuned_config_offers_zero_where_the_baseline_won(model):
    decision, specs = adaptive_study_decision(model)
    assert decision.policy.config == "adaptive"
    tuned = tuned_adaptive_steps(decision, "adaptive", specs)
    assert tuned == {1: tuple(sorted({*default_steps_at(1), 5})), 8: (3,), 32: (0,)}
    assert tuned_adaptive_steps(decision, "steps3", specs) is None  # a static winner: no adaptive config
    assert default_steps_at(4) == DEFAULT_ADAPTIVE_STEPS[1] and default_steps_at(40) == DEFAULT_ADAPTIVE_STEPS[32]


def test_an_adaptive_winner_is_served_as_its_finalist_runs_measured_it(model):
    # Issue 59: the finalist runs measured the adaptive winner on SGLang's default candidate steps; the study serves
    # and registers exactly that config, and the table's suggested steps are only said (no run measured them).
    from pipeline.config import TrialConfig
    from pipeline.study.served import served_config

    decision, specs = adaptive_study_decision(model)
    configs = {"baseline": TrialConfig(), **{k: TrialConfig(spec=v) for k, v in specs.items()}}
    chosen, config, note = served_config(decision, configs)
    assert chosen == "adaptive" and config == configs["adaptive"] and isinstance(config.spec, Eagle3Spec)
    assert config.spec.adaptive_steps is None
    serving = serving_config(gpu(model, config.spec), Provenance(study="s", decision="promote", source=chosen,
                                                                 workload="w", workload_digest="0" * 16))
    files = deploy_files(serving, {"config_file": "x"}, "v1")
    assert ADAPTIVE_CONFIG_FILE not in files  # SGLang's default tiers, the ones measured
    command = files[COMMAND_FILE]
    assert "--speculative-adaptive " in command and "--speculative-adaptive-config" not in command
    tuned = tuned_adaptive_steps(decision, "adaptive", specs)
    assert tuned is not None and note is not None and "no run measured them" in note
    assert all(f"{level}: {list(steps)}" in note for level, steps in tuned.items())
    assert served_config(decision, {**configs, "adaptive": configs["steps3"]})[2] is None  # a static winner: no note


@needs_sglang
def test_the_tuned_config_round_trips_through_sglangs_loader_and_the_deployed_command_names_it(model, tmp_path,
                                                                                               replica_dir, on_sm90):
    served = tuned_replica(model, replica_dir)
    assert validate_spec(served.spec) == []
    serving = serving_config(served, Provenance(study="s", decision="promote", source="adaptive", workload="w",
                                                workload_digest="0" * 16))
    files = deploy_files(serving, {"config_file": "x"}, "v1")
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    for name, text in files.items():
        (deploy / name).write_text(text)
    loaded = check_adaptive_config(str(deploy / ADAPTIVE_CONFIG_FILE))
    assert loaded is not None and loaded["ok"], loaded
    assert loaded["buckets"] == {"1": [1, 3, 5, 7], "8": [3], "32": [0]}
    command = files[COMMAND_FILE]
    assert f"--speculative-adaptive-config {ADAPTIVE_CONFIG_FILE}" in command and 'cd "$(dirname "$0")"' in command
    assert "--speculative-adaptive " in command
    exported = SglangEngine().command_argv(serving.replica, "127.0.0.1", 30000)
    with unkept_verdicts():
        assert run_preflight([exported], parse_only=True) is not None
    # The replica writes the same document on its node and SGLang resolves the engine with it.
    path = write_adaptive_config(served)
    assert path is not None and json.loads(Path(path).read_text()) == json.loads(files[ADAPTIVE_CONFIG_FILE])
    # asked with the module's other sm90 questions (`on_sm90`: the same document at the same path); SGLang is asked
    # here only if this argv differs from that one
    (result,) = on_sm90.ask([sglang_argv(served, "127.0.0.1", 30000, adaptive_config=path)])
    assert result.ok and result.resolved["speculative_adaptive"] is True, result.error
    assert result.resolved["speculative_adaptive_config"] == path

