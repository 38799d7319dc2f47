"""From YAML and dotted overrides to a validated ``ConveyorConfig``.

Overrides (``train.lr=1e-5``) are applied to the raw mapping before decoding, so they are
validated exactly like the file; msgspec's errors are rewritten to name the dotted path
and what was expected; the cross-field rules of ``checks`` run last."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import yaml

from pipeline.config.algorithm import DEFAULT_ALGORITHM, AlgorithmFields, algorithm_configs
from pipeline.config.base import ConfigError
from pipeline.config.checks import check_config
from pipeline.config.root import ConveyorConfig

# ---------------------------------------------------------------------------- loading

_PATH_RE = re.compile(r"at `\$(.*?)`")


def _render_error(err: msgspec.ValidationError, raw: dict[str, Any]) -> str:
    """``Expected `int` >= 0 - at `$.dataflow.max_staleness``` ->
    ``dataflow.max_staleness: expected int >= 0, got -1``."""
    text = str(err)
    m = _PATH_RE.search(text)
    path = m.group(1).lstrip(".") if m else ""
    reason = _PATH_RE.sub("", text).rstrip(" -").replace("`", "")
    reason = reason[:1].lower() + reason[1:]
    field = re.match(r"object (contains unknown|missing required) field (\S+)", reason)
    if field:
        kind, name = field.groups()
        path = f"{path}.{name}" if path else name
        return f"{path}: " + ("unknown field (not in the schema)" if kind == "contains unknown" else "required field missing")
    enum = re.match(r"invalid enum value (.*)", reason)
    if enum:
        allowed = _enum_values(path)
        if allowed and allowed[-1] is int:  # a number or a word (``max_staleness``)
            return f"{path}: expected an integer >= 0 or one of {allowed[:-1]}, got {enum.group(1)}"
        if allowed and allowed[-1] is bool:  # true, false or a word (``placement.mps``)
            return f"{path}: expected true, false or one of {allowed[:-1]}, got {enum.group(1)}"
        return f"{path}: expected one of {allowed}, got {enum.group(1)}" if allowed else f"{path}: {reason}"
    if path and ", got" not in reason:
        found, value = _lookup(raw, path)
        if found:
            reason += f", got {value!r}"
    return f"{path}: {reason}" if path else reason


def _enum_values(path: str) -> list[Any] | None:
    """The allowed values of the ``Literal`` field at ``path`` (None if not found)."""
    typ: Any = ConveyorConfig
    for part in re.findall(r"[^.\[\]]+", path):
        if part.isdigit():
            args = typing.get_args(typ)
            typ = args[0] if args else typ
            continue
        if isinstance(typ, types.UnionType):  # the algorithm variants share their Literal fields
            typ = typing.get_args(typ)[0]
        hints = typing.get_type_hints(typ, include_extras=True) if isinstance(typ, type) else {}
        if part not in hints:
            return None
        typ = hints[part]
        while typing.get_origin(typ) is typing.Annotated:
            typ = typing.get_args(typ)[0]
        if typing.get_origin(typ) is list:
            typ = typing.get_args(typ)[0]
    if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
        # ``NonNegInt | Literal["auto"]``: its words, then ``int`` (``bool`` for ``bool |
        # Literal[...]``) to say a number (true or false) is taken too.
        members = typing.get_args(typ)
        words = [a for t in members if typing.get_origin(t) is typing.Literal for a in typing.get_args(t)]
        other = [t for t in members if typing.get_origin(t) is not typing.Literal]
        return ([*words, bool if bool in other else int] if other else words) or None
    return list(typing.get_args(typ)) if typing.get_origin(typ) is typing.Literal else None


def _lookup(raw: Any, path: str) -> tuple[bool, Any]:
    node = raw
    for part in re.findall(r"[^.\[\]]+", path):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def parse_override(item: str) -> tuple[list[str], Any]:
    """``train.lr=1e-5`` -> (["train", "lr"], 1e-5); the value is read as YAML."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY.PATH=VALUE")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML ({exc})") from exc
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with dotted overrides applied (sections created as needed)."""
    out = _deep_copy(raw)
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {where} is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def decode_config(raw: dict[str, Any]) -> ConveyorConfig:
    """Decode and cross-check a raw mapping; raise ``ConfigError`` with the dotted path."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(raw).__name__}")
    raw = _read_switch_words(_expand_placement(raw))
    rest = {k: v for k, v in raw.items() if k != "algorithm"}
    try:
        # strict=False: YAML 1.1 reads ``3e-4`` as a string; numbers in strings convert.
        cfg = msgspec.convert(rest, ConveyorConfig, strict=False)
        if "algorithm" in raw:
            cfg = msgspec.structs.replace(cfg, algorithm=decode_algorithm(raw["algorithm"]))
    except msgspec.ValidationError as exc:
        raise ConfigError(_render_error(exc, raw)) from None
    cfg = _normalise(cfg)
    check_config(cfg)
    return cfg


def decode_algorithm(algo: Any) -> AlgorithmFields:
    """The ``algorithm`` section as its registered struct: without a ``name`` it is GRPO;
    an unknown name is refused with the choices. Raises ``msgspec.ValidationError`` with
    paths under ``$.algorithm``."""
    if not isinstance(algo, dict):
        raise ConfigError(f"algorithm: expected a mapping, got {algo!r}")
    configs = algorithm_configs()
    name = algo.get("name", DEFAULT_ALGORITHM)
    if name not in configs:
        raise ConfigError(f"algorithm.name: expected one of {list(configs)}, got {name!r}")
    section = msgspec.defstruct("AlgorithmSection", [("algorithm", configs[name])], forbid_unknown_fields=True)
    return msgspec.convert({"algorithm": {**algo, "name": name}}, section, strict=False).algorithm


# Fields whose words YAML 1.1 reads as booleans when bare (`off`, `on`): the word back.
_SWITCH_WORDS: dict[tuple[str, str], dict[bool, str]] = {
    ("algorithm", "off_policy"): {False: "off"},
    ("reference", "enabled"): {False: "off", True: "on"},
    ("rollout", "compile"): {False: "off", True: "on"},
    ("train", "compile"): {False: "off", True: "on"},
}


def _read_switch_words(raw: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    for (section, key), words in _SWITCH_WORDS.items():
        block = out.get(section)
        if isinstance(block, dict) and isinstance(block.get(key), bool) and block[key] in words:
            out[section] = {**block, key: words[block[key]]}
    return out


def _expand_placement(raw: dict[str, Any]) -> dict[str, Any]:
    """``placement: auto`` -> ``{}``; ``placement: {rollout: [0, 1]}`` -> ``{rollout: {gpus: [0, 1]}}``."""
    place = raw.get("placement")
    if place is None or (isinstance(place, dict) and not any(isinstance(v, list) for v in place.values())):
        return raw
    if isinstance(place, str):
        if place not in ("auto", "colocate"):
            raise ConfigError(f"placement: expected 'auto', 'colocate' or a mapping of stage -> GPU indices, "
                              f"got {place!r}")
        return {**raw, "placement": {"mode": place}}
    if not isinstance(place, dict):
        raise ConfigError(f"placement: expected 'auto', 'colocate' or a mapping of stage -> GPU indices, "
                          f"got {place!r}")
    return {**raw, "placement": {k: {"gpus": v} if isinstance(v, list) else v for k, v in place.items()}}


def _normalise(cfg: ConveyorConfig) -> ConveyorConfig:
    """Fold shorthands into their canonical place (``rollout.max_memory_ratio``) and fill
    defaults that depend on other sections (``algorithm.loss_norm_tokens``)."""
    if cfg.rollout.max_memory_ratio is not None:
        mem = msgspec.structs.replace(cfg.rollout.memory, max_memory_ratio=cfg.rollout.max_memory_ratio)
        cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, memory=mem))
    if cfg.algorithm.loss_norm_tokens is None:
        algo = msgspec.structs.replace(cfg.algorithm, loss_norm_tokens=cfg.rollout.max_tokens)
        cfg = msgspec.structs.replace(cfg, algorithm=algo)
    if cfg.placement.mode == "colocate" and not cfg.rollout.sleep_mode:
        cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, sleep_mode=True))
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ConveyorConfig:
    """Read a YAML file (or defaults when ``path`` is None), apply overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r}: not found")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(p)!r}: invalid YAML ({exc})") from None
        raw = loaded if loaded is not None else {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
    return decode_config(apply_overrides(raw, overrides or []))
