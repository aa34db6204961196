"""llama.cpp's typed spec: its own tagged variants in the one SpecConfig union, validation, argv, search spaces."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.config import TrialConfig, validate_trial
from serve.engines import algorithms_of, engine_for
from serve.engines.base import ReplicaConfig
from serve.engines.llama_cpp import flags, models
from serve.engines.llama_cpp.adapter import LlamaCppEngine
from serve.spec import (LLAMA_CPP_ALGORITHMS, LlamaDraftSpec, LlamaNgramCacheSpec, LlamaNgramModSpec,
                        LlamaNgramSimpleSpec, NgramSpec, NoSpec, draft_token_count, parse_spec, validate_spec)

REPO = Path(__file__).resolve().parents[2]


def test_the_union_parses_llama_variants_and_rejects_unknown_keys():
    spec = parse_spec({"algorithm": "llama_ngram_mod", "n_min": 2, "n_max": 8})
    assert isinstance(spec, LlamaNgramModSpec) and (spec.n_min, spec.n_max, spec.n_match) == (2, 8, 24)
    simple = TrialConfig(spec={"algorithm": "llama_ngram_simple", "size_n": 3}).spec
    assert isinstance(simple, LlamaNgramSimpleSpec) and simple.size_n == 3
    with pytest.raises(ValidationError, match="num_draft_tokens"):  # SGLang's knob is not llama.cpp's
        parse_spec({"algorithm": "llama_ngram_simple", "num_draft_tokens": 4})
    with pytest.raises(ValidationError):
        parse_spec({"algorithm": "llama_ngram_simple", "size_n": 0})


def test_rules_name_field_rule_and_value():
    assert validate_spec(LlamaNgramModSpec(n_min=4, n_max=4)) == []
    (v,) = validate_spec(LlamaNgramModSpec(n_min=9, n_max=4))
    assert str(v) == "spec.n_min: llama_ngram_mod: n_min <= n_max must hold, got n_min=9, n_max=4"
    found = validate_spec(LlamaDraftSpec(draft_n_min=5, draft_n_max=2))
    assert [v.field for v in found] == ["spec.draft_model", "spec.draft_n_min"]
    assert "draft_n_min=5, draft_n_max=2" in str(found[1])
    assert validate_spec(LlamaDraftSpec(draft_model="smollm2-135m")) == []
    (v,) = validate_spec(LlamaNgramCacheSpec(dynamic_cache=False))
    assert v.field == "spec.dynamic_cache"


def test_engine_kinds_keep_their_algorithms_apart():
    assert validate_trial(TrialConfig(spec=LlamaNgramSimpleSpec()), "llama_cpp") == []
    assert validate_trial(TrialConfig(spec=NoSpec()), "llama_cpp") == []
    (v,) = validate_trial(TrialConfig(spec=NgramSpec()), "llama_cpp")
    assert v.field == "spec.algorithm" and "llama-server" in v.rule
    assert "llama_ngram_simple" not in algorithms_of("cpu")
    assert [v.field for v in validate_trial(TrialConfig(spec=LlamaNgramSimpleSpec()), "cpu")] == ["spec.algorithm"]


def test_draft_token_count_reads_llama_knobs():
    assert draft_token_count(LlamaDraftSpec(draft_model="d", draft_n_max=5)) == 5
    assert draft_token_count(LlamaNgramSimpleSpec(size_m=7)) == 7
    assert draft_token_count(LlamaNgramModSpec(n_max=9, n_min=1)) == 9


@pytest.mark.parametrize("spec, expected", [
    (NoSpec(), []),
    (LlamaNgramSimpleSpec(size_n=3, size_m=8, min_hits=2),
     ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8",
      "--spec-ngram-simple-min-hits", "2"]),
    (parse_spec({"algorithm": "llama_ngram_map_k4v", "size_n": 2}),
     ["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", "2", "--spec-ngram-map-k4v-size-m", "48",
      "--spec-ngram-map-k4v-min-hits", "1"]),
    (LlamaNgramModSpec(n_match=8, n_min=2, n_max=16),
     ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "8", "--spec-ngram-mod-n-min", "2",
      "--spec-ngram-mod-n-max", "16"]),
    (LlamaNgramCacheSpec(), ["--spec-type", "ngram-cache"]),
])
def test_spec_flags(spec, expected):
    assert flags.spec_flags(spec) == expected


def test_server_argv_owns_its_flags_and_resolves_models():
    config = ReplicaConfig(engine="llama_cpp", model="smollm2-135m@f32", threads=2, max_running_requests=3,
                           spec=LlamaDraftSpec(draft_model="smollm2-135m", draft_n_max=4, threads=1))
    engine = engine_for("llama_cpp")
    assert isinstance(engine, LlamaCppEngine)  # server_argv is llama.cpp's own: production runs that command
    argv = engine.server_argv(config)
    assert argv[argv.index("--model") + 1].endswith("SmolLM2-135M-Instruct.Q4_1.f32.gguf")
    assert argv[argv.index("--spec-draft-model") + 1].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert argv[argv.index("--threads") + 1] == "1"  # the spec's threads win over the study's
    assert argv[argv.index("--parallel") + 1] == "3" and argv[argv.index("--spec-draft-n-max") + 1] == "4"
    with pytest.raises(ValueError, match="engine.extra_flags"):
        flags.server_argv(Path("x"), Path("m.gguf"), NoSpec(), None, None, ["--port=1"])
    with pytest.raises(ValueError, match="GGUF only"):
        models.gguf_path("not-a-model-dir")


def test_shim_argv_carries_the_spec_and_the_dynamic_cache_switch():
    engine = engine_for("llama_cpp")
    argv = engine.argv(ReplicaConfig(engine="llama_cpp", model="smollm2-135m", spec=LlamaNgramCacheSpec()), "h", 9)
    shim, server = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    assert shim[1:3] == ["-m", "serve.engines.llama_cpp"] and "--dynamic-lookup-cache" in shim
    assert parse_spec(__import__("json").loads(shim[shim.index("--spec") + 1])) == LlamaNgramCacheSpec()
    assert server[0].endswith("llama-server") and "--port" not in server  # the shim picks llama-server's port



def test_deploy_files_carry_the_bare_llama_server_command():
    """A llama.cpp winner's deploy/ also holds llama-server alone: the same argv the shim runs, plus host/port, and
    for ngram-cache the dynamic lookup file created first (llama-server aborts on a missing one)."""
    import shlex

    from serve.engines.llama_cpp.adapter import LLAMA_SERVER_COMMAND_FILE
    from serve.serving import Provenance, ServingConfig, deploy_files

    provenance = Provenance(study="s", decision="promote", source="final-0", workload="w", workload_digest="d")
    for spec in (LlamaDraftSpec(draft_model="smollm2-135m"), LlamaNgramCacheSpec()):
        replica = ReplicaConfig(engine="llama_cpp", model="smollm2-135m", spec=spec, threads=1)
        text = deploy_files(ServingConfig(replica=replica, provenance=provenance), {"config_file": "c"}, "1")[
            LLAMA_SERVER_COMMAND_FILE]
        argv = shlex.split(next(line for line in text.splitlines() if line.startswith("exec ")))[1:]
        shim = engine_for("llama_cpp").argv(replica, "h", 1)
        assert argv[:-4 if isinstance(spec, LlamaDraftSpec) else -6] == shim[shim.index("--") + 1:]
        assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "30000"
        if isinstance(spec, LlamaNgramCacheSpec):
            assert argv[-2:] == ["--lookup-cache-dynamic", "lookup-dynamic.bin"]
            assert "touch lookup-dynamic.bin\n" in text
    cpu = ReplicaConfig(model="smollm2-135m")
    assert LLAMA_SERVER_COMMAND_FILE not in deploy_files(ServingConfig(replica=cpu, provenance=provenance),
                                                         {"config_file": "c"}, "1")

def test_missing_binary_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_LLAMA_SERVER", str(tmp_path / "nope"))
    with pytest.raises(models.LlamaCppMissing, match="bash infra/install-llama-cpp.sh"):
        models.require_server()


def test_bundled_llama_spaces_load_and_cover_every_type():
    from pipeline.search.space import load_space

    files = sorted((REPO / "search_spaces").glob("llama-cpp-*.yaml"))
    assert files
    covered = set()
    for path in files:
        covered |= set(load_space(path).algorithms)
    assert covered == {"none", *LLAMA_CPP_ALGORITHMS}


def test_example_study_loads():
    from pipeline.config import load_study

    study = load_study(REPO / "examples" / "study-llama-cpp.yaml", {})
    assert study.engine.kind == "llama_cpp"
