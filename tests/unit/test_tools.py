"""Tools of multi-turn rollouts (stages/tools.py): the call parser, the calculator, the
guarded call (errors, timeouts) and the Python sandbox's limits."""

from __future__ import annotations

import asyncio
import time

import pytest

from stages.tools import PythonSandbox, ToolCall, call_tool, evaluate_arithmetic, find_tool_call, load_tools


@pytest.mark.parametrize(("text", "start", "call"), [
    ("12+7 [calc: 12+7] -> 19", 0, ToolCall("calc", "12+7", 17)),
    ("12+7 [calc: ", 0, None),  # not closed yet
    ("12+7 [calc: 12+7]", 12, ToolCall("calc", "12+7", 17)),  # opened in the prompt, closed after start
    ("[calc: 1] then 2]", 10, None),  # a "]" after a closed call closes nothing
    ("[x] [py:print(1)]", 0, ToolCall("py", "print(1)", 17)),  # "[x]" is no call: no "name:"
    ("[calc: 1]", 9, None),  # the call ended before start
    ("[9a: 1] [b_2 :  (3) ]", 0, ToolCall("b_2", "(3)", 21)),
])
def test_find_tool_call(text, start, call):
    assert find_tool_call(text, start) == call


def test_calculator_evaluates_arithmetic_only():
    assert [evaluate_arithmetic(e) for e in ("12+7", "7/2", "8/2", "-(2**10) % 7", "46*6", "7//2")] == [
        "19", "3.5", "4", "5", "276", "3"]  # -(1024) % 7 = 5 (Python's modulo follows the divisor)
    for bad in ("__import__('os')", "x + 1", "2 ** 100", "", "1 +", "[1]"):
        with pytest.raises(ValueError):
            evaluate_arithmetic(bad)


def _call(tools, name="t", arguments="a", timeout_s=5.0):
    return asyncio.run(call_tool(tools, ToolCall(name, arguments, 0), timeout_s))


def test_call_tool_never_raises():
    def boom(_):
        raise KeyError("k")

    def slow(_):
        time.sleep(0.5)
        return "late"

    assert _call({"t": str.upper}) == ("A", True)
    assert _call({"t": boom}) == ("error: KeyError: 'k'", False)
    assert _call({"t": lambda a: 3}) == ("error: t returned int, expected str", False)
    assert _call({"t": slow}, timeout_s=0.05) == ("error: t timed out after 0.05 s", False)
    assert _call({"t": str.upper}, name="u") == ("error: unknown tool 'u' (tools: t)", False)
    assert _call({"t": lambda a: "error: bad input"}) == ("error: bad input", False)  # a tool's own error


# Generous time limits where the code ends by itself: a child interpreter's start-up on a
# loaded machine must never read as a timeout.
def test_sandbox_runs_code_and_prints_the_last_expression():
    box = PythonSandbox(timeout_s=60.0, memory_mb=256)
    assert box("6*7") == "42"
    assert box("x = 3\nprint(x)\nx + 1") == "3\n4"
    assert box("1/0") == "error: ZeroDivisionError: division by zero"
    assert box("import sys; sys.exit(3)") == "error: exit status 3"
    assert PythonSandbox(timeout_s=60.0, max_output_chars=5)("'a' * 50") == "aaaaa"


def test_sandbox_stops_a_loop_and_a_memory_bomb_with_errors():
    assert PythonSandbox(timeout_s=1.0)("while True: pass") == "error: timed out after 1 s"
    box = PythonSandbox(timeout_s=60.0, memory_mb=128)
    # 8 GB asked for under a 128 MiB address space: the allocation fails in the child.
    assert box("x = bytearray(8 * 10**9)") == "error: MemoryError"
    assert box("x = [0] * 10**9") == "error: MemoryError"
    assert box("6*7") == "42"  # the sandbox is reusable after either


def test_load_tools(tmp_path):
    assert sorted(load_tools("builtin")) == ["calc", "python"]
    good = tmp_path / "tools.py"
    good.write_text("TOOLS = {'echo': lambda a: a}\nNOT = 3\nBAD = {'no way': print}\n")
    assert load_tools(f"{good}:TOOLS")["echo"]("hi") == "hi"
    with pytest.raises(ValueError, match=r"^rollout\.tools\.functions: .* is int, expected a non-empty dict"):
        load_tools(f"{good}:NOT")
    with pytest.raises(ValueError, match=r"^rollout\.tools\.functions: entry 'no way'"):
        load_tools(f"{good}:BAD")
    with pytest.raises(ValueError, match=r"^rollout\.tools\.functions: "):
        load_tools("no_such_module_xyz:TOOLS")
    with pytest.raises(ValueError, match=r"^rollout\.tools\.functions: "):
        load_tools(f"{tmp_path}/missing.py:TOOLS")
