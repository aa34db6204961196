"""`python -m pipeline.tune --engine sglang|llama_cpp` from a shell, to its decision (tests/cli_run.py). With
`--engine sglang` the study's validation once imported Ray before the command line set Ray's auth mode, and the local
Ray it started refused its own driver ("Failed to start GCS"): every SGLang study from a shell died before its first
trial while the library-level tests passed."""

from __future__ import annotations

import pytest

from tests.cli_run import check_decided, tune
from tests.integration.llama_cpp_helpers import require_llama_server
from tests.sglang_servers import needs_sglang_cpu

pytestmark = [pytest.mark.integration, pytest.mark.engines]


@needs_sglang_cpu
def test_the_command_line_runs_an_sglang_study_to_its_decision(tmp_path):
    check_decided(tune("sglang", tmp_path, "--search-space", "ngram.yaml", "--set", "engine.device=cpu"))


def test_the_command_line_runs_a_llama_cpp_study_to_its_decision(tmp_path):
    require_llama_server()
    check_decided(tune("llama_cpp", tmp_path, "--search-space", "llama-cpp-ngram.yaml"))
