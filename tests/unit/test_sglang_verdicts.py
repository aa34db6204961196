"""SGLang's verdicts kept on disk (serve/engines/sglang/verdicts.py): the same question is answered from the disk,
with `cached` on its record; a changed model file, another GPU architecture or another SGLang environment variable is
another question; a run that could not answer is never kept. Against the SGLang installed --no-deps (CI); skipped
where absent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serve.engines.sglang import verdicts
from serve.engines.base import PROJECT_ROOT, ReplicaConfig
from serve.engines.sglang.engine import run_preflight, server_arg_fields, sglang_argv
from serve.spec import EagleSpec, NgramSpec
from tests.unit.test_sglang_flags import TINY_LLAMA, needs_sglang


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """A fresh verdict folder; its path."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(verdicts.ENV_SWITCH, raising=False)
    return tmp_path / "cache" / verdicts.FOLDER


def model_folder(tmp_path, **override):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, **override}))
    return str(folder)


def argv(model: str, port: int = 30000, refused: bool = False) -> list[str]:
    """An NGRAM command line; `refused`: partial EAGLE settings, which SGLang refuses at resolve."""
    spec = EagleSpec(draft_model=model, num_steps=3) if refused else NgramSpec(num_draft_tokens=8, max_bfs_breadth=2)
    return sglang_argv(ReplicaConfig(engine="sglang", device="cuda", model=model, spec=spec), "127.0.0.1", port)


def test_ports_are_left_out_of_the_question_and_nothing_else():
    assert verdicts.without_ports(["--port", "1", "--host", "h", "--nccl-port", "2", "--tp-size", "1"]) == \
        ["--port", "<port>", "--host", "h", "--nccl-port", "<port>", "--tp-size", "1"]


def test_a_named_file_or_folder_is_known_by_its_bytes(tmp_path):
    folder = model_folder(tmp_path)
    adaptive = tmp_path / "adaptive.json"
    adaptive.write_text("{}")
    before = verdicts.named_files(["--model-path", folder, "--speculative-adaptive-config", str(adaptive), "--x", "1"])
    assert set(before) == {f"{folder}/config.json", str(adaptive)}
    model_folder(tmp_path, num_hidden_layers=3)
    assert verdicts.named_files(["--model-path", folder])[f"{folder}/config.json"] != before[f"{folder}/config.json"]


def test_the_own_sources_are_what_the_preflight_subprocess_imports():
    code = ("import sys, serve.engines.sglang.preflight; "
            "print('\\n'.join(m.__file__ for n, m in sys.modules.items() if n.split('.')[0] == 'serve'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PROJECT_ROOT)
    imported = {str(Path(f).resolve().relative_to(PROJECT_ROOT)) for f in done.stdout.split()}
    assert imported <= set(verdicts.OWN_SOURCES), imported - set(verdicts.OWN_SOURCES)


def test_another_gpu_sglang_variable_install_package_or_model_file_is_another_question(tmp_path, monkeypatch):
    model = model_folder(tmp_path)
    site = tmp_path / "site"
    record = site / "sglang-9.9.9.dist-info" / "RECORD"
    record.parent.mkdir(parents=True)
    record.write_text("sglang/__init__.py,,\n")

    def digest(arch: str = "sm90", port: int = 30000) -> str | None:
        return verdicts.key(verdicts.preflight_question(argv(model, port), False, arch), [site], {})

    first = digest()
    assert first is not None and digest() == first == digest(port=1)
    assert verdicts.key({"fields": True}, [tmp_path], {}) is None  # no SGLang there: nothing is ever kept
    assert digest("sm100") != first
    monkeypatch.setenv("SGLANG_TEST_VERDICT_KEY", "1")
    assert digest() != first
    monkeypatch.delenv("SGLANG_TEST_VERDICT_KEY")
    monkeypatch.setenv("SGLANG_CACHE_DIR", str(tmp_path))  # where SGLang keeps its caches changes no verdict
    assert digest() == first
    record.write_text("sglang/__init__.py,sha256=x,1\n")  # another install
    assert digest() != first
    record.write_text("sglang/__init__.py,,\n")
    assert digest() == first
    (site / "transformers-9.9.9.dist-info").mkdir()  # another package installed or upgraded
    assert digest() != first
    (site / "transformers-9.9.9.dist-info").rmdir()
    model_folder(tmp_path, num_hidden_layers=3)
    assert digest() != first


@needs_sglang
def test_the_same_question_is_answered_from_disk_and_a_changed_one_asks_sglang(tmp_path, kept, monkeypatch):
    model = model_folder(tmp_path)
    (first, refused) = run_preflight([argv(model), argv(model, refused=True)], gpu_arch="sm90") or []
    assert first.ok and not first.cached, first.error
    assert not refused.ok and refused.stage in ("resolve", "check") and not refused.cached
    assert len(list(kept.glob("*.json"))) == 2

    (again, refused_again) = run_preflight([argv(model, port=41234), argv(model, refused=True)], gpu_arch="sm90") or []
    assert again.cached and refused_again.cached
    assert (again.ok, again.stage, again.error, again.resolved) == (first.ok, first.stage, first.error, first.resolved)
    assert (refused_again.ok, refused_again.error) == (False, refused.error)
    assert again.as_record()["cached"] is True

    monkeypatch.setenv(verdicts.ENV_SWITCH, "0")  # switched off: nothing is read back, so SGLang is asked
    assert all(verdicts.read(path.stem) is None for path in kept.glob("*.json"))


@pytest.fixture
def fields_recomputed():
    """server_arg_fields' in-process memo emptied before and after (the test below plants a list in it)."""
    server_arg_fields.cache_clear()
    yield
    server_arg_fields.cache_clear()


@needs_sglang
def test_the_field_list_is_kept_too(kept, fields_recomputed):
    first = server_arg_fields()
    assert first and len(list(kept.glob("*.json"))) == 1
    server_arg_fields.cache_clear()
    (only,) = kept.glob("*.json")
    only.write_text(json.dumps({"answer": sorted(first)[:3]}))  # what a second call reads, if it reads the disk
    assert server_arg_fields() == frozenset(sorted(first)[:3])


def test_a_run_that_could_not_answer_is_not_kept(tmp_path, kept):
    """An SGLang whose import fails (its dist-info present, its package broken): stage `import`, nothing written."""
    target = tmp_path / "target"
    (target / "sglang").mkdir(parents=True)
    (target / "sglang" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    (target / "sglang-9.9.9.dist-info").mkdir()
    (target / "sglang-9.9.9.dist-info" / "RECORD").write_text("sglang/__init__.py,,\n")
    (result,) = run_preflight([["--model-path", str(tmp_path)]], sglang_path=str(target)) or []
    assert not result.ok and result.stage == "import" and not result.cached
    assert not kept.exists() or not list(kept.glob("*.json"))
