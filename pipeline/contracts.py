"""What a node takes and gives, and the checks that a graph's edges fit.

A node class (a stage core) declares, as class attributes, any of:
- ``takes``: the wire type, or a tuple of wire types, it accepts on its input edge;
- ``gives``: the wire type it puts on its output edges;
- ``takes_fields``: optional fields (default ``None``) of its input that must be set,
  e.g. ``("rewards",)`` for a learner;
- ``gives_fields``: the optional fields it sets on what it gives, e.g. ``("ref_logprobs",)``.

Guarantees:
- ``check_edge_contracts`` runs in ``DataFlow.validate``, before any actor starts. It
  refuses, with a ``GraphError`` naming the node or the edge and the mismatch: a
  declaration that is not a wire type or names a field the type lacks; an edge whose
  producer gives a type its consumer does not take; a consumer that needs a field which
  no node upstream sets (judged only when every node upstream declares ``gives``: an
  undeclared node may set anything). What a side does not declare is not checked.
- ``describe_micro_batch`` lists a micro-batch's wire type and, per field, an array's
  shape and dtype, a list's length and element type, or a scalar's value.
  ``check_micro_batch`` lists every way one micro-batch fails its consumer's declaration
  (type, required fields, one row per sample); empty when it fits. Debug runs
  (``df.run(debug=True)``, ``run.debug: true``) print the first micro-batch of every edge
  with both, and stop the run on a mismatch (``WireMismatch``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np


class WireMismatch(TypeError):
    """A micro-batch on an edge does not fit what its consumer declares."""


@dataclass(frozen=True)
class Contract:
    """One node's declaration (``None``: not declared)."""

    takes: tuple[type, ...] | None = None
    gives: type | None = None
    takes_fields: tuple[str, ...] = ()
    gives_fields: tuple[str, ...] = ()


def _names(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)


def _optional_fields(wire_type: type) -> set[str]:
    return {f.name for f in msgspec.structs.fields(wire_type) if f.default is None}


def read_contract(node_class: Any, node: str) -> Contract:
    """The declaration of ``node_class`` (any class; undeclared attributes stay ``None``),
    checked for form: wire types (msgspec Structs) and fields they have."""
    takes = getattr(node_class, "takes", None)
    gives = getattr(node_class, "gives", None)
    takes_t = (takes,) if isinstance(takes, type) else takes
    if takes_t is not None and (not isinstance(takes_t, tuple) or not takes_t
                                or not all(isinstance(t, type) and issubclass(t, msgspec.Struct) for t in takes_t)):
        raise ValueError(f"node {node!r}: takes: expected a wire type or a tuple of wire types, got {takes!r}")
    if gives is not None and not (isinstance(gives, type) and issubclass(gives, msgspec.Struct)):
        raise ValueError(f"node {node!r}: gives: expected a wire type, got {gives!r}")
    contract = Contract(takes_t, gives, tuple(getattr(node_class, "takes_fields", ())),
                        tuple(getattr(node_class, "gives_fields", ())))
    for attr, types in (("takes_fields", contract.takes), ("gives_fields", (gives,) if gives else None)):
        fields = getattr(contract, attr)
        if fields and types is None:
            raise ValueError(f"node {node!r}: {attr} needs {'takes' if attr == 'takes_fields' else 'gives'} declared")
        for t in types or ():
            unknown = [f for f in fields if f not in _optional_fields(t)]
            if unknown:
                raise ValueError(f"node {node!r}: {attr} {unknown} are not optional fields of {t.__name__} "
                                 f"(its optional fields: {sorted(_optional_fields(t))})")
    return contract


def check_edge_contracts(contracts: Mapping[str, Contract], input_from: Mapping[str, str | None]) -> list[str]:
    """Every mismatch of the graph's edges (see the module guarantees); empty when they fit."""
    problems = []
    for consumer, producer in input_from.items():
        if producer is None:
            continue
        edge, want, have = f"{producer}->{consumer}", contracts[consumer], contracts[producer]
        if want.takes is not None and have.gives is not None and not issubclass(have.gives, want.takes):
            problems.append(f"edge {edge!r}: {producer} gives {have.gives.__name__}, "
                            f"{consumer} takes {_names(want.takes)}")
            continue
        if not want.takes_fields:
            continue
        upstream, node = [], producer
        while node is not None:
            upstream.append(contracts[node])
            node = input_from[node]
        if any(c.gives is None for c in upstream):
            continue  # an undeclared node upstream may set anything: the debug run checks it
        set_upstream = {f for c in upstream for f in c.gives_fields}
        missing = [f for f in want.takes_fields if f not in set_upstream]
        if missing:
            problems.append(f"edge {edge!r}: {consumer} needs {missing} set, and no node upstream "
                            f"({', '.join(_chain(producer, input_from))}) declares it in gives_fields")
    return problems


def _chain(node: str | None, input_from: Mapping[str, str | None]) -> list[str]:
    out = []
    while node is not None:
        out.append(node)
        node = input_from[node]
    return out


# -------------------------------------------------------------- one micro-batch

def _describe_value(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array {list(value.shape)} {value.dtype}"
    if isinstance(value, list | tuple):
        kind = type(value[0]).__name__ if value else "-"
        return f"{type(value).__name__}[{kind}] x{len(value)}"
    if isinstance(value, dict):
        keys = sorted(map(str, value))
        return f"dict keys {keys[:6]}{' ...' if len(keys) > 6 else ''}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_micro_batch(item: Any) -> list[str]:
    """One line for the type, then one per field (see the module guarantees)."""
    if not isinstance(item, msgspec.Struct):
        return [f"{type(item).__name__} (not a wire type)"]
    lines = [type(item).__name__]
    for f in msgspec.structs.fields(item):
        lines.append(f"  {f.name:<20} {_describe_value(getattr(item, f.name))}")
    return lines


def check_micro_batch(item: Any, contract: Contract, consumer: str,
                      check_rows: Callable[[Any], None] | None = None) -> list[str]:
    """The mismatches between ``item`` and ``consumer``'s ``contract``. ``check_rows``
    raises ``ValueError`` when the item's per-sample fields disagree on the row count."""
    if contract.takes is not None and not isinstance(item, contract.takes):
        return [f"{consumer} takes {_names(contract.takes)}, got {type(item).__name__}"]
    problems = [f"{consumer} needs {name} set, got None" for name in contract.takes_fields
                if getattr(item, name, None) is None]
    if check_rows is not None:
        try:
            check_rows(item)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def inspect_first_micro_batch(edge: str, item: Any, contract: Contract, consumer: str) -> str:
    """The debug print of the first micro-batch on ``edge``; raises ``WireMismatch``
    naming the edge and every mismatch (the print follows, to see what did arrive)."""
    from pipeline.memory.splitting import check_rollout_batch
    from pipeline.types import RolloutBatch

    lines = describe_micro_batch(item)
    text = "\n".join([f"[debug] first micro-batch on edge {edge!r}: {lines[0]}", *lines[1:]])
    problems = check_micro_batch(item, contract, consumer, check_rollout_batch if isinstance(item, RolloutBatch) else None)
    if problems:
        raise WireMismatch(f"edge {edge!r}: " + "; ".join(problems) + "\n" + text)
    return text
