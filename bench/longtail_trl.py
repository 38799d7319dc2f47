"""The TRL row of ``bench longtail``: ``GRPOTrainer`` with vLLM colocated, each prompt held
to its own completion length, in a process of its own.

TRL (1.16) builds one ``SamplingParams`` for a whole generation batch, from
``max_completion_length``, and in colocate mode calls ``self.llm.generate(vllm_prompts,
sampling_params=..., use_tqdm=False)`` in ``trl/generation/vllm_generation.py``
(``VLLMGeneration.generate``), one request per sample (``n=1``), prompts as token ids.
The narrowest place to give each prompt its own length is that call: ``install_budgets``
replaces the ``generate`` of the trainer's ``vllm_generation.llm`` (the instance, not the
class) with one that passes vLLM a list of ``SamplingParams``, one per request, each a
clone of TRL's with ``max_tokens`` = ``min_tokens`` = the prompt's length, looked up by
its token ids (else by its decoded text). Everything else, TRL's sampling settings
included, is TRL's own. It also wraps that engine's ``step`` to time each finished request
(the samples in flight, ``stages.rollout.occupancy``), as the Conveyor rows' rollout does.

Guarantees: a prompt the schedule does not know stops the row (``KeyError`` naming it),
never a silent default length; TRL's ``max_completion_length`` is the schedule's cap.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.longtail_lengths import MAX_FIELD
from stages.rollout.occupancy import OccupancyMeter, compute_tail_wait, summarize_length_counts

TRL_MICRO_BATCH = 8  # samples per forward/backward pass: long completions, TRL pads to the longest of a pass
TRL_GPU_MEMORY = 0.45  # vLLM's share of the GPU: a long-tail step's KV cache (TRL's default is 0.3)


class BudgetTable:
    """Prompt token ids (or, failing that, decoded text) -> the prompt's length."""

    def __init__(self, tokenizer: Any, rows: list[dict[str, Any]]) -> None:
        self.tok = tokenizer
        self.by_ids: dict[tuple[int, ...], int] = {}
        self.by_text: dict[str, int] = {}
        for row in rows:
            prompt, n = row["prompt"], int(row[MAX_FIELD])
            if isinstance(prompt, list):
                text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                text, ids = prompt, tokenizer(prompt)["input_ids"]
            self.by_ids[tuple(ids)] = n
            self.by_text[self._norm(tokenizer.decode(ids, skip_special_tokens=False))] = n
        self.matched = {"ids": 0, "text": 0}

    @staticmethod
    def _norm(text: str) -> str:
        return text.strip()

    def lookup(self, prompt_ids: list[int]) -> int:
        key = tuple(prompt_ids)
        if key in self.by_ids:
            self.matched["ids"] += 1
            return self.by_ids[key]
        text = self._norm(self.tok.decode(list(prompt_ids), skip_special_tokens=False))
        if text in self.by_text:
            self.matched["text"] += 1
            return self.by_text[text]
        raise KeyError(f"longtail TRL row: vLLM was asked for a prompt the length schedule does not know: {text!r}")


def install_budgets(llm: Any, table: BudgetTable, meter: OccupancyMeter, lengths: dict[int, int]) -> None:
    """Make ``llm.generate`` give each request its prompt's length (module docstring), and
    count the samples in flight in ``meter`` and the lengths generated in ``lengths``."""
    original = llm.generate

    def generate(prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        params = []
        for p in prompts:
            n = table.lookup(p["prompt_token_ids"])
            own = sampling_params.clone()
            own.max_tokens, own.min_tokens = n, n
            params.append(own)
        meter.add(len(prompts), time.time())
        outputs = original(prompts, sampling_params=params, **kwargs)
        for out in outputs:
            for c in out.outputs:
                lengths[len(c.token_ids)] = lengths.get(len(c.token_ids), 0) + 1
        if meter.level:  # requests whose finish the step wrapper did not see
            meter.remove(meter.level, time.time())
        return outputs

    llm.generate = generate
    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "step"):
        step = engine.step

        def timed_step() -> Any:
            outs = step()
            done = sum(1 for o in outs if getattr(o, "finished", False))
            if done:
                meter.remove(min(done, meter.level), time.time())
            return outs

        engine.step = timed_step


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    """The TRL row of a job (``spec``: written by ``run_trl_isolated``)."""
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.e2e import build_trl_args, summarize_curve
    from bench.gpu_e2e import compute_steady_rate
    from pipeline.config import load_config
    from stages.data.tasks import load_task
    from stages.models.tiny import resolve_model_path

    t0 = time.time()
    cfg = load_config(Path(spec["config"]), spec["overrides"])
    path = resolve_model_path(cfg.model)
    task = load_task(cfg.data.task, **cfg.data.task_kwargs)
    rows = [json.loads(line) for line in Path(spec["prompts_path"]).read_text().splitlines() if line.strip()]
    steps, warmup, per_step = spec["steps"], spec["warmup"], cfg.train.prompts_per_step * cfg.rollout.n
    from bench.e2e import build_trl_dataset

    data = build_trl_dataset(rows)
    tokenizer = AutoTokenizer.from_pretrained(path)
    table, meter, lengths = BudgetTable(tokenizer, rows), OccupancyMeter(), {}

    def reward(prompts: list[Any], completions: list[Any], ground_truth: list[str], data_source: list[str],
               **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(task.compute_score(ds, c, gt)) for c, gt, ds in zip(texts, ground_truth, data_source, strict=True)]

    times: list[float] = []
    curve: list[tuple[float, float | None]] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            times.append(time.time())

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                curve.append((time.time() - t0, float(logs["reward"])))

    micro = min(TRL_MICRO_BATCH, per_step)
    trl_args = {**build_trl_args(cfg, Path(spec["root"]), steps), "per_device_train_batch_size": micro,
                "gradient_accumulation_steps": per_step // micro, "max_completion_length": cfg.rollout.max_tokens}
    args = GRPOConfig(**trl_args, bf16=True, model_init_kwargs={"dtype": torch.bfloat16}, use_vllm=True,
                      vllm_mode="colocate", vllm_gpu_memory_utilization=TRL_GPU_MEMORY, vllm_enable_sleep_mode=False,
                      vllm_max_model_length=cfg.data.max_prompt_len + cfg.rollout.max_tokens)
    trainer = GRPOTrainer(model=str(path), reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Record()])
    install_budgets(trainer.vllm_generation.llm, table, meter, lengths)
    trainer.train()
    total = time.time() - t0
    span = times[-1] - times[warmup - 1] if len(times) > warmup else 0.0
    tail = compute_tail_wait(meter.seconds_at())
    return {
        "system": "trl-grpo-vllm-colocate", "steps": trainer.state.global_step, "startup_s": times[0] - t0 if times
        else None, "total_s": total, "warmup_steps": warmup, "samples_trained": trainer.state.global_step * per_step,
        "samples_per_s": compute_steady_rate(times, per_step, warmup),
        "step_s": span / (len(times) - warmup) if span else None,
        "tail": tail, "tail_share": tail["tail_share"], "lengths": summarize_length_counts(lengths),
        "budget_lookups": table.matched, "micro_batch": micro,
        "budget_hook": "trainer.vllm_generation.llm.generate (VLLMGeneration.generate, colocate mode): "
                       "one SamplingParams per request, max_tokens = min_tokens = the prompt's length",
        **summarize_curve(curve),
    }


def run_trl_isolated(job: Any, root: Path, warmup: int) -> dict[str, Any]:
    """``run_trl`` in a process of its own (TRL's vLLM keeps its GPU memory until its
    process exits), its row read back."""
    from bench.e2e import _version

    root.mkdir(parents=True, exist_ok=True)
    spec = {"config": str(job.config), "overrides": list(job.overrides), "steps": job.steps, "warmup": warmup,
            "prompts_path": str(job.prompts_path), "root": str(root)}
    (root / "spec.json").write_text(json.dumps(spec))
    out = root / "trl-row.json"
    code = subprocess.run([sys.executable, "-m", "bench.longtail_trl", str(root / "spec.json"), str(out)],
                          check=False).returncode
    if code != 0 or not out.is_file():
        raise RuntimeError(f"the TRL row's process exited with status {code} (its output is above)")
    return {**json.loads(out.read_text()), "trl_version": _version("trl")}


if __name__ == "__main__":  # SPEC_JSON OUT_JSON
    if len(sys.argv) != 3:
        sys.exit("usage: python -m bench.longtail_trl SPEC_JSON OUT_JSON")
    Path(sys.argv[2]).write_text(json.dumps(run_trl(json.loads(Path(sys.argv[1]).read_text()))))
