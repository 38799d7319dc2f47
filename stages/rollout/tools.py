"""Tools a model calls during a multi-turn rollout (``rollout.tools``): the call format,
the built-in calculator and sandboxed Python evaluator, and the guarded call.

The call format: ``[name: arguments]``, complete at its closing ``]`` (its ``[`` may lie
in the prompt); the result is shown as ``RESULT_TEMPLATE``, tokens the loss never sees.

Guarantees:
- ``find_tool_call`` is a pure function of the text: the first complete, well-formed call
  whose ``]`` lies at or after ``start``;
- ``call_tool`` never raises: any failure or a timeout gives ``"error: ..."``, which the
  model sees;
- ``evaluate_arithmetic`` evaluates numbers and arithmetic only, with bounded results
  checked before each ``*`` and ``**``;
- ``PythonSandbox`` bounds runaway code (CPU, memory, processes, output, wall clock; the
  whole process group killed by the time the call returns); it is not a security
  boundary. Limits in detail: docs/architecture.md, "Tools".
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

RESULT_TEMPLATE = " -> {result}\n"
ERROR_PREFIX = "error: "
_CALL_BODY = re.compile(r"^\s*([A-Za-z_]\w*)\s*:(.*)$", re.DOTALL)
_MAX_POWER = 64  # 2 ** 64: big enough for arithmetic prompts, far from a slow bignum
_MAX_BITS = 4096  # an integer result's size: ~1,200 digits, microseconds to compute


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


def _check_size(op: ast.operator, left: Any, right: Any) -> None:
    """Refuse a ``*`` or ``**`` of integers whose result may pass ``_MAX_BITS`` bits,
    before computing it (floats overflow by themselves, at once)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    if isinstance(op, ast.Pow) and right > 0:
        bits, symbol = abs(left).bit_length() * right, "**"  # |x ** n| < 2 ** (bit_length(x) * n)
    elif isinstance(op, ast.Mult):
        bits, symbol = abs(left).bit_length() + abs(right).bit_length(), "*"
    else:
        return
    if bits > _MAX_BITS:
        raise ValueError(f"the result of {symbol} may have up to {bits} bits, beyond {_MAX_BITS}")


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
            _check_size(node.op, left, right)
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
# last bare expression is printed). RLIMIT_NPROC counts every task (thread) of the user,
# so the limit is what the user runs now plus the sandbox's own allowance.
_RUNNER = """
import ast, os, resource, sys
mem, cpu, nproc = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
uid = os.getuid()
for pid in os.listdir("/proc"):
    try:
        if pid.isdigit() and os.stat("/proc/" + pid).st_uid == uid:
            nproc += len(os.listdir("/proc/" + pid + "/task"))
    except OSError:
        pass
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
source = sys.stdin.read()
tree = ast.parse(source)
if tree.body and isinstance(tree.body[-1], ast.Expr):
    tree.body[-1] = ast.Expr(ast.Call(ast.Name("print", ast.Load()), [tree.body[-1].value], []))
    ast.fix_missing_locations(tree)
exec(compile(tree, "<tool>", "exec"), {"__name__": "__tool__"})
"""
_STDERR_TAIL = 4096  # bytes of stderr kept: its last line is the error the model reads
_CHUNK = 65536
_POLL_S = 0.05  # how often the reader checks whether the child has exited


@dataclass(frozen=True)
class PythonSandbox:
    """The ``python`` tool: ``arguments`` run as Python in a limited child process (see
    the module guarantees); the result is its output (cut at ``max_output_chars``), or
    ``error: ...`` with the last line of the error."""

    timeout_s: float = 2.0
    memory_mb: int = 256
    max_output_chars: int = 200
    max_processes: int = 16

    def __call__(self, arguments: str) -> str:
        # The CPU limit is a backstop a second past the wall clock: equal to it, a busy loop
        # could reach it first (its CPU time counts from its start, the deadline from
        # after the start) and end killed by SIGXCPU instead of timed out.
        cpu = math.ceil(self.timeout_s) + 1
        cap = 4 * self.max_output_chars + 64  # bytes of stdout that hold max_output_chars characters
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _RUNNER, str(self.memory_mb << 20), str(cpu), str(self.max_processes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err, ended = self._communicate(proc, arguments.encode(), cap)
        finally:
            _kill_group(proc)
        if ended == "timeout":
            return f"{ERROR_PREFIX}timed out after {self.timeout_s:g} s"
        text = out.decode(errors="replace").strip()[: self.max_output_chars]
        if ended == "output":  # stopped for its output: what it printed is the result
            return text
        if proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            last = lines[-1] if lines else f"exit status {proc.returncode}"
            if proc.returncode < 0:
                last = f"killed by signal {-proc.returncode} (CPU or memory limit)"
            return ERROR_PREFIX + last[: self.max_output_chars]
        return text

    def _communicate(self, proc: subprocess.Popen, data: bytes, cap: int) -> tuple[bytes, bytes, str]:
        """(stdout up to ``cap`` bytes, stderr's tail, how it ended: ``exit``, ``output``
        (past ``cap``) or ``timeout``), reading both pipes in chunks until the deadline."""
        deadline = time.monotonic() + self.timeout_s
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:  # the runner reads all of stdin first; a call's arguments fit the pipe
            proc.stdin.write(data)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        out, err = bytearray(), bytearray()
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, out)
            sel.register(proc.stderr, selectors.EVENT_READ, err)
            exited = False
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return bytes(out), bytes(err), "timeout"
                # A descendant may hold the pipes open after the child exits: once the
                # child is gone, read only what is already there.
                ready = sel.select(0 if exited else min(left, _POLL_S))
                if exited and not ready:
                    break
                for key, _ in ready:
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    key.data.extend(chunk)
                    if key.data is err and len(err) > _STDERR_TAIL:
                        del err[:-_STDERR_TAIL]
                    if key.data is out and len(out) > cap:
                        return bytes(out[:cap]), bytes(err), "output"
                exited = exited or proc.poll() is not None
        try:
            proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            return bytes(out), bytes(err), "timeout"
        return bytes(out), bytes(err), "exit"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (the child and every descendant still in it),
    reap the child and close its pipes."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


Tools = Mapping[str, Callable[[str], str]]


TOOL_THREADS = 8  # the tools' own threads: a call waits for one before its timeout starts
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_stuck = 0  # tool threads held by calls past their timeout


def _tool_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="conveyor-tool")
        return _pool


def _release_stuck(_: Any) -> None:
    global _stuck
    with _pool_lock:
        _stuck -= 1


async def call_tool(tools: Tools, call: ToolCall, timeout_s: float) -> tuple[str, bool]:
    """(result text, ok) of one call, off the event loop; never raises (see the module
    guarantees).

    Tools run on ``TOOL_THREADS`` threads of their own, never the event loop's default
    pool (which the backends' ``generate`` and weight updates use). ``timeout_s`` counts
    from the moment a thread starts the call, not from when it was queued, so calls
    beyond ``TOOL_THREADS`` wait their turn instead of timing out unstarted. Anything a
    tool raises, ``SystemExit`` included, is an error result. A Python tool still running
    at ``timeout_s`` cannot be killed in a thread: the call returns an error and that
    thread stays held until the tool returns (it is lost to the tools' threads, never the
    rollout's); once all ``TOOL_THREADS`` are held so, calls are refused with an error.
    The ``python`` tool (``PythonSandbox``) runs its code in a process it kills at its
    own timeout, so it holds no thread for long."""
    global _stuck
    fn = tools.get(call.name)
    if fn is None:
        return f"{ERROR_PREFIX}unknown tool {call.name!r} (tools: {', '.join(sorted(tools))})", False
    with _pool_lock:
        if _stuck >= TOOL_THREADS:
            return f"{ERROR_PREFIX}{call.name} not run: all {TOOL_THREADS} tool threads are held by calls " \
                   f"past their timeout", False
    loop = asyncio.get_running_loop()
    started = asyncio.Event()

    def run() -> tuple[str, bool]:
        loop.call_soon_threadsafe(started.set)
        try:
            result = fn(call.arguments)
        except BaseException as exc:  # a tool's own failure, SystemExit too, is the model's to read
            return f"{ERROR_PREFIX}{type(exc).__name__}: {exc}", False
        if not isinstance(result, str):
            return f"{ERROR_PREFIX}{call.name} returned {type(result).__name__}, expected str", False
        return result, not result.startswith(ERROR_PREFIX)

    future = _tool_pool().submit(run)
    await started.wait()
    try:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
    except TimeoutError:
        with _pool_lock:
            _stuck += 1
        future.add_done_callback(_release_stuck)
        return f"{ERROR_PREFIX}{call.name} timed out after {timeout_s:g} s", False


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
