"""One door per engine: what the study asks of an engine kind is a method of `Engine`, "not applicable" by default, and
every engine keeps its files under the model store's one cache root (docs/design.md, "Add an engine")."""

from pathlib import Path
from typing import get_args

import pytest

from serve import model_store
from serve.engines import engine_for
from serve.engines.base import Engine, EngineKind, ReplicaConfig
from serve.engines.llama_cpp import models as llama_models
from serve.engines.sglang import cpu as sglang_cpu
from serve.engines.sglang import verdicts
from serve.ngram import compiled


def test_a_kind_that_overrides_nothing_is_not_applicable_to_every_study_question():
    class Bare(Engine):
        kind = "bare"
        label = "a bare engine"
        algorithms = frozenset({"none"})

    bare, config = Bare(), ReplicaConfig(model="smollm2-135m")
    assert bare.device(config) == "cpu" and bare.describe_device(config) is None
    assert bare.gpu_study("cuda", lambda: pytest.fail("a kind without a GPU never asks")) is False
    assert bare.pinned_settings(config) == {} and bare.node_facts(config) is None
    assert bare.shared_settings(config, "sm90", [], [], False) is None
    assert bare.check_commands([config], None) is None and bare.deploy_folder_report(Path(".")) is None
    assert bare.installed("cpu") is None and bare.install_problem("cpu", None) is None
    assert bare.model_name("m@f32") == "m@f32" and not bare.cpu_size_limited(config)


def test_every_kind_answers_through_its_engine():
    for kind in get_args(EngineKind):
        engine = engine_for(kind)
        assert engine.kind == kind and isinstance(engine, Engine)
    sglang = engine_for("sglang")
    on_gpu = ReplicaConfig(engine="sglang", model="/m", device="cuda")
    assert sglang.device(on_gpu) == "cuda" and "cuda" in (sglang.describe_device(on_gpu) or "")
    assert sglang.gpu_study("cuda", lambda: False) and not sglang.gpu_study("cpu", lambda: True)
    assert sglang.pinned_settings(on_gpu)["max_running_requests"] == 48
    assert engine_for("cpu").pinned_settings(ReplicaConfig(model="m")) == {}
    assert engine_for("llama_cpp").model_name("smollm2-135m@f32") == "smollm2-135m"


def test_every_engine_keeps_its_files_under_the_one_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    for name in ("SPECDEC_LLAMA_CPP_HOME", "SPECDEC_SGLANG_CPU_VENV", "SPECDEC_LLAMA_SERVER"):
        monkeypatch.delenv(name, raising=False)
    assert model_store.cache_root() == tmp_path
    for path in (llama_models.install_root(), llama_models.server_binary(), sglang_cpu.venv_dir(), verdicts.folder(),
                 compiled._library_path(), llama_models.gguf_path("smollm2-135m")):
        assert tmp_path in path.parents, path
