"""The tool_rl template's reward: it reads the whole trajectory, tool results included.

A trajectory looks like ``3*4] -> 12\n12`` after the prompt ``3*4 [calc: ``: the model
closed the call the prompt opened, the tool answered on the line after ``->``, and the
model wrote its final answer. Credit, at most 1:
- 0.2 for a call the tool answered without an error and with some output (a
  well-formed call; an empty Python call prints nothing and earns nothing);
- 0.2 when the final answer is what the tool answered (the model used the result);
- 0.6 when the final answer is the right one.
The final answer is the number at the start of the text after the last tool result (or
of the whole completion, without a call). Edit freely; it must never raise on any
completion string (verl's signature).
"""

import re

RESULT = re.compile(r" -> (.*)\n")
NUMBER = re.compile(r"\s*(-?\d+)")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    results = RESULT.findall(solution_str)
    ok = [r.strip() for r in results if r.strip() and not r.startswith("error:")]
    match = NUMBER.match(solution_str.rsplit("\n", 1)[-1] if results else solution_str)
    answer = match.group(1) if match else None
    used = bool(ok) and answer == ok[-1]
    right = answer == str(ground_truth)
    return {"score": 0.2 * bool(ok) + 0.2 * used + 0.6 * right, "answer_correct": float(right),
            "answer_from_tool": float(used), "tool_correct": float(str(ground_truth) in ok)}
