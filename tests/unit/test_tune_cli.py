"""The CLI surface: --help documents every option, --dry-run works per bundled space, bad input exits non-zero."""

import shutil
import subprocess
import sys

import pytest

from pipeline.config import SEARCH_SPACES_DIR
from pipeline.tune import build_parser, main


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in text
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"


# What each bundled space needs on the default (cpu) engine to run: a draft model, or another engine (named in the fix)
CPU_RUNS = {"standalone.yaml": ["--model", "qwen2.5-coder-1.5b", "--set", "model.drafts.standalone=qwen2.5-coder-0.5b"],
            "standalone-small.yaml": ["--model", "qwen2.5-coder-1.5b", "--set",
                                      "model.drafts.standalone=qwen2.5-coder-0.5b"]}
OTHER_ENGINE = {"eagle3.yaml": "--engine sglang", "llama-cpp-draft.yaml": "--engine llama_cpp",
                "llama-cpp-ngram.yaml": "--engine llama_cpp", "llama-cpp-ngram-simple.yaml": "--engine llama_cpp",
                "vllm-ngram.yaml": "--engine vllm", "vllm-suffix.yaml": "--engine vllm"}


@pytest.mark.parametrize("path", sorted(SEARCH_SPACES_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_dry_run_of_every_bundled_space_exits_zero_where_it_can_run_and_names_the_fix_where_not(path, capsys):
    rc = main(["--dry-run", "--samples", "4", "--search-space", path.name, *CPU_RUNS.get(path.name, [])])
    captured = capsys.readouterr()
    assert "# resolved study" in captured.out and "#0   VALID    none" in captured.out
    if path.name in OTHER_ENGINE:
        assert rc == 2 and OTHER_ENGINE[path.name] in captured.err, captured.err
    else:
        assert rc == 0, captured.err


def test_a_draft_model_space_without_its_draft_cannot_run(capsys):
    assert main(["--dry-run", "--samples", "4", "--search-space", "standalone.yaml"]) == 2
    err = capsys.readouterr().err
    assert "sampled configs of standalone are INVALID" in err and "model.drafts.standalone" in err


def test_dry_run_misspelled_space_key_exits_non_zero_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithms: [none, ngram]\nbranches:\n  ngram:\n    max_trie_dept: {type: int, low: 2, high: 8}\n")
    assert main(["--dry-run", "--search-space", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "branches.ngram.max_trie_dept" in err and "max_trie_depth" in err


def test_overrides_reach_the_resolved_study(tmp_path, capsys):
    study = tmp_path / "s.yaml"
    study.write_text("name: from-file\nbudget: {max_trials: 20}\n")
    assert main(["--dry-run", "--samples", "1", "--study", str(study), "--trials", "4",
                 "--set", "promotion.margin=0.1", "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "name: from-file" in out and "max_trials: 4" in out and "margin: 0.1" in out
    assert f"output_dir: {tmp_path / 'out'}" in out


def test_bad_set_syntax_is_reported(capsys):
    assert main(["--dry-run", "--set", "nonsense"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["cpu", "sglang", "llama_cpp"])
def test_dry_run_starts_no_ray(engine):
    # A separate interpreter: the dry run, and so everything a real run does before it sets Ray's environment
    # (loading and checking the study), must not even import ray or mlflow, for every engine kind. A Ray imported
    # there read RAY_AUTH_MODE before the CLI set it, and the local Ray it started refused its own driver.
    code = ("import sys; from pipeline.tune import main; "
            f"rc = main(['--dry-run', '--samples', '2', '--engine', {engine!r}]); "
            "assert 'ray' not in sys.modules and 'mlflow' not in sys.modules and 'torch' not in sys.modules; "
            "sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    # llama_cpp with the default space cannot run (SGLang's NGRAM is not llama-server's): exit 2 with the fix; so
    # does SGLang on this CPU where its venv is not installed
    from serve.engines.sglang.cpu import venv_python

    cannot = engine == "llama_cpp" or (engine == "sglang" and venv_python() is None and not shutil.which("nvidia-smi"))
    assert result.returncode == (2 if cannot else 0), result.stderr
    assert "AssertionError" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_the_auth_mode_reaches_a_ray_imported_before_it(monkeypatch):
    # Whatever imported Ray first, the mode the CLI sets is the one the driver's Ray uses (Ray re-reads it).
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    code = ("import os, ray; from ray._raylet import AuthenticationMode, get_authentication_mode; "
            "from pipeline.config import load_study; from pipeline.tune import quiet_libraries; "
            "assert get_authentication_mode() != AuthenticationMode.TOKEN; "
            "quiet_libraries(load_study(None, {})); "
            "assert os.environ['RAY_AUTH_MODE'] == 'token'; "
            "assert get_authentication_mode() == AuthenticationMode.TOKEN, get_authentication_mode()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("setting, field", [
    ("promotion.equivalence_threshold=0", "promotion.equivalence_threshold"),
    ("promotion.tie_tolerance=1.5", "promotion.tie_tolerance"),
    ("workload.max_new_tokens=1000000000", "workload.max_new_tokens"),
    ("engine.extra_flags=[--port, '1']", "engine.extra_flags"),
])
def test_dry_run_refuses_values_that_would_fail_mid_study(setting, field, capsys):
    assert main(["--dry-run", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert field in err and "Fix" in err and "Traceback" not in err


def test_dry_run_refuses_a_bound_dividing_by_zero_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithms: [none, ngram]\nbranches:\n  ngram:\n"
                   "    num_draft_tokens: {type: int, low: 2, high: 8 // 0}\n")
    assert main(["--dry-run", "--search-space", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "branches.ngram.num_draft_tokens.high: '8 // 0'" in err and "Traceback" not in err


def test_dry_run_masks_passwords(capsys, tmp_path):
    # The dry run checks that the tracking server answers (issue #63): a real HTTP server (501 to every GET)
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert main(["--dry-run", "--samples", "1", "--storage", f"sqlite:///{tmp_path}/o.db?password=hunter2",
                     "--tracking-uri", f"http://bob:s3cret@127.0.0.1:{port}"]) == 0
    finally:
        server.shutdown()
        server.server_close()
    out = capsys.readouterr().out
    assert "hunter2" not in out and "s3cret" not in out
    assert f"sqlite:///{tmp_path}/o.db?password=***" in out and f"http://bob:***@127.0.0.1:{port}" in out


def test_dry_run_uses_the_study_sampler_and_budget(capsys):
    assert main(["--dry-run", "--trials", "40"]) == 0
    out = capsys.readouterr().out
    assert "10 random start-up trials of 40" in out  # the study's rule, not Optuna's default
    assert "# first 40 trial configs" in out and "#39 " in out


def test_the_resume_hint_repeats_the_command_line():
    from pipeline.tune import resume_command

    assert resume_command(["--name", "a b", "--resume", "--trials", "4"]) == \
        "python -m pipeline.tune --name 'a b' --trials 4 --resume"
