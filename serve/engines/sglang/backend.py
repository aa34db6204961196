"""The attention backend SGLang's engines run with on a GPU, and whether its verify applies a draft tree's mask. Pure:
no sglang, no torch, no I/O.

A study renders one `--attention-backend` for the baseline and every trial (serve/engines/sglang/engine.py): the backend
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
- Verify with a tree, by backend class (`layers/attention/`), at the topk SGLang gives it: FlashInferAttnBackend plans
  TARGET_VERIFY with the spec's custom mask whenever the spec carries one, at any topk (`flashinfer_backend.py`
  ~1326); TritonAttnBackend passes the custom mask to its extend kernel at any topk (`triton_backend.py` ~1007-1051;
  its split-KV topk-1 fast path is ROCm gfx95 only). FlashAttentionBackend (fa3, and fa4, the same class) runs
  cascade attention whose second pass reads the tree mask only at topk > 1; at topk <= 1 its verify is plain causal
  attention (`flashattention_backend.py` ~1037, ~1586-1593), MHA and MLA alike. SGLang's docs mark FA4 on MLA at
  topk > 1 unsupported, so fa4 never verifies an MLA tree. FlashInferMLAAttnBackend (flashinfer on an MLA model)
  plans verify causal and drops the mask ("TODO: Support topk > 1 with custom mask", `flashinfer_mla_backend.py`
  ~1110-1131; its EAGLE draft backend refuses topk > 1 at ~1196). trtllm_mla, cutedsl_mla and flashmla run
  32/64-token pages, where SGLang accepts a tree only on flashinfer, fa3 or triton (`speculative_hook.py` ~1271,
  ~1355); flashmla refuses topk > 1 (~608); trtllm_mha takes topk 1 only. On a CPU, torch_native's verify is this
  project's own branch, mask included at any topk (serve/engines/sglang/cpu/verify.py).
- NGRAM is a tree at every breadth: SGLang sets its topk to max_bfs_breadth, but its draft at breadth 1 still
  branches (`Trie::buildRecency` starts every anchor's expansion at the root, equal tokens merge there, pads hang
  under the root: serve/ngram/trie.py is the faithful copy). So NGRAM at breadth 1 is a tree verified at topk 1,
  which fa3/fa4 verify causally: the study takes a backend that masks at the space's smallest breadth.
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

# Per attention type, the backends whose TARGET_VERIFY applies a draft tree's mask, each with the smallest topk (as
# SGLang resolves it) at which it does (module docstring). Anything else with a tree is refused: a backend not read
# is not trusted.
MASK_FROM_TOPK: dict[str, dict[str, int]] = {
    "mha": {"flashinfer": 1, "triton": 1, "torch_native": 1, "fa3": 2, "fa4": 2},
    "mla": {"triton": 1, "fa3": 2},
}
# Where SGLang's own choice cannot verify one of the study's trees: the backend of each attention type that applies
# the mask at every topk on every architecture (SGLang's own tree choice for MHA, the only one for MLA).
TREE_FALLBACK: dict[str, str] = {"mha": "flashinfer", "mla": "triton"}
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
    """A speculative config as SGLang's backend choice and its verify see it: `algorithm` (None = the baseline), the
    topk the command line gives (None for NGRAM, SGLang-chosen EAGLE parameters and adaptive EAGLE: the backend
    choice runs before SGLang sets it), the topk SGLang then runs it at (`topk`, what a backend's verify sees), and
    whether its draft can branch (`branches`: False = a chain, whose causal mask is its tree mask)."""

    algorithm: str | None
    given_topk: int | None
    topk: int
    branches: bool

    def describe(self) -> str:
        if self.algorithm is None:
            return "the baseline"
        if not self.branches:
            return f"{self.algorithm} chain"
        return f"{self.algorithm} tree at topk {self.topk}"


BASELINE_TREE = Tree(None, None, 1, False)
# `speculative_hook._auto_choose_speculative_params`: the topk SGLang picks when steps/topk/draft are all unset.
AUTO_TREE_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM"})


def auto_topk(architecture: str, algorithm: str) -> int:
    return 4 if algorithm != "standalone" and architecture in AUTO_TREE_ARCHITECTURES else 1


def resolved_tree(algorithm: str | None, topk: int | None) -> Tree:
    """The tree of a config as SGLang resolved it (`speculative_algorithm`, `speculative_eagle_topk`): NGRAM branches
    at every topk (module docstring), a drafted algorithm only above topk 1."""
    if not algorithm:
        return BASELINE_TREE
    name, k = str(algorithm).upper(), int(topk or 1)
    return Tree(name, None, k, name == "NGRAM" or k > 1)


def tree_of(spec: SpecConfig, architecture: str = "") -> Tree:
    """`spec` as SGLang's backend choice and its verify see it, for a target of `architecture`."""
    name = spec.algorithm.upper()
    if isinstance(spec, NgramSpec):  # topk := max_bfs_breadth; its draft branches even at 1
        return Tree("NGRAM", None, spec.max_bfs_breadth, True)
    if isinstance(spec, (EagleSpec, Eagle3Spec)) and spec.adaptive:
        return Tree(name, spec.topk, 1, False)
    if isinstance(spec, (EagleSpec, Eagle3Spec, StandaloneSpec)):
        topk = spec.topk if spec.topk is not None else auto_topk(architecture, spec.algorithm)
        return Tree(name, spec.topk, topk, topk > 1)
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


def masks(backend: str, kind: AttentionKind, topk: int) -> bool:
    """Whether `backend`'s verify applies a draft tree's mask on a `kind` model at `topk`."""
    start = MASK_FROM_TOPK[kind].get(backend)
    return start is not None and topk >= start


def tree_mask_problem(backend: str, kind: AttentionKind, tree: Tree) -> str | None:
    """Why verifying `tree` on `backend` for a `kind` model would not be greedy-exact (None: it is, or the draft is a
    chain, whose causal mask is its tree mask)."""
    if not tree.branches or masks(backend, kind, tree.topk):
        return None
    start = MASK_FROM_TOPK[kind].get(backend)
    if kind == "mla" and backend == "flashinfer":
        why = ("flashinfer on an MLA model is SGLang's FlashInferMLAAttnBackend, whose verify ignores the tree mask "
               "(causal plan; 'TODO: Support topk > 1 with custom mask' in flashinfer_mla_backend.py)")
    elif start is not None:
        why = (f"the {backend} backend applies the tree mask only at topk >= {start} (at topk {tree.topk} its verify "
               "is plain causal attention, flashattention_backend.py)")
    elif kind == "mla" and backend == "fa4":
        why = "SGLang does not support fa4 on an MLA model with a tree (its docs mark FA4 MLA at topk > 1 unsupported)"
    else:
        why = (f"the {backend} backend's verify does not apply a tree mask on {kind.upper()} models in SGLang 0.5.23 "
               f"(trees verify on {', '.join(sorted(MASK_FROM_TOPK[kind]))})")
    ngram = " (an NGRAM draft branches at every max_bfs_breadth, 1 included)" if tree.algorithm == "NGRAM" else ""
    keep = (f"keep max_bfs_breadth/topk >= {start} in the search space, or " if start is not None
            else "keep EAGLE topk at 1 in the search space, or " if tree.algorithm != "NGRAM" else "")
    return (f"a draft tree verified at topk {tree.topk}{ngram} on attention backend {backend}: {why}, so its outputs "
            f"would not be the baseline's greedy outputs. Fix: {keep}set engine.attention_backend: "
            f"{TREE_FALLBACK[kind]} (it applies the mask at every topk)")


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
    """The backend a study renders for every engine, with what stock SGLang would have picked and why: `unmasked`
    is a tree of the study that stock pick would verify without its mask (None: it verifies them all)."""

    backend: str
    arch: GpuArch
    kind: AttentionKind
    architecture: str
    widest: Tree
    stock_baseline: str
    stock_widest: str
    unmasked: Tree | None = None

    def describe(self) -> str:
        line = (f"attention backend {self.backend} for the baseline and every trial ({ARCH_NAMES[self.arch]}, "
                f"{self.kind.upper()} {self.architecture or 'model'}, widest tree: {self.widest.describe()}; "
                f"SGLang 0.5.23 picks {self.stock_widest} for it")
        if self.unmasked is not None:
            start = MASK_FROM_TOPK[self.kind].get(self.stock_widest)
            if start is not None:
                why = f"which applies the tree mask only at topk >= {start}"
            else:
                why = f"whose verify ignores the tree mask on {self.kind.upper()}"
            ngram = (" (an NGRAM draft branches at every max_bfs_breadth)" if self.unmasked.algorithm == "NGRAM"
                     else "")
            line += (f", {why}, and the space has an {self.unmasked.describe()}{ngram}: {self.backend} applies the "
                     "mask at every topk")
        if self.stock_baseline != self.backend:
            line += f"; it would run the baseline on {self.stock_baseline}"
        return line + ")"


def choose_backend(arch: GpuArch, kind: AttentionKind, architecture: str, trees: list[Tree],
                   asymmetric_kv: bool = False, attention_sinks: bool = False) -> BackendChoice:
    """SGLang's own choice for the most demanding of `trees` (the widest; on a tie a branching one, a speculative
    one, then one whose topk is given on the command line, which SGLang's choice sees), the same for the baseline;
    where that backend's verify would ignore the mask of any of `trees` (the narrowest NGRAM tree on fa3, say), the
    fallback that applies it at every topk."""
    widest = max(trees or [BASELINE_TREE],
                 key=lambda t: (t.topk, t.branches, t.algorithm is not None, t.given_topk is not None))
    stock = sglang_default(arch, kind, architecture, widest, asymmetric_kv, attention_sinks)
    unmasked = next((t for t in sorted(trees, key=lambda t: t.topk) if tree_mask_problem(stock, kind, t)), None)
    fallback = "triton" if attention_sinks else TREE_FALLBACK[kind]
    # DSA models run only their own sparse backend: no fallback there (their trees are refused, fail closed)
    backend = fallback if stock != "dsa" and unmasked is not None else stock
    return BackendChoice(backend=backend, arch=arch, kind=kind, architecture=architecture, widest=widest,
                         stock_baseline=sglang_default(arch, kind, architecture, BASELINE_TREE, asymmetric_kv,
                                                       attention_sinks),
                         stock_widest=stock, unmasked=unmasked if backend != stock else None)
