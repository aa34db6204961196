"""Launch sharing and start phases on a real SGLang replica (local Ray Serve on a GPU node):

    SPECDEC_GPU_MODEL=/models/Qwen2.5-0.5B-Instruct python -m pytest -q tests/gpu/test_gate_launch_sharing.py

Skipped without a GPU, SGLang or a model path. Checked: a trial start reports its phases (preflight with SGLang's
own parser, loading; the corpus loaded over `POST /add_external_corpus` and listed by `GET /list_external_corpora`
with its token count); the next config with the same engine settings and no corpus runs on the same SGLang process
with the corpus removed; a fresh launch asked for (a finalist's next run) stops that process, waits for its GPU
memory and starts a new one.
"""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from pipeline.study.driver import connect_ray
from pipeline.trial.replicas import delete_study_apps, launch_fresh, release, start_engine
from serve.engines import engine_for
from serve.engines.base import ReplicaConfig
from serve.engines.sglang.engine import installed_version

MODEL = os.environ.get("SPECDEC_GPU_MODEL")
STUDY = "gpu-sharing"
ENGINE = engine_for("sglang")  # the engine of `config`'s replicas
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no GPU (nvidia-smi not found)"),
    pytest.mark.skipif(installed_version() is None, reason="sglang is not installed"),
    pytest.mark.skipif(not MODEL, reason="set SPECDEC_GPU_MODEL to a local model directory"),
]


def config(tmp_path, label: str, spec: dict) -> ReplicaConfig:
    return ReplicaConfig(engine="sglang", model=MODEL or "", spec=spec, start_timeout_s=1800,
                         log_dir=str(tmp_path / label))


def test_sglang_starts_report_phases_and_equal_settings_share_one_launch(tmp_path):
    serve_url = connect_ray(STUDY)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps("def add(a, b):\n    return a + b\n") + "\n")
    ngram = {"algorithm": "ngram", "num_draft_tokens": 8, "max_bfs_breadth": 4, "external_sam_budget": 2}
    try:
        first_app, _ = start_engine(STUDY, "a", serve_url,
                                    config(tmp_path, "a", {**ngram, "external_corpus": str(corpus)}), 2000, ENGINE)
        first = httpx.get(f"{first_app.url}/replica/argv", timeout=30).json()
        assert {"preflight", "loading", "corpus"} <= set(first["phases"]) and not first["launch"]["shared"]
        listed = httpx.get(f"{first_app.url}/list_external_corpora", timeout=30).json()
        assert listed["success"] and listed["corpus_token_counts"] == {str(corpus):
                                                                       first["corpus"]["loaded_token_count"]}
        second_app, _ = start_engine(STUDY, "b", serve_url, config(tmp_path, "b", ngram), 2000, ENGINE)
        second = httpx.get(f"{second_app.url}/replica/argv", timeout=30).json()
        assert second["launch"]["shared"] and second["pid"] == first["pid"]
        assert httpx.get(f"{second_app.url}/list_external_corpora", timeout=30).json()["corpus_token_counts"] == {}
        body = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        assert httpx.post(f"{second_app.url}/generate", json=body, timeout=300).status_code == 200
        launch_fresh(STUDY)
        third_app, _ = start_engine(STUDY, "c", serve_url, config(tmp_path, "c", ngram), 2000, ENGINE)
        third = httpx.get(f"{third_app.url}/replica/argv", timeout=30).json()
        assert not third["launch"]["shared"] and third["pid"] != first["pid"]
        assert third["phases"]["stopping"] >= 0 and third["phases"]["loading"] > 0
    finally:
        release(STUDY)
        delete_study_apps(STUDY)
