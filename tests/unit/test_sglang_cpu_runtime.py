"""The CPU runtime pieces as SGLang's processes get them (serve/engines/sglang/cpu/runtime.py), each in a fresh
interpreter: the sgl_kernel stand-in, the torchvision stub, the version refusal, and what an AMX CPU would do.

The AMX branch cannot run on this machine (AMD EPYC: AVX-512, no AMX), so it is forced: torch's AMX probe is made to
answer True before SGLang reads it, in the real SGLang 0.5.23 of the CPU venv (skipped without it).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from serve.engines.sglang import cpu as sglang_cpu
from serve.engines.base import PROJECT_ROOT
from serve.engines.sglang.cpu.runtime import version_problem

CPU_PYTHON = sglang_cpu.venv_python()
needs_cpu_venv = pytest.mark.skipif(CPU_PYTHON is None, reason=f"no SGLang CPU venv at {sglang_cpu.venv_dir()}: "
                                    "bash infra/install-sglang-cpu.sh")


def run_python(code, python=sys.executable, env=None, timeout=300):
    full = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), **(env or {})}
    done = subprocess.run([str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                          timeout=timeout, cwd=PROJECT_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_stand_in_sgl_kernel_serves_its_ops_and_names_the_missing_ones():
    # The project venv holds sglang 0.5.23 (its parser), so install() accepts it here.
    out = run_python("""
        import json, torch
        from serve.engines.sglang.cpu import kernels, runtime
        runtime.install()
        from sgl_kernel import verify_tree_greedy_cpu, decode_attention_cpu
        from sgl_kernel.speculative import reconstruct_indices_from_tree_mask
        try:
            decode_attention_cpu(1, 2)
            missing = None
        except NotImplementedError as exc:
            missing = str(exc)
        print(json.dumps({"same": verify_tree_greedy_cpu is kernels.verify_tree_greedy_cpu,
                          "speculative": reconstruct_indices_from_tree_mask is kernels.reconstruct_indices_from_tree_mask,
                          "missing": missing,
                          "registered": hasattr(torch.ops.sgl_kernel, "convert_weight_packed")}))
    """)
    assert out["same"] and out["speculative"]
    assert "sgl_kernel.decode_attention_cpu was called" in out["missing"]
    assert out["registered"] is False  # SGLang's AMX probe must find nothing registered


def test_the_torchvision_stub_serves_sglang_imports_only_and_stays_invisible_to_probes():
    out = run_python("""
        import importlib.util, json
        from serve.engines.sglang.cpu import runtime
        runtime.install()
        try:  # another package's import (before SGLang's put the stub in sys.modules): not installed
            exec("import torchvision", {"__name__": "some_other_package"})
            other = "imported"
        except ImportError:
            other = "ImportError"
        sglang_module = {"__name__": "sglang.srt.multimodal.internvl_utils"}
        exec("import torchvision.transforms as T\\nfrom torchvision.transforms.functional import InterpolationMode",
             sglang_module)
        try:
            sglang_module["T"].Compose([])
            called = None
        except NotImplementedError as exc:
            called = str(exc)
        print(json.dumps({"called": called, "probe": importlib.util.find_spec("torchvision") is None,
                          "probe_sub": importlib.util.find_spec("torchvision.transforms") is None,
                          "other": other}))
    """)
    assert "torchvision.transforms.Compose was called" in out["called"]
    assert out["probe"] and out["probe_sub"]  # transformers' availability probe sees no torchvision
    assert out["other"] == "ImportError"


def test_another_sglang_version_is_refused_with_the_fix(tmp_path):
    assert version_problem("0.5.23") is None
    problem = version_problem("0.5.22")
    assert problem is not None
    assert "SGLang 0.5.22 is installed" in problem and "0.5.23 only" in problem
    assert "bash infra/install-sglang-cpu.sh" in problem
    # The launcher itself, in front of a fake 0.5.22 distribution: exit 2 with the message, before SGLang starts.
    dist = tmp_path / "sglang-0.5.22.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.22\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(PROJECT_ROOT)])}
    done = subprocess.run([sys.executable, "-m", "serve.engines.sglang.cpu", "serve", "--model-path", "/nowhere"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=PROJECT_ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "SGLang 0.5.22 is installed" in done.stderr and "install-sglang-cpu.sh" in done.stderr


AMX_PROBE = """
    import json, sys, torch
    torch.cpu._is_amx_tile_supported = lambda: True   # as on a Xeon with AMX (read by sglang at import)
    from serve.engines.sglang.cpu import runtime
    runtime.install()
    from sglang.srt.utils import common
    from sglang.srt.server_args import prepare_server_args

    def resolved():
        args = prepare_server_args(["--model-path", sys.argv[1], "--device", "cpu", "--skip-tokenizer-init"])
        args.resolve_once()
        return {"amx": common.cpu_has_amx_support(), "backend": args.resolved_dict()["attention_backend"]}

    stand_in = resolved()
    lib = torch.library.Library("sgl_kernel", "DEF")   # what the real CPU sgl-kernel build registers on import
    lib.define("convert_weight_packed(Tensor w) -> Tensor")
    common._is_intel_amx_backend_available.cache_clear()
    print(json.dumps({"stand_in": stand_in, "real_kernel": resolved()}))
"""


@needs_cpu_venv
def test_on_an_amx_cpu_sglang_falls_back_to_torch_native_unless_the_real_kernel_is_there(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4, "vocab_size": 1000,
         "max_position_embeddings": 2048, "torch_dtype": "float32", "rms_norm_eps": 1e-6}))
    full = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "SGLANG_USE_CPU_ENGINE": "1"}
    done = subprocess.run([str(CPU_PYTHON), "-c", textwrap.dedent(AMX_PROBE), str(model)], capture_output=True,
                          text=True, env=full, timeout=300, cwd=PROJECT_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # Our stand-in registers nothing under torch.ops.sgl_kernel: on an AMX CPU SGLang takes the torch-native path
    # it takes here (and the adapter pins torch_native on CPU in any case).
    assert out["stand_in"] == {"amx": False, "backend": "torch_native"}
    # The control: with the real CPU build's op registered, the same probe takes SGLang's AMX path.
    assert out["real_kernel"] == {"amx": True, "backend": "intel_amx"}
