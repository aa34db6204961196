"""The attention backend SGLang's engines run with on a GPU, and whether its verify applies a draft tree's mask. Pure:
no sglang, no torch, no I/O.

A study renders one `--attention-backend` for the baseline and every trial (serve/engines/sglang.py): the backend
SGLang 0.5.23 itself picks, on the GPU architecture and for the model's attention type, for the most demanding tree
of the study's search space. Read from the 0.5.23 wheel (paths inside `sglang/srt/`):

- Order: `arg_groups/pipeline.py` resolves the backend (`handle_attention_backend_compatibility`) before the
  speculative hook (`handle_speculative_decoding`), and NGRAM's tree width (topk := max_bfs_breadth) is set by that
  hook (`speculative_hook._handle_ngram`). So at backend time an NGRAM config has no topk, an EAGLE config has the
  topk it was given (None when SGLang chooses its own parameters), an adaptive EAGLE config has none either.
- Choice (`model_override_base.get_default_attn_backend`): MHA: fa3 on Hopper unless a topk > 1 is given;
  trtllm_mha on sm100 without speculation or with an explicit topk (fa4 where K and V widths differ); else
  flashinfer (triton where flashinfer is absent or the model has attention sinks). MLA: fa3 on Hopper, flashinfer on
  sm100, triton elsewhere. DeepSeek-V3-layout models (and Kimi-K2, Mistral-Large-3) take trtllm_mla on sm100
  (`model_overrides/deepseek_v2.py`); DeepSeek-V2 layout does not. sm120 (RTX PRO 6000 Blackwell) is not `is_sm100`.
- Verify with a tree (topk > 1), by backend class (`layers/attention/`): FlashInferAttnBackend plans TARGET_VERIFY
  with the spec's custom mask (`flashinfer_backend.py` ~1326); FlashAttentionBackend (fa3, fa4) runs cascade
  attention whose second pass reads a page table sorted by the tree mask, MHA and MLA alike (`flashattention_backend.py`
  ~1086-1160, ~1586, ~2031); TritonAttnBackend passes the custom mask to its extend kernel (`triton_backend.py`
  ~1007-1051). FlashInferMLAAttnBackend (flashinfer on an MLA model) plans verify causal and drops the mask ("TODO:
  Support topk > 1 with custom mask", `flashinfer_mla_backend.py` ~1110-1131; its EAGLE draft backend refuses
  topk > 1 at ~1196). trtllm_mla, cutedsl_mla and flashmla run 32/64-token pages, where SGLang accepts a tree only
  on flashinfer, fa3 or triton (`speculative_hook.py` ~1271, ~1355); flashmla refuses topk > 1 (~608);
  trtllm_mha takes topk 1 only. On a CPU, torch_native's verify is this project's own branch, mask included
  (serve/engines/sglang_cpu/verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from serve.spec import Eagle3Spec, EagleSpec, NgramSpec, SpecConfig, StandaloneSpec

GpuArch = Literal["sm80", "sm90", "sm100", "sm120"]
GPU_ARCHS: tuple[GpuArch, ...] = ("sm80", "sm90", "sm100", "sm120")
AttentionKind = Literal["mha", "mla"]
ARCH_NAMES = {"sm80": "Ampere/Ada (sm80/sm86/sm89)", "sm90": "Hopper (sm90)",
              "sm100": "Blackwell datacenter (sm100)", "sm120": "Blackwell RTX (sm120)"}

# Backends whose TARGET_VERIFY applies the tree mask, per attention type (module docstring). Anything else with a
# tree is refused: a backend not read is not trusted.
TREE_MASK_BACKENDS: dict[str, frozenset[str]] = {
    "mha": frozenset({"flashinfer", "fa3", "fa4", "triton", "torch_native"}),
    "mla": frozenset({"fa3", "fa4", "triton"}),
}
# Where SGLang's own choice cannot verify the study's trees: the backend that can on every architecture.
TREE_FALLBACK = "triton"
# `model_overrides/deepseek_v2.py`: these architectures take trtllm_mla on sm100 when no backend is given (the DSA
# ones, DeepSeek-V3.2/GLM-5, take dsa instead: outside this table, so refused for trees).
SM100_TRTLLM_MLA = frozenset({"DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "MistralLarge3ForCausalLM",
                              "PixtralForConditionalGeneration"})
DSA_ARCHITECTURES = frozenset({"DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "Glm5NextForConditionalGeneration"})
# `attention_hook.handle_deterministic_inference`: SGLang's deterministic mode runs on these backends
# (`choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES`), and on absorbed-MLA DeepSeek-family models only on the
# radix-capable ones (`RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND`).
DETERMINISTIC_BACKENDS = frozenset({"ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton"})
DETERMINISTIC_MLA_BACKENDS = frozenset({"ascend", "fa3", "fa4", "triton"})
DETERMINISTIC_DEEPSEEK = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                                    "MistralLarge3ForCausalLM", "PixtralForConditionalGeneration",
                                    "GlmMoeDsaForCausalLM", "Glm4MoeLiteForCausalLM",
                                    "Glm5NextForConditionalGeneration"})


def arch_of(compute_cap: str) -> GpuArch | None:
    """`nvidia-smi --query-gpu=compute_cap` ("9.0") -> the architecture family SGLang tells apart by major version
    (`utils/common.py` `_check_cuda_device_version`); None for one outside the table."""
    try:
        major = int(compute_cap.strip().split(".")[0])
    except ValueError:
        return None
    return {8: "sm80", 9: "sm90", 10: "sm100", 12: "sm120"}.get(major)  # type: ignore[return-value]


def platform_facts(arch: GpuArch) -> dict[str, Any]:
    """SGLang's own platform facts for a GPU of `arch` with CUDA 13 and flashinfer installed (0.5.23's wheel pins
    both), for `sglang.srt.runtime_context.override_platform`: how a CPU machine resolves as that GPU would."""
    major = int(arch[2:-1])
    return {"is_cuda": True, "is_hip": False, "is_npu": False, "is_xpu": False, "is_musa": False, "is_mps": False,
            "is_sm90": major == 9, "is_sm100": major == 10, "is_sm110": False, "is_sm100_or_sm110": major == 10,
            "is_sm120": major == 12, "is_blackwell": major in (10, 12), "is_hopper_with_cuda_12_3": major == 9,
            "has_flashinfer": True, "device_sm": major * 10, "device_capability": (major, 0)}


def attention_kind(model_config: Mapping[str, Any]) -> AttentionKind:
    """MLA where the model's config.json carries a latent KV rank (every MLA layout SGLang 0.5.23 lists in
    `configs/model_config.py` has `kv_lora_rank`, top level or in `text_config`), else MHA. SGLang's own answer
    (`use_mla_backend`) is what the preflight records and checks; this one serves where SGLang is not importable."""
    text = model_config.get("text_config") or {}
    return "mla" if model_config.get("kv_lora_rank") or text.get("kv_lora_rank") else "mha"


def architecture_of(model_config: Mapping[str, Any]) -> str:
    architectures = model_config.get("architectures") or [""]
    return str(architectures[0])


@dataclass(frozen=True)
class Tree:
    """A speculative config as SGLang's backend choice sees it: `algorithm` (None = the baseline), the topk the
    command line gives (None for NGRAM, SGLang-chosen EAGLE parameters and adaptive EAGLE), and the widest tree the
    engine then verifies (`width`, 1 = a chain)."""

    algorithm: str | None
    given_topk: int | None
    width: int

    def describe(self) -> str:
        if self.algorithm is None:
            return "the baseline"
        return f"{self.algorithm} tree width {self.width}" if self.width > 1 else f"{self.algorithm} chain"


BASELINE_TREE = Tree(None, None, 1)
# `speculative_hook._auto_choose_speculative_params`: the topk SGLang picks when steps/topk/draft are all unset.
AUTO_TREE_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM"})


def auto_topk(architecture: str, algorithm: str) -> int:
    return 4 if algorithm != "standalone" and architecture in AUTO_TREE_ARCHITECTURES else 1


def tree_of(spec: SpecConfig, architecture: str = "") -> Tree:
    """`spec` as SGLang's backend choice and its verify see it, for a target of `architecture`."""
    name = spec.algorithm.upper()
    if isinstance(spec, NgramSpec):
        return Tree("NGRAM", None, spec.max_bfs_breadth)
    if isinstance(spec, (EagleSpec, Eagle3Spec)) and spec.adaptive:
        return Tree(name, spec.topk, 1)
    if isinstance(spec, (EagleSpec, Eagle3Spec, StandaloneSpec)):
        if spec.topk is None:
            return Tree(name, None, auto_topk(architecture, spec.algorithm))
        return Tree(name, spec.topk, spec.topk)
    return BASELINE_TREE


def sglang_default(arch: GpuArch, kind: AttentionKind, architecture: str, tree: Tree,
                   asymmetric_kv: bool = False, attention_sinks: bool = False) -> str:
    """What SGLang 0.5.23 picks with no --attention-backend for `tree` on `arch` (module docstring). Checked against
    SGLang's own resolution with the device faked (tests/unit/test_sglang_backend_table.py)."""
    if architecture in DSA_ARCHITECTURES:
        return "dsa"
    if kind == "mla":
        if arch == "sm100" and architecture in SM100_TRTLLM_MLA:
            return "trtllm_mla"
        return {"sm90": "fa3", "sm100": "flashinfer"}.get(arch, "triton")
    chain = tree.given_topk is None or tree.given_topk == 1  # `is_no_spec_infer_or_topk_one` (page_size 1)
    if arch == "sm90" and chain:
        return "fa3"
    if arch == "sm100" and chain and (tree.algorithm is None or tree.given_topk is not None):
        return "fa4" if asymmetric_kv else "trtllm_mha"
    return "triton" if attention_sinks else "flashinfer"


def tree_mask_problem(backend: str, kind: AttentionKind, width: int) -> str | None:
    """Why verifying a tree `width` wide on `backend` for a `kind` model would not be greedy-exact (None: it is, or
    the draft is a chain, whose causal mask is its tree mask)."""
    if width <= 1 or backend in TREE_MASK_BACKENDS[kind]:
        return None
    if kind == "mla" and backend == "flashinfer":
        why = ("flashinfer on an MLA model is SGLang's FlashInferMLAAttnBackend, whose verify ignores the tree mask "
               "(causal plan; 'TODO: Support topk > 1 with custom mask' in flashinfer_mla_backend.py)")
    else:
        why = (f"the {backend} backend's verify does not apply a tree mask on {kind.upper()} models in SGLang 0.5.23 "
               f"(trees verify on {', '.join(sorted(TREE_MASK_BACKENDS[kind]))})")
    return (f"a draft tree {width} wide (topk/max_bfs_breadth {width}) on attention backend {backend}: {why}, so its "
            f"outputs would not be the baseline's greedy outputs. Fix: keep topk/max_bfs_breadth at 1 in the search "
            f"space, or set engine.attention_backend: {TREE_FALLBACK}")


def deterministic_problem(backend: str, kind: AttentionKind, architecture: str) -> str | None:
    """Why SGLang refuses --enable-deterministic-inference on `backend` (None: it runs it)."""
    if backend not in DETERMINISTIC_BACKENDS:
        return (f"SGLang 0.5.23 runs deterministic inference only on {sorted(DETERMINISTIC_BACKENDS)} and the "
                f"engines run attention backend {backend}")
    if kind == "mla" and architecture in DETERMINISTIC_DEEPSEEK and backend not in DETERMINISTIC_MLA_BACKENDS:
        return (f"SGLang 0.5.23 runs deterministic inference on an absorbed-MLA {architecture} model only on "
                f"{sorted(DETERMINISTIC_MLA_BACKENDS)} and the engines run attention backend {backend}")
    return None


@dataclass(frozen=True)
class BackendChoice:
    """The backend a study renders for every engine, with what stock SGLang would have picked and why."""

    backend: str
    arch: GpuArch
    kind: AttentionKind
    architecture: str
    widest: Tree
    stock_baseline: str
    stock_widest: str

    def describe(self) -> str:
        line = (f"attention backend {self.backend} for the baseline and every trial ({ARCH_NAMES[self.arch]}, "
                f"{self.kind.upper()} {self.architecture or 'model'}, widest tree: {self.widest.describe()}; "
                f"SGLang 0.5.23 picks {self.stock_widest} for it")
        if self.backend != self.stock_widest:
            line += (f", whose verify ignores the tree mask on {self.kind.upper()}: {self.backend} applies it")
        if self.stock_baseline != self.backend:
            line += f"; it would run the baseline on {self.stock_baseline}"
        return line + ")"


def choose_backend(arch: GpuArch, kind: AttentionKind, architecture: str, trees: list[Tree],
                   asymmetric_kv: bool = False, attention_sinks: bool = False) -> BackendChoice:
    """SGLang's own choice for the most demanding of `trees` (the widest; on a tie a speculative one, then one whose
    topk is given on the command line, which SGLang's choice sees), the same for the baseline; where that backend's
    verify ignores the tree mask for that tree, the fallback that applies it."""
    widest = max(trees or [BASELINE_TREE],
                 key=lambda t: (t.width, t.algorithm is not None, t.given_topk is not None))
    stock = sglang_default(arch, kind, architecture, widest, asymmetric_kv, attention_sinks)
    # DSA models run only their own sparse backend: no fallback there (their trees are refused, fail closed)
    backend = TREE_FALLBACK if stock != "dsa" and tree_mask_problem(stock, kind, widest.width) else stock
    return BackendChoice(backend=backend, arch=arch, kind=kind, architecture=architecture, widest=widest,
                         stock_baseline=sglang_default(arch, kind, architecture, BASELINE_TREE, asymmetric_kv,
                                                       attention_sinks),
                         stock_widest=stock)
