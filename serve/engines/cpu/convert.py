"""GGUF -> dequantized HF safetensors dir, and loading a model dir.

Imports torch/transformers inside the functions; `models` imports this module lazily."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["gguf_to_hf_dir", "load_hf_model", "load_model", "load_tokenizer", "torch_dtype"]

DTYPES = ("float32", "bfloat16")


def torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def gguf_to_hf_dir(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` to fp32 and save model + tokenizer as an HF dir at `out` (atomically: temp dir, rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model ("quantized with gguf and is not serializable"), although its
    # weights are plain dequantized tensors by now: drop the quantizer state so that it saves them as they are.
    setattr(model, "hf_quantizer", None)  # HF attributes the type stubs do not declare
    setattr(model, "is_quantized", False)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_model(model_dir: Path, dtype: str) -> tuple[Any, Any]:
    """(HF model in eval mode, tokenizer) from an HF dir, in `dtype` ("float32" or "bfloat16")."""
    return load_hf_model(model_dir, dtype), load_tokenizer(model_dir)


def load_hf_model(model_dir: Path, dtype: str) -> Any:
    """The HF module of an HF dir, in eval mode (the engine uses it only for models without a fast forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype(dtype), attn_implementation="sdpa")
    model.eval()
    return model


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer of an HF dir. A Llama dir whose tokenizer_config.json names `TokenizersBackend` (what our
    conversion of SmolLM2 writes) loads that class directly: `AutoTokenizer` would first build the model's config
    class, which imports torch.distributed and costs ~1 s of engine start, to arrive at the same class with the same
    settings (tests/unit/test_cpu_fast_start.py). Other model types keep AutoTokenizer, whose per-type overrides
    (e.g. qwen2's) matter."""
    model_dir = Path(model_dir)
    declared = _json(model_dir / "tokenizer_config.json").get("tokenizer_class")
    model_type = _json(model_dir / "config.json").get("model_type")
    if declared == "TokenizersBackend" and model_type == "llama" and (model_dir / "tokenizer.json").exists():
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
