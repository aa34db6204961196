"""The GGUF kernel's build runs the ninja installed beside the interpreter, activated venv or not: two ninja versions
on one build dir each discard the other's log (1.11 writes v5, 1.13 v7) and rebuild the kernel, ~25 s of an engine
start, whenever a shell with the venv activated and one without take turns."""

from __future__ import annotations

import os
import shutil
import sys

from serve.engines.cpu.kernel_store import environment_ninja


def test_the_build_finds_the_ninja_beside_the_interpreter_first_and_path_is_restored(tmp_path, monkeypatch):
    venv, system = tmp_path / "venv" / "bin", tmp_path / "usr" / "bin"
    for folder in (venv, system):
        folder.mkdir(parents=True)
        (folder / "ninja").write_text("#!/bin/sh\n")
        (folder / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", str(system))  # the venv not activated: the system's ninja comes first
    assert shutil.which("ninja") == str(system / "ninja")
    with environment_ninja():
        assert shutil.which("ninja") == str(venv / "ninja")
    assert os.environ["PATH"] == str(system)


def test_without_a_ninja_beside_the_interpreter_path_is_left_alone(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", "/usr/bin")
    with environment_ninja():
        assert os.environ["PATH"] == "/usr/bin"
    assert os.environ["PATH"] == "/usr/bin"
