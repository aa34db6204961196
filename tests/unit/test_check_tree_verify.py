"""tests/gpu/check_tree_verify.py on the CPU: it passes with torch as its only third-party import, it fails when a
masked path ignores the tree or when the causal path stops diverging, and its reproduction of fa3's draft-pass page
table gives each draft row its own ancestors' slots (checked on a tree written out by hand)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from serve.ngram.drafttree import DraftTree

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "gpu" / "check_tree_verify.py"
# Everything the check must do without: what a bare GPU machine lacks (torch's own optional numpy included).
BLOCKED = ("pydantic", "ray", "pytest", "sglang", "numpy", "httpx", "mlflow", "optuna", "yaml", "pipeline")


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_the_check_passes_on_a_cpu_importing_nothing_but_torch():
    result = run_python(f"""
        import importlib.abc, runpy, sys
        BLOCKED = {BLOCKED!r}
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"blocked: {{name}}", name=name)
        sys.meta_path.insert(0, Block())
        sys.argv = ["check_tree_verify.py", "--device", "cpu"]
        try:
            runpy.run_path({str(CHECK)!r}, run_name="__main__")
        finally:
            imported = sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED))
            print("blocked modules imported:", imported)
            print("serve/__init__.py ran:", getattr(sys.modules.get("serve"), "__file__", None) is not None)
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "blocked modules imported: []" in result.stdout
    assert "serve/__init__.py ran: False" in result.stdout  # the project's files were read by path


def attention_failures(patch: str) -> list[str]:
    """The check's attention cases with one of its paths replaced; the failures it reports."""
    result = run_python(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("check", {str(CHECK)!r})
        check = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(check)
        check.torch.set_num_threads(1)  # as main() does on a CPU
        trie, sglang_cpu, cpu_verify, paths = check.load_project()
        {patch}
        table = check.Table()
        check.attention_cases(table, trie, paths, sglang_cpu, check.SIZES["small"], "cpu", 1)
        print(repr(table.failures))
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    return eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 -- the repr of a list of str printed above


def test_a_masked_path_that_ignores_the_tree_is_a_mismatch():
    # what SGLang runs at topk <= 1, put where the masked cascade should be
    failures = attention_failures("paths.fa3_two_pass = paths.fa3_causal")
    assert failures and all("masked path is off the reference" in f for f in failures)
    assert {f.split(":")[0].split()[-1] for f in failures} == {"b1", "b2", "b4", "b8"}


def test_a_causal_path_that_masks_is_caught_as_not_diverging():
    failures = attention_failures("paths.fa3_causal = paths.reference")
    assert failures and all(f.split(":")[0].endswith("b1") for f in failures)


def load_paths():
    spec = importlib.util.spec_from_file_location("tree_verify_paths", ROOT / "tests" / "gpu" / "tree_verify_paths.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fa3_draft_pass_reads_each_rows_ancestors_from_sglangs_full_mask():
    paths = load_paths()
    # root r; a and b under r; c under a; a pad under r. Two requests, prefixes 2 and 5.
    tree = DraftTree(tokens=(7, 8, 9, 0), parents=(-1, -1, 0, -1), num_real=3)
    batch = paths.Batch([tree, tree], [2, 5], torch.Generator().manual_seed(0))
    table, seqlens = paths.fa3_expand_metadata(batch)
    ancestors = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 4]}  # node -> itself and its ancestors, root 0
    for b, prefix in enumerate([2, 5]):
        drafts = batch.slot_rows(b, prefix + 5)[prefix:]
        for node, seen in ancestors.items():
            row = b * 5 + node
            assert int(seqlens[row]) == len(seen)
            assert table[row, :len(seen)].tolist() == drafts[seen].tolist()
    assert batch.positions.tolist() == [2, 3, 3, 4, 3, 5, 6, 6, 7, 6]
    assert paths.branches(tree) and not paths.branches(DraftTree((7, 0), (-1, -1), 1))
