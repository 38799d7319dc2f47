"""verl as a peer: its GRPO trainer (``python -m verl.trainer.main_ppo``, vLLM rollout, FSDP actor)
on Conveyor's job, in a process of its own, read back as a row like ``bench/gpu_e2e.py``'s.

``write_verl_files`` writes the job as verl takes it (parquet rows with verl's ``prompt`` /
``reward_model`` / ``extra_info`` columns, a reward file calling the Conveyor task's score, the
agent-loop list), ``build_verl_overrides`` its Hydra overrides, ``run_verl`` runs it and
``summarize_verl_steps`` turns verl's console lines (``parse_verl_log``) into the row.

Guarantees:
- the job and rows are checked before anything is written: a bad one raises ``ValueError``
  naming the field (and row) and what was expected;
- a row's ``min_tokens`` / ``max_tokens`` go on that prompt's own vLLM requests
  (``apply_prompt_lengths``, called by ``bench.peers.verl_agent_loop`` inside verl);
- rates come from the times verl's step lines reached this process (the clock of the
  Conveyor and TRL rows); verl's own step timer is reported beside them;
- importing this module needs neither verl nor a GPU; only ``run_verl`` starts verl;
- where ``CONVEYOR_VERL_SITE`` names directories, verl's processes take them as their path
  (after this checkout) instead of the inherited one, and verl is looked for there: one
  bench call can run verl beside rows whose packages verl cannot share (TRL, on the GPU).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

VERL_VERSION = "0.9.1"
VERL_SITE_ENV = "CONVEYOR_VERL_SITE"
ROOT = Path(__file__).resolve().parents[2]
AGENT_LOOP_NAME = "conveyor_prompt_lengths"
AGENT_LOOP_TARGET = "bench.peers.verl_agent_loop.PromptLengthAgentLoop"
# For prompts given as plain text: the user message's text, nothing added (what Conveyor and TRL
# tokenize for such a job). No quotes, so it passes through Hydra's override grammar as it is.
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
TRAINER_MODES = ("sync", "colocate_async")  # verl's v1 trainers that run on one GPU
ATTENTION = ("sdpa", "eager", "flash_attention_2")
# The parts of a verl step (``timing_s/<name>``) the row reports, in the order they run.
TIMING_PARTS = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step")


class VerlJob(msgspec.Struct, frozen=True, kw_only=True):
    """One verl GRPO run: the model, the shape of a step and the optimiser, as Conveyor's
    config states them (``train.prompts_per_step``, ``rollout.n``, ``train.lr``...)."""

    model_path: str
    task: str  # the Conveyor task whose compute_score is the reward (stages.data.tasks.load_task)
    steps: int
    prompts_per_step: int
    group_size: int  # rollout.n
    lr: float
    max_prompt_tokens: int
    max_completion_tokens: int  # verl's response_length: at least every row's max_tokens
    task_kwargs: dict[str, Any] = {}
    micro_batch_samples: int = 8  # samples per forward/backward pass (ppo_micro_batch_size_per_gpu)
    token_budget: int | None = None  # tokens per pass instead (verl's use_dynamic_bsz)
    gradient_checkpointing: bool = True  # verl's default (model.enable_gradient_checkpointing)
    gpu_memory_utilization: float = 0.5  # vLLM's share of the GPU while it generates
    temperature: float = 1.0
    top_p: float = 1.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    norm_adv_by_std: bool = True
    seed: int = 0
    attn_implementation: str = "sdpa"  # flash-attn has no wheel for the device's torch
    trainer_mode: str = "sync"  # "colocate_async": partial rollouts across weight updates
    gpus: int = 1


class VerlFiles(msgspec.Struct, frozen=True, kw_only=True):
    """What ``write_verl_files`` wrote; ``plain_prompts``: the rows' prompts were text."""

    train: Path
    reward: Path
    agent_loops: Path
    plain_prompts: bool


def check_job(job: VerlJob) -> None:
    """``ValueError`` naming the first field of ``job`` that verl could not run with."""
    whole = {"steps": job.steps, "prompts_per_step": job.prompts_per_step, "max_prompt_tokens": job.max_prompt_tokens,
             "max_completion_tokens": job.max_completion_tokens, "micro_batch_samples": job.micro_batch_samples,
             "gpus": job.gpus}
    for name, value in whole.items():
        if value < 1:
            raise ValueError(f"verl job: {name} must be >= 1, got {value}")
    if job.group_size < 2:
        raise ValueError(f"verl job: group_size must be >= 2 (GRPO compares samples of a prompt), got {job.group_size}")
    if not (job.lr > 0 and math.isfinite(job.lr)):
        raise ValueError(f"verl job: lr must be a positive number, got {job.lr}")
    if not 0 < job.gpu_memory_utilization < 1:
        raise ValueError(f"verl job: gpu_memory_utilization must be in (0, 1), got {job.gpu_memory_utilization}")
    samples = job.prompts_per_step * job.group_size
    if job.token_budget is None and samples % (job.micro_batch_samples * job.gpus):
        raise ValueError(f"verl job: micro_batch_samples x gpus ({job.micro_batch_samples} x {job.gpus}) must divide "
                         f"the samples of a step ({job.prompts_per_step} x {job.group_size} = {samples})")
    longest = job.max_prompt_tokens + job.max_completion_tokens
    if job.token_budget is not None and job.token_budget < longest:
        raise ValueError(f"verl job: token_budget must hold the longest sample (max_prompt_tokens + "
                         f"max_completion_tokens = {longest}), got {job.token_budget}")
    if job.trainer_mode not in TRAINER_MODES:
        raise ValueError(f"verl job: trainer_mode must be one of {list(TRAINER_MODES)}, got {job.trainer_mode!r}")
    if job.attn_implementation not in ATTENTION:
        raise ValueError(f"verl job: attn_implementation must be one of {list(ATTENTION)}, "
                         f"got {job.attn_implementation!r}")


def check_rows(rows: list[dict[str, Any]], job: VerlJob) -> bool:
    """``ValueError`` naming the first bad row and field; True when the prompts are plain text
    (else each is a list of ``{"role", "content"}`` messages). Enough rows for every step."""
    need = job.steps * job.prompts_per_step
    if len(rows) < need:
        raise ValueError(f"verl rows: {job.steps} steps x {job.prompts_per_step} prompts need {need} rows, got {len(rows)}")
    plain = isinstance(rows[0].get("prompt"), str)
    for i, row in enumerate(rows):
        for key in ("prompt", "ground_truth", "data_source"):
            if row.get(key) is None:
                raise ValueError(f"verl rows: row {i}: missing {key!r}")
        prompt = row["prompt"]
        if plain != isinstance(prompt, str):
            raise ValueError(f"verl rows: row {i}: 'prompt' must be {'text' if plain else 'a message list'} like row 0's")
        if not plain and not (isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt)):
            raise ValueError(f"verl rows: row {i}: 'prompt' must be a non-empty list of {{'role', 'content'}} strings")
        low, high = row.get("min_tokens"), row.get("max_tokens")
        for key, value in (("min_tokens", low), ("max_tokens", high)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 1 <= value <= job.max_completion_tokens):
                raise ValueError(f"verl rows: row {i}: {key!r} must be an integer in [1, max_completion_tokens = "
                                 f"{job.max_completion_tokens}], got {value!r}")
        if low is not None and low > (high if high is not None else job.max_completion_tokens):
            raise ValueError(f"verl rows: row {i}: 'min_tokens' ({low}) is above 'max_tokens' ({high})")
    return plain


def apply_prompt_lengths(sampling_params: dict[str, Any], extra_info: dict[str, Any] | None,
                         response_length: int) -> dict[str, Any]:
    """The vLLM sampling parameters of one prompt's request: a copy of ``sampling_params`` with
    the row's ``max_tokens`` (capped at verl's ``response_length``) and ``min_tokens``.

    When both are equal the length is exact: ``ignore_eos`` with ``max_tokens`` alone, because
    verl's partial-rollout client (``colocate_async``) resumes an aborted request with
    ``max_tokens`` reduced by what it already made but ``min_tokens`` unchanged, which vLLM
    refuses once ``min_tokens > max_tokens``. A row without lengths keeps verl's defaults."""
    params = dict(sampling_params)
    info = extra_info or {}
    low, high = info.get("min_tokens"), info.get("max_tokens")
    if high is not None:
        params["max_tokens"] = min(int(high), response_length)
    if low is not None:
        low = min(int(low), params.get("max_tokens", response_length))
        if low == params.get("max_tokens"):
            params["ignore_eos"] = True
        else:
            params["min_tokens"] = low
    return params


def build_verl_records(rows: list[dict[str, Any]], plain: bool) -> list[dict[str, Any]]:
    """The rows as verl's ``RLHFDataset`` reads them: ``prompt`` as chat messages, the answer in
    ``reward_model.ground_truth`` (as text, as the TRL row gets it), lengths in ``extra_info``."""
    records = []
    for i, row in enumerate(rows):
        prompt = [{"role": "user", "content": row["prompt"]}] if plain else row["prompt"]
        records.append({
            "data_source": str(row["data_source"]),
            "prompt": [{"role": m["role"], "content": m["content"]} for m in prompt],
            "ability": "conveyor",
            "reward_model": {"style": "rule", "ground_truth": str(row["ground_truth"])},
            "extra_info": {"index": i, "min_tokens": row.get("min_tokens"), "max_tokens": row.get("max_tokens")},
        })
    return records


def render_reward_file(task: str, task_kwargs: dict[str, Any]) -> str:
    """A reward file for verl (``reward.custom_reward_function``): the Conveyor task's score."""
    kwargs = json.dumps(task_kwargs, sort_keys=True)
    return (
        '"""Written by bench.peers.verl_grpo: the Conveyor task\'s compute_score, as verl calls it."""\n'
        "import json\n\nfrom stages.data.tasks import load_task\n\n"
        f"_TASK = load_task({task!r}, **json.loads({kwargs!r}))\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_):\n"
        "    return float(_TASK.compute_score(data_source, solution_str, ground_truth, extra_info))\n"
    )


def write_verl_files(job: VerlJob, rows: list[dict[str, Any]], root: Path) -> VerlFiles:
    """Check ``job`` and ``rows``, then write the train parquet, the reward file and the agent
    loop list under ``root`` (the first ``steps x prompts_per_step`` rows, in order)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_job(job)
    plain = check_rows(rows, job)
    root.mkdir(parents=True, exist_ok=True)
    used = rows[: job.steps * job.prompts_per_step]
    train = root / "train.parquet"
    pq.write_table(pa.Table.from_pylist(build_verl_records(used, plain)), train)
    reward = root / "conveyor_reward.py"
    reward.write_text(render_reward_file(job.task, job.task_kwargs))
    agent_loops = root / "agent_loops.yaml"
    agent_loops.write_text(f"- name: {AGENT_LOOP_NAME}\n  _target_: {AGENT_LOOP_TARGET}\n")
    return VerlFiles(train=train, reward=reward, agent_loops=agent_loops, plain_prompts=plain)


def build_verl_overrides(job: VerlJob, files: VerlFiles, root: Path) -> list[str]:
    """verl's Hydra overrides for ``job`` (on ``verl/trainer/config/ppo_trainer.yaml``): GRPO
    without KL or reference model, one optimizer step per step (one mini-batch, one epoch),
    token-mean loss, a constant learning rate, the hybrid engine (FSDP actor and vLLM sharing
    the GPUs), console logging only, no validation or checkpoint."""
    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    per_pass = ([f"{actor}.use_dynamic_bsz=true", f"{actor}.ppo_max_token_len_per_gpu={job.token_budget}"]
                if job.token_budget else [f"{actor}.ppo_micro_batch_size_per_gpu={job.micro_batch_samples}",
                                          f"{rollout}.log_prob_micro_batch_size_per_gpu={job.micro_batch_samples}"])
    overrides = [
        "algorithm.adv_estimator=grpo", f"algorithm.norm_adv_by_std_in_grpo={str(job.norm_adv_by_std).lower()}",
        "algorithm.use_kl_in_reward=false",
        f"data.train_files={files.train}", f"data.val_files={files.train}", "data.prompt_key=prompt",
        f"data.train_batch_size={job.prompts_per_step}", f"data.max_prompt_length={job.max_prompt_tokens}",
        f"data.max_response_length={job.max_completion_tokens}", "data.shuffle=false", "data.truncation=error",
        "data.filter_overlong_prompts=false", "data.dataloader_num_workers=0", f"data.seed={job.seed}",
        f"actor_rollout_ref.model.path={job.model_path}", "actor_rollout_ref.model.use_remove_padding=true",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(job.gradient_checkpointing).lower()}",
        f"+actor_rollout_ref.model.override_config.attn_implementation={job.attn_implementation}",
        f"{actor}.optim.lr={job.lr}", f"{actor}.optim.weight_decay={job.weight_decay}",
        f"{actor}.ppo_mini_batch_size={job.prompts_per_step}", f"{actor}.ppo_epochs=1",
        f"{actor}.clip_ratio_low={job.clip_eps_low}", f"{actor}.clip_ratio_high={job.clip_eps_high}",
        f"{actor}.grad_clip={job.grad_clip}", f"{actor}.loss_agg_mode=token-mean", f"{actor}.use_kl_loss=false",
        f"{actor}.entropy_coeff=0", *per_pass,
        f"{rollout}.name=vllm", f"{rollout}.n={job.group_size}", f"{rollout}.temperature={job.temperature}",
        f"{rollout}.top_p={job.top_p}", f"{rollout}.gpu_memory_utilization={job.gpu_memory_utilization}",
        f"{rollout}.tensor_model_parallel_size=1",
        f"{rollout}.max_model_len={job.max_prompt_tokens + job.max_completion_tokens}",
        f"{rollout}.agent.agent_loop_config_path={files.agent_loops}",
        f"{rollout}.agent.default_agent_loop={AGENT_LOOP_NAME}",
        f"reward.custom_reward_function.path={files.reward}", "reward.custom_reward_function.name=compute_score",
        "trainer.use_v1=true", f"trainer.v1.trainer_mode={job.trainer_mode}", "trainer.logger=[console]",
        f"trainer.n_gpus_per_node={job.gpus}", "trainer.nnodes=1", f"trainer.total_training_steps={job.steps}",
        "trainer.total_epochs=1", "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", "trainer.project_name=conveyor-peers",
        f"trainer.experiment_name=verl-grpo-{job.trainer_mode}", f"trainer.default_local_dir={root / 'checkpoints'}",
        f"hydra.run.dir={root / 'hydra'}",
    ]
    if files.plain_prompts:
        overrides.append(f"actor_rollout_ref.model.custom_chat_template='{PLAIN_CHAT_TEMPLATE}'")
    return overrides


_NUMPY_SCALAR = re.compile(r"np\.\w+\((.*)\)")
# Ray colours the ``(Actor pid=..)`` prefix of a worker's lines even when they go to a pipe.
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _parse_value(text: str) -> float | None:
    """A value as verl's console logger prints it (``pprint.pformat`` of a number): ``1.5``,
    ``np.float64(1.5)``, ``nan``, ``True``; None for anything else."""
    found = _NUMPY_SCALAR.fullmatch(text)
    text = found.group(1) if found else text
    if text in ("True", "False"):
        return float(text == "True")
    try:
        return float(text)
    except ValueError:
        return None


def parse_verl_line(line: str) -> dict[str, float] | None:
    """One console line of verl's ``LocalLogger`` (``step:N - key:value - ...``, after any
    ``(TaskRunnerV1 pid=..)`` prefix Ray adds) as ``{"step": N, key: value...}``; None for
    any other line. A training step's line carries ``timing_s/step``."""
    line = _ANSI.sub("", line)
    at = line.find("step:")
    if at < 0 or (at > 0 and not line[:at].endswith(") ")):
        return None
    parts = line[at:].rstrip("\n").split(" - ")
    step = parts[0].removeprefix("step:")
    if not step.isdigit():
        return None
    row: dict[str, float] = {"step": float(step)}
    for part in parts[1:]:
        key, sep, value = part.partition(":")
        parsed = _parse_value(value) if sep else None
        if parsed is not None:
            row[key] = parsed
    return row


def parse_verl_log(lines: Iterable[str | tuple[float, str]]) -> list[dict[str, float]]:
    """The training steps of a verl log, in order: each line's fields, and ``time`` where the
    line came with its arrival time (``(time, line)``). Validation-only lines are left out."""
    rows = []
    for item in lines:
        when, line = item if isinstance(item, tuple) else (None, item)
        row = parse_verl_line(line)
        if row is not None and "timing_s/step" in row:
            rows.append(row if when is None else {**row, "time": when})
    return rows


def summarize_verl_steps(rows: list[dict[str, float]], t0: float, samples_per_step: int, gpus: int,
                         warmup: int) -> dict[str, Any]:
    """The row of a verl run from its step lines (``parse_verl_log`` with times) and its start
    time ``t0``; steady figures leave out the first ``warmup`` steps, as the Conveyor rows do."""
    from bench.e2e import summarize_curve
    from bench.gpu_e2e import compute_steady_rate

    times = [r["time"] for r in rows if "time" in r]
    steady = rows[warmup:]
    rate = compute_steady_rate(times, samples_per_step, warmup) or 0.0
    step_s = _mean([r.get("timing_s/step") for r in steady])
    timing = {k: _mean([r.get(f"timing_s/{k}") for r in steady]) for k in TIMING_PARTS}
    return {
        "steps": len(rows), "gpus": gpus, "startup_s": times[0] - t0 if times else None,
        "samples_trained": len(rows) * samples_per_step, "samples_dropped": {},
        "samples_per_s": rate, "samples_per_s_per_gpu": rate / gpus if rate else None,
        # verl's own clock: its step timer (the wait between steps left out).
        "samples_per_s_step_timer": samples_per_step / step_s if step_s else None,
        "completion_tokens_per_s": _mean([r["response_length/mean"] * samples_per_step / r["timing_s/step"]
                                          for r in steady if r.get("response_length/mean") is not None]),
        # Prompt and completion tokens of the step over its time (verl's perf/throughput x GPUs).
        "trainer_tokens_per_s": _mean([r.get("perf/total_num_tokens", 0) / r["timing_s/step"] for r in steady]) or None,
        "verl_timing_s": timing,
        "generation_share": timing["gen"] / timing["step"] if timing["gen"] and timing["step"] else None,
        "response_length_mean": _mean([r.get("response_length/mean") for r in steady]),
        **summarize_curve([(r["time"] - t0, r.get("critic/score/mean")) for r in rows if "time" in r]),
    }


def run_verl(job: VerlJob, rows: list[dict[str, Any]], root: Path, warmup: int,
             pythonpath: tuple[str, ...] = (), python: str = sys.executable) -> dict[str, Any]:
    """Run verl's GRPO trainer on ``job`` under ``root`` (its full output in ``root/verl.log``)
    and return its row; ``pythonpath``: directories put first on verl's path (a transformers at
    verl's pin, say). A failed run, or one that logs no training step, raises ``RuntimeError``
    with the log's last lines."""
    files = write_verl_files(job, rows, root)
    argv = [python, "-m", "verl.trainer.main_ppo", *build_verl_overrides(job, files, root)]
    site = verl_site()
    path = [*pythonpath, str(ROOT), *(site if site is not None else filter(None, [os.environ.get("PYTHONPATH")]))]
    # Ray's workers (agent loops, reward) inherit this environment: they import the agent loop
    # and the reward's task from this checkout.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
    timed: list[tuple[float, str]] = []
    t0 = time.time()
    with open(root / "verl.log", "w") as log, subprocess.Popen(
            argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            timed.append((time.time(), line))
            log.write(line)
    total = time.time() - t0
    if proc.returncode != 0:
        tail = "".join(line for _, line in timed[-60:])
        raise RuntimeError(f"verl exited with status {proc.returncode}; the end of {root / 'verl.log'}:\n{tail}")
    steps = parse_verl_log(timed)
    if not steps:
        tail = "".join(line for _, line in timed[-80:])
        raise RuntimeError(f"verl exited with status 0 but logged no training step (no `step:N` line with "
                           f"timing_s/step); the end of {root / 'verl.log'}:\n{tail}")
    return {"system": f"verl-grpo-{job.trainer_mode}", "verl_version": verl_version(),
            "pythonpath_first": list(pythonpath), "verl_site": site, "total_s": total, "argv": argv[1:],
            **summarize_verl_steps(steps, t0, job.prompts_per_step * job.group_size, job.gpus, warmup)}


def _mean(values: Iterable[Any]) -> float | None:
    """The mean of the numbers among ``values``; None when there are none."""
    nums = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return sum(nums) / len(nums) if nums else None


def verl_site() -> list[str] | None:
    """The directories ``CONVEYOR_VERL_SITE`` names (``os.pathsep``-separated), or None."""
    value = os.environ.get(VERL_SITE_ENV, "")
    return [p for p in value.split(os.pathsep) if p] or None


def verl_version() -> str | None:
    """verl's version where its processes will find it (``verl_site``, else this path)."""
    return _installed("verl", verl_site())


def _installed(dist: str, path: list[str] | None = None) -> str | None:
    from importlib.metadata import PackageNotFoundError, distributions, version

    if path is not None:
        found = next(iter(distributions(name=dist, path=path)), None)
        return found.version if found is not None else None
    try:
        return version(dist)
    except PackageNotFoundError:
        return None
