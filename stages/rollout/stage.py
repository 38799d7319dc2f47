"""The rollout stage: the Ray actor shell around a generation backend (vLLM by default).

Guarantees:
- a micro-batch of prompts becomes one ``RolloutBatch`` holding every prompt's ``n``
  samples consecutively (GRPO groups stay whole), with behaviour log-probs and the policy
  version of every token;
- up to ``rollout.max_inflight`` micro-batches generate at once (continuous batching),
  each emitted as soon as its sequences finish;
- weights are applied as soon as published, while generation goes on; the payload's
  sha256 is checked first, and (``train.weight_sync_monitor``) the live weights are read
  back, a mismatch stopping the run before a token is sampled from them;
- at shutdown every worker serves and has verified the final policy;
- generation for step k waits for the newest version step k may train with
  (``required_serving_version`` under η as the controller last handed it with a weight
  update, less ``dataflow.tail_slack``), so no sample is made only to be dropped; that wait is a ``wait_version``
  span, and the micro-batch carries the η it was generated under to the trainer's gate;
- under ``rollout.memory`` a micro-batch generates only once its KV cache fits; queues
  carry whole micro-batches only; colocated, no micro-batch generates on a sleeping
  engine; with ``rollout.tools`` tool output is masked out of the loss;
- a prompt's own generation budget (``Prompt.max_tokens`` / ``min_tokens``, from
  ``data.max_tokens_field``) is honoured per request, clamped to ``rollout.max_tokens``:
  prompts of one budget share a backend call, the calls of a micro-batch run at once;
- ``result()`` reports the samples in flight over time (``occupancy``: seconds at each
  count, ``stages/rollout/occupancy.py``) and the completion lengths generated;
- an engine whose process died (``EngineDied``) is rebuilt in place, up to
  ``rollout.max_engine_restarts`` times (``stages/rollout/restarts.py``): the new one
  serves the version the dead one served, read back and matched to its fingerprint
  before anything generates on it (where that payload is gone from the trainer's
  ``cuda_ipc`` ring, the checkpoint until the newest version lands), and every
  micro-batch that was in flight generates again, whole, under its own prompt ids,
  once the engine serves the version it needs (one output per input, as ever).
- with an ``Evaluator`` (``build_evaluator``; ``stages/evaluation/``, worker 0 when
  ``eval`` is on), a version the schedule calls due is evaluated right after it is
  applied and before any newer one is, no sleep in between, so every token the
  evaluation scores comes from that version; ``finalize`` evaluates the final weights.
  Nothing the evaluation generates leaves as a ``RolloutBatch`` or counts in ``result()``.
Mechanisms: docs/architecture.md, "Rollout stage".
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections import Counter
from typing import Any, Protocol

import msgspec
import numpy as np

from pipeline.bound import SCHEDULER_FIGURES
from pipeline.controller import resolve_payload
from pipeline.memory.admission import ModelShape, estimate_kv_cache_bytes, expand_rollout_seq_lens
from pipeline.memory.guard import MemoryGuard, build_pool_reading
from pipeline.memory.oom import run_with_oom_recovery
from pipeline.memory.splitting import count_groups, split_prompt_batch
from pipeline.plugins import register_stage
from pipeline.types import EvalResult, PromptBatch, RolloutBatch, WeightConfirmation
from pipeline.versions import compute_lookahead, required_serving_version
from pipeline.weights import WeightSyncError, compute_sha256, fingerprints_match
from stages.rollout.base import EngineDied, GenerationResult, SamplingSettings, apply_budget
from stages.rollout.occupancy import OccupancyMeter, summarize_length_counts
from stages.rollout.restarts import EngineRestarts, find_engine_death


def pad_rows(rows: list[list[Any]], dtype: Any, fill: Any = 0) -> np.ndarray:
    """Right-pad ragged rows into a [len(rows), max_len] array (max_len >= 1)."""
    width = max((len(r) for r in rows), default=0) or 1
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def build_rollout_batch(pb: PromptBatch, results: list[GenerationResult], n: int, pad_id: int,
                        max_staleness: int | None = None) -> RolloutBatch:
    """Assemble the wire batch: sample ``i*n + j`` is completion j of prompt i;
    ``max_staleness``: the η it was generated under."""
    if len(results) != len(pb.prompts):
        raise ValueError(f"batch {pb.batch_id}: {len(results)} generation results for {len(pb.prompts)} prompts")
    prompt_rows, comp_rows, lp_rows, ver_rows = [], [], [], []
    sample_ids, texts, reasons = [], [], []
    for prompt, res in zip(pb.prompts, results, strict=True):
        if len(res.completions) != n:
            raise ValueError(f"prompt {prompt.prompt_id}: {len(res.completions)} completions, expected n={n}")
        for j, c in enumerate(res.completions):
            prompt_rows.append(res.prompt_token_ids)
            comp_rows.append(c.token_ids)
            lp_rows.append(c.logprobs)
            ver_rows.append(c.token_versions)
            sample_ids.append(f"{prompt.prompt_id}/{j}")
            texts.append(c.text)
            reasons.append(c.finish_reason)
    versions = [v for row in ver_rows for v in row]
    completions = [c for res in results for c in res.completions]
    masked = any(c.loss_mask for c in completions)
    loss_mask = pad_rows([c.loss_mask or [True] * len(c.token_ids) for c in completions], bool, False) if masked else None
    keys = sorted({k for c in completions for k in c.extras})
    extras = {k: [float(c.extras.get(k, float("nan"))) for c in completions] for k in keys}
    return RolloutBatch(
        batch_id=pb.batch_id,
        step=pb.step,
        prompts=pb.prompts,
        group_size=n,
        sample_ids=sample_ids,
        prompt_ids=pad_rows(prompt_rows, np.int32, pad_id),
        prompt_lens=np.array([len(r) for r in prompt_rows], dtype=np.int32),
        completion_ids=pad_rows(comp_rows, np.int32, pad_id),
        completion_lens=np.array([len(r) for r in comp_rows], dtype=np.int32),
        completions=texts,
        behaviour_logprobs=pad_rows(lp_rows, np.float32, 0.0),
        token_versions=pad_rows(ver_rows, np.int32, -1),
        policy_version=min(versions) if versions else 0,
        finish_reasons=reasons,
        loss_mask=loss_mask,
        rollout_extras=extras,
        max_staleness=max_staleness,
    )


def _join_results(parts: list[list[GenerationResult]]) -> list[GenerationResult]:
    return [r for part in parts for r in part]


def group_by_budget(prompts: list[Any], sampling: SamplingSettings) -> list[tuple[SamplingSettings, list[int]]]:
    """The settings each prompt generates under (its own budget applied: ``apply_budget``)
    and the indices of the prompts sharing them, in order of first appearance."""
    groups: dict[tuple[int, int], tuple[SamplingSettings, list[int]]] = {}
    for i, p in enumerate(prompts):
        own = apply_budget(sampling, p.max_tokens, p.min_tokens)
        groups.setdefault((own.max_tokens, own.min_tokens), (own, []))[1].append(i)
    return list(groups.values())


OBSERVED_RESERVE_AFTER = 64  # samples generated before rollout.kv_reserve "observed" reserves their p90


def reserve_completion(budget: int, observed: int | None) -> int:
    """Completion tokens a sample of generation budget ``budget`` reserves in KV admission
    (``rollout.kv_reserve``): the budget, or the smaller of it and ``observed`` (the p90
    of the completions generated so far, under "observed" once there are enough)."""
    return budget if observed is None else min(budget, max(1, observed))


def describe_kv_admission(shape: ModelShape, budget_bytes: int, seq_tokens: int, max_num_seqs: int | None,
                          own_budgets: bool) -> tuple[int, str | None]:
    """The most samples the rollout's KV admission lets generate at once when each reserves
    ``seq_tokens`` (``data.max_prompt_len`` + ``rollout.max_tokens``) of a ``budget_bytes``
    budget, and, where that is fewer than the ``max_num_seqs`` the engine was planned for
    and prompts carry no generation budget of their own (``own_budgets``), why and what to
    change. A sample reserves its whole length from its first token: a cap far above the
    usual completion leaves most of the cache unused while generation waits."""
    most = budget_bytes // max(1, estimate_kv_cache_bytes(shape, seq_tokens))
    if own_budgets or max_num_seqs is None or most >= max_num_seqs:
        return most, None
    return most, (
        f"KV admission lets at most {most} samples generate at once, of the {max_num_seqs} the engine was planned "
        f"for: each reserves data.max_prompt_len + rollout.max_tokens = {seq_tokens} tokens of KV cache until it "
        f"ends ({budget_bytes / 2**30:.1f} GiB budget). Lower rollout.max_tokens to what completions need, give "
        "prompts their own budget (data.max_tokens_field), enlarge the cache (rollout.kv_cache_gib, "
        "rollout.gpu_memory_utilization), reserve what completions have taken (rollout.kv_reserve=observed), or "
        "reserve nothing (rollout.kv_reserve=none): vLLM's scheduler then admits while blocks are free and preempts "
        "when they run out")


class Generate(Protocol):
    async def __call__(self, prompt_ids: list[list[int]], texts: list[str],
                       sampling: SamplingSettings) -> list[GenerationResult]: ...


class Evaluator(Protocol):
    """What the rollout needs from an evaluation of the held-out set (``stages/evaluation``)."""

    def kind(self, version: int) -> str | None:
        """``before_train`` or ``periodic`` when ``version`` is due an evaluation, else None."""
        ...

    def done(self, version: int) -> bool:
        """``version`` was evaluated already."""
        ...

    async def evaluate(self, generate: Generate, version: int, kind: str, worker: str) -> EvalResult:
        """Generate with ``generate`` (the engine serves ``version`` throughout) and score."""
        ...


@register_stage("rollout")
class RolloutStage:
    takes, gives = PromptBatch, RolloutBatch  # pipeline/contracts.py

    def __init__(self) -> None:
        self.generated_samples = 0
        self.generated_tokens = 0
        # Counters and the last update only: a long run applies one update per sync.
        self.applied_count, self.apply_s_total = 0, 0.0
        self.last_applied: dict[str, Any] | None = None
        self._watch_error: BaseException | None = None
        # placement: colocate: sleeps and wakes (counters), and generation in progress.
        self.colocated, self.asleep = False, False
        self._asleep_for = -1  # the version whose training the engine sleeps for
        self._weights_freed = False  # asleep with the weights' memory freed too
        self.sleeps, self.sleep_s_total, self.wake_s_total = 0, 0.0, 0.0
        self._generating = 0
        self.occupancy = OccupancyMeter()  # samples in flight in the engine over time
        self.max_staleness: int | None = None  # η as the controller last handed it (max_staleness: auto raises it)
        self.length_counts: Counter[int] = Counter()  # completion length -> samples
        self.reserve_tokens: int | None = None  # rollout.kv_reserve "observed": completion tokens reserved
        self.kv_admission_seqs: int | None = None  # "cap": samples admission lets generate at once at the cap
        # What a rebuilt engine loads again: (update, payload, fingerprint) of the weights
        # served now (the payload is held for it), None for the checkpoint, whose
        # fingerprint the engine read back at set-up.
        self._serving: tuple[Any, Any, tuple[float, float]] | None = None
        self._checkpoint_fingerprint: tuple[float, float] | None = None
        self.reissued_batches = 0  # micro-batches generated again after an engine death
        self.evaluator: Evaluator | None = None

    async def setup(self, ctx: Any) -> None:
        importing = time.monotonic()
        from transformers import AutoTokenizer

        from stages.models.tiny import resolve_model_path
        from stages.rollout import build_backend, build_sampling_settings

        self.ctx = ctx
        cfg = ctx.config
        self.cfg = cfg
        began = time.monotonic()
        model_path = resolve_model_path(cfg.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # imports: transformers and the backend's modules (vLLM's), loaded on first use.
        self.startup_phases = {"imports": began - importing, "model_files": time.monotonic() - began}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        dtype = cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
        self.colocated = cfg.placement.mode == "colocate"
        self.sampling = build_sampling_settings(cfg.rollout, None)
        if cfg.rollout.tools is not None:
            from stages.rollout.tools import load_tools

            self.tools = load_tools(cfg.rollout.tools.functions)
        self._new_backend = lambda: build_backend(cfg.rollout.backend, model_path, cfg.rollout, dtype)
        compiling = "torch.compile, " if cfg.rollout.compile == "on" else ""
        self.setup_doing = (f"starting vLLM's engine (weights, {compiling}CUDA graphs, KV cache)"
                            if cfg.rollout.backend == "vllm" else f"starting the {cfg.rollout.backend} backend")
        self.backend = await self._start_backend(self.startup_phases)
        self.restarts = EngineRestarts(cfg.rollout.max_engine_restarts, ctx.worker_id)
        if self._rebuildable:
            # What an engine rebuilt before the first update is checked against.
            self.setup_doing = "reading the served weights' fingerprint"
            reading = time.monotonic()
            self._checkpoint_fingerprint = tuple(await self.backend.live_fingerprint())
            self.startup_phases["fingerprint"] = time.monotonic() - reading
        hf_config = json.loads((model_path / "config.json").read_text())
        self.shape = ModelShape.from_hf_config({**hf_config, "torch_dtype": dtype})
        # Admission's KV budget: the cache the engine made (vLLM reports its blocks), else
        # rollout.kv_cache_gib (1 GiB unset).
        tokens = getattr(self.backend, "kv_cache_tokens", lambda: None)()
        self.kv_cache_bytes = (estimate_kv_cache_bytes(self.shape, tokens) if tokens
                               else int(cfg.rollout.kv_cache_budget_gib * (1 << 30)))
        pool = build_pool_reading(self.kv_cache_bytes)
        if tokens and cfg.rollout.kv_cache_gib is None:
            # An engine rebuilt after a death gets the cache this one made: sized by
            # profiling, it would measure a GPU whose memory the trainer beside it uses.
            rebuilt = msgspec.structs.replace(cfg.rollout, kv_cache_gib=self.kv_cache_bytes / (1 << 30))
            self._new_backend = lambda: build_backend(cfg.rollout.backend, model_path, rebuilt, dtype)
        self.guard = MemoryGuard(ctx.name, cfg.rollout.memory, read=lambda: pool, spans=ctx.spans)
        if self.guard.protected and cfg.rollout.kv_reserve_policy == "cap":
            self.kv_admission_seqs, why = describe_kv_admission(
                self.shape, self.guard.controller.budget_for(pool), cfg.data.max_prompt_len + cfg.rollout.max_tokens,
                cfg.rollout.max_num_seqs, own_budgets=cfg.data.max_tokens_field is not None)
            if why is not None:
                ctx.log.warning("kv_admission_limits_generation", detail=why)
        self._version_changed = asyncio.Condition()
        self._idle = asyncio.Condition()  # notified when a generation ends
        self._applying = asyncio.Lock()  # shutdown waits for an update in progress; sleeps wait too
        self.evaluator = self.build_evaluator(ctx, model_path)
        self._watchers = [asyncio.create_task(self._watch(loop)) for loop in
                          (self._watch_weights, *([self._watch_sleep_requests] if self.colocated else []))]

    async def _start_backend(self, phases: dict[str, float] | None = None) -> Any:
        """A new backend of ``rollout.backend``, started and warmed up, serving the
        checkpoint (version 0); ``phases`` gets the seconds of ``engine``, ``warm_up`` and,
        where vLLM compiled the model here, ``compile`` or ``compile_cached``."""
        began = time.monotonic()
        backend = self._new_backend()
        if self.colocated and not (hasattr(backend, "sleep") and hasattr(backend, "wake_up")):
            raise ValueError(f"placement: colocate needs a rollout backend that can sleep and wake up; "
                             f"rollout.backend {self.cfg.rollout.backend!r} cannot")
        await backend.start()
        # Warm the engine up (its first call compiles and allocates) before timing starts.
        warm = [self.tokenizer(p, add_special_tokens=True)["input_ids"] for p in ("0", "1")]
        warming = time.monotonic()
        self.setup_doing = "warming the engine up"
        await backend.generate(warm, msgspec.structs.replace(self.sampling, max_tokens=1))
        if phases is not None:
            # torch.compile's seconds are a part of the engine's start-up of their own
            # (fresh, or from vLLM's cache): the one that a second run of a model skips.
            compiled = getattr(backend, "compile_phase", {})
            phases.update(engine=warming - began - sum(compiled.values()), **compiled,
                          warm_up=time.monotonic() - warming)
        return backend

    # ------------------------------------------------------------------ engine restarts
    @property
    def _rebuildable(self) -> bool:
        """An engine death here is answered by a rebuild (which needs the served payload)."""
        return self.restarts.limit > 0 and not self.colocated

    async def _restart_engine(self, epoch: int, death: EngineDied) -> None:
        async with self._applying:  # no update (or sleep) meanwhile
            await self._restart_engine_locked(epoch, death)

    async def _restart_engine_locked(self, epoch: int, death: EngineDied) -> None:
        """Rebuild the engine that died under ``epoch`` (once: module guarantees)."""
        if self.restarts.is_answered(epoch):
            return
        if self.colocated:
            raise EngineDied(f"{self.ctx.worker_id}: the rollout engine died ({death}); under placement: colocate it "
                             f"is not rebuilt, as the trainer may hold its GPU memory") from death
        number = self.restarts.admit(death)  # raises past rollout.max_engine_restarts
        version = self.backend.version
        self.ctx.log.warning("engine_died", restart=number, max_engine_restarts=self.restarts.limit,
                             policy_version=version, error=str(death))
        t0 = time.time()
        with self.ctx.spans.span("sync"):
            try:
                await self.backend.shutdown()
            except Exception as err:  # it is dead; the runner reaps what is left at the end
                self.ctx.log.warning("dead_engine_shutdown_failed", error=repr(err))
            backend = await self._start_backend()
            try:
                await self._serve_again(backend)
            except BaseException:
                await backend.shutdown()
                raise
        self.backend = backend
        self.restarts.took_over()
        self.ctx.log.warning("engine_restarted", restart=number, policy_version=version,
                             seconds=round(time.time() - t0, 1))
        async with self._version_changed:
            self._version_changed.notify_all()

    async def _serve_again(self, backend: Any) -> None:
        """Load into a rebuilt ``backend`` the version served before its death, read
        back and matched to the fingerprint it was served with. A payload that cannot
        load again while a newer version is published (a ``cuda_ipc`` ring slot the
        trainer has rewritten since) leaves it on the checkpoint, as after set-up: the
        watcher applies the newest version, and micro-batches wait for the one they need."""
        if self._serving is not None:
            update, payload, expected = self._serving
            data = await self._read_payload(update, payload)
            try:  # read back (verify on), as every update with weight_sync_monitor
                live = await backend.update_weights(data, update.version)
            except WeightSyncError as err:
                newer, _ = await self.ctx.controller.latest_update()
                if newer is None or newer.version <= update.version:
                    raise
                self.ctx.log.warning("served_weights_gone", policy_version=update.version, newest=newer.version,
                                     error=str(err))
                self._serving = None
            else:
                self._check_served(update.version, expected, live)
                return
        # The checkpoint: a fresh engine's, or one whose refused load left it there.
        self._check_served(0, self._checkpoint_fingerprint, await backend.live_fingerprint())

    def _check_served(self, version: int, expected: tuple[float, float] | None, live: Any) -> None:
        if expected is None or not fingerprints_match(tuple(expected), tuple(live)):
            raise WeightSyncError(
                f"{self.ctx.worker_id}: the rebuilt rollout engine's weights (fingerprint {tuple(live)}) are not "
                f"version v{version} that the dead engine served (fingerprint {expected})"
            )

    async def _load_update(self, data: bytes, version: int, verify: bool) -> Any:
        """The backend's ``update_weights``, on a rebuilt engine after an engine death.
        ``verify`` is passed only when off: a plug-in backend of the two-argument protocol
        keeps working with the default. Called with ``_applying`` held."""
        while True:
            epoch = self.restarts.epoch
            try:
                return await (self.backend.update_weights(data, version) if verify
                              else self.backend.update_weights(data, version, verify=False))
            except Exception as exc:
                death = find_engine_death(exc)
                if death is None:
                    raise
                await self._restart_engine_locked(epoch, death)
    def build_evaluator(self, ctx: Any, model_path: Any) -> Evaluator | None:
        """None: this stage evaluates nothing (``stages/evaluation/stage.py`` overrides it)."""
        return None

    # ------------------------------------------------------------------ weights
    async def _read_payload(self, update: Any, payload_ref: Any) -> bytes:
        """The payload's bytes, checked against the sha256 it was published with."""
        data = await resolve_payload(payload_ref)
        sha = compute_sha256(data)
        if sha != update.sha256:
            raise WeightSyncError(
                f"{self.ctx.worker_id}: weights v{update.version} arrived corrupt "
                f"(sha256 {sha[:12]} != published {update.sha256[:12]})"
            )
        return data

    async def _watch(self, loop: Any) -> None:
        try:
            await loop()
        except BaseException as exc:  # surfaced by the process() calls waiting, and the next
            self._watch_error = exc
            if not isinstance(exc, asyncio.CancelledError):
                self.ctx.fail(exc)  # and the stage's run ends now, whether or not a call waits
            async with self._version_changed:
                self._version_changed.notify_all()
            raise

    async def _watch_weights(self) -> None:
        evaluating = self.evaluator is not None
        if evaluating and self.evaluator.kind(self.backend.version) is not None:
            async with self._applying:  # before_train: the weights the engine started with
                await self._evaluate_locked(self.evaluator.kind(self.backend.version))
        confirmed = None  # the confirmation of an update rides on the next wait
        while True:
            newer = max(self.backend.version, self._asleep_for) if self.asleep else self.backend.version
            update, payload, eta = await self.ctx.controller.wait_for_update(newer, None, confirmed, evaluating)
            if eta is not None:
                self.max_staleness = eta  # before the update lands: its version waits use it
            if update is None:
                return  # the run is stopping
            if self.asleep and update.version <= self._asleep_for:
                confirmed = None  # found before the sleep: the trainer trains on it now; the next one wakes us
                continue
            kind = self.evaluator.kind(update.version) if evaluating else None
            if kind is None:
                confirmed = await self._apply(update, payload)
            else:
                await self._apply_and_evaluate(update, payload, kind)
                confirmed = None  # confirmed before the evaluation

    async def _apply_and_evaluate(self, update: Any, payload: Any, kind: str) -> None:
        """Apply a version due an evaluation and evaluate it while holding updates and
        sleeps back: the engine serves exactly that version until the result is in."""
        async with self._applying:
            if update.version > self.backend.version:
                # Confirmed now: the board shows the version served, not after the evaluation.
                await self.ctx.controller.confirm(await self._apply_locked(update, payload))
            if self.backend.version == update.version and not self.evaluator.done(update.version):
                await self._evaluate_locked(kind)

    async def _evaluate_locked(self, kind: str) -> None:
        """Evaluate the version served now (the caller holds ``_applying``) and report it."""
        version = self.backend.version
        self._generating += 1  # a colocated sleep waits for it
        try:
            with self.ctx.spans.span("eval"):
                result = await self.evaluator.evaluate(functools.partial(self._generate_prompts, metered=False),
                                                       version, kind, self.ctx.worker_id)
        finally:
            async with self._idle:
                self._generating -= 1
                self._idle.notify_all()
        await self.ctx.controller.report_eval(result)
        self.ctx.log.info("evaluated", policy_version=version, kind=kind, seconds=round(result.wall_s, 2),
                          **{k.removeprefix("eval/"): round(v, 4) for k, v in result.metrics.items()
                             if k in ("eval/reward_mean", "eval/greedy_reward", "eval/pass@1")})

    async def _watch_sleep_requests(self) -> None:
        """placement: colocate: sleep when the trainer asks for the GPU (module guarantees)."""
        seen = -1
        while True:
            seen = await self.ctx.controller.wait_for_sleep_request(seen)
            async with self._applying:
                async with self._idle:
                    await self._idle.wait_for(lambda: self._generating == 0)
                    sleep = not self.asleep
                    # From here no generation starts (version waits see it) and only a
                    # version newer than ``seen`` wakes the engine.
                    self.asleep, self._asleep_for = True, seen
                    self._weights_freed |= sleep
                if sleep:
                    t0 = time.time()
                    with self.ctx.spans.span("sync"):
                        await self.backend.sleep()
                    self.sleeps += 1
                    self.sleep_s_total += time.time() - t0
            await self.ctx.controller.confirm_asleep(self.ctx.worker_id, seen)

    async def _wake(self, tags: list[str]) -> None:
        t0 = time.time()
        await self.backend.wake_up(tags)
        self.wake_s_total += time.time() - t0

    async def _apply(self, update: Any, payload_ref: Any) -> WeightConfirmation | None:
        async with self._applying:
            if update.version <= self.backend.version:
                return None  # ``finalize`` applied it (or a newer one) meanwhile
            return await self._apply_locked(update, payload_ref)

    async def _apply_locked(self, update: Any, payload_ref: Any, wake_kv: bool = True) -> WeightConfirmation:
        t0 = time.time()
        with self.ctx.spans.span("sync"):
            data = await self._read_payload(update, payload_ref)
            # The backend raises WeightSyncError (and serves nothing unverified) when
            # the read-back differs from the payload.
            verify = self.cfg.train.weight_sync_monitor
            if self._weights_freed:
                await self._wake(["weights"])  # memory for the update to load into
                self._weights_freed = False
            fingerprint = await self._load_update(data, update.version, verify)
            if self._rebuildable:
                self._serving = (update, payload_ref, tuple(fingerprint))
            if self.asleep and wake_kv:
                # The backend resumed its scheduler with the KV cache still asleep; nothing
                # generates before this wake, as the version waits see ``asleep``.
                await self._wake(["kv_cache"])
                self.asleep = False
        seconds = time.time() - t0
        self.applied_count += 1
        self.apply_s_total += seconds
        self.last_applied = {"version": update.version, "apply_s": seconds, "verified": verify,
                             "fingerprint": list(fingerprint)}
        self.ctx.log.debug("weights_applied", policy_version=update.version, seconds=round(seconds, 3), verified=verify)
        async with self._version_changed:
            self._version_changed.notify_all()
        return WeightConfirmation(worker=self.ctx.worker_id, version=update.version, fingerprint=tuple(fingerprint),
                                  verified=verify, apply_s=seconds)

    def _serves(self, need: int) -> bool:
        """The engine is awake and serves version ``need`` or newer."""
        return self.backend.version >= need and not self.asleep

    def _bound(self) -> int:
        """η now: the config's, or the higher one ``max_staleness: auto`` chose since."""
        return max(self.cfg.initial_max_staleness, self.max_staleness or 0)

    def _needs(self, step: int) -> int:
        interval = self.cfg.train.sync_interval
        lookahead = compute_lookahead(self._bound(), self.cfg.dataflow.tail_slack, interval)
        return required_serving_version(step, lookahead, interval)

    async def _wait_for_version(self, step: int, batch_id: int) -> int:
        """Until the engine serves a version step ``step`` may train with under η as it
        stands then (a raise while waiting lowers the version needed); returns that η."""
        if self._serves(self._needs(step)) and self._watch_error is None:
            return self._bound()
        timeout = self.cfg.train.weight_sync_timeout_s
        t0 = time.time()
        with self.ctx.spans.span("wait_version", batch_id):
            async with self._version_changed:
                try:
                    await asyncio.wait_for(self._version_changed.wait_for(
                        lambda: self._serves(self._needs(step)) or self._watch_error is not None), timeout)
                except TimeoutError:
                    raise WeightSyncError(
                        f"{self.ctx.worker_id}: waited {time.time() - t0:.0f}s (train.weight_sync_timeout_s) for "
                        f"policy version {self._needs(step)} to generate batch {batch_id}; still serving "
                        f"v{self.backend.version}"
                    ) from None
        if self._watch_error is not None:
            raise self._watch_error
        return self._bound()

    # ------------------------------------------------------------------ generation
    async def process(self, pb: PromptBatch) -> RolloutBatch:
        if self._watch_error is not None:
            raise self._watch_error
        while True:  # once more, whole, on a rebuilt engine after each engine death
            epoch = self.restarts.epoch
            eta = await self._wait_for_version(pb.step, pb.batch_id)
            self._generating += 1  # no await since the version wait: a sleep cannot start in between
            try:
                return await self._generate_batch(pb, eta)
            except Exception as exc:
                death = find_engine_death(exc)
                if death is None:
                    raise
            finally:
                async with self._idle:
                    self._generating -= 1
                    self._idle.notify_all()
            await self._restart_engine(epoch, death)
            self.reissued_batches += 1
            self.ctx.log.info("batch_reissued", batch_id=pb.batch_id, prompts=len(pb.prompts))

    async def _generate_batch(self, pb: PromptBatch, max_staleness: int) -> RolloutBatch:
        ids = {p.prompt_id: p.token_ids or self.tokenizer(p.text, add_special_tokens=True)["input_ids"]
               for p in pb.prompts}

        def estimate(piece: PromptBatch) -> int:
            if self.cfg.rollout.kv_reserve_policy == "none":
                return 0  # admitted at once: vLLM's scheduler fits what it can
            tokens = sum(sum(expand_rollout_seq_lens([len(ids[piece.prompts[i].prompt_id]) for i in idx],
                                                     sampling.n, reserve_completion(sampling.max_tokens,
                                                                                    self.reserve_tokens)))
                         for sampling, idx in group_by_budget(piece.prompts, self.sampling))
            return estimate_kv_cache_bytes(self.shape, tokens)

        async def generate_group(prompts: list[Any], sampling: SamplingSettings) -> list[GenerationResult]:
            return await self._generate_prompts([ids[p.prompt_id] for p in prompts], [p.text for p in prompts],
                                                sampling)

        async def generate(piece: PromptBatch) -> list[GenerationResult]:
            self.guard.mark_attempt()
            groups = group_by_budget(piece.prompts, self.sampling)
            if len(groups) == 1:
                return await generate_group(piece.prompts, groups[0][0])
            # One call per budget, all at once (the engine batches them); an error in one
            # cancels the others, so a retried piece never generates twice.
            tasks = [asyncio.ensure_future(generate_group([piece.prompts[i] for i in idx], sampling))
                     for sampling, idx in groups]
            try:
                parts = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            out: list[Any] = [None] * len(piece.prompts)
            for (_, idx), part in zip(groups, parts, strict=True):
                for i, res in zip(idx, part, strict=True):
                    out[i] = res
            return out

        async def generate_recovering(piece: PromptBatch) -> list[GenerationResult]:
            if not self.guard.protected:
                return await generate(piece)
            return await run_with_oom_recovery(generate, piece, split=split_prompt_batch, merge=_join_results,
                                               stage=self.guard.stage, size=count_groups,
                                               on_event=self.guard.on_oom(pb.batch_id))

        results = await self.guard.run(pb, generate_recovering, estimate=estimate, split=split_prompt_batch,
                                       merge=_join_results, size=count_groups, key=pb.batch_id, concurrent=True)
        batch = build_rollout_batch(pb, results, self.sampling.n, self.pad_id, max_staleness)
        self.generated_samples += batch.num_samples
        self.generated_tokens += batch.completion_tokens
        self.length_counts.update(int(n) for n in batch.completion_lens)
        if self.cfg.rollout.kv_reserve_policy == "observed" and self.generated_samples >= OBSERVED_RESERVE_AFTER:
            self.reserve_tokens = summarize_length_counts(self.length_counts)["p90"]
        return batch

    async def _generate_prompts(self, prompt_ids: list[list[int]], texts: list[str], sampling: SamplingSettings,
                                metered: bool = True) -> list[GenerationResult]:
        """One engine call for the prompts' token ids (their ``texts`` for the tools loop
        when ``rollout.tools`` is set): training and evaluation generate alike; only
        ``metered`` calls (training's) count in ``occupancy``."""
        count = len(prompt_ids) * sampling.n if metered else 0
        self.occupancy.add(count, time.time())
        try:
            if self.cfg.rollout.tools is not None:
                from stages.rollout.multi_turn import generate_with_tools

                return await generate_with_tools(self.backend, self.tokenizer, prompt_ids, texts, sampling,
                                                 self.tools, self.cfg.rollout.tools)
            return await self.backend.generate(prompt_ids, sampling)
        finally:
            self.occupancy.remove(count, time.time())

    async def finalize(self) -> None:
        """The final evaluation (an ``Evaluator``'s worker): the versions still due, oldest
        first, then the newest published weights, unless they were evaluated already."""
        if self.evaluator is None or self._watch_error is not None:
            return
        while True:
            update, payload = await self.ctx.controller.latest_update(self.backend.version, True)
            if update is None or update.version <= self.backend.version:
                break
            await self._apply_and_evaluate(update, payload, self.evaluator.kind(update.version) or "final")
        async with self._applying:
            if self.asleep:
                self.ctx.log.warning("final_eval_skipped", policy_version=self.backend.version,
                                     reason="the engine sleeps and no newer weights wake it")
                return
            if not self.evaluator.done(self.backend.version):
                await self._evaluate_locked("final")

    def status(self) -> dict[str, Any]:
        colocate = ({"asleep": self.asleep, "sleeps": self.sleeps, "sleep_s_total": self.sleep_s_total,
                     "wake_s_total": self.wake_s_total} if self.colocated else {})
        engine = getattr(self.backend, "engine_stats", lambda: None)()  # vLLM's in-process engine core
        # Its scheduler's figures so far: what the driver's early bound reads (pipeline/bound.py).
        scheduler = {k: engine[k] for k in SCHEDULER_FIGURES if k in engine} if engine else {}
        levels = self.occupancy.seconds_at(time.time())  # since its first hand-over: the engine empty at 0
        return {"state": "asleep" if self.asleep else "generating", "policy_version": self.backend.version,
                "samples": self.generated_samples, "tokens": self.generated_tokens,
                "engine_restarts": self.restarts.count, "reissued_batches": self.reissued_batches,
                "kv_reserve": self.cfg.rollout.kv_reserve_policy, **({"engine": scheduler} if scheduler else {}),
                "engine_seconds": {"idle": levels.get(0, 0.0), "total": sum(levels.values())},
                **self.guard.status(), **colocate}

    def result(self) -> dict[str, Any]:
        trims = getattr(self.backend, "host_memory_trims", None)  # vLLM backend's (rollout.host_memory_trim_s)
        freed = getattr(self.backend, "sleep_freed_bytes", None)  # vLLM backend's, on a GPU
        engine = getattr(self.backend, "engine_stats", lambda: None)()  # vLLM's in-process engine core: all of it
        return {**self.status(), "weight_updates": {"count": self.applied_count, "apply_s_total": self.apply_s_total,
                                                    "last": self.last_applied},
                **({} if trims is None else {"host_memory_trims": trims, "host_memory_trimmed_mib":
                                             self.backend.host_memory_trimmed_bytes / 2**20}),
                **({} if freed is None else {"sleep_freed_gib": {"min": freed[0] / 2**30, "max": freed[1] / 2**30}}),
                **({} if engine is None else {"engine": engine}),
                "kv_cache_gib": self.kv_cache_bytes / 2**30,  # the cache the engine made (its blocks)
                **({} if self.kv_admission_seqs is None else {"kv_admission_seqs": self.kv_admission_seqs}),
                **({} if self.reserve_tokens is None else {"kv_reserve_tokens": self.reserve_tokens}),
                "occupancy": {"seconds_at": self.occupancy.seconds_at(), "peak": self.occupancy.peak},
                "completion_lengths": summarize_length_counts(self.length_counts)}

    async def shutdown(self) -> None:
        async with self._applying:  # never cancel an update (or a sleep) half-done inside the engine
            for task in self._watchers:
                task.cancel()
        if self._watch_error is None:
            # End of run: serve the final policy (the last publish lands after the last
            # generation), so every worker ends on the trainer's version, verified.
            update, payload = await self.ctx.controller.latest_update()
            if update is not None and update.version > self.backend.version:
                await self.ctx.controller.confirm(await self._apply_locked(update, payload, wake_kv=False))
            # An engine whose weights were freed (an interrupted colocated run) has none to read back.
            if update is not None and not self.cfg.train.weight_sync_monitor and not self._weights_freed:
                await self._verify_final(update)
        await self.backend.shutdown()

    async def _verify_final(self, update: Any) -> None:
        """The end-of-run read-back when updates were applied unverified."""
        expected = self.last_applied["fingerprint"] if self.last_applied else None
        live = await self.backend.live_fingerprint()
        if expected is None or not fingerprints_match(tuple(expected), live):
            raise WeightSyncError(
                f"{self.ctx.worker_id}: at the end of the run the engine's live weights (fingerprint {live}) "
                f"are not the final version v{update.version} it loaded (payload {expected}); updates were "
                f"not read back during the run (train.weight_sync_monitor: false)"
            )
        await self.ctx.controller.confirm(WeightConfirmation(worker=self.ctx.worker_id, version=update.version,
                                                            fingerprint=tuple(live), verified=True, apply_s=0.0))
