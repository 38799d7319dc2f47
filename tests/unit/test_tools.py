"""Tools of multi-turn rollouts (stages/rollout/tools.py): the call parser, the calculator, the
guarded call (errors, timeouts) and the Python sandbox's limits."""

from __future__ import annotations

import asyncio
import os
import time

import psutil
import pytest

from stages.rollout.tools import (
    TOOL_THREADS,
    PythonSandbox,
    ToolCall,
    calculator,
    call_tool,
    evaluate_arithmetic,
    find_tool_call,
    load_tools,
)


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


def test_calculator_refuses_a_result_too_large_before_computing_it():
    # 9**64 has 203 bits; its 64th power may reach 203 * 64 = 12992 bits > 4096: refused
    # before the power is computed (the whole nest would take minutes of big-int work).
    assert _call({"calc": calculator}, name="calc", arguments="(((9**64)**64)**64)**64") == (
        "error: ValueError: the result of ** may have up to 12992 bits, beyond 4096", False)
    # 2**63 has 64 bits; 64 factors make 2**4032 (4033 bits), and one more may make
    # 4033 + 64 = 4097 bits: refused.
    big = "*".join(["(2**63)"] * 70)
    assert _call({"calc": calculator}, name="calc", arguments=big) == (
        "error: ValueError: the result of * may have up to 4097 bits, beyond 4096", False)
    assert evaluate_arithmetic("(2**63) * (2**63)") == str(2**126)  # within the bound


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

    def leave(_):
        raise SystemExit(3)

    assert _call({"t": leave}) == ("error: SystemExit: 3", False)


def test_call_tool_times_a_call_from_its_start_not_its_queueing():
    # 12 waves of calls on TOOL_THREADS threads, 0.25 s each: the last wave starts ~2.75 s
    # after it was queued, far past the 1 s timeout, yet runs well within it.
    def nap(a):
        time.sleep(0.25)
        return a

    async def many():
        n = 12 * TOOL_THREADS
        return await asyncio.gather(*(call_tool({"t": nap}, ToolCall("t", str(i), 0), 1.0) for i in range(n)))

    assert asyncio.run(many()) == [(str(i), True) for i in range(12 * TOOL_THREADS)]


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


def _dead(pid: int) -> bool:
    """Whether ``pid`` is dead (a zombie is: an orphan's reaper is not ours), polled for up
    to 30 s because a SIGKILL lands asynchronously; a process never killed reads False."""
    for _ in range(3000):
        try:
            if psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.01)
    return False


def _live_members(pgid: int) -> list[int]:
    members = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return members


def test_sandbox_kills_its_whole_process_group():
    # The sandboxed code forks a child that would sleep 10 minutes, prints the child's
    # pid and its own process group, and exits: the child must not outlive the call.
    code = "import os, time\nif (pid := os.fork()) == 0:\n    time.sleep(600)\nelse:\n    print(pid, os.getpgrp())"
    child, group = map(int, PythonSandbox(timeout_s=60.0)(code).split())
    assert group != os.getpgrp()  # a group of its own, so killing it spares this one
    assert _dead(child)
    assert _live_members(group) == []


def test_sandbox_cuts_a_flood_of_output_while_reading_it():
    # 100 kB a line forever: stopped once past its output cap, not read whole.
    out = PythonSandbox(timeout_s=60.0, max_output_chars=200)('while True: print("x" * 100000)')
    assert out == "x" * 200


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
