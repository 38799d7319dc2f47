"""Render the configuration reference (``docs/configuration.md``) from the config structs.

``python -m pipeline.config_doc > docs/configuration.md`` regenerates it; a unit test
(``tests/unit/test_config_doc.py``) keeps the committed file equal to ``render()``.
Each section is one msgspec Struct of ``pipeline.config``: its docstring, then one row
per key with its type (bounds included), default and the comment written beside it.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from typing import Annotated, Any, Literal

import msgspec

from pipeline import config as config_module
from pipeline.config import ConveyorConfig

HEADER = """# Configuration reference

Generated from the config structs of `pipeline/config/` by
`python -m pipeline.config_doc > docs/configuration.md`; do not edit by hand. One YAML
file, every key typed and bounded; dotted overrides on the command line
(`train.lr=1e-5`); a bad value stops the launch with its path and exit status 2.
"""

_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "length >="))


def _struct_types(path: str, tp: Any) -> list[tuple[str, type]]:
    """The (path, Struct class) pairs a field's type holds: ``X | None`` and unions at
    ``path``, a dict's values at ``path.<name>``, a list's items at ``path[]``."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return [(path, tp)]
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is dict:
        return _struct_types(f"{path}.<name>", args[1])
    if origin is list:
        return _struct_types(f"{path}[]", args[0])
    return [pair for arg in args for pair in _struct_types(path, arg)]


def type_name(tp: Any) -> str:
    """``Annotated[int, Meta(ge=1)]`` -> ``int >= 1``; ``Literal['a', 'b']`` -> ``"a" | "b"``."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *metas = typing.get_args(tp)
        bounds = [f"{sym} {getattr(m, key)}" for m in metas for key, sym in _BOUNDS
                  if getattr(m, key, None) is not None]
        return " ".join([type_name(base), *bounds])
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def field_comments(cls: type) -> dict[str, str]:
    """The comment lines above each field of ``cls`` and the comment at its line's end."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        text = line.strip()
        if text.startswith("#"):
            pending.append(text.lstrip("# "))
            continue
        match = re.match(r"(\w+)\s*:[^#]*?(?:#\s*(.*))?$", text)
        if match and not text.startswith(("def ", "@", "return")):
            comments[match.group(1)] = " ".join([*pending, match.group(2) or ""]).strip()
        pending = []
    return comments


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return "(required)"
    value = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    if isinstance(value, msgspec.Struct):
        return "(section)"
    return f"`{msgspec.json.encode(value).decode()}`"


def _md(text: str) -> str:
    """Docstring markup (reST's double backticks) as Markdown on one line."""
    return re.sub(r"\s*\n\s*", " ", text.replace("``", "`"))


def _cell(text: str) -> str:
    return _md(text).replace("|", "\\|")


def _section(path: str, cls: type, skip: frozenset[str] = frozenset()) -> tuple[list[str], list[tuple[str, type]]]:
    """The Markdown of one section and the (path, Struct) pairs nested in it."""
    lines = [f"## `{path}`", ""]
    doc = inspect.getdoc(cls) if cls.__doc__ else ""
    if doc:
        lines += [line for para in doc.split("\n\n") for line in (_md(para), "")]
    hints = typing.get_type_hints(cls, include_extras=True)
    comments = {**field_comments(cls)}
    for base in cls.__mro__[1:]:
        if issubclass(base, msgspec.Struct) and base is not msgspec.Struct:
            comments = {**field_comments(base), **comments}
    rows, nested = [], []
    for field in msgspec.structs.fields(cls):
        if field.name in skip:
            continue
        tp = hints[field.name]
        rows.append(f"| `{field.name}` | {_cell(type_name(tp))} | {_cell(_default(field))} | "
                    f"{_cell(comments.get(field.name, ''))} |")
        nested += _struct_types(f"{path}.{field.name}", tp)
    if rows:
        lines += ["| key | type | default | notes |", "|---|---|---|---|", *rows, ""]
    return lines, nested


def render() -> str:
    """The whole reference, sections in the order of ``ConveyorConfig``'s fields."""
    out = [HEADER]
    hints = typing.get_type_hints(ConveyorConfig, include_extras=True)
    shared = config_module.AlgorithmFields
    hints["algorithm"] = typing.Union[tuple(config_module.algorithm_configs().values())]  # noqa: UP007
    todo = [pair for f in msgspec.structs.fields(ConveyorConfig) for pair in _struct_types(f.name, hints[f.name])]
    shared_names = frozenset(f.name for f in msgspec.structs.fields(shared))
    seen: dict[type, str] = {}
    while todo:
        path, cls = todo.pop(0)
        if issubclass(cls, shared) and cls is not shared:
            if shared not in seen:
                seen[shared] = "algorithm"
                lines, _ = _section("algorithm", shared)
                out += lines
            tag = cls.__struct_config__.tag
            own = frozenset(f.name for f in msgspec.structs.fields(cls)
                            if f.name not in shared_names or _overrides(cls, shared, f.name))
            lines, nested = _section(f"algorithm (name: {tag})", cls, frozenset(shared_names - own))
        else:
            if cls in seen:
                out += [f"## `{path}`", "", f"The keys of `{seen[cls]}`.", ""]
                continue
            seen[cls] = path
            lines, nested = _section(path, cls)
        out += lines
        todo[0:0] = nested
    return "\n".join(out).rstrip() + "\n"


def _overrides(cls: type, base: type, name: str) -> bool:
    """Whether ``cls`` gives field ``name`` another default or type than ``base``."""
    mine = {f.name: f for f in msgspec.structs.fields(cls)}[name]
    theirs = {f.name: f for f in msgspec.structs.fields(base)}[name]
    return (mine.default, mine.type) != (theirs.default, theirs.type)


if __name__ == "__main__":
    print(render(), end="")
