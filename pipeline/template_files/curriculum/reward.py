"""The curriculum template's reward: credit for each leading digit copied from the prompt.

Edit freely: any function with this signature works (verl's); return a float, or a dict
with "score" and extra metrics. It must never raise on any completion string.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Level k asks for the prompt's first k digits; each right position earns 1/k, so a
    # model that has learned level k - 1 starts level k with a signal to climb from.
    target = str(ground_truth)
    answer = solution_str[: len(target)]
    return sum(a == b for a, b in zip(answer, target, strict=False)) / max(len(target), 1)
