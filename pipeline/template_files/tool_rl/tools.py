"""The tool_rl template's tools: name -> function(arguments: str) -> str.

The model calls one by writing ``[name: arguments]`` and reads `` -> result`` on the next
line. Add your own: any function of one string that returns a string. A tool that
raises or runs past rollout.tools.timeout_s is not fatal: the model reads
``error: ...`` instead, and the step metrics count it (tool/<name>/errors).
"""

from stages.rollout.tools import PythonSandbox, calculator

TOOLS = {
    "calc": calculator,  # arithmetic only: numbers, + - * / // % ** and parentheses
    # Python in a child interpreter: 2 s of wall and CPU time, 256 MiB of address space;
    # the value of a last bare expression is printed, as in a REPL.
    "python": PythonSandbox(timeout_s=2.0, memory_mb=256),
}
