"""Multi-turn rollouts with tools (stages/rollout/multi_turn.py) over a scripted fake
backend and the real char tokenizer: the trajectory, its loss mask, its version labels
across turns, the tool errors the model reads, the budget, and the batch they make."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from pipeline.config import ToolsConfig
from pipeline.types import Prompt, PromptBatch
from stages.algorithms import assign_advantages
from stages.algorithms.grpo import GrpoConfig
from stages.models.tiny import build_char_tokenizer
from stages.rollout.base import GenerationResult, SamplingSettings
from stages.rollout.multi_turn import Trajectory, cut_at_call, generate_with_tools
from stages.rollout.stage import build_rollout_batch
from stages.rollout.tools import PythonSandbox, calculator, find_tool_call
from tests.ray_local.fakes import FakeScriptedBackend

TOK = build_char_tokenizer("llama")
PROMPT = "3+4 [calc: "


def _run(script, n=2, max_tokens=20, max_turns=2, bump=1, tools=None, prompt=PROMPT, max_result_tokens=12):
    backend = FakeScriptedBackend(TOK, script, bump=bump)
    ids = TOK(prompt, add_special_tokens=True)["input_ids"]
    # Generous time limits: a child interpreter's start-up on a loaded machine is no timeout.
    cfg = ToolsConfig(max_turns=max_turns, timeout_s=60.0, max_result_tokens=max_result_tokens)
    sampling = SamplingSettings(n=n, temperature=1.0, max_tokens=max_tokens)
    tools = tools or {"calc": calculator, "python": PythonSandbox(timeout_s=60.0)}
    results = asyncio.run(generate_with_tools(backend, TOK, [ids], [prompt], sampling, tools, cfg))
    return backend, ids, results[0].completions


def _answer(context, j):
    # Turn 1: sample 0 closes the call the prompt opened (and would go on), sample 1 never
    # calls; turn 2 (after a tool result line): the final answer.
    if context.endswith("\n"):
        return "7"
    return "3+4]xyz" if j == 0 else "no call"


def test_a_call_is_cut_run_appended_masked_and_continued():
    backend, _, (called, plain) = _run(_answer)
    assert called.text == "3+4] -> 7\n7"
    assert backend.calls[1] == [PROMPT + "3+4] -> 7\n"]  # turn 2 reads prompt + everything so far
    # Mask: the model's 4 + 1 tokens; the tool's " -> 7\n" (6 chars) is not the model's.
    assert called.loss_mask == [True] * 4 + [False] * 6 + [True]
    # Versions: turn 1 on v0, turn 2 on v1 (an update landed between the turns); the tool
    # tokens carry the version of the model token before them.
    assert called.token_versions == [0] * 10 + [1]
    assert called.logprobs == [-0.5] * 4 + [0.0] * 6 + [-0.5]
    assert called.finish_reason == "stop"
    assert called.extras == {"tool/used": 1.0, "tool/calls": 1.0, "tool/errors": 0.0, "tool/turns": 2.0,
                             "tool/calc/calls": 1.0, "tool/calc/errors": 0.0, "tool/python/calls": 0.0,
                             "tool/python/errors": 0.0, "turn/1/tokens": 4.0, "turn/2/tokens": 1.0}
    assert plain.text == "no call" and plain.loss_mask == [True] * 7 and plain.extras["tool/used"] == 0.0
    assert "turn/2/tokens" not in plain.extras


class _CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.decodes = tok, 0

    def decode(self, ids, **kwargs):
        self.decodes += 1
        return self.tok.decode(ids, **kwargs)


@pytest.mark.parametrize("turn", ["]", "3+4]", "3+4] and more text after the call, " * 8, "no call at all " * 8])
def test_cut_at_call_keeps_the_shortest_prefix_with_few_decodes(turn):
    tok = _CountingTokenizer(TOK)
    traj = Trajectory(TOK(PROMPT, add_special_tokens=True)["input_ids"], PROMPT)
    ids = TOK(turn, add_special_tokens=False)["input_ids"]
    keep, call = cut_at_call(tok, traj, ids)
    end = turn.find("]") + 1  # char tokenizer: one token per character
    assert (keep, call) == ((end, find_tool_call(PROMPT + turn)) if end else (len(ids), None))
    # 2 decodes to find the call, then a binary search: at most ceil(log2(L)) more, where
    # a scan over prefixes would take up to L (here up to 264).
    assert tok.decodes <= 2 + int(np.ceil(np.log2(len(ids))))


def test_the_batch_keeps_the_mask_through_advantages_and_the_oldest_version():
    _, ids, comps = _run(_answer)
    pb = PromptBatch(batch_id=0, step=0, prompts=[Prompt(prompt_id="p0", text=PROMPT, token_ids=ids)])
    batch = build_rollout_batch(pb, [GenerationResult(prompt_token_ids=ids, completions=comps)], 2, TOK.pad_token_id)
    assert batch.loss_mask.shape == batch.completion_ids.shape == (2, 11)
    assert batch.loss_tokens == 5 + 7 and batch.policy_version == 0
    assert batch.rollout_extras["tool/used"] == [1.0, 0.0]
    assert np.isnan(batch.rollout_extras["turn/2/tokens"][1])
    out = assign_advantages(msgspec.structs.replace(batch, rewards=np.array([1.0, 0.0], dtype=np.float32)),
                            GrpoConfig())
    # GRPO: (1 - 0.5) / (0.5 + eps) ~ +1 on the model's tokens only; the tool's tokens get
    # no advantage and no loss.
    assert out.advantages[0].tolist() == pytest.approx([1.0] * 4 + [0.0] * 6 + [1.0], abs=1e-5)
    assert (out.advantages[0][4:10] == 0).all()
    assert out.loss_mask[0].tolist() == [True] * 4 + [False] * 6 + [True]


def test_a_failing_tool_gives_the_model_an_error_and_the_run_goes_on():
    def boom(arguments):
        raise RuntimeError("disk on fire")

    _, _, (comp,) = _run(lambda c, j: "ok" if c.endswith("\n") else "1]", n=1, max_tokens=40,
                         tools={"calc": boom}, prompt="1 [calc: ")
    # The result is cut to max_result_tokens (12) inside its template: its line still ends.
    assert comp.text == "1] -> error: Runti\nok"  # "error: Runti": 12 characters
    assert comp.extras["tool/calc/errors"] == 1.0 and comp.extras["tool/errors"] == 1.0


def test_unknown_tools_and_the_python_sandbox_answer_with_errors():
    _, _, (comp,) = _run(lambda c, j: "x" if c.endswith("\n") else "1/0]", n=1, max_tokens=80, prompt="[python: ",
                         max_result_tokens=60)
    assert comp.text == "1/0] -> error: ZeroDivisionError: division by zero\nx"
    assert comp.extras["tool/python/errors"] == 1.0
    _, _, (comp,) = _run(lambda c, j: "x" if c.endswith("\n") else "2]", n=1, max_tokens=80, prompt="[sql: ",
                         max_result_tokens=60)
    assert comp.text == "2] -> error: unknown tool 'sql' (tools: calc, python)\nx" and comp.extras["tool/errors"] == 1.0


def test_budget_and_last_turn():
    # max_tokens 8: "3+4]" (4) leaves 4 of the tool line's 6 tokens (" -> "); no turn follows.
    _, _, (comp, _) = _run(_answer, max_tokens=8)
    assert comp.text == "3+4] -> " and comp.finish_reason == "length" and len(comp.token_ids) == 8
    assert comp.extras["tool/turns"] == 1.0
    # A call in the last allowed turn is not run: nothing would read its result.
    _, _, (comp,) = _run(lambda c, j: "5]" if c.endswith("\n") else "3+4]", n=1, max_turns=2, max_tokens=40)
    assert comp.text == "3+4] -> 7\n5]" and comp.extras["tool/calls"] == 1.0


def test_several_calls_in_one_trajectory():
    # The second call opens its own bracket: "2*5]" alone after a closed call is no call.
    script = {"7\n": "[calc: 2*5]", "10\n": "10"}
    _, _, (comp,) = _run(lambda c, j: script.get(c[-3:].lstrip(" >"), "3+4]"), n=1, max_turns=3, max_tokens=60)
    assert comp.text == "3+4] -> 7\n[calc: 2*5] -> 10\n10"
    assert comp.extras["tool/calc/calls"] == 2.0 and comp.extras["tool/turns"] == 3.0


def test_rollout_extras_follow_splits_merges_and_drops():
    from pipeline.memory.splitting import check_rollout_batch, merge_rollout_batches, split_rollout_batch_at
    from stages.rewards.shaping import empty_like

    backend = FakeScriptedBackend(TOK, _answer)
    prompts = [Prompt(prompt_id=f"p{i}", text=PROMPT, token_ids=TOK(PROMPT)["input_ids"]) for i in range(2)]
    results = asyncio.run(generate_with_tools(
        backend, TOK, [p.token_ids for p in prompts], [PROMPT] * 2, SamplingSettings(n=2, max_tokens=20),
        {"calc": calculator}, ToolsConfig(timeout_s=60.0)))
    batch = build_rollout_batch(PromptBatch(batch_id=3, step=0, prompts=prompts), results, 2, TOK.pad_token_id)
    first, second = split_rollout_batch_at(batch, [1, 1])
    assert first.rollout_extras["tool/used"] == second.rollout_extras["tool/used"] == [1.0, 0.0]
    assert first.loss_mask.shape == (2, 11)
    merged = merge_rollout_batches([first, second])
    assert merged.rollout_extras["tool/calls"] == batch.rollout_extras["tool/calls"] == [1.0, 0.0, 1.0, 0.0]
    assert (merged.loss_mask == batch.loss_mask).all()
    empty = empty_like(batch)
    check_rollout_batch(empty)
    assert empty.rollout_extras == {k: [] for k in batch.rollout_extras}
