"""Hugging Face Hub names for ``model.path``, ``reference.path``, ``data.path`` and
``eval.path``, resolved into the user's Hub cache before Ray starts.

Guarantees of ``resolve_hub_names``:
- A value that is ``tiny``, an existing local path, or not shaped like a Hub id
  (``org/name``) is left as it is. Any other ``org/name`` is fetched with
  ``huggingface_hub.snapshot_download`` into the user's cache (``HF_HOME``/``HF_HUB_CACHE``)
  and replaced by the local path, so every actor reads local files and none touches
  the network. A cached snapshot is reused; with ``HF_HUB_OFFLINE=1`` only the cache
  is read.
- Models: only what a run loads is fetched (``MODEL_FILES``: config, generation
  config, tokenizer files, safetensors weights), at ``model.revision``.
- Datasets (``repo_type="dataset"``, at ``data.revision``; the held-out set likewise with
  ``eval``'s own ``split``, ``config_name`` and ``revision``), without the ``datasets``
  package: the split's files are chosen from the dataset card's ``configs:``
  (``data_files`` of ``data.config_name``, else the default or only config), else from
  the standard layouts (``data/<split>-*``, ``<config>/<split>-*``, ``<split>.jsonl``...);
  ``data.path`` becomes the one file or a glob over the split's shards
  (``stages/data/files.py`` reads either).
- Every failure is a ``ConfigError`` whose message begins with the key at fault
  (``model.path``, ``model.revision``, ``data.path``, ``data.split``...): a repository
  not in the cache while the Hub cannot be reached says so and how to fetch it.
- One progress line per fetched name on stdout (``hub: ...``); huggingface_hub's own
  bars show the download.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Any

import msgspec
import yaml

from pipeline.config import ConfigError, ConveyorConfig

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
               "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.*", "*.tiktoken"]
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
CARD = "README.md"


def is_hub_id(value: str | None) -> bool:
    """``org/name`` that is not a local path (``tiny`` and existing paths are local)."""
    if not value or Path(value).expanduser().exists():
        return False
    return bool(HUB_ID.match(value)) and not value.startswith((".", "~"))


def resolve_hub_names(cfg: ConveyorConfig) -> tuple[ConveyorConfig, list[str]]:
    """The config with every Hub name replaced by its local path, and one note per name."""
    notes: list[str] = []
    model, reference, data = cfg.model, cfg.reference, cfg.data
    if is_hub_id(model.path):
        local = fetch_model(model.path, model.revision, "model")
        notes.append(f"hub: model.path {model.path} -> {local}")
        model = msgspec.structs.replace(model, path=str(local))
    if is_hub_id(reference.path):
        local = fetch_model(reference.path, model.revision, "reference")
        notes.append(f"hub: reference.path {reference.path} -> {local}")
        reference = msgspec.structs.replace(reference, path=str(local))
    if is_hub_id(data.path):
        local = fetch_dataset(data.path, data.split, data.config_name, data.revision)
        notes.append(f"hub: data.path {data.path} ({data.config_name or 'default'}/{data.split}) -> {local}")
        data = msgspec.structs.replace(data, path=local)
    ev = cfg.eval
    if is_hub_id(ev.path):
        local = fetch_dataset(ev.path, ev.split, ev.config_name, ev.revision, section="eval")
        notes.append(f"hub: eval.path {ev.path} ({ev.config_name or 'default'}/{ev.split}) -> {local}")
        ev = msgspec.structs.replace(ev, path=local)
    return msgspec.structs.replace(cfg, model=model, reference=reference, data=data, eval=ev), notes


def fetch_model(repo_id: str, revision: str | None, section: str) -> Path:
    """The local snapshot of a model repository (``MODEL_FILES`` only)."""
    print(f"hub: fetching {section} {repo_id} (revision {revision or 'main'}) into the Hugging Face cache",
          flush=True)
    return Path(_snapshot(repo_id, "model", revision, MODEL_FILES, f"{section}.path", "model.revision"))


def fetch_dataset(repo_id: str, split: str, config_name: str | None, revision: str | None,
                  section: str = "data") -> str:
    """``<section>.path`` (``data`` or ``eval``) for one split of a dataset repository: its
    file, or a glob over its shards."""
    print(f"hub: fetching dataset {repo_id} ({config_name or 'default'}/{split}, revision {revision or 'main'}) "
          f"into the Hugging Face cache", flush=True)
    root = Path(_snapshot(repo_id, "dataset", revision, [CARD, *_layout_patterns(split, config_name)],
                          f"{section}.path", f"{section}.revision"))
    patterns = split_patterns(_read_card(root / CARD), split, config_name, section)
    if patterns is None:
        patterns = _layout_patterns(split, config_name)
    else:  # the card names the files: fetch those (a no-op where the layout matched them)
        _snapshot(repo_id, "dataset", revision, patterns, f"{section}.path", f"{section}.revision")
    files = match_data_files(root, patterns)
    if not files:
        raise ConfigError(f"{section}.split: no data file of split {split!r}"
                          f"{f' (config {config_name!r})' if config_name else ''} in the dataset {repo_id} "
                          f"(looked for {', '.join(patterns)}); see its files on the Hub and set {section}.split "
                          f"or {section}.config_name")
    kinds = {f.suffix for f in files}
    if len(kinds) > 1:
        raise ConfigError(f"{section}.split: split {split!r} of {repo_id} mixes file kinds {sorted(kinds)}")
    if len(files) == 1:
        return str(files[0])
    glob = files[0].parent / f"{_common_prefix([f.name for f in files])}*{files[0].suffix}"
    if sorted(glob.parent.glob(glob.name)) != files:
        raise ConfigError(f"{section}.split: the files of split {split!r} of {repo_id} are not one folder's shards "
                          f"({', '.join(str(f.relative_to(root)) for f in files[:4])}...); point {section}.path "
                          f"at one")
    return str(glob)


def split_patterns(card: dict[str, Any] | None, split: str, config_name: str | None,
                   section: str = "data") -> list[str] | None:
    """The ``data_files`` patterns of ``split`` in the dataset card's ``configs:`` (None:
    the card lists no configs). ``ConfigError`` for an unknown config or split, naming
    ``<section>.config_name`` or ``<section>.split``."""
    configs = (card or {}).get("configs")
    if not isinstance(configs, list) or not configs:
        return None
    by_name = {c.get("config_name", "default"): c for c in configs if isinstance(c, dict)}
    if config_name is None:
        chosen = next((c for c in by_name.values() if c.get("default")), None) or by_name.get("default")
        if chosen is None and len(by_name) == 1:
            chosen = next(iter(by_name.values()))
        if chosen is None:
            raise ConfigError(f"{section}.config_name: the dataset has configs {sorted(by_name)}; choose one")
    elif config_name in by_name:
        chosen = by_name[config_name]
    else:
        raise ConfigError(f"{section}.config_name: expected one of {sorted(by_name)}, got {config_name!r}")
    files = chosen.get("data_files")
    if isinstance(files, str):
        files = [files]
    if isinstance(files, dict):
        splits = files
    elif isinstance(files, list) and all(isinstance(f, str) for f in files):
        splits = {"train": files}  # one list for the whole config: datasets names it the train split
    else:
        splits = {f.get("split"): f.get("path") for f in files or [] if isinstance(f, dict)}
    if split not in splits:
        raise ConfigError(f"{section}.split: expected one of {sorted(map(str, splits))}, got {split!r}")
    path = splits[split]
    return [path] if isinstance(path, str) else list(path)


def match_data_files(root: Path, patterns: list[str]) -> list[Path]:
    """Data files (``DATA_SUFFIXES``) under ``root`` whose repository path matches a pattern."""
    found = []
    for file in sorted(root.rglob("*")):
        rel = file.relative_to(root).as_posix()
        if file.is_file() and file.suffix in DATA_SUFFIXES and any(fnmatch.fnmatch(rel, p) for p in patterns):
            found.append(file)
    return found


def _layout_patterns(split: str, config_name: str | None) -> list[str]:
    """Hugging Face's standard file layouts of a split (with a config: under its folder)."""
    base = [f"data/{split}-*", f"data/{split}.*", f"data/{split}/*", f"{split}-*", f"{split}.*", f"{split}/*"]
    if config_name:
        return [f"{config_name}/{p}" for p in base] + [f"data/{config_name}/{split}-*"]
    return base


def _read_card(path: Path) -> dict[str, Any] | None:
    """The YAML header of a dataset card (None without one)."""
    if not path.is_file():
        return None
    parts = path.read_text(encoding="utf-8", errors="replace").split("---", 2)
    if len(parts) < 3 or parts[0].strip():
        return None
    try:
        header = yaml.safe_load(parts[1])
    except yaml.YAMLError:
        return None
    return header if isinstance(header, dict) else None


def _common_prefix(names: list[str]) -> str:
    prefix = names[0]
    for name in names[1:]:
        while not name.startswith(prefix):
            prefix = prefix[:-1]
    return prefix


def _snapshot(repo_id: str, repo_type: str, revision: str | None, patterns: list[str], key: str,
              revision_key: str) -> str:
    """``snapshot_download`` with its failures turned into ``ConfigError``s naming ``key``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    kind = "dataset" if repo_type == "dataset" else "model"
    try:
        return str(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=patterns))
    except RevisionNotFoundError:
        raise ConfigError(f"{revision_key}: {kind} {repo_id} has no revision {revision!r}") from None
    except GatedRepoError:
        raise ConfigError(f"{key}: {kind} {repo_id} is gated: accept its terms on the Hub and log in "
                          f"(`hf auth login`) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{key}: no {kind} repository {repo_id!r} on the Hugging Face Hub (a private one needs "
                          f"`hf auth login` or HF_TOKEN), and no local path of that name") from None
    except LocalEntryNotFoundError:
        flag = "--repo-type dataset " if kind == "dataset" else ""
        raise ConfigError(f"{key}: {kind} {repo_id!r} (revision {revision or 'main'}) is not in the Hugging Face "
                          f"cache and the Hub cannot be reached (offline: HF_HUB_OFFLINE=1 or no network); fetch "
                          f"it where the Hub is reachable (`hf download {flag}{repo_id}`) or give a local "
                          f"path") from None
    except HFValidationError as exc:
        raise ConfigError(f"{key}: {repo_id!r} is not a valid Hub repository id ({exc})") from None
    except OSError as exc:  # incomplete snapshot, disk full...
        raise ConfigError(f"{key}: fetching {kind} {repo_id} failed ({type(exc).__name__}: {exc})") from None
