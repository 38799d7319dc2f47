"""DPO: the loss on hand-derived numbers, the config rules that go with it, and the
preference-pair rows (refused with the row and field, responses tokenized)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import ConfigError, PairsConfig, load_config
from stages.algorithms import build_policy_loss
from stages.algorithms.dpo import DpoConfig, compute_dpo_loss
from stages.data.files import RowError
from stages.data.pairs import encode_response
from stages.data.prompt_rows import ColumnMap, extract_row, resolve_columns
from stages.models.tiny import build_char_tokenizer

PAIRS = ["algorithm.name=dpo", "data.path=pairs.jsonl", "data.pairs.chosen_key=chosen", "rollout.n=2"]


def _pair(beta=0.5, ls=0.0):
    # Chosen: policy [-1, -1] (sum -2), reference [-1.5, -1.5] (sum -3): reward beta * 1.
    # Rejected: policy [-2, pad], reference [-1, garbage] (sum -1): reward beta * -1.
    logp = torch.tensor([[-1.0, -1.0], [-2.0, float("nan")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.5], [-1.0, float("-inf")]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    loss, metrics = compute_dpo_loss(logp, torch.zeros(2, 2), torch.zeros(2, 2), mask, ref_logprobs=ref,
                                     beta=beta, label_smoothing=ls)
    return logp, loss, metrics


def test_dpo_loss_matches_the_hand_derived_value_and_gradient():
    logp, loss, metrics = _pair()
    # margin m = 0.5 * ((-2 + 3) - (-2 + 1)) = 1.0; loss = -log sigmoid(1) = log(1 + e^-1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)  # 0.313262
    assert metrics == pytest.approx({"preference_accuracy": 1.0, "reward_margin": 1.0, "chosen_reward": 0.5,
                                     "rejected_reward": -0.5}, abs=1e-6)
    loss.backward()
    # d loss / d logp_chosen token = -beta * sigmoid(-m) = -0.5 * 0.268941 = -0.134471; rejected +0.134471;
    # the masked position gets no gradient (its NaN never enters the arithmetic).
    g = 0.5 / (1.0 + math.e)
    assert logp.grad.flatten().tolist() == pytest.approx([-g, -g, g, 0.0], abs=1e-6)


def test_label_smoothing_mixes_in_the_flipped_label():
    _, loss, _ = _pair(ls=0.2)
    # 0.8 * log(1 + e^-1) + 0.2 * log(1 + e^1) = 0.8 * 0.313262 + 0.2 * 1.313262 = 0.513262
    assert loss.item() == pytest.approx(0.513262, abs=1e-6)


def test_accuracy_counts_strictly_preferred_pairs_and_rows_must_pair():
    logp = torch.tensor([[-1.0], [-2.0], [-3.0], [-1.0], [-1.0], [-1.0]])
    mask = torch.ones(6, 1, dtype=torch.bool)
    # Against a zero reference: margins +1, -2 and 0 (a tie is not a preference).
    _, metrics = compute_dpo_loss(logp, logp, logp, mask, ref_logprobs=torch.zeros(6, 1), beta=1.0)
    assert metrics["preference_accuracy"] == pytest.approx(1 / 3)
    assert metrics["reward_margin"] == pytest.approx(-1 / 3)
    with pytest.raises(ValueError, match="pairs"):
        compute_dpo_loss(logp[:3], logp[:3], logp[:3], mask[:3], ref_logprobs=torch.zeros(3, 1))
    with pytest.raises(ValueError, match="reference"):
        compute_dpo_loss(logp, logp, logp, mask)


def test_registry_binds_beta_and_label_smoothing():
    loss = build_policy_loss(DpoConfig(beta=0.5, label_smoothing=0.2))
    logp = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.5], [-1.0, 0.0]])
    out, _ = loss(logp, logp, logp, torch.tensor([[1, 1], [1, 0]]), ref_logprobs=ref, kl_coef=0.0, fresh_mask=None)
    assert out.item() == pytest.approx(0.513262, abs=1e-6)


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm.name=dpo", "data.path=p.jsonl", "rollout.n=2"], "data.pairs: expected a pairs section"),
    (["data.pairs.chosen_key=c"], "data.pairs: expected a pairs section"),
    ([*PAIRS, "rollout.n=4"], "rollout.n: expected 2 with algorithm.name dpo"),
    ([*PAIRS, "reference.enabled='off'"], "reference.enabled: dpo needs"),
    ([*PAIRS, "algorithm.loss_agg=token-mean"], "algorithm.loss_agg: dpo's loss is a mean over pairs"),
    ([*PAIRS, "algorithm.label_smoothing=0.5"], "algorithm.label_smoothing"),
    ([*PAIRS, "algorithm.beta=0"], "algorithm.beta"),
    ([*PAIRS, "algorithm.kl_coef=0.1"], "algorithm.kl_coef: dpo's loss has no KL term"),
])
def test_dpo_config_rules(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, overrides)


def test_dpo_config_turns_the_reference_on():
    cfg = load_config(None, PAIRS)
    assert cfg.reference_enabled and cfg.algorithm.kl_coef == 0.0 and cfg.algorithm.offline


CMAP = ColumnMap(pair=("chosen", "rejected"))


@pytest.mark.parametrize(("row", "reason", "text"), [
    ({"prompt": "12=", "chosen": "1"}, "malformed", "d.jsonl row 3: no field 'rejected'"),
    ({"prompt": "12=", "chosen": 1, "rejected": "2"}, "malformed",
     "d.jsonl row 3: field 'chosen' must be a string (the prompt is plain text), got int"),
    ({"prompt": "12=", "chosen": "1", "rejected": ""}, "empty", "d.jsonl row 3: field 'rejected' is empty"),
    ({"prompt": [{"role": "user", "content": "hi"}], "chosen": "a", "rejected": []}, "malformed",
     "d.jsonl row 3: field 'chosen' must be a list of chat messages (the prompt is chat), got str"),
    ({"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "malformed", "d.jsonl row 3: chosen[0] must be"),
])
def test_bad_pair_rows_are_refused_naming_row_and_field(row, reason, text):
    with pytest.raises(RowError) as info:
        extract_row(row, CMAP, "d.jsonl row 3")
    assert info.value.reason == reason and str(info.value).startswith(text)


def test_pair_columns_are_resolved_or_named():
    pairs = PairsConfig(chosen_key="good", rejected_key="bad")
    assert resolve_columns(["prompt", "good", "bad"], "prompt", "ground_truth", "f", pairs).pair == ("good", "bad")
    with pytest.raises(ConfigError, match=r"^data\.pairs\.rejected_key: f has no column 'bad'"):
        resolve_columns(["prompt", "good"], "prompt", "ground_truth", "f", pairs)


def test_responses_are_tokenized_after_their_prompt():
    llama, qwen = build_char_tokenizer("llama"), build_char_tokenizer("qwen2")
    # Plain: the response's characters, then the end-of-sequence token.
    assert encode_response(llama, "12=", "12=", "1", "r", "chosen") == [*llama("1", add_special_tokens=False)
                                                                        ["input_ids"], llama.eos_token_id]
    # Chat: what the template adds after the rendered prompt (the assistant turn and its end).
    prompt = [{"role": "user", "content": "12="}]
    text = qwen.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    ids = encode_response(qwen, prompt, text, [{"role": "assistant", "content": "1"}], "r", "chosen")
    full = qwen.apply_chat_template([*prompt, {"role": "assistant", "content": "1"}], tokenize=False)
    assert qwen.decode(ids) == full[len(text):] and qwen.decode(ids).startswith("1")


def test_preflight_report_counts_bad_pair_rows_and_refuses_a_file_without_a_good_one(tmp_path):
    import json

    from pipeline.config import DataConfig
    from stages.data.prompt_rows import check_data_file

    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "12=", "chosen": "1", "rejected": "2"}, {"prompt": "34=", "chosen": "3"},
            {"prompt": "56=", "chosen": 5, "rejected": "6"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(path=str(path), pairs=PairsConfig())
    report = check_data_file(data, build_char_tokenizer("llama"), "m")
    assert report.rows_usable == 1 and report.skipped == {"malformed": 2} and report.first_rows["malformed"] == [2, 3]
    assert report.first_errors["malformed"] == "pairs.jsonl row 2: no field 'rejected' (a preference pair needs it)"
    path.write_text("".join(json.dumps(r) + "\n" for r in (rows[2], rows[1])))  # columns: the first row's
    with pytest.raises(ConfigError, match=r"^data\.path: no usable row in (.|\n)*rows 1, 2\); first: pairs\.jsonl row 1: "
                                          r"field 'chosen' must be a string"):
        check_data_file(data, build_char_tokenizer("llama"), "m")


def test_dpo_scores_at_temperature_one_and_trains_whole_pairs_per_chunk():
    from stages.trainer.engine import align_chunk_size

    # Offline pairs were sampled by no rollout: trainer and reference take the model's
    # own log-probs (temperature 1), whatever rollout.temperature says; GRPO keeps it.
    dpo = load_config(None, [*PAIRS, "rollout.temperature=0.7"])
    assert dpo.scoring_temperature == 1.0
    assert load_config(None, ["rollout.temperature=0.7"]).scoring_temperature == 0.7
    # chunks of whole (chosen, rejected) pairs: 3 -> 2, 1 -> 2, 4 stays; grpo keeps 3
    assert [align_chunk_size(c, dpo.algorithm) for c in (3, 1, 4)] == [2, 2, 4]
    assert align_chunk_size(3, load_config(None, []).algorithm) == 3
