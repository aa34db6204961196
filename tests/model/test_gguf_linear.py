"""The GGUF decode kernel (serve/engines/cpu/gguf_linear.py) on the real SmolLM2-135M (its GGUF and converted dir
from the model cache, fetched if absent): the weights it multiplies by are the engine's fp32 tensors bit for bit,
a row's result does not depend on the rows computed with it nor on the thread count, greedy decoding gives the fp32
engine's tokens, a chained verify gives plain decode's, and `--weights` falls back or fails as documented.

Both kernel builds are checked where the CPU runs them (AVX-512 machines run the AVX2 build too: building it the
first time costs ~30-45 s, cached afterwards under the model cache's kernels/). The kernel tests skip, naming the
package, where no C++ compiler is on PATH; a build that fails with one present is a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from serve.engines.cpu import gguf_linear as gl
from serve.engines.cpu import kernel_store
from serve.engines.cpu import probe
from serve.engines.cpu.llama import KERNEL_MAX_ROWS
from serve.model_store import fetch_gguf, resolve_model
from serve.engines.cpu.runner import ModelRunner, chain_visibility

pytestmark = pytest.mark.model
MODEL = "smollm2-135m"
PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is in two sentences.",
           "def fibonacci(n):\n    # return the n-th Fibonacci number"]


def available_isas() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(capability, [])


def needs_compiler() -> None:
    """The kernel is compiled at first use by torch's cpp_extension, with $CXX (default c++)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"the GGUF kernel needs a C++ compiler and {compiler!r} is not on PATH: apt-get install g++")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model(MODEL)


@pytest.fixture(scope="module")
def fp32(model_dir):
    return ModelRunner.from_dir(model_dir, "float32", "fp32")


@pytest.fixture(scope="module")
def blocks(fp32, model_dir):
    s = fp32.fast.shape
    return gl.cached_model_weights(model_dir, fetch_gguf(MODEL), s.num_heads, s.num_kv_heads, s.num_layers,
                                   s.tie_word_embeddings)


def engine_tensors(fp32) -> dict[str, torch.Tensor]:
    out = {"head": fp32.fast.head}
    for i, layer in enumerate(fp32.fast.layers):
        out.update({f"{i}.qkv": layer.qkv, f"{i}.o": layer.o, f"{i}.gate_up": layer.gate_up, f"{i}.down": layer.down})
    return out


@pytest.fixture(params=["avx512", "avx2"])
def kernel(request, monkeypatch):
    if request.param not in available_isas():
        pytest.skip(f"this CPU ({torch.backends.cpu.get_cpu_capability()}) does not run the {request.param} build")
    needs_compiler()
    monkeypatch.setenv(gl.KERNEL_ENV, request.param)
    ext, isa = gl.load_kernel()
    assert isa == request.param and ext.lanes() == {"avx512": 16, "avx2": 8}[isa]
    return ext


# ------------------------------------------------------------------------------------------------------ weights

def test_blocks_dequantize_to_the_engines_fp32_tensors_bit_for_bit(fp32, blocks):
    tensors = engine_tensors(fp32)
    assert set(blocks) == set(tensors) and len(blocks) == 4 * 30 + 1
    differ = [k for k, w in blocks.items() if not torch.equal(w.dequantize(), tensors[k])]
    assert differ == []
    assert blocks["0.qkv"].kind == "Q4_1" and blocks["head"].kind == "Q8_0"


def test_blocks_match_gguf_own_dequantization():
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = fetch_gguf(MODEL)
    raw = {t.name: t for t in GGUFReader(str(path)).tensors}
    blocks, _ = gl.read_gguf_weights(path, 9, 3)
    for name in ("blk.0.attn_v.weight", "blk.3.ffn_down.weight", "token_embd.weight"):  # not row-permuted
        t = raw[name]
        want = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32))
        assert torch.equal(blocks[name].dequantize(), want), name
    # q/k rows: gguf's values in HF's row order (the permutation moves whole rows)
    t = raw["blk.2.attn_q.weight"]
    want_rows = gl.unpermute_rows(dequantize(t.data, t.tensor_type).astype(np.float32), 9)
    assert torch.equal(blocks["blk.2.attn_q.weight"].dequantize(), torch.from_numpy(want_rows))


def test_the_blocks_cache_is_read_back_not_rewritten(model_dir, blocks, fp32):
    s = fp32.fast.shape
    cached = model_dir / gl.BLOCKS_FILE
    assert cached.exists()
    before = cached.stat().st_mtime_ns
    again = gl.cached_model_weights(model_dir, fetch_gguf(MODEL), s.num_heads, s.num_kv_heads, s.num_layers, True)
    assert cached.stat().st_mtime_ns == before  # read, not rewritten
    assert all(torch.equal(again[k].qs, blocks[k].qs) and torch.equal(again[k].d, blocks[k].d) for k in blocks)


# ------------------------------------------------------------------------------------------------------ the kernel

def test_a_venv_that_never_built_the_kernel_imports_the_kept_build(kernel, tmp_path):
    # The kept build of this ISA exists (the fixture loaded or built it); a process whose own build folder is empty,
    # as in a fresh venv, imports it from there and builds nothing.
    isa = "avx512" if kernel.lanes() == 16 else "avx2"
    script = ("import pathlib, sys\nfrom serve.engines.cpu import kernel_store\n"
              "kernel_store.build_dir = lambda folder: pathlib.Path(sys.argv[1]) / folder\n"
              "from serve.engines.cpu.gguf_linear import load_kernel\nprint(load_kernel()[0].__file__)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, gl.KERNEL_ENV: isa})
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(done.stdout.strip()).parent.name.startswith(f"specdec_gguf_mm_{isa}-")
    assert list(tmp_path.iterdir()) == []


def test_the_study_builds_the_kernel_ahead_with_the_engines_own_command_and_only_for_local_engines(kernel):
    # pipeline.tune starts the engine's `build_ahead` beside the model's fetch on a fresh machine; with the kernel
    # kept it must be the quick no-op the driver counts on, and it must load the very build engines import.
    from pipeline.config import resolve_study
    from pipeline.tune import start_build_ahead
    from serve.engines import engine_for

    argv = engine_for("cpu").build_ahead()
    assert argv is not None
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"from {kernel.__file__}" in done.stdout
    remote, _ = resolve_study(None, {"ray.address": "ray://10.0.0.1:10001"})
    assert start_build_ahead(remote) is None  # the engines run on other nodes: nothing to build here
    local, _ = resolve_study(None, {})
    started = start_build_ahead(local)
    assert started is not None and started.args == argv
    assert started.wait(timeout=300) == 0


def test_the_kept_build_is_keyed_by_source_and_flags(tmp_path):
    one, other = tmp_path / "one.cpp", tmp_path / "other.cpp"
    one.write_text("int f() { return 1; }\n")
    other.write_text("int f() { return 2; }\n")
    same = kernel_store.kept_library("k", one, ["-O3"])
    assert kernel_store.kept_library("k", one, ["-O3"]) == same
    assert kernel_store.kept_library("k", other, ["-O3"]) != same
    assert kernel_store.kept_library("k", one, ["-O2"]) != same


@pytest.mark.parametrize("key", ["0.qkv", "7.o", "12.gate_up", "29.down", "head"])
def test_kernel_multiplies_by_exactly_the_fp32_weights(kernel, fp32, blocks, key):
    w = engine_tensors(fp32)[key]
    k = w.shape[1]
    got = torch.cat([blocks[key].matmul(kernel, torch.eye(k)[i:i + KERNEL_MAX_ROWS])
                     for i in range(0, k, KERNEL_MAX_ROWS)])  # identity rows: W^T as the kernel forms it
    assert torch.equal(got.t(), w)


def test_a_row_is_the_same_whatever_rows_run_with_it_and_on_any_thread_count(kernel, blocks, one_thread):
    torch.manual_seed(0)
    for key in ("3.qkv", "3.down", "head"):
        w = blocks[key]
        x = torch.randn(KERNEL_MAX_ROWS, w.shape[1])
        alone = torch.cat([w.matmul(kernel, x[i:i + 1]) for i in range(x.shape[0])])
        for m in (2, 3, 4, 5, 9, KERNEL_MAX_ROWS):
            assert torch.equal(w.matmul(kernel, x[:m]), alone[:m]), (key, m)
        torch.set_num_threads(2)
        two = w.matmul(kernel, x)
        torch.set_num_threads(1)
        assert torch.equal(two, alone), key


# ------------------------------------------------------------------------------------------------------ the engine

def greedy(runner: ModelRunner, ids: list[int], new_tokens: int) -> list[int]:
    cache = runner.new_cache()
    out = [int(runner.logits(runner.prefill(cache, ids)).argmax(-1))]
    while len(out) < new_tokens:
        n = runner.cache_len(cache)
        hidden = runner.forward(cache, [out[-1]], [n], chain_visibility(n, 1))
        out.append(int(runner.logits(hidden).argmax(-1)))
    return out


def prompt_ids(runner: ModelRunner, model_dir: Path) -> list[list[int]]:
    from serve.engines.cpu.convert import load_tokenizer

    tok = load_tokenizer(model_dir)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module", params=available_isas() or ["none"])
def gguf_runner(request, model_dir):
    if request.param == "none":
        pytest.skip("no kernel build runs on this CPU")
    needs_compiler()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(gl.KERNEL_ENV, request.param)
        runner = ModelRunner.from_dir(model_dir, "float32", "gguf")
    assert runner.weights.mode == "gguf" and runner.weights.isa == request.param
    return runner


@pytest.fixture(scope="module")
def fp32_tokens(fp32, model_dir) -> list[list[int]]:
    """The fp32 engine's greedy tokens for each prompt, on 1 thread as the decodes compared with them run: decoded
    once for the module, not again for each kernel build."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [greedy(fp32, ids, 32) for ids in prompt_ids(fp32, model_dir)]
    finally:
        torch.set_num_threads(threads)


def test_greedy_decode_gives_the_fp32_engines_tokens(gguf_runner, fp32, fp32_tokens, model_dir, one_thread):
    for ids, want in zip(prompt_ids(fp32, model_dir), fp32_tokens, strict=True):
        assert greedy(gguf_runner, ids, 32) == want


def test_a_chained_verify_predicts_what_plain_decode_does(gguf_runner, model_dir, one_thread):
    (ids, *_) = prompt_ids(gguf_runner, model_dir)
    plain = greedy(gguf_runner, ids, 24)
    cache = gguf_runner.new_cache()
    gguf_runner.prefill(cache, ids)
    for start in (0, 10):  # two verify rounds of 10 chained tokens (the kernel's path: <= KERNEL_MAX_ROWS rows)
        chain, base = plain[start:start + 10], gguf_runner.cache_len(cache)
        hidden = gguf_runner.forward(cache, chain, range(base, base + 10), chain_visibility(base, 10))
        assert gguf_runner.logits(hidden).argmax(-1).tolist() == plain[start + 1:start + 11], start


def test_weights_fp32_keeps_every_matmul_on_the_fp32_tensors(fp32):
    assert fp32.weights.mode == "fp32" and fp32.weights.isa is None and fp32.fast.kernel is None


def test_auto_falls_back_to_fp32_without_the_kernel_and_gguf_fails(model_dir, monkeypatch):
    monkeypatch.setenv(gl.KERNEL_ENV, "off")
    runner = ModelRunner.from_dir(model_dir, "float32", "auto")
    assert runner.fast is not None
    assert runner.weights.mode == "fp32" and runner.fast.kernel is None
    assert f"{gl.KERNEL_ENV}=off" in runner.weights.reason
    with pytest.raises(gl.WeightsError, match="--weights gguf: disabled by SPECDEC_GGUF_KERNEL=off.*Fix"):
        ModelRunner.from_dir(model_dir, "float32", "gguf")


def test_auto_stays_fp32_for_bfloat16_and_for_dirs_without_a_gguf(model_dir, tmp_path):
    fast = ModelRunner.from_dir(model_dir, "float32", "fp32").fast
    assert fast is not None
    shape = fast.shape
    choice, weights, _ = gl.resolve_weights("auto", model_dir, shape, "bfloat16")
    assert choice.mode == "fp32" and "--dtype bfloat16" in choice.reason and weights is None
    choice, _, _ = gl.resolve_weights("auto", tmp_path, shape, "float32")
    assert choice.mode == "fp32" and "not converted from a GGUF" in choice.reason
    choice, _, _ = gl.resolve_weights("auto", model_dir, None, "float32")
    assert choice.mode == "fp32" and "HF's modules" in choice.reason


def test_choose_weights_is_the_documented_rule():
    assert gl.choose_weights("auto", None, "avx2").mode == "gguf"
    assert gl.choose_weights("gguf", None, "avx512").isa == "avx512"
    assert gl.choose_weights("fp32", None, "avx512").mode == "fp32"
    assert gl.choose_weights("auto", "no AVX2").reason == "fp32 fallback: no AVX2"
    with pytest.raises(gl.WeightsError, match="--weights gguf: no AVX2"):
        gl.choose_weights("gguf", "no AVX2")
    with pytest.raises(gl.WeightsError, match="--weights: 'q4'"):
        gl.choose_weights("q4", None)


def test_an_unknown_kernel_override_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setenv(gl.KERNEL_ENV, "sse")
    isa, why = gl.kernel_isa()
    assert isa is None and "SPECDEC_GGUF_KERNEL='sse' is not one of auto, avx512, avx2, off" in why


def test_the_weights_mode_is_part_of_the_verify_cost_key(model_dir):
    fp32_key = probe.probe_key(model_dir, "float32", "fast-llama", (1, 2), "fp32")
    gguf_key = probe.probe_key(model_dir, "float32", "fast-llama", (1, 2), "gguf-avx512")
    assert fp32_key != gguf_key and gguf_key["weights_mode"] == "gguf-avx512"


def test_a_gguf_with_other_block_types_is_refused_with_the_tensor_named():
    w = gl.GgufWeight(torch.zeros(8, 1, 16, dtype=torch.uint8), torch.zeros(8, 1, dtype=torch.float16),
                      torch.zeros(8, 1, dtype=torch.float16))
    blocks = {f"blk.0.{n}.weight": w for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
    with pytest.raises(gl.KernelUnavailable, match="blk.0.ffn_down.weight is Q6_K"):
        gl.model_weights(blocks, {"blk.0.ffn_down.weight": "Q6_K"}, 1, True)
