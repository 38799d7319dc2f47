"""Config decoding: errors name the dotted path; overrides apply; shipped YAMLs decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import ConfigError, apply_overrides, load_config

CONFIGS_DIR = Path(__file__).parents[2] / "configs"
CONFIGS = sorted(CONFIGS_DIR.glob("*.yaml"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dataflow.max_staleness=-1", "dataflow.max_staleness: expected int >= 0, got -1"),
        ("dataflow.foo=1", "dataflow.foo: unknown field"),
        ("train.lr=abc", "train.lr: expected float, got str"),
        ("rollout.top_p=2", "rollout.top_p: expected float <= 1.0, got 2"),
        ("rollout.n=1", "rollout.n: expected >= 2 for grpo (group baseline), got 1"),
        ("rollout.top_p=0.9", "rollout.top_p: expected 1.0 (trainer and reference log-probs use the full softmax"),
        ("rollout.top_k=20", "rollout.top_k: expected -1 (off; trainer and reference log-probs use the full"),
        # The built-ins first, in their order; an algorithm module added later lists after them.
        ("algorithm.name=kto", "algorithm.name: expected one of ['grpo', 'rloo', 'reinforce_plus_plus', "
                               "'reinforce_plus_plus_baseline', 'ppo', 'dpo'"),
        ("algorithm.clip_ratio_c=1", "algorithm.clip_ratio_c: expected float > 1.0, got 1"),
        ("algorithm.loss_agg=sum", "algorithm.loss_agg: expected one of ['token-mean', 'seq-mean-token-mean', "
                                   "'seq-mean-token-sum', 'seq-mean-token-sum-norm'], got 'sum'"),
        ("algorithm.off_policy=maybe", "algorithm.off_policy: expected one of ['off', 'truncate', 'reject']"),
        ("algorithm.behav_imp_weight_cap=0.5", "algorithm.behav_imp_weight_cap: expected float >= 1.0, got 0.5"),
        ("train.prompts_per_step=6", "train.prompts_per_step: expected a multiple of dataflow.prompts_per_micro_batch"),
        ("train.sync_interval=3", "dataflow.max_staleness: expected >= train.sync_interval - 1 (2)"),
        ("dataflow.nodes=[{name: a}]", "dataflow.nodes[0].node_class: required field missing"),
        ("rollout.backend=nope", "rollout.backend: expected 'vllm', 'hf' or 'module:attr'"),
        ("model.dtype=int8", "model.dtype: expected one of"),
        ("run.max_restarts=-1", "run.max_restarts: expected int >= 0, got -1"),
        ("run.auto_resume=sometimes", "run.auto_resume: expected bool, got str"),
        ("rollout.engine_kwargs.gpu_memory_utilization=0.3",
         "rollout.engine_kwargs.gpu_memory_utilization: set by Conveyor; use rollout.gpu_memory_utilization"),
        ("rollout.engine_kwargs=[1]", "rollout.engine_kwargs: expected object, got array"),
        ("rollout.sampler_tap=sometimes", "rollout.sampler_tap: expected one of ['auto', 'never', 'verify']"),
    ],
)
def test_bad_values_name_their_path(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


@pytest.mark.parametrize("other", [["rollout.engine_core=subprocess"], ["rollout.backend=hf"],
                                   ["rollout.tensor_parallel_size=2"],
                                   ["rollout.logprobs=false", "dataflow.max_staleness=0"]])
def test_verifying_the_sampler_tap_needs_vllms_engine_core_in_the_rollouts_process(other):
    assert load_config(None, ["rollout.sampler_tap=verify"]).rollout.sampler_tap == "verify"
    load_config(None, other)  # valid without verify
    with pytest.raises(ConfigError, match="rollout.sampler_tap: verify checks vLLM's log-probs in the rollout's process"):
        load_config(None, ["rollout.sampler_tap=verify", *other])


def test_engine_kwargs_reach_the_config_and_need_the_vllm_backend():
    cfg = load_config(None, ["rollout.engine_kwargs.max_num_batched_tokens=8192",
                             "rollout.engine_kwargs.async_scheduling=true"])
    assert cfg.rollout.engine_kwargs == {"max_num_batched_tokens": 8192, "async_scheduling": True}
    with pytest.raises(ConfigError, match=r"rollout.engine_kwargs: vLLM's engine arguments; rollout.backend is 'hf'"):
        load_config(None, ["rollout.backend=hf", "rollout.engine_kwargs.max_num_batched_tokens=8192"])
    # One that a rollout key sets is refused here, naming the key.
    with pytest.raises(ConfigError, match=r"rollout.engine_kwargs.max_num_seqs.*rollout.max_num_seqs"):
        load_config(None, ["rollout.engine_kwargs.max_num_seqs=512"])
    # rollout.compile off writes vLLM's compilation config: one of the two, not both.
    with pytest.raises(ConfigError, match=r"rollout.engine_kwargs.compilation_config: rollout.compile off"):
        load_config(None, ["rollout.engine_kwargs.compilation_config={mode: 3}"])
    both = load_config(None, ["rollout.compile=on", "rollout.engine_kwargs.compilation_config={mode: 3}"])
    assert both.rollout.engine_kwargs == {"compilation_config": {"mode": 3}}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.name=rloo", "algorithm.norm_adv_by_std=false"], "algorithm.norm_adv_by_std: unknown field"),
        (["algorithm.gamma=0.9"], "algorithm.gamma: unknown field"),  # grpo has no gamma
        (["algorithm.name=reinforce_plus_plus", "algorithm.gamma=1.5"], "algorithm.gamma: expected float <= 1.0"),
        (["algorithm.name=rloo", "rollout.n=1"], "rollout.n: expected >= 2 for rloo (group baseline), got 1"),
        (["train.lr_scheduler=step"], "train.lr_scheduler: expected one of ['constant', 'linear', 'cosine'], got 'step'"),
        (["train.lr_scheduler=cosine", "train.warmup_steps=100", "run.steps=100"],
         "train.warmup_steps: expected < the run's optimizer updates (100: run.steps x train.ppo_epochs x "
         "train.ppo_mini_batches) for a decaying cosine schedule, got 100"),
        # 10 steps x 2 epochs x 2 mini-batches = 40 updates: warmup 40 is refused ...
        (["train.lr_scheduler=linear", "train.warmup_steps=40", "run.steps=10", "train.ppo_epochs=2",
          "train.ppo_mini_batches=2"], "(40: run.steps x train.ppo_epochs x train.ppo_mini_batches)"),
        (["train.min_lr_ratio=1.5"], "train.min_lr_ratio: expected float <= 1.0, got 1.5"),
    ],
)
def test_per_algorithm_fields_are_validated(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_warmup_counts_optimizer_updates_not_steps():
    # 10 steps x 2 epochs x 2 mini-batches = 40 updates: a warmup of 39 updates still
    # leaves one to decay over (run.steps alone would refuse anything from 10 on).
    cfg = load_config(None, ["train.lr_scheduler=linear", "train.warmup_steps=39", "run.steps=10",
                             "train.ppo_epochs=2", "train.ppo_mini_batches=2"])
    assert cfg.train.warmup_steps == 39


def test_default_learning_rate_suits_a_pretrained_checkpoint():
    # verl's actor and TRL's GRPO default to 1e-6; the tiny model's configs set their own.
    assert load_config(None, []).train.lr == 1e-6
    assert load_config(CONFIGS_DIR / "quickstart.yaml", []).train.lr == 5e-4


def test_algorithm_name_picks_its_fields():
    cfg = load_config(None, [])
    assert cfg.algorithm.name == "grpo" and cfg.algorithm.norm_adv_by_std is True
    assert cfg.algorithm.loss_norm_tokens == cfg.rollout.max_tokens == 512  # constant normaliser default
    cfg = load_config(None, ["algorithm.name=reinforce_plus_plus", "algorithm.gamma=0.9", "rollout.n=1"])
    assert (cfg.algorithm.name, cfg.algorithm.gamma, cfg.rollout.n) == ("reinforce_plus_plus", 0.9, 1)
    cfg = load_config(None, ["algorithm.name=grpo", "algorithm.norm_adv_by_std=false", "algorithm.loss_norm_tokens=3"])
    assert (cfg.algorithm.norm_adv_by_std, cfg.algorithm.loss_norm_tokens) == (False, 3)


def test_cli_refuses_top_p_with_exit_2(capsys):
    assert main(["status", "--config", str(CONFIGS[0]), "rollout.top_p=0.95"]) == 2
    assert "rollout.top_p: expected 1.0" in capsys.readouterr().err


def test_overrides_apply_and_yaml_floats_parse():
    cfg = load_config(None, ["train.lr=1e-5", "dataflow.async_execution=false", "rollout.max_memory_ratio=0.5"])
    assert cfg.train.lr == 1e-5  # YAML 1.1 reads "1e-5" as a string; it still converts
    assert cfg.dataflow.async_execution is False
    assert cfg.rollout.memory.max_memory_ratio == 0.5  # the shorthand lands in its section


def test_override_into_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match="train.lr is not a section"):
        apply_overrides({"train": {"lr": 1.0}}, ["train.lr.x=1"])


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        load_config(None, ["train.lr"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_decodes(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# conveyor "), f"{path.name} must open with the command that runs it"
    cfg = load_config(path)
    assert cfg.run.steps >= 1


def test_shipped_configs_exist():
    assert any(p.name == "quickstart.yaml" for p in CONFIGS)


def test_cli_bad_config_exits_2_with_path(capsys):
    code = main(["status", "--config", str(CONFIGS[0]), "dataflow.max_staleness=-1"])
    assert code == 2
    assert "dataflow.max_staleness: expected int >= 0, got -1" in capsys.readouterr().err


def test_cli_status_prints_queue_table(capsys):
    assert main(["status", "--config", str(CONFIGS[0])]) == 0
    out = capsys.readouterr().out
    for needle in ("queue", "producer", "consumer", "bound", "rollout->reward"):
        assert needle in out


def test_cli_unknown_record_edge_exits_2(capsys):
    code = main(["status", "--config", str(CONFIGS[0]), "record.edges=[trainer->nowhere]"])
    assert code == 2
    assert "record.edges" in capsys.readouterr().err


@pytest.mark.parametrize(("override", "field", "word"), [
    ("reference.enabled=off", "reference.enabled", "off"), ("reference.enabled=on", "reference.enabled", "on"),
    ("algorithm.off_policy=off", "algorithm.off_policy", "off"),
])
def test_bare_on_and_off_words_read_as_words_not_booleans(override, field, word):
    cfg = load_config(None, [override])  # YAML 1.1 reads a bare off / on as false / true
    section, key = field.split(".")
    assert getattr(getattr(cfg, section), key) == word


def test_a_boolean_where_no_word_means_it_is_still_refused():
    with pytest.raises(ConfigError, match="algorithm.off_policy"):
        load_config(None, ["algorithm.off_policy=true"])
