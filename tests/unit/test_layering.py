"""Layering: ``pipeline`` reaches ``stages`` and ``bench`` only by import path.

Importing the plumbing (``pipeline.launch``, ``pipeline.cli``) must load no module of
``stages`` or ``bench`` (nor torch, which only model code needs); no module of
``pipeline`` may import them by a statement, at module level or inside a function;
every path the plumbing names must resolve, so the indirection cannot rot silently; and
the built-in stages register themselves from the modules ``stages.STAGE_MODULES``
lists, and no module of that list is missing.
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
