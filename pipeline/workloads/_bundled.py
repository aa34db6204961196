"""Builders of the bundled workloads. Standard library only, so the builders run under any CPython 3.10-3.13.

Each builder returns `(id, text)` pairs in a fixed order plus notes; the data lives in the JSON files next to this
module. All prompts are plain completion prompts (no chat template) kept under ~400 tokens.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import json
import textwrap
import tokenize
from collections import Counter
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent

CODE_EDIT_TEMPLATE = (
    "Here is a Python function from the standard library module `{module}`:\n\n"
    "```python\n{source}```\n\n"
    "The same function with `{old}` renamed to `{new}`:\n"
    "```python\n"
)


def _data(name: str) -> dict:
    with open(DATA_DIR / name, encoding="utf-8") as fh:
        return json.load(fh)


def build_code_edit() -> tuple[list[tuple[str, str]], list[str]]:
    """Copy-heavy prompts: a stdlib function's source, then an instruction to rewrite it with one name renamed.

    The model's answer is mostly the input again. Sources come from `inspect.getsource` at run time, so the text is
    fixed for a given Python minor version (see code_edit.json for how the functions were chosen). A function that is
    missing or has no source in the running Python is skipped and named in the notes.
    """
    spec = _data("code_edit.json")
    per_function = int(spec["renames_per_function"])
    prompts: list[tuple[str, str]] = []
    skipped: list[str] = []
    for qualname in spec["functions"]:
        found = _source_of(qualname)
        if found is None:
            skipped.append(qualname)
            continue
        module, source = found
        taken = _identifiers(source)
        for old in _rename_targets(source, per_function):
            new = _new_name(old, taken)
            text = CODE_EDIT_TEMPLATE.format(module=module, source=source, old=old, new=new)
            prompts.append((f"{qualname}:{old}", text))
    notes = []
    if skipped:
        notes.append(f"code-edit: skipped {len(skipped)} function(s) not available as source in this Python: {skipped}")
    return prompts, notes


def _source_of(qualname: str) -> tuple[str, str] | None:
    parts = qualname.split(".")
    # The longest importable prefix is the module ("urllib.parse.unquote"); the rest are attributes
    # ("random.Random.triangular").
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            source = textwrap.dedent(inspect.getsource(obj))
        except (AttributeError, OSError, TypeError):
            return None
        return module_name, source if source.endswith("\n") else source + "\n"
    return None


def _identifiers(source: str) -> set[str]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.string for tok in tokens if tok.type == tokenize.NAME}


def _rename_targets(source: str, k: int) -> list[str]:
    """The `k` parameters or local variables used most often (ties by name): renaming them touches many lines."""
    func = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    a = func.args
    params = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None]
    local = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    candidates = (set(params) | local) - {"self", "cls", "_"}
    uses = Counter(n.id for n in ast.walk(func) if isinstance(n, ast.Name) and n.id in candidates)
    for p in params:
        if p in candidates:
            uses[p] += 1
    ranked = sorted((name for name, count in uses.items() if count >= 2), key=lambda name: (-uses[name], name))
    return ranked[:k]


def _new_name(old: str, taken: set[str]) -> str:
    new = "new_" + old.lstrip("_")
    while new in taken:
        new += "_"
    return new


def build_free_text() -> tuple[list[tuple[str, str]], list[str]]:
    """Open-ended essays, stories and explanations (templates x topics): output rarely repeats the prompt."""
    spec = _data("free_text.json")
    prompts = []
    for t, template in enumerate(spec["templates"]):
        for topic in spec["topics"]:
            prompts.append((f"free-{t}-{topic.replace(' ', '-')}", template.format(topic=topic)))
    return prompts, []


def build_templated() -> tuple[list[tuple[str, str]], list[str]]:
    """The same few files edited again and again (agent-loop style): answers repeat across requests.

    Prompts interleave the documents (prompt i edits document i % n_documents), so any sizeable split holds
    several edits of every document and a warm n-gram trie has seen most of each answer before.
    """
    spec = _data("templated.json")
    docs = spec["documents"]
    prompts = []
    for e in range(max(len(d["edits"]) for d in docs)):
        for d in docs:
            if e < len(d["edits"]):
                text = spec["template"].format(name=d["name"], document=d["text"], edit=d["edits"][e])
                prompts.append((f"{d['name']}#{e}", text))
    return prompts, []


def build_reasoning() -> tuple[list[tuple[str, str]], list[str]]:
    """Long, self-repeating answers (step-by-step working, one line per step): what reasoning models produce, where
    the answer's own n-grams recur and a corpus of earlier answers holds its structure. See reasoning.json."""
    spec = _data("reasoning.json")
    numbers = spec["numbers"]
    prompts = [(f"reasoning:{t}:{n}", template.format(n=n))
               for t, template in enumerate(spec["templates"]) for n in numbers]
    return prompts, []


BUILDERS = {"code-edit": build_code_edit, "free-text": build_free_text, "templated": build_templated,
            "reasoning": build_reasoning}
