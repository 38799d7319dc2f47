"""The evaluator of the held-out set against a fake engine (``FakeGenerate``): the prompts
it reads, the calls it makes (greedy, then sampled with per-call seeds), the version
check and the metrics it reports; the run's reward function scores the completions."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.evaluation import EvalSchedule
from stages.evaluation.evaluator import HeldOutEvaluator, check_token_versions, load_eval_prompts
from stages.models.tiny import build_char_tokenizer
from stages.rewards.reward import build_run_reward_fn
from stages.rollout.base import Completion, GenerationResult

TOK = build_char_tokenizer("llama")


def write_rows(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


class FakeGenerate:
    """The rollout's generation path, scripted: completion j of a prompt ``<d>...=`` is
    its first digit when ``right(j, sampling)``, else ``x``; every token is labelled
    ``version`` (or ``versions[call]``). Records each call's prompts and settings."""

    def __init__(self, version: int, right, versions: list[int] | None = None) -> None:
        self.version, self.right, self.versions = version, right, versions
        self.calls: list[tuple[list[str], object]] = []
        self.running = self.peak = 0

    async def __call__(self, prompt_ids, texts, sampling):
        version = self.versions[len(self.calls)] if self.versions else self.version
        self.calls.append((list(texts), sampling))
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(0.01)
        self.running -= 1
        out = []
        for ids, text in zip(prompt_ids, texts, strict=True):
            comps = []
            for j in range(sampling.n):
                answer = text[0] if self.right(j, sampling) else "x"
                tokens = TOK(answer, add_special_tokens=False)["input_ids"]
                comps.append(Completion(token_ids=tokens, logprobs=[0.0] * len(tokens),
                                        token_versions=[version] * len(tokens), finish_reason="stop", text=answer))
            out.append(GenerationResult(prompt_token_ids=ids, completions=comps))
        return out


def make_evaluator(tmp_path, *overrides: str) -> HeldOutEvaluator:
    rows = [{"prompt": f"{d}{d}7=", "ground_truth": str(d)} for d in range(1, 6)]
    path = write_rows(tmp_path / "held.jsonl", rows)
    cfg = load_config(None, [f"eval.path={path}", "dataflow.prompts_per_micro_batch=2", "rollout.max_inflight=2",
                             "rollout.max_tokens=3", *overrides])
    return HeldOutEvaluator(load_eval_prompts(cfg, TOK, "/models/m"), build_run_reward_fn(cfg),
                            EvalSchedule(every=cfg.eval.every, before_train=cfg.eval.before_train), cfg.eval,
                            cfg.eval.max_tokens or cfg.rollout.max_tokens, cfg.dataflow.prompts_per_micro_batch,
                            cfg.rollout.max_inflight)


SHORT = ["data.max_prompt_len=64"]  # the 80-character row is over it


def test_the_held_out_prompts_are_the_first_usable_rows_in_file_order(tmp_path):
    path = write_rows(tmp_path / "h.jsonl", [{"prompt": "12=", "ground_truth": "1"}, "{oops",
                                             {"prompt": "9" * 80, "ground_truth": "9"},  # over data.max_prompt_len
                                             {"prompt": "3=", "ground_truth": "3", "data_source": "d"},
                                             {"prompt": "4=", "ground_truth": "4"}])
    cfg = load_config(None, [*SHORT, f"eval.path={path}", "eval.num_prompts=2"])
    prompts = load_eval_prompts(cfg, TOK, "/models/m")
    # llama char vocab: <bos> 1, "1" 5, "2" 6, "3" 7, "=" 70; ids name the file's rows
    assert [(p.prompt_id, p.text, p.token_ids, p.ground_truth) for p in prompts] == [
        ("eval-1", "12=", [1, 5, 6, 70], "1"), ("eval-4", "3=", [1, 7, 70], "3")]
    assert prompts[1].data_source == "d"
    assert len(load_eval_prompts(load_config(None, [*SHORT, f"eval.path={path}"]), TOK, "/models/m")) == 3  # 0: all
    with pytest.raises(ConfigError, match="^eval.answer_key: h.jsonl has no column 'answer'"):
        load_eval_prompts(load_config(None, [*SHORT, f"eval.path={path}", "eval.answer_key=answer"]), TOK, "/models/m")


def test_a_greedy_evaluation_makes_one_pass_in_micro_batch_calls(tmp_path):
    evaluator = make_evaluator(tmp_path)  # temperature 0: the greedy completion alone
    assert evaluator.sampled is None and evaluator.kind(0) is None
    generate = FakeGenerate(version=3, right=lambda j, s: True)
    result = asyncio.run(evaluator.evaluate(generate, 3, "final", "rollout:0"))
    # 5 prompts in calls of 2 (dataflow.prompts_per_micro_batch), at most 2 at once
    assert [texts for texts, _ in generate.calls] == [["117=", "227="], ["337=", "447="], ["557="]]
    assert generate.peak == 2
    sampling = generate.calls[0][1]
    assert (sampling.n, sampling.temperature, sampling.max_tokens, sampling.seed) == (1, 0.0, 3, None)
    assert (result.version, result.kind, result.worker) == (3, "final", "rollout:0")
    m = result.metrics
    assert (m["eval/greedy_reward"], m["eval/reward_mean"], m["eval/pass@1"], m["eval/prompts"]) == (1.0, 1.0, 1.0, 5.0)
    assert "eval/pass@2" not in m and evaluator.done(3) and not evaluator.done(2)


def test_a_sampled_evaluation_seeds_each_call_and_estimates_pass_at_k(tmp_path):
    evaluator = make_evaluator(tmp_path, "eval.n=4", "eval.temperature=0.7", "eval.seed=7", "eval.max_tokens=2")
    # greedy completions wrong; of the 4 samples of each prompt, the first one right
    generate = FakeGenerate(version=5, right=lambda j, s: s.temperature > 0 and j == 0)
    m = asyncio.run(evaluator.evaluate(generate, 5, "periodic", "rollout:0")).metrics
    greedy_calls, sampled_calls = generate.calls[:3], generate.calls[3:]
    assert [s.temperature for _, s in greedy_calls] == [0.0] * 3
    # completion i of prompt j samples with seed + j * n + i: each call starts at its first prompt's
    assert [(s.n, s.temperature, s.max_tokens, s.seed) for _, s in sampled_calls] == [
        (4, 0.7, 2, 7), (4, 0.7, 2, 7 + 2 * 4), (4, 0.7, 2, 7 + 4 * 4)]
    assert m["eval/greedy_reward"] == 0.0 and m["eval/reward_mean"] == 0.25
    assert m["eval/pass@1"] == pytest.approx(0.25)  # c = 1 of n = 4
    assert m["eval/pass@2"] == pytest.approx(0.5)   # 1 - C(3,2)/C(4,2)
    assert m["eval/pass@4"] == pytest.approx(1.0)
    assert m["eval/response_length"] == 1.0


def test_completions_from_another_version_fail_the_evaluation(tmp_path):
    evaluator = make_evaluator(tmp_path)
    with pytest.raises(RuntimeError, match=r"evaluation of policy version 3: its completions hold tokens of "
                                           r"versions \[3, 4\]"):
        asyncio.run(evaluator.evaluate(FakeGenerate(3, lambda j, s: True, versions=[3, 4, 3]), 3, "periodic", "r:0"))
    assert not evaluator.done(3)
    check_token_versions([], 3)  # nothing generated: nothing to contradict
