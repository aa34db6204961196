"""GGUF -> dequantized HF safetensors dir, and loading a model dir.

Imports torch/transformers inside the functions; `models` imports this module lazily."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["gguf_to_hf_dir", "load_model", "torch_dtype"]

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
    model.hf_quantizer = None
    model.is_quantized = False
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
    """(model in eval mode, tokenizer) from an HF dir, in `dtype` ("float32" or "bfloat16")."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype(dtype), attn_implementation="sdpa")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return model, tokenizer
