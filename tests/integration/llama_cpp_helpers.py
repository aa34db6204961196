"""Shared by the llama.cpp integration tests: skip (naming the install command) when llama-server is not built."""

import pytest

from serve.engines.llama_cpp import models


def require_llama_server() -> None:
    try:
        models.require_server()
    except models.LlamaCppMissing as exc:
        pytest.skip(f"llama.cpp engine tests need llama-server: {exc}")
