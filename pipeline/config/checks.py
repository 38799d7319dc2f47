"""Cross-field rules, run after decoding and before any actor starts: each failure is a
``ConfigError`` naming the key to change and what was expected."""

from __future__ import annotations

import re

from pipeline.config.base import ConfigError
from pipeline.config.data import DataConfig
from pipeline.config.model import LoraConfig
from pipeline.config.placement import PlacementEntry
from pipeline.config.rollout import ENGINE_KWARGS_OWNED
from pipeline.config.root import ConveyorConfig


def check_config(cfg: ConveyorConfig) -> None:
    """Cross-field rules that a single field's bounds cannot express."""
    df, tr, ro = cfg.dataflow, cfg.train, cfg.rollout
    check_colocate(cfg)  # first: its reasons say more than the generic rules it implies
    check_sampler_logprobs(cfg)
    if tr.prompts_per_step % df.prompts_per_micro_batch:
        raise ConfigError(
            f"train.prompts_per_step: expected a multiple of dataflow.prompts_per_micro_batch "
            f"({df.prompts_per_micro_batch}) so GRPO groups never straddle a step, "
            f"got {tr.prompts_per_step}"
        )
    if tr.prompts_per_step % (tr.ppo_mini_batches * df.prompts_per_micro_batch):
        raise ConfigError(
            f"train.ppo_mini_batches: expected train.prompts_per_step ({tr.prompts_per_step}) to split into "
            f"{tr.ppo_mini_batches} mini-batches of whole micro-batches (dataflow.prompts_per_micro_batch "
            f"{df.prompts_per_micro_batch}), got {tr.ppo_mini_batches}")
    if (tr.ppo_epochs > 1 or tr.ppo_mini_batches > 1) and any(e.endswith("->trainer") for e in cfg.record.edges):
        raise ConfigError(
            "record.edges: a recorded trainer input replays one optimizer update per step; with "
            "train.ppo_epochs or train.ppo_mini_batches > 1 a step makes several, so it cannot be recorded")
    check_staleness(cfg)
    if cfg.run.auto_resume and not tr.resumable:
        raise ConfigError("run.auto_resume: resumes from the newest checkpoint, and train.resumable: false writes "
                          "none; set train.resumable=true or run.auto_resume=false")
    if tr.num_ranks > 1 and any(e.endswith("->trainer") for e in cfg.record.edges):
        raise ConfigError(f"record.edges: replay retrains a recorded step on one rank; record with "
                          f"train.num_ranks 1, got {tr.num_ranks}")
    updates = cfg.run.steps * tr.ppo_epochs * tr.ppo_mini_batches
    if tr.lr_scheduler != "constant" and tr.warmup_steps >= updates:
        raise ConfigError(
            f"train.warmup_steps: expected < the run's optimizer updates ({updates}: run.steps x "
            f"train.ppo_epochs x train.ppo_mini_batches) for a decaying {tr.lr_scheduler} schedule, "
            f"got {tr.warmup_steps}"
        )
    if ro.n < 2 and cfg.algorithm.group_baseline:
        raise ConfigError(f"rollout.n: expected >= 2 for {cfg.algorithm.name} (group baseline), got {ro.n}")
    check_algorithm(cfg)
    # The trainer and the reference score sampled tokens under the full softmax; a
    # truncated sampler renormalises over the kept tokens, so even on-policy the ratio
    # would be the kept mass, not 1, and negative-advantage tokens would lose their
    # gradient. Until the same truncation is applied there, refuse it.
    if ro.top_p < 1.0:
        raise ConfigError(
            f"rollout.top_p: expected 1.0 (trainer and reference log-probs use the full softmax; "
            f"nucleus sampling would make every importance ratio wrong), got {ro.top_p}"
        )
    if ro.top_k != -1:
        raise ConfigError(
            f"rollout.top_k: expected -1 (off; trainer and reference log-probs use the full "
            f"softmax, top-k sampling would make every importance ratio wrong), got {ro.top_k}"
        )
    owned = sorted(k for k in ro.engine_kwargs if k in ENGINE_KWARGS_OWNED)
    if owned:
        raise ConfigError(f"rollout.engine_kwargs.{owned[0]}: set by Conveyor; use {ENGINE_KWARGS_OWNED[owned[0]]}")
    if not ro.recompute_on_update and ro.engine_kwargs.get("enable_prefix_caching"):
        raise ConfigError("rollout.engine_kwargs.enable_prefix_caching: true would let new requests start on KV "
                          "the old weights filled; rollout.recompute_on_update false turns it off")
    if ro.compile == "off" and "compilation_config" in ro.engine_kwargs:
        raise ConfigError("rollout.engine_kwargs.compilation_config: rollout.compile off sets vLLM's compilation "
                          "config; set one of them")
    if ro.engine_kwargs and ro.backend != "vllm":
        raise ConfigError(f"rollout.engine_kwargs: vLLM's engine arguments; rollout.backend is {ro.backend!r}")
    if ro.backend not in ("vllm", "hf") and ":" not in ro.backend:
        raise ConfigError(f"rollout.backend: expected 'vllm', 'hf' or 'module:attr', got {ro.backend!r}")
    if ro.sampler_tap == "verify" and (ro.backend != "vllm" or ro.engine_core == "subprocess"
                                       or ro.tensor_parallel_size > 1 or not ro.logprobs):
        raise ConfigError("rollout.sampler_tap: verify checks vLLM's log-probs in the rollout's process: it needs "
                          "rollout.backend vllm, rollout.engine_core in_process or auto, tensor_parallel_size 1 "
                          "and rollout.logprobs true")
    for edge in df.queue_sizes:
        if "->" not in edge:
            raise ConfigError(f"dataflow.queue_sizes.{edge}: expected an edge 'producer->consumer'")
    if cfg.run.script and df.nodes:
        raise ConfigError("run.script: set either a DataFlow script or dataflow.nodes, not both")
    for i, node in enumerate(df.nodes):
        if ":" not in node.node_class:
            raise ConfigError(f"dataflow.nodes[{i}].node_class: expected 'module:attr', got {node.node_class!r}")
    for edge in cfg.record.edges:
        if "->" not in edge:
            raise ConfigError(f"record.edges: expected 'producer->consumer', got {edge!r}")
    check_reward_sources(cfg)
    check_lora(cfg.model.lora)
    check_curriculum(cfg.data)
    check_pairs(cfg)
    check_eval(cfg)
    cfg.algorithm.check(cfg)  # the algorithm's own rules, in its module
    if cfg.reward.path is not None and cfg.reward.function != "task":
        raise ConfigError(
            f"reward.path: set either reward.function ({cfg.reward.function!r}) or reward.path with "
            f"reward.name (verl's spelling), not both"
        )


def check_staleness(cfg: ConveyorConfig) -> None:
    """η covers a sync interval; ``auto`` needs something to tune: streaming generation
    (lock-step waits for every step, offline data is generated by no policy) and a cap
    that covers the interval too."""
    df, tr = cfg.dataflow, cfg.train
    # Step k trains at version k; with weights published every s steps the newest
    # version a step can generate on may be s - 1 steps old (sync mode included).
    if not cfg.auto_staleness and int(df.max_staleness) < tr.sync_interval - 1:
        raise ConfigError(
            f"dataflow.max_staleness: expected >= train.sync_interval - 1 "
            f"({tr.sync_interval - 1}), or some steps' samples could never be trained, "
            f"got {df.max_staleness}"
        )
    if not cfg.auto_staleness and df.tail_slack and int(df.max_staleness) - df.tail_slack < tr.sync_interval - 1:
        raise ConfigError(
            f"dataflow.tail_slack: expected <= dataflow.max_staleness - (train.sync_interval - 1) "
            f"({int(df.max_staleness) - tr.sync_interval + 1}): the slack comes out of η's lead, got {df.tail_slack}"
        )
    if not cfg.auto_staleness:
        return
    if not df.async_execution:
        raise ConfigError("dataflow.max_staleness: 'auto' needs dataflow.async_execution: true (lock-step "
                          "generates each step on the weights of the step before: there is no lead to tune)")
    if cfg.algorithm.offline:
        raise ConfigError(f"dataflow.max_staleness: 'auto' tunes how far generation runs ahead of training; "
                          f"algorithm {cfg.algorithm.name!r} trains on data rows that no policy generated")
    if df.max_staleness_cap < tr.sync_interval - 1:
        raise ConfigError(f"dataflow.max_staleness_cap: expected >= train.sync_interval - 1 "
                          f"({tr.sync_interval - 1}), or some steps' samples could never be trained, "
                          f"got {df.max_staleness_cap}")


def check_colocate(cfg: ConveyorConfig) -> None:
    """``placement: colocate`` time-shares a GPU between generation and training, one
    after the other: lock-step, on-policy, weights after every step (the rollout wakes
    to load them: it dropped its own), vLLM (whose sleep mode frees the memory), each
    replica on one GPU, and GPUs the planner chooses."""
    if cfg.placement.mode != "colocate":
        return
    df, tr, ro = cfg.dataflow, cfg.train, cfg.rollout
    wrong = [("dataflow.async_execution: expected false (generation and training take turns on the GPU), got true",
              df.async_execution),
             (f"algorithm.name: expected an on-policy algorithm (with {cfg.algorithm.name!r} no rollout generates, "
              f"so nothing sleeps)", cfg.algorithm.offline),
             (f"algorithm.name: {cfg.algorithm.name!r} trains a critic, which does not give the GPU back while vLLM "
              f"generates; use placement: auto", cfg.algorithm.needs_critic),
             ("reward.sources: a reward model does not give the GPU back while vLLM generates; use placement: auto",
              cfg.reward_model_enabled),
             (f"dataflow.max_staleness: expected 0 (a step generates on the weights of the step before), "
              f"got {df.max_staleness!r}", df.max_staleness != 0),
             (f"train.sync_interval: expected 1 (the rollout drops its weights while it sleeps and wakes "
              f"to load the next ones), got {tr.sync_interval}", tr.sync_interval != 1),
             ("rollout.backend: expected 'vllm' (its sleep mode frees the GPU memory) or a plug-in backend with "
              "sleep and wake_up, got 'hf'", ro.backend == "hf"),
             (f"train.ppo_mini_batches: expected 1 (a colocated step trains once it is whole), got "
              f"{tr.ppo_mini_batches}", tr.ppo_mini_batches != 1),
             (f"rollout.tensor_parallel_size: expected 1 (a tensor-parallel replica takes GPUs of its "
              f"own), got {ro.tensor_parallel_size}", ro.tensor_parallel_size != 1),
             *((f"placement.{f}: expected no gpus or num_gpus (colocate plans the GPUs itself)",
                entry.gpus is not None or entry.num_gpus > 0)
               for f in cfg.placement.__struct_fields__
               if isinstance(entry := getattr(cfg.placement, f), PlacementEntry))]
    for message, bad in wrong:
        if bad:
            raise ConfigError(f"{message} with placement: colocate")


def check_sampler_logprobs(cfg: ConveyorConfig) -> None:
    """``rollout.logprobs: false``: the trainer's detached log-probs stand in for the
    sampler's, which is exact only where every sample is trained, in one update, by the
    weights that generated it, and nothing else reads the sampler's log-probs."""
    if cfg.rollout.logprobs:
        return
    df, tr, algo = cfg.dataflow, cfg.train, cfg.algorithm
    wrong = [(f"dataflow.max_staleness: expected 0 (samples trained by the weights that generated them), "
              f"got {df.max_staleness!r}", df.max_staleness != 0),
             (f"train.sync_interval: expected 1 (the rollout serves every step's weights), got {tr.sync_interval}",
              tr.sync_interval != 1),
             (f"train.ppo_epochs: expected 1 (a later epoch's ratio needs the sampler's log-probs), "
              f"got {tr.ppo_epochs}", tr.ppo_epochs != 1),
             (f"train.ppo_mini_batches: expected 1 (after the first update the weights are no longer the "
              f"sampler's), got {tr.ppo_mini_batches}", tr.ppo_mini_batches != 1),
             (f"algorithm.off_policy: expected 'off' (its importance weight divides by the sampler's "
              f"log-probs), got {algo.off_policy!r}", algo.off_policy != "off"),
             ("algorithm.use_kl_in_reward: expected false (its penalty reads the sampler's log-probs)",
              algo.use_kl_in_reward)]
    for message, bad in wrong:
        if bad:
            raise ConfigError(f"{message} with rollout.logprobs: false")


def check_lora(lora: LoraConfig) -> None:
    """``model.lora.target_modules``: ``all-linear``, a non-empty regular expression, or a
    non-empty list of module names."""
    targets = lora.target_modules
    if isinstance(targets, list):
        blank = [i for i, name in enumerate(targets) if not name.strip()]
        if not targets or blank:
            raise ConfigError(f"model.lora.target_modules: expected 'all-linear', a regular expression or a "
                              f"non-empty list of module names, got {targets!r}")
        return
    if not targets.strip():
        raise ConfigError("model.lora.target_modules: expected 'all-linear', a regular expression or a list of "
                          "module names, got an empty string")
    if targets != "all-linear":
        try:
            re.compile(targets)
        except re.error as exc:
            raise ConfigError(f"model.lora.target_modules: {targets!r} is not a valid regular expression ({exc})") from None


def check_curriculum(data: DataConfig) -> None:
    """``data.curriculum``: over a data file, strictly increasing levels, a start among them,
    a demotion threshold below the promotion one."""
    cur = data.curriculum
    if cur is None:
        return
    if not data.path:
        raise ConfigError("data.curriculum: expected data.path (rows with a level column), got a task")
    if any(b <= a for a, b in zip(cur.levels, cur.levels[1:], strict=False)):
        raise ConfigError(f"data.curriculum.levels: expected strictly increasing levels, got {cur.levels}")
    if cur.start is not None and cur.start not in cur.levels:
        raise ConfigError(f"data.curriculum.start: expected one of {cur.levels}, got {cur.start}")
    if cur.demote_below is not None and cur.demote_below >= cur.promote_at:
        raise ConfigError(f"data.curriculum.demote_below: expected < promote_at ({cur.promote_at}), "
                          f"got {cur.demote_below}")


def check_eval(cfg: ConveyorConfig) -> None:
    """``eval``: a rollout to generate with, published versions to evaluate, and samples
    that can differ when there are several."""
    ev = cfg.eval
    if not ev.enabled:
        return
    if cfg.algorithm.offline:
        raise ConfigError(f"eval.path: evaluation generates with the rollout, and algorithm.name "
                          f"{cfg.algorithm.name!r} runs none")
    if ev.every % cfg.train.sync_interval:
        raise ConfigError(f"eval.every: expected a multiple of train.sync_interval ({cfg.train.sync_interval}): "
                          f"only published versions can be evaluated, got {ev.every}")
    if ev.n > 1 and ev.temperature == 0:
        raise ConfigError(f"eval.n: expected 1 with eval.temperature 0 (greedy completions are all the same), "
                          f"got {ev.n}; set eval.temperature above 0 for pass@k")


def check_pairs(cfg: ConveyorConfig) -> None:
    """An offline algorithm (``dpo``) and ``data.pairs`` go together; its own rules are its ``check``."""
    algo, data = cfg.algorithm, cfg.data
    if algo.offline != (data.pairs is not None):
        raise ConfigError(f"data.pairs: expected a pairs section exactly with algorithm.name dpo "
                          f"(algorithm.name is {algo.name!r}, data.pairs is {'set' if data.pairs else 'unset'})")


def check_reward_sources(cfg: ConveyorConfig) -> None:
    """``reward.sources``: one model source with a path, at most one function source."""
    sources = cfg.reward.sources
    if not sources:
        return
    kinds = {name: src.kind for name, src in sources.items()}
    if list(kinds.values()).count("model") != 1 or list(kinds.values()).count("function") > 1:
        raise ConfigError(f"reward.sources: expected one source of kind 'model' and at most one of kind "
                          f"'function', got {kinds}")
    for name, src in sources.items():
        if src.kind == "model" and not src.path:
            raise ConfigError(f"reward.sources.{name}.path: expected a local reward model checkpoint directory "
                              f"(AutoModelForSequenceClassification, one logit), got none")
        if src.kind == "function" and src.path:
            raise ConfigError(f"reward.sources.{name}.path: a 'function' source is reward.function's score; "
                              f"path is for kind 'model'")
        if name in ("mean", "std", "max", "min", "errors"):
            raise ConfigError(f"reward.sources.{name}: the name is a reward metric of its own; choose another")


def check_algorithm(cfg: ConveyorConfig) -> None:
    """``algorithm`` fields that depend on other sections."""
    algo, ro = cfg.algorithm, cfg.rollout
    if algo.use_kl_in_reward and not cfg.reference_enabled:
        raise ConfigError("algorithm.use_kl_in_reward: needs reference log-probs, but reference.enabled is 'off'")
    if algo.drop_zero_variance_groups and not cfg.dataflow.async_execution:
        # Lock-step moves a fixed number of micro-batches per step; with dropped groups
        # replaced, the last prompts of a run can sit in the reward stage's regrouping
        # queue while the runner waits for admission room that only they would free.
        raise ConfigError(
            "algorithm.drop_zero_variance_groups: needs dataflow.async_execution: true (lock-step cannot "
            "schedule the replacements of dropped groups)")
    if algo.drop_zero_variance_groups and ro.n < 2:
        raise ConfigError(
            f"algorithm.drop_zero_variance_groups: needs rollout.n >= 2 (a group of one sample always has "
            f"zero variance), got rollout.n {ro.n}")
    if algo.needs_critic and algo.use_kl_in_reward and algo.kl_ctrl.type == "adaptive":
        # The critic assigns advantages and returns upstream of the trainer, whose KL
        # controller moves an adaptive coefficient; the critic sees only the fixed one.
        raise ConfigError(
            f"algorithm.kl_ctrl.type: expected 'fixed' with algorithm.name {algo.name!r} (the critic computes "
            f"returns with kl_ctrl.kl_coef), got 'adaptive'")
    if algo.overlong_buffer_len >= ro.max_tokens:
        raise ConfigError(
            f"algorithm.overlong_buffer_len: expected < rollout.max_tokens ({ro.max_tokens}), "
            f"got {algo.overlong_buffer_len}")
