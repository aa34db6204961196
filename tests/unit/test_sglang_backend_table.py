"""Issue 40 item 1: the attention backend the project renders on a GPU, per architecture x attention type x the study's
widest tree, checked with SGLang 0.5.23's own resolution functions on this CPU machine, the device faked with SGLang's
own `override_platform` (serve/engines/sglang/preflight.py). Models: a DeepSeek-V2-layout MLA config.json (the one
examples/study-seed-mla.yaml ships) and a Llama-layout MHA one.

Per cell: the project's backend for a study whose widest tree is that column's (the baseline column: no tree);
SGLang accepts the baseline's and the trial's command lines with it (parse, `resolve_once`, `check_server_args`) and
resolves both to it; the tree SGLang then verifies (its own topk and MLA verdict) is on a backend whose verify applies
the tree mask; SGLang's own choice without `--attention-backend` is what `sglang_default` says, and the project
differs from it only where that choice's verify ignores the tree mask. docs/configuration.md shows the same table.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.search.space import SearchSpace
from pipeline.study.backend import decide_backend
from pipeline.trial.replica_config import replica_config
from serve.engines.sglang.engine import resolved_problem, sglang_args
from serve.engines.sglang.backend import (GPU_ARCHS, TREE_FALLBACK, AttentionKind, Tree, architecture_of,
                                          attention_kind, resolved_tree, sglang_default, tree_mask_problem, tree_of)
from serve.engines.sglang.check import installed_version, run_preflight
from serve.spec import Eagle3Spec, NgramSpec, NoSpec

ROOT = Path(__file__).resolve().parents[2]
MLA_CONFIG = ROOT / "examples" / "models" / "deepseek-v2-236b" / "config.json"
MHA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu"}
COLUMNS = ("baseline", "NGRAM breadth 1", "NGRAM breadth 4", "EAGLE3 topk 1", "EAGLE3 topk 4")
# The table as docs/configuration.md shows it: (arch, attention) -> the backend of each column.
EXPECTED = {
    ("sm80", "MHA"): ("flashinfer",) * 5,
    ("sm80", "MLA"): ("triton",) * 5,
    # NGRAM at breadth 1 is a tree SGLang verifies at topk 1, where fa3 (and flashinfer on MLA) verify causally
    ("sm90", "MHA"): ("fa3", "flashinfer", "fa3", "fa3", "flashinfer"),
    ("sm90", "MLA"): ("fa3", "triton", "fa3", "fa3", "fa3"),
    ("sm100", "MHA"): ("trtllm_mha", "flashinfer", "flashinfer", "trtllm_mha", "flashinfer"),
    ("sm100", "MLA"): ("flashinfer", "triton", "triton", "flashinfer", "triton"),
    ("sm120", "MHA"): ("flashinfer",) * 5,
    ("sm120", "MLA"): ("triton",) * 5,
}
needs_sglang = pytest.mark.skipif(installed_version() is None,
                                  reason="sglang is not installed (bash infra/install-sglang-parser.sh)")


def column_spec(column: str, model: str):
    return {"baseline": NoSpec(),
            "NGRAM breadth 1": NgramSpec(num_draft_tokens=8, max_bfs_breadth=1),
            "NGRAM breadth 4": NgramSpec(num_draft_tokens=8, max_bfs_breadth=4, min_bfs_breadth=2),
            "EAGLE3 topk 1": Eagle3Spec(draft_model=model, num_steps=3, topk=1, num_draft_tokens=4),
            "EAGLE3 topk 4": Eagle3Spec(draft_model=model, num_steps=3, topk=4, num_draft_tokens=8)}[column]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / "MLA").mkdir()
    shutil.copy(MLA_CONFIG, root / "MLA" / "config.json")
    (root / "MHA").mkdir()
    (root / "MHA" / "config.json").write_text(json.dumps(MHA_CONFIG))
    return {kind: str(root / kind) for kind in ("MHA", "MLA")}


def column_space(column: str) -> SearchSpace:
    """A search space whose one speculative point is the column's (the baseline column: none)."""
    fixed = {"NGRAM breadth 1": ("ngram", {"num_draft_tokens": 8, "max_bfs_breadth": 1}),
             "NGRAM breadth 4": ("ngram", {"num_draft_tokens": 8, "max_bfs_breadth": 4, "min_bfs_breadth": 2}),
             "EAGLE3 topk 1": ("eagle3", {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}),
             "EAGLE3 topk 4": ("eagle3", {"num_steps": 3, "topk": 4, "num_draft_tokens": 8})}.get(column)
    if fixed is None:
        return SearchSpace.model_validate({"name": "baseline", "algorithms": ["none"]})
    algorithm, values = fixed
    return SearchSpace.model_validate({"name": column, "algorithms": ["none", algorithm], "branches": {
        algorithm: {k: {"type": "fixed", "value": v} for k, v in values.items()}}})


def study_for(arch: str, model: str, column: str):
    """The study as it runs: its backend decided as `run_study` decides it (`decide_backend`)."""
    study = load_study(None, {"engine.kind": "sglang", "engine.device": "cuda", "engine.gpu_arch": arch,
                              "model.target": model, "model.dtype": "auto", "model.drafts": {"eagle3": model}})
    return decide_backend(study, column_space(column)).study


def project_argv(arch: str, model: str, column: str, tmp: Path) -> list[str]:
    """The command line the project renders for the column's trial (baseline column: the baseline)."""
    study = study_for(arch, model, column)
    return sglang_args(replica_config(study, TrialConfig(spec=column_spec(column, model)), tmp), "127.0.0.1", 30000)


def project_backend(arch: str, model: str, column: str) -> str:
    argv = project_argv(arch, model, column, Path("/tmp"))
    return argv[argv.index("--attention-backend") + 1]


def test_the_pure_table_is_the_documented_one(models):
    table = {(arch, kind): tuple(project_backend(arch, models[kind], c) for c in COLUMNS)
             for arch in GPU_ARCHS for kind in ("MHA", "MLA")}
    assert table == EXPECTED
    docs = (ROOT / "docs" / "configuration.md").read_text()
    for (arch, kind), backends in EXPECTED.items():
        assert f"| {arch} | {kind} | " + " | ".join(backends) + " |" in docs, (arch, kind)


def test_flashinfer_on_mla_is_refused_for_trees_and_kept_for_chains():
    tree4, chain = Tree("EAGLE3", 4, 4, True), Tree("EAGLE3", 1, 1, False)
    assert "FlashInferMLAAttnBackend" in (tree_mask_problem("flashinfer", "mla", tree4) or "")
    assert tree_mask_problem("flashinfer", "mla", chain) is None  # a chain: its causal mask is its tree mask
    assert tree_mask_problem("flashinfer", "mha", tree4) is None
    assert tree_mask_problem("trtllm_mla", "mla", Tree("EAGLE3", 2, 2, True)) is not None  # 64-token pages
    assert tree_mask_problem("some_new_backend", "mha", Tree("EAGLE3", 2, 2, True)) is not None  # not read


def test_ngram_is_a_tree_at_every_breadth_and_fa3_masks_only_above_topk_1():
    breadth1 = tree_of(NgramSpec(num_draft_tokens=8, max_bfs_breadth=1))
    assert breadth1 == Tree("NGRAM", None, 1, True) == resolved_tree("NGRAM", 1)
    for backend in ("fa3", "fa4"):  # cascade verify with the mask only at topk > 1: causal at topk 1
        assert "only at topk >= 2" in (tree_mask_problem(backend, "mha", breadth1) or "")
        assert tree_mask_problem(backend, "mha", tree_of(NgramSpec(num_draft_tokens=8, max_bfs_breadth=2))) is None
    assert tree_mask_problem("fa3", "mla", breadth1) is not None
    assert tree_mask_problem("fa3", "mla", resolved_tree("EAGLE3", 1)) is None  # a topk-1 EAGLE draft is a chain
    assert "FA4 MLA" in (tree_mask_problem("fa4", "mla", resolved_tree("NGRAM", 4)) or "")  # no MLA tree on fa4
    masking: tuple[tuple[str, AttentionKind], ...] = (("triton", "mla"), ("triton", "mha"), ("flashinfer", "mha"),
                                                      ("torch_native", "mha"))
    for backend, kind in masking:
        assert tree_mask_problem(backend, kind, breadth1) is None, backend  # the mask at any topk
    for backend in ("flashinfer", "trtllm_mla"):  # sm100's MLA picks never apply it
        assert tree_mask_problem(backend, "mla", breadth1) is not None, backend
    assert resolved_problem({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 1, "attention_backend": "fa3",
                             "use_mla_backend": True}) is not None


@pytest.mark.parametrize("low, backend", [(1, "triton"), (2, "fa3")])
def test_the_study_checks_the_spaces_narrowest_ngram_tree_too(low, backend):
    from pipeline.study.backend import widest_specs
    from serve.engines.sglang.backend import BASELINE_TREE, choose_backend

    space = SearchSpace.model_validate({"name": "s", "algorithms": ["none", "ngram"], "branches": {"ngram": {
        "max_bfs_breadth": {"type": "int", "low": low, "high": 8}}}})
    specs = widest_specs(space)
    ngram_specs = [s for s in specs if isinstance(s, NgramSpec)]
    assert ngram_specs == specs
    assert {s.max_bfs_breadth for s in ngram_specs} >= {low, 8}
    choice = choose_backend("sm90", "mla", "DeepseekV2ForCausalLM", [BASELINE_TREE, *map(tree_of, specs)])
    assert choice.stock_widest == "fa3" and choice.backend == backend  # fa3 masks at topk >= 2 only
    assert (choice.unmasked == Tree("NGRAM", None, 1, True)) == (backend == "triton")
    # sm100: SGLang's MLA picks (flashinfer; trtllm_mla for DeepSeek-V3 layouts) never apply it, at any breadth
    for architecture, stock in (("DeepseekV2ForCausalLM", "flashinfer"), ("DeepseekV3ForCausalLM", "trtllm_mla")):
        choice = choose_backend("sm100", "mla", architecture, [BASELINE_TREE, *map(tree_of, specs)])
        assert (choice.stock_widest, choice.backend) == (stock, "triton"), architecture


def test_sglangs_own_ngram_draft_at_breadth_1_branches():
    # The fact the table rests on, from the project's copy of SGLang's trie (serve/ngram/trie.py): at
    # max_bfs_breadth 1 a draft still has a node with two children (anchors expand from the root; pads hang there).
    import random

    from serve.ngram.trie import NgramCache

    rng = random.Random(0)
    branching = 0
    for _ in range(50):
        cache = NgramCache(max_trie_depth=6, capacity=100000, min_bfs_breadth=1, max_bfs_breadth=1,
                           match_type="BFS", num_draft_tokens=8)
        context = [rng.randrange(6) for _ in range(64)]
        cache.insert(context)
        tree = cache.draft(context)
        children = [tree.parents.count(i) for i in range(-1, len(tree.parents))]
        branching += max(children) >= 2
    assert branching > 25


@needs_sglang
def test_each_cell_is_what_sglang_resolves_and_its_verify_applies_the_tree_mask(models, tmp_path):
    cells, argvs = [], []
    archs: list[str | None] = []  # run_preflight's type: one GPU architecture (or none) per command line
    for arch, kind in EXPECTED:
        model = models[kind]
        for column in COLUMNS:
            spec = column_spec(column, model)
            study = study_for(arch, model, column)  # the baseline of the same study as the trial
            baseline = sglang_args(replica_config(study, TrialConfig(), tmp_path), "127.0.0.1", 30000)
            trial_argv = sglang_args(replica_config(study, TrialConfig(spec=spec), tmp_path), "127.0.0.1", 30000)
            backend = trial_argv[trial_argv.index("--attention-backend") + 1]
            at = trial_argv.index("--attention-backend")
            stock_argv = trial_argv[:at] + trial_argv[at + 2:]  # SGLang's own choice
            cells.append((arch, kind, column, backend, spec))
            argvs += [baseline, trial_argv, stock_argv]
            archs += [arch] * 3
    results = run_preflight(argvs, gpu_arch=archs)  # one SGLang import for the 120 resolutions
    assert results is not None
    for i, (arch, kind, column, backend, spec) in enumerate(cells):
        base, trial, stock = results[3 * i: 3 * i + 3]
        where = (arch, kind, column)
        assert base.ok and trial.ok and stock.ok, (where, base.error, trial.error, stock.error)
        assert base.resolved["attention_backend"] == trial.resolved["attention_backend"] == backend, where
        assert trial.resolved["use_mla_backend"] == (kind == "MLA"), where
        assert resolved_problem(trial.resolved) is None, where  # SGLang's own topk + MLA verdict on our backend
        config = json.loads((Path(models[kind]) / "config.json").read_text())
        tree = tree_of(spec, architecture_of(config))
        mirrored = sglang_default(arch, attention_kind(config), architecture_of(config), tree)  # type: ignore[arg-type]
        assert stock.resolved["attention_backend"] == mirrored, where
        verified = resolved_tree(stock.resolved.get("speculative_algorithm"),
                                 stock.resolved.get("speculative_eagle_topk"))
        if backend != mirrored:  # the project moved off SGLang's choice only where its verify ignores the mask
            attention: AttentionKind = "mla" if kind == "MLA" else "mha"
            assert tree_mask_problem(mirrored, attention, verified), where
            assert backend == TREE_FALLBACK[attention], where
        assert EXPECTED[(arch, kind)][COLUMNS.index(column)] == backend, where


@needs_sglang
def test_a_tree_on_a_backend_whose_verify_ignores_its_mask_is_invalid(models, tmp_path, monkeypatch):
    # flashinfer named by the study on the MLA model: SGLang itself accepts the NGRAM command lines (its
    # FlashInferMLAAttnBackend would then verify the tree with a causal mask); the project refuses them, from SGLang's
    # own resolved backend, algorithm, topk and MLA verdict, and before that from the model's config.json.
    import serve.engines.sglang.engine as sglang
    from serve.engines.base import ConfigRejected, ReplicaConfig
    from serve.engines.sglang.study import check_commands

    model = models["MLA"]
    tree, chain = (ReplicaConfig(engine="sglang", device="cuda", model=model, dtype="auto", attention_backend="flashinfer",
                                 spec=NgramSpec(num_draft_tokens=8, max_bfs_breadth=b)) for b in (4, 1))
    argv = sglang_args(tree, "127.0.0.1", 30000)
    (verdict,) = run_preflight([argv], gpu_arch="sm100") or []
    assert verdict.ok and verdict.resolved["speculative_eagle_topk"] == 4 and verdict.resolved["use_mla_backend"]
    assert "FlashInferMLAAttnBackend" in (resolved_problem(verdict.resolved) or "")
    baseline = tree.model_copy(update={"spec": NoSpec()})
    tree_check, breadth1_check, baseline_check = check_commands([tree, chain, baseline], "sm100")  # the dry run's
    assert tree_check.ok is False and "ignores the tree mask" in (tree_check.problem or "")
    # breadth 1: SGLang resolves topk 1, and the draft still branches, so it is refused too (it once passed as a chain)
    assert breadth1_check.resolved["speculative_eagle_topk"] == 1
    assert breadth1_check.ok is False and "branches at every max_bfs_breadth" in (breadth1_check.problem or "")
    assert baseline_check.ok is True  # no tree, nothing to mask
    monkeypatch.setattr(sglang, "node_gpu_arch", lambda: "sm100")
    monkeypatch.setattr(sglang, "run_preflight", lambda *a, **k: pytest.fail("refused before SGLang is asked"))
    with pytest.raises(ConfigRejected, match="ignores the tree mask"):  # in the replica: an INVALID trial
        sglang.SglangEngine().prepare(tree, argv)
