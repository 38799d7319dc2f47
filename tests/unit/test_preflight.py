"""Pre-flight: a missing path, an unimportable module or unusable data stops
``conveyor launch`` (and ``conveyor status --config``) with exit 2 naming the field,
before Ray starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import yaml

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.preflight import check_learning_settings, run_preflight
from stages.models.tiny import build_char_tokenizer

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


def make_checkpoint_dir(path: Path, arch: str) -> Path:
    """Enough of a checkpoint for pre-flight: config.json and the tokenizer (no weights)."""
    build_char_tokenizer(arch).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": arch}))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"chat": make_checkpoint_dir(root / "chat", "qwen2"), "base": make_checkpoint_dir(root / "base", "llama")}


@pytest.fixture
def setup(tmp_path, models):
    """A good config: chat JSONL + reward file; each test breaks one thing."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}="}], "ground_truth": str(i)})
                            + "\n" for i in range(3)))
    reward = tmp_path / "my_reward.py"
    reward.write_text(REWARD)
    raw = {"model": {"path": str(models["chat"])}, "data": {"path": str(data)},
           "reward": {"function": f"{reward}:compute_score"}, "run": {"dir": str(tmp_path / "run")}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    return config, tmp_path


@pytest.fixture
def ray_starts(monkeypatch):
    """Records any attempt to start Ray or the run (a test session may already have a
    cluster up, so ``ray.is_initialized`` says nothing about this test)."""
    calls: list[str] = []
    monkeypatch.setattr(ray, "init", lambda *a, **kw: calls.append("ray.init"))
    monkeypatch.setattr("pipeline.launch.run_dataflow", lambda *a, **kw: calls.append("run_dataflow"))
    return calls


def launch(config: Path, *overrides: str, command: str = "launch") -> int:
    return main([command, "--config", str(config), *overrides])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.path={tmp}/missing.jsonl", "data.path: '{tmp}/missing.jsonl' does not exist"),
        ("model.path={tmp}/no_model", "model.path: expected 'tiny', a local Hugging Face checkpoint directory or a Hub id"),
        ("reward.function=no_such_module_xyz:score", "reward.function: cannot import module 'no_such_module_xyz'"),
        ("reward.function={tmp}/missing.py:compute_score", "reward.function: '{tmp}/missing.py' does not exist"),
        ("reward.function={tmp}/my_reward.py:nope", "reward.function: '{tmp}/my_reward.py' defines no 'nope'"),
        ("rollout.backend=no_such_module_xyz:Backend", "rollout.backend: cannot import module 'no_such_module_xyz'"),
        ("reference.path={tmp}/no_ref", "reference.path: expected a local Hugging Face checkpoint directory"),
        ("data.prompt_key=question", "data.prompt_key: chat.jsonl has no column 'question' "
                                     "(its columns: messages, ground_truth)"),
        ("data.answer_key=solution", "data.answer_key: chat.jsonl has no column 'solution'"),
        ("data.chat_template=none", "data.chat_template: 'none' cannot render chat messages"),
        ("rollout.tools.functions={tmp}/missing.py:TOOLS", "rollout.tools.functions: '{tmp}/missing.py' does not exist"),
        ("rollout.tools.functions=no_such_module_xyz:TOOLS",
         "rollout.tools.functions: cannot import module 'no_such_module_xyz'"),
        ("rollout.tools.max_turns=1", "rollout.tools.max_turns: expected int >= 2, got 1"),
        ("data.pairs.chosen_key=good", "data.pairs: expected a pairs section exactly with algorithm.name dpo"),
        ("rollout.engine_kwargs.no_such_arg=1", "rollout.engine_kwargs.no_such_arg: not an engine argument of this vLLM"),
    ],
)
def test_bad_inputs_exit_2_naming_the_field_before_ray_starts(setup, capsys, ray_starts, override, expected):
    config, tmp = setup
    assert launch(config, override.format(tmp=tmp)) == 2
    err = capsys.readouterr().err
    assert f"conveyor: invalid config: {expected.format(tmp=tmp)}" in err
    assert ray_starts == []


def test_chat_rows_on_a_model_without_a_template(setup, models, capsys):
    config, _ = setup
    assert launch(config, f"model.path={models['base']}") == 2
    assert (f"data.chat_template: the tokenizer of {models['base']} has no chat template"
            in capsys.readouterr().err)


def test_a_model_dir_without_a_tokenizer(setup, capsys):
    config, tmp = setup
    (tmp / "weights_only").mkdir()
    (tmp / "weights_only" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert launch(config, f"model.path={tmp}/weights_only") == 2
    assert f"model.path: cannot load the tokenizer of '{tmp}/weights_only'" in capsys.readouterr().err


def test_an_unimportable_custom_node_class(setup, capsys):
    config, _ = setup
    raw = yaml.safe_load(config.read_text())
    raw["dataflow"] = {"nodes": [{"name": "source", "node_class": "no_such_module_xyz:Source"}]}
    config.write_text(yaml.safe_dump(raw))
    assert launch(config) == 2
    assert "dataflow.nodes[0].node_class: cannot import module 'no_such_module_xyz'" in capsys.readouterr().err


def test_a_file_with_no_usable_row_exits_2_with_the_report(setup, capsys, ray_starts):
    config, tmp = setup
    bad = tmp / "bad.jsonl"
    bad.write_text('{"messages": []}\n{oops\n\n')
    assert launch(config, f"data.path={bad}") == 2
    err = capsys.readouterr().err
    assert f"data.path: no usable row in {bad}" in err
    assert "bad.jsonl (jsonl): 3 rows, 0 usable" in err
    assert "skipped 2 empty (rows 1, 3)" in err and "skipped 1 malformed (row 2)" in err
    assert ray_starts == []


def test_status_runs_the_same_checks(setup, capsys):
    config, tmp = setup
    assert launch(config, f"data.path={tmp}/missing.jsonl", command="status") == 2
    assert "conveyor: invalid config: data.path:" in capsys.readouterr().err


def test_a_good_config_passes_with_absolute_paths_and_a_data_report(setup, monkeypatch, ray_starts):
    config, tmp = setup
    monkeypatch.chdir(tmp)
    cfg = load_config(config, ["data.path=chat.jsonl", "reward.function=my_reward.py:compute_score"])
    cfg, report = run_preflight(cfg)
    assert cfg.data.path == str(tmp / "chat.jsonl")
    assert cfg.reward.function == f"{tmp}/my_reward.py:compute_score"
    assert report.to_summary() == {"data/rows_total": 3, "data/rows_usable": 3}
    assert "chat.jsonl (jsonl): 3 rows, 3 usable (3 chat); prompt column 'messages'" in report.describe()
    assert ray_starts == []


def test_checking_engine_arguments_leaves_the_environment_as_it_was(setup, monkeypatch):
    """Preflight imports vLLM to check ``rollout.engine_kwargs``; what that import sets
    in the environment must not reach the actors started after it."""
    import os

    config, tmp = setup
    monkeypatch.chdir(tmp)
    cfg = load_config(config, ["data.path=chat.jsonl", "reward.function=my_reward.py:compute_score",
                               "rollout.engine_kwargs.max_num_batched_tokens=8192"])
    import pipeline.preflight as preflight

    real = preflight.load_builtin

    def importing_vllm(name):  # as importing vLLM does, whether or not it is imported already
        if name != "check_engine_kwargs":
            return real(name)

        def check(kwargs):
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
            real(name)(kwargs)
        return check

    monkeypatch.setattr(preflight, "load_builtin", importing_vllm)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    before = dict(os.environ)
    run_preflight(cfg)
    assert dict(os.environ) == before


def test_verl_reward_spelling_is_checked_too(setup, capsys):
    config, tmp = setup
    raw = yaml.safe_load(config.read_text())
    raw["reward"] = {"path": str(tmp / "my_reward.py"), "name": "missing_fn"}
    config.write_text(yaml.safe_dump(raw))
    assert launch(config) == 2
    assert f"reward.function: '{tmp}/my_reward.py' defines no 'missing_fn'" in capsys.readouterr().err


def test_compile_on_without_any_compiler_exits_2_and_auto_does_not(setup, capsys, ray_starts, monkeypatch):
    config, tmp = setup
    empty = tmp / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    assert launch(config, "train.compile=on") == 2
    assert "conveyor: invalid config: train.compile: on needs a compiler for torch.compile's kernels" in capsys.readouterr().err
    assert ray_starts == []
    cfg = load_config(config, ["train.compile=auto"])
    assert run_preflight(cfg)[0].train.compile == "auto"  # auto runs eager where nothing compiles


def test_a_router_loss_needs_a_model_with_a_router(setup, models, capsys, ray_starts, tmp_path):
    config, _ = setup
    assert launch(config, "train.router_aux_loss_coef=0.01") == 2
    assert (f"conveyor: invalid config: train.router_aux_loss_coef: 0.01 needs a mixture of experts, but the model "
            f"at {models['chat']} (qwen2) has no router" in capsys.readouterr().err)
    assert ray_starts == []
    moe = make_checkpoint_dir(tmp_path / "moe", "qwen2")
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "output_router_logits": False}))
    cfg = load_config(config, [f"model.path={moe}", "train.router_aux_loss_coef=0.01"])
    assert run_preflight(cfg)[0].train.router_aux_loss_coef == 0.01
    assert ray_starts == []


def test_a_high_learning_rate_on_a_wide_model_is_warned_naming_train_lr(tmp_path):
    # hidden size 896 (a 0.5B-class model) at the old default 3e-4 (> 1e-4): warned;
    # at 1e-6, or the embedded tiny width 128 at 3e-4: nothing to say.
    wide, tiny = tmp_path / "wide", tmp_path / "tiny"
    for path, hidden in ((wide, 896), (tiny, 128)):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": hidden}))
    (note,) = check_learning_settings(load_config(None, ["train.lr=3e-4"]), wide)
    assert note.startswith("warning: train.lr 0.0003 is above 0.0001") and "hidden size 896" in note
    assert check_learning_settings(load_config(None, ["train.lr=1e-6"]), wide) == []
    assert check_learning_settings(load_config(None, ["train.lr=3e-4"]), tiny) == []


def test_kl_in_the_reward_and_in_the_loss_is_warned(tmp_path):
    # use_kl_in_reward with the default algorithm.kl_coef (0.04 > 0): the KL twice.
    (note,) = check_learning_settings(load_config(None, ["algorithm.use_kl_in_reward=true"]), tmp_path)
    assert "algorithm.use_kl_in_reward" in note and "algorithm.kl_coef 0.04" in note and "twice" in note
    cfg = load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_coef=0"])
    assert check_learning_settings(cfg, tmp_path) == []
