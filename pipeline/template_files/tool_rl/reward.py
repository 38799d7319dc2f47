"""The tool_rl template's reward: it reads the whole trajectory, tool results included.

A trajectory looks like ``34-27] -> 7\n7`` after the prompt ``34-27 [calc: ``: the model
closed the call the prompt opened, the tool answered on the line after ``->``, and the
model wrote its final answer. Credit, at most 1:
- 0.2 for a call the tool answered without an error and with some output (a
  well-formed call; an empty Python call prints nothing and earns nothing);
- 0.3 when a tool's answer is the right one (the model asked the right question);
- 0.5 when the final answer (the text after the last tool result, or the whole
  completion without one) starts with the right number.
Edit freely; it must never raise on any completion string (verl's signature).
"""

import re

RESULT = re.compile(r" -> (.*)\n")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    target = str(ground_truth)
    results = RESULT.findall(solution_str)
    ok = [r.strip() for r in results if r.strip() and not r.startswith("error:")]
    final = solution_str.rsplit("\n", 1)[-1] if results else solution_str
    answer = re.match(r"\s*(-?\d+)", final)
    score = 0.2 * bool(ok) + 0.3 * (target in ok) + 0.5 * bool(answer and answer.group(1) == target)
    return {"score": score, "answer_correct": float(bool(answer and answer.group(1) == target)),
            "tool_correct": float(target in ok)}
