"""``conveyor init``: a starting point for the jobs users run, written into a directory.

A template is a folder of package data (``pipeline/template_files/<name>/``, installed with
the package): a commented ``config.yaml`` headed by the command that runs it and, where the
job needs them, a small data file and a module the user edits (reward, tools).

Guarantees:
- ``write_template`` refuses a directory that exists and is not empty unless ``force``
  (then it overwrites the template's own files and leaves every other file alone);
- ``THIS_DIR`` in a written file is replaced by the directory it was written to, so the
  config's first line is the command to copy;
- a template is listed only when its config exists; its one-line description is the
  config's first comment line after the command (``describe_templates``).
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from pipeline.config import ConfigError

PLACEHOLDER = "THIS_DIR"


def _root() -> Traversable:
    return resources.files("pipeline") / "template_files"


def list_templates() -> list[str]:
    """Names of the templates the installed package carries, sorted."""
    return sorted(p.name for p in _root().iterdir() if p.is_dir() and (p / "config.yaml").is_file())


def describe_templates() -> dict[str, str]:
    """Template name -> one line: the config's first comment line after the command."""
    out = {}
    for name in list_templates():
        lines = (_root() / name / "config.yaml").read_text().splitlines()
        text = next((ln.lstrip("# ").strip() for ln in lines[1:] if ln.startswith("# ") and ln.strip("# ")), "")
        out[name] = text
    return out


def write_template(name: str, target: Path, force: bool = False) -> list[Path]:
    """Write template ``name`` into ``target``; the paths written. ``ConfigError`` (exit 2)
    for an unknown name or a non-empty ``target`` without ``force``."""
    names = list_templates()
    if name not in names:
        raise ConfigError(f"init --template: no template {name!r} (expected one of: {', '.join(names)})")
    target = Path(target).expanduser()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"init DIR: {str(target)!r} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise ConfigError(f"init DIR: {str(target)!r} exists and is not empty (pass --force to write the "
                          f"template's files into it anyway)")
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sorted(_root().joinpath(name).iterdir(), key=lambda p: p.name):
        if not src.is_file() or src.name.startswith((".", "__")):
            continue
        text = src.read_text().replace(PLACEHOLDER, str(target))
        dest = target / src.name
        dest.write_text(text)
        written.append(dest)
    return written
