"""The house's proportions and layering, checked from the source (docs/ARCHITECTURE.md).

Read with ``ast`` only (nothing is imported), so this runs in a second:
- no file in ``tempering/`` over 800 lines, no function over 80 lines, no class with more
  than 12 public methods;
- no import cycle between modules, nor between the package's parts (``data`` importing
  ``environments`` while ``environments`` imports ``data`` is a cycle of parts);
- no import from a lower layer to a higher one, in this order (a module may import its own
  layer and those below it):
  utils < config < distributed < losses, logits, preference_losses < models < data,
  experience, environments < algorithms < evaluation, cli.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING`` alike: a
lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tempering"

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80
MAX_PUBLIC_METHODS = 12

# rank of each top-level part of the package; a module may import only ranks <= its own
# (parts of one rank may import each other one way: test_no_cycle_between_parts).
LAYERS: dict[str, int] = {
    "errors": 0,
    "utils": 0,
    "config": 1,
    "distributed": 2,
    "losses": 3,
    "logits": 3,
    "preference_losses": 3,
    "models": 4,
    "data": 5,
    "experience": 5,
    "environments": 5,
    "algorithms": 6,
    "evaluation": 7,
    "cli": 7,
    "__init__": 8,
    "__main__": 8,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The package module an import names (``a.b.C`` -> ``a.b`` when C is not a module)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" for a in node.names] or [prefix]
        for name in names:
            if not name.startswith("tempering"):
                continue
            target = _resolve(name)
            if target and target != module:
                found.add(target)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_part_has_a_layer():
    missing = sorted({_part(m) for m in MODULES} - LAYERS.keys())
    assert not missing, f"parts of tempering/ with no layer in LAYERS: {missing}"


def test_no_import_reaches_up():
    bad = []
    for module, targets in GRAPH.items():
        src = _part(module)
        for target in sorted(targets):
            dst = _part(target)
            if dst == src or dst == "__init__" and target == "tempering":
                continue
            if LAYERS[dst] > LAYERS[src]:
                bad.append(f"{module} (layer {LAYERS[src]}) imports {target} (layer {LAYERS[dst]})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_cycle_between_parts():
    parts: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        edges = parts.setdefault(_part(module), set())
        edges.update(_part(t) for t in targets if _part(t) != _part(module))
    for p in list(parts.values()):
        for t in p:
            parts.setdefault(t, set())
    evidence = {(_part(m), _part(t)): f"{m} -> {t}" for m, ts in GRAPH.items() for t in ts}
    bad = []
    for cycle in _cycles(parts):
        bad.append(
            " <-> ".join(cycle)
            + ":\n  "
            + "\n  ".join(
                v for (a, b), v in evidence.items() if a in cycle and b in cycle and a != b
            )
        )
    assert not bad, "parts of the package that import each other:\n" + "\n".join(bad)


def _sizes():
    files, functions, classes = [], [], []
    for module, path in MODULES.items():
        text = path.read_text()
        n = text.count("\n")
        if n > MAX_FILE_LINES:
            files.append(f"{path.relative_to(PACKAGE.parent)}: {n} lines")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    functions.append(f"{module}:{node.lineno} {node.name}: {length} lines")
            elif isinstance(node, ast.ClassDef):
                public = [
                    n.name
                    for n in node.body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and not n.name.startswith("_")
                ]
                if len(public) > MAX_PUBLIC_METHODS:
                    classes.append(f"{module}.{node.name}: {len(public)} public methods")
    return files, functions, classes


FILES, FUNCTIONS, CLASSES = _sizes()


def test_no_file_over_800_lines():
    assert not FILES, "\n".join(FILES)


def test_no_function_over_80_lines():
    assert not FUNCTIONS, "\n".join(FUNCTIONS)


def test_no_class_over_12_public_methods():
    assert not CLASSES, "\n".join(CLASSES)


def test_test_modules_have_unique_names():
    """tests/ has no __init__ per folder: pytest imports test modules by basename, and two of
    one name (tests/unit/test_kto.py and tests/functional/test_kto.py, 2026-12-01) fail the
    whole tier's collection on a clean clone."""
    seen: dict[str, list[str]] = {}
    for path in sorted((PACKAGE.parent / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from tempering.algorithms import grpo\n", "tempering.algorithms.grpo"),
        ("from tempering.losses import X\n", "tempering.losses"),
        ("import tempering.utils.timers\n", "tempering.utils.timers"),
    ],
)
def test_import_resolution_sees_each_form(tmp_path, source, expected):
    """The checker must see every import form, or the layering test could pass blind."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    " + source)
    assert expected in _imports("tempering.models.x", path)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_the_checkout_is_lint_clean_and_formatted(command):
    """``ruff check`` and ``ruff format --check`` (pyproject.toml's settings) over the whole
    checkout: drift is caught here, not by the next engineer's formatter."""
    import subprocess
    import sys

    root = PACKAGE.parent
    result = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=root,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
