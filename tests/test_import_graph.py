"""The project's modules import one another without a cycle, and keep pyproject.toml's layer contracts.

The graph is built from the source with `ast`, not by importing anything: every `import` and
`from ... import` counts, at module level or inside a function (a function-level import hides a
cycle from Python's loader, not from a reader). Importing `a.b.c` runs `a` and `a.b` first, so those
count too, except the importer's own packages (they are already running when it runs: a package that
re-exports its modules is not a circle); `from a import b` counts `a.b` when it is a module.

The contracts (`[tool.importlinter]`: the gateway's layers, P0 without the engine, no jax in the gateway,
no web server in the engine) are import-linter's to check: `lint-imports` from the repo root, as a
developer runs it, and its report shown when one is broken.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bankml", "configs", "gateway", "gpu_monitor", "kernels", "model")


def project_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `name` (at `path`) imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    own = set(_with_parents(name))  # its packages, and itself
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package, `level` steps up
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            targets = [source, *(f"{source}.{alias.name}" for alias in node.names)]
        for target in targets:
            found.update(m for m in _with_parents(target) if m in modules and m not in own)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (an iterative depth-first search, so deep graphs are fine)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_sees_what_the_code_imports():
    graph = import_graph()
    assert "bankml.serve" in graph["bankml.cli"]  # a function-level import counts
    assert {"bankml.verify", "bankml.config"} <= graph["gateway.app"]
    assert "bankml.errors" in graph["model.engine_thread"]


def test_no_module_imports_itself_through_others():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_only_the_cli_imports_the_launcher():
    graph = import_graph()
    assert sorted(name for name, deps in graph.items() if "bankml.serve" in deps) == ["bankml.cli"]


def test_the_cycle_finder_finds_one_and_says_where():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert find_cycle({"x": {"y"}, "y": {"y2"}, "y2": {"x"}}) == ["x", "y", "y2", "x"]


# `lint-imports`, run by the interpreter running the tests: no PATH lookup, and the repo root (the cwd)
# is on sys.path, so the packages checked are this checkout's
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_the_import_contracts_are_kept():
    # --no-cache: a stale graph never answers, and parallel test workers write nothing
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    run = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache", "--no-logo"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    report = run.stdout + run.stderr
    assert run.returncode == 0, f"lint-imports exited {run.returncode}:\n{report}"
    assert " 0 broken" in report, report  # the contracts were read and checked, not skipped
