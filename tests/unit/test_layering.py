"""Layering: ``pipeline`` reaches ``stages`` and ``bench`` only by import path.

Importing the plumbing (``pipeline.launch``, ``pipeline.cli``) must load no module of
``stages`` or ``bench`` (nor torch, which only model code needs); no module of
``pipeline`` may import them by a statement, at module level or inside a function;
every path the plumbing names must resolve, so the indirection cannot rot silently;
the built-in stages register themselves from the modules ``stages.STAGE_MODULES``
lists, and no module of that list is missing; and no modules of ``pipeline`` and
``stages`` import each other in a circle, counting imports inside functions (only an
``if TYPE_CHECKING:`` import, never run, is left out), nor do the rooms of ``stages``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.plugins import BUILTINS, load_builtin, registered_stages

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["pipeline.launch", "pipeline.cli"])
def test_importing_the_plumbing_loads_no_stage_bench_or_torch_module(module: str) -> None:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert module in loaded  # the probe really imported it
    forbidden = [m for m in loaded if m.split(".")[0] in ("stages", "bench", "torch")]
    assert forbidden == []


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_no_pipeline_module_imports_stages_or_bench() -> None:
    # Template files are package data written out for a user to edit (``conveyor init``),
    # never imported as modules of ``pipeline``: a template's tools may use the stages'.
    templates = ROOT / "pipeline" / "template_files"
    files = sorted(f for f in (ROOT / "pipeline").rglob("*.py") if templates not in f.parents)
    assert len(files) > 20  # the walk found the package
    offending = [f"{f.relative_to(ROOT)}:{line} imports {name}" for f in files
                 for line, name in _imported_modules(f) if name.split(".")[0] in ("stages", "bench")]
    assert offending == []


def test_the_scan_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from stages.trainer.stage import x\n    import bench.e2e\n")
    assert _imported_modules(probe) == [(2, "stages.trainer.stage"), (3, "bench.e2e")]


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_every_builtin_path_resolves(name: str) -> None:
    assert callable(load_builtin(name))


def test_the_built_in_stages_register_themselves() -> None:
    # The names launch.py asks for: the chain, plus the offline source and the PPO trainer.
    names = {"source", "pairs", "rollout", "reward", "reward_model", "reference", "critic", "trainer", "ppo_trainer"}
    stages = registered_stages()
    assert names <= set(stages)
    assert all(isinstance(cls, type) for cls in stages.values())


def test_every_module_that_registers_a_stage_is_listed() -> None:
    from stages import STAGE_MODULES

    registering = sorted(_module_name(f) for f in (ROOT / "stages").rglob("*.py")
                         if "@register_stage(" in f.read_text())
    assert len(registering) >= 9  # the scan found the stages
    assert sorted(STAGE_MODULES) == registering


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement run at some point: module level and inside functions, not
    under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif not _is_type_checking(node):
            found += _runtime_imports(node)
    return found


def _import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (``from a import b`` is module
    ``a.b`` when that is a module, else ``a``; relative imports resolved)."""
    files = {_module_name(f, root): f for p in packages for f in (root / p).rglob("*.py")
             if "template_files" not in f.parts}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
                continue
            base = node.module or ""
            if node.level:  # ``from ..x import y``: the package ``level - 1`` above this one
                base = ".".join([*package[:len(package) - node.level + 1], base]).strip(".")
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports (``[a, b, a]``), or ``[]``: a depth-first walk that meets a
    module still on its path."""
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return []
        for target in sorted(graph[module]):
            if cycle := walk(target, [*path, module]):
                return cycle
        done.add(module)
        return []

    for module in sorted(graph):
        if cycle := walk(module, []):
            return cycle
    return []


def test_no_import_cycles_in_pipeline_and_stages() -> None:
    graph = _import_graph(ROOT, ("pipeline", "stages"))
    assert len(graph) > 80 and "stages.trainer.ranks" in graph["stages.trainer.stage"]  # the walk saw the code
    assert _find_cycle(graph) == []


def test_the_rooms_of_stages_import_each_other_in_one_direction() -> None:
    # A room is a package of stages/ (data, rollout, rewards...): collapsed to rooms, the
    # imports between them still form no circle (today flow > trainer > rewards > data >
    # rollout > models > algorithms).
    rooms: dict[str, set[str]] = {}
    for module, targets in _import_graph(ROOT, ("stages",)).items():
        room = ".".join(module.split(".")[:2])
        rooms.setdefault(room, set()).update(".".join(t.split(".")[:2]) for t in targets)
        rooms[room].discard(room)
    assert {"stages.data", "stages.trainer", "stages.rollout"} <= set(rooms)
    assert _find_cycle(rooms) == []


def test_the_cycle_scan_sees_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import x\n")
    (tmp_path / "pkg" / "b.py").write_text("def x():\n    from . import a\n")
    (tmp_path / "pkg" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    graph = _import_graph(tmp_path, ("pkg",))
    assert graph["pkg.c"] == set()  # a type-only import is never run
    assert _find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
