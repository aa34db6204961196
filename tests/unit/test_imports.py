"""House rules checked on the source (docs/design.md, "Data flow = module layout" and "Engines"): no import circles among serve/ and pipeline/ modules (imports
inside functions count: they only hide a circle), serve/ never imports pipeline/, pipeline/ never imports an engine's
implementation, and outside the engine package the engine-kind strings appear only in config parsing."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIND_STRINGS = {"cpu", "sglang", "llama_cpp", "vllm"}
# Config parsing: the study file's `engine.kind` (its Literal lives in serve/engines/base.py as EngineKind).
KIND_STRINGS_ALLOWED = {"pipeline/config/engine.py", "pipeline/config/trial.py",
                        # the machine record's "cpu" field (the processor's name), no engine kind
                        "pipeline/records/provenance.py"}


def modules() -> dict[str, Path]:
    found = {}
    for package in ("serve", "pipeline"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every project module `name` imports, anywhere in the file (packages resolved to their modules)."""
    targets = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            candidates = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known and "." in candidate:
                candidate = candidate.rpartition(".")[0]
            if candidate in known and candidate != name and known[candidate].name != "__init__.py":
                targets.add(candidate)
    return targets


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_circle_hidden_in_a_function():
    edges = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert cycles(edges) == [["a", "b"]]


def test_no_import_circles():
    assert cycles(graph()) == []


def test_serve_never_imports_pipeline():
    edges = graph()
    assert sorted(f"{a} -> {b}" for a, bs in edges.items() if a.startswith("serve") for b in bs
                  if b.startswith("pipeline")) == []


def test_pipeline_reaches_engines_only_through_the_engine_abstraction():
    edges = graph()
    # round_table: the round table's consistency check, engine-agnostic (the shape probe reads any engine's table);
    # load_failures, waits: any engine's failed start classified, any engine's start deadline
    allowed = {"serve.engines", "serve.engines.base", "serve.engines.spec_flags", "serve.engines.round_table",
               "serve.engines.load_failures", "serve.engines.waits"}
    leaks = sorted(f"{a} -> {b}" for a, bs in edges.items() if a.startswith("pipeline") for b in bs
                   if b.startswith("serve.engines") and b not in allowed)
    assert leaks == []


def test_engine_kind_strings_appear_only_in_config_parsing_outside_the_engine_package():
    found = []
    for name, path in modules().items():
        relative = str(path.relative_to(ROOT))
        if name.startswith("serve.engines") or relative in KIND_STRINGS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in KIND_STRINGS:
                found.append(f"{relative}:{node.lineno}: {node.value!r}")
    assert found == []


def room(module: str) -> str:
    """A room of pipeline/: its sub-package (`pipeline.trial`) or a module at its root (`pipeline.tune`)."""
    return ".".join(module.split(".")[:2])


def rooms_importing_each_other(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    between: set[tuple[str, str]] = {(room(a), room(b)) for a, bs in edges.items() for b in bs
                                     if a.startswith("pipeline.") and b.startswith("pipeline.") and room(a) != room(b)}
    return sorted((a, b) for a, b in between if a < b and (b, a) in between)


def room_graph() -> dict[str, set[str]]:
    """`graph()` with imports of a package's `__init__` kept (`from pipeline.search.space import X` is an import of
    the search room even though the name lives in a module below it)."""
    known = modules()
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = imports_of(name, path, known)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "") in known:
                targets.add(node.module or "")
            elif isinstance(node, ast.ImportFrom) and node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
                if base in known:
                    targets.add(base)
        edges[name] = targets - {name}
    return edges


def test_the_room_checker_finds_two_rooms_importing_each_other():
    edges = {"pipeline.trial.lifecycle": {"pipeline.search.space"}, "pipeline.search.plan": {"pipeline.trial.corpus"},
             "pipeline.search.space": set(), "pipeline.trial.corpus": set()}
    assert rooms_importing_each_other(edges) == [("pipeline.search", "pipeline.trial")]


def test_floors_only_go_down_no_two_rooms_of_pipeline_import_each_other():
    """Rooms sit on floors (docs/design.md, "Data flow = module layout"): a room imports only rooms below it, so two
    rooms never import each other, not even inside a function."""
    assert rooms_importing_each_other(room_graph()) == []
