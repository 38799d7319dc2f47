"""Tools a model calls during a multi-turn rollout (``rollout.tools``): the call format,
the built-in calculator and sandboxed Python evaluator, and the guarded call.

The call format: ``[name: arguments]``. A call is complete at its closing ``]``; its
opening ``[`` may lie in the prompt (a prompt can open the call for the model) or earlier
in the completion. The result is shown to the model as ``RESULT_TEMPLATE``
(`` -> 42`` and a newline), tokens the loss never sees.

Guarantees:
- ``find_tool_call`` is a pure function of the text: the first complete, well-formed call
  whose ``]`` lies at or after ``start`` (text between brackets that is not
  ``name: arguments`` is not a call);
- ``call_tool`` never raises: an unknown tool, a tool that raises, returns a non-string
  or runs past ``timeout_s`` gives ``"error: ..."`` as its result, which the model sees;
- ``evaluate_arithmetic`` evaluates numbers, + - * / // % ** and parentheses only (no
  names, no calls), with bounded exponents;
- ``PythonSandbox`` runs code in a separate interpreter (``python -I``) with an address
  space limit (``memory_mb``), a CPU time limit and a wall-clock limit (the process is
  killed at ``timeout_s``), files that cannot grow (``RLIMIT_FSIZE`` 0) and output cut at
  ``max_output_chars``. It bounds runaway code (a loop, a memory bomb); it is not a
  security boundary against hostile code (no network or filesystem isolation).
"""

from __future__ import annotations

import ast
import asyncio
import operator
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

RESULT_TEMPLATE = " -> {result}\n"
ERROR_PREFIX = "error: "
_CALL_BODY = re.compile(r"^\s*([A-Za-z_]\w*)\s*:(.*)$", re.DOTALL)
_MAX_POWER = 64  # 2 ** 64: big enough for arithmetic prompts, far from a slow bignum


@dataclass(frozen=True)
class ToolCall:
    """A complete call: ``name``, ``arguments`` (stripped) and ``end``, the position just
    past its ``]`` in the text it was found in."""

    name: str
    arguments: str
    end: int


def find_tool_call(text: str, start: int = 0) -> ToolCall | None:
    """The first well-formed call in ``text`` whose ``]`` is at or after ``start``."""
    pos = text.find("]", start)
    while pos != -1:
        opening = text.rfind("[", 0, pos)
        if opening != -1 and "]" not in text[opening + 1:pos]:
            match = _CALL_BODY.match(text[opening + 1:pos])
            if match:
                return ToolCall(match.group(1), match.group(2).strip(), pos + 1)
        pos = text.find("]", pos + 1)
    return None


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_arithmetic(expression: str) -> str:
    """The value of an arithmetic expression as text (integers stay integers); raises
    ``ValueError`` for anything else."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
                raise ValueError(f"exponent {right} is beyond {_MAX_POWER}")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None
    value = ev(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def calculator(arguments: str) -> str:
    """The ``calc`` tool: ``evaluate_arithmetic``."""
    return evaluate_arithmetic(arguments)


# Run in the child: limits first, then the code from stdin, REPL-style (the value of a
# last bare expression is printed).
_RUNNER = """
import ast, resource, sys
mem, cpu = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
source = sys.stdin.read()
tree = ast.parse(source)
if tree.body and isinstance(tree.body[-1], ast.Expr):
    tree.body[-1] = ast.Expr(ast.Call(ast.Name("print", ast.Load()), [tree.body[-1].value], []))
    ast.fix_missing_locations(tree)
exec(compile(tree, "<tool>", "exec"), {"__name__": "__tool__"})
"""


@dataclass(frozen=True)
class PythonSandbox:
    """The ``python`` tool: ``arguments`` run as Python in a limited child process (see
    the module guarantees); the result is its output, or ``error: ...`` with the last
    line of the error."""

    timeout_s: float = 2.0
    memory_mb: int = 256
    max_output_chars: int = 200

    def __call__(self, arguments: str) -> str:
        cpu = max(1, int(self.timeout_s + 0.999))
        try:
            done = subprocess.run([sys.executable, "-I", "-c", _RUNNER, str(self.memory_mb << 20), str(cpu)],
                                  input=arguments, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:  # subprocess.run has killed the child
            return f"{ERROR_PREFIX}timed out after {self.timeout_s:g} s"
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            last = lines[-1] if lines else f"exit status {done.returncode}"
            if done.returncode < 0:
                last = f"killed by signal {-done.returncode} (CPU or memory limit)"
            return ERROR_PREFIX + last[: self.max_output_chars]
        return done.stdout.strip()[: self.max_output_chars]


Tools = Mapping[str, Callable[[str], str]]


async def call_tool(tools: Tools, call: ToolCall, timeout_s: float) -> tuple[str, bool]:
    """(result text, ok) of one call, off the event loop; never raises (see the module
    guarantees). A tool still running at ``timeout_s`` is abandoned (its thread is left
    to finish; the sandbox stops its own child)."""
    fn = tools.get(call.name)
    if fn is None:
        return f"{ERROR_PREFIX}unknown tool {call.name!r} (tools: {', '.join(sorted(tools))})", False
    try:
        result = await asyncio.wait_for(asyncio.to_thread(fn, call.arguments), timeout_s)
    except TimeoutError:
        return f"{ERROR_PREFIX}{call.name} timed out after {timeout_s:g} s", False
    except Exception as exc:  # a tool's own failure is the model's to read, not the stage's
        return f"{ERROR_PREFIX}{type(exc).__name__}: {exc}", False
    if not isinstance(result, str):
        return f"{ERROR_PREFIX}{call.name} returned {type(result).__name__}, expected str", False
    return result, not result.startswith(ERROR_PREFIX)


BUILTIN_TOOLS: dict[str, Callable[[str], str]] = {"calc": calculator, "python": PythonSandbox()}


def load_tools(spec: str) -> dict[str, Callable[[str], str]]:
    """``rollout.tools.functions``: ``builtin`` (calc, python), ``path/to/file.py:NAME``
    or ``module:NAME``, naming a dict of tool name -> callable(str) -> str. ``ValueError``
    naming the field for anything else."""
    from pipeline.plugins import import_object, load_file_object

    what = "rollout.tools.functions"
    if spec == "builtin":
        return dict(BUILTIN_TOOLS)
    file, _, name = spec.rpartition(":")
    try:
        tools = load_file_object(file, name, what) if file.endswith(".py") else import_object(spec, what)
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(tools, Mapping) or not tools:
        raise ValueError(f"{what}: {spec!r} is {type(tools).__name__}, expected a non-empty dict of tool name -> "
                         f"callable(str) -> str")
    for key, fn in tools.items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_]\w*", key) or not callable(fn):
            raise ValueError(f"{what}: entry {key!r} of {spec!r}: expected a name (letters, digits, _) and a "
                             f"callable(str) -> str")
    return dict(tools)
