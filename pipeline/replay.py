"""``conveyor replay``: feed a recording back into the trainer on its own, or inspect it.

    conveyor replay RECORDING --inspect [--limit N] [--from-step K]
    conveyor replay RECORDING [--config PATH] [--from-step K --steps N] [--verify] [key=value ...]

``RECORDING`` is a recording root (one subdirectory per consumer; ``--stage``, default
``trainer``, picks one) or one consumer's directory.

Guarantees:
- no other stage and no Ray: ``TrainerEngine`` runs here from the newest saved state at or
  before step K; each step trains exactly the items its ``StepRecord`` names, in the
  recorded order and RNG state, and takes one optimizer step;
- ``--verify``: a step reproduces when loss and grad norm agree within ``RTOL``/``ATOL``
  (``GPU_RTOL`` on a GPU) and, on CPU, the weights' sha256 is identical; replay stops at
  the first step that does not, naming the step, the metric and the difference;
- every file replay needs is located and verified before the engine is built;
- exit 0 reproduced, 1 diverged (inspect: a damaged file), 2 bad config, arguments or
  recording. Tolerances and thread pinning: docs/architecture.md, "Replay".
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, ConveyorConfig, load_config, to_dict
from pipeline.plugins import load_builtin
from pipeline.recorder import INDEX, MANIFEST, STEPS_DIR, RecordedItem, RecordingError, RecordingReader, describe_item
from pipeline.types import RolloutBatch, StepRecord
from pipeline.versions import batch_bound, is_too_stale

RTOL = 1e-6
ATOL = 1e-9
GPU_RTOL = 1e-3
EXIT_OK, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 2
STATES_DIR = "states"
# Config fields that change what a trainer step computes: replay warns when --config
# differs from the recording's snapshot in any of them.
_TRAINING_FIELDS = ("model.path", "model.dtype", "model.tiny", "algorithm", "train.lr", "train.weight_decay",
                    "train.grad_clip", "train.zero_stage", "train.offload_optimizer", "train.prompts_per_step",
                    "train.threads", "train.chunk_size", "train.pass_tokens", "rollout.n", "rollout.temperature",
                    "rollout.logprobs", "run.seed", "dataflow.max_staleness", "dataflow.late_samples")

Out = Callable[[str], None]


class ReplayError(ValueError):
    """Replay cannot start or go on; the message names the file, step or batch."""


# ------------------------------------------------------------------ locating things

def _is_recording(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path / INDEX).is_file() or (path / STEPS_DIR).is_dir()


def resolve_recording(path: str | Path, stage: str) -> Path:
    """The consumer recording to read: ``path/<stage>`` when ``path`` is a root holding it,
    ``path/recording/<stage>`` when it is a run directory, else ``path`` itself."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ReplayError(f"{p}: not a directory (expected a recording root such as runs/x/recording, "
                          f"or one consumer's recording such as runs/x/recording/trainer)")
    for candidate in (p / stage, p / "recording" / stage):
        if candidate.is_dir() and _is_recording(candidate):
            return candidate
    if _is_recording(p):
        return p
    subs = sorted(d.name for d in p.iterdir() if d.is_dir() and _is_recording(d))
    raise ReplayError(f"{p}: no {stage!r} recording here (consumer recordings found: {subs or 'none'})")


def list_states(recording: Path) -> dict[int, Path]:
    """Policy version -> saved trainer state under ``recording/states``."""
    out = {}
    for p in sorted((recording / STATES_DIR).glob("state-*.pt")):
        digits = p.name[len("state-"):-len(".pt")]
        if digits.isdigit():
            out[int(digits)] = p
    return out


def find_input_edge(reader: RecordingReader, stage: str) -> str:
    """The recorded edge that ``stage`` consumes ("reference->trainer")."""
    edges = [e for e in reader.edges if e.split("->")[-1] == stage]
    if len(edges) != 1:
        raise ReplayError(f"{reader.root}: expected one recorded edge into {stage!r}, found {edges or 'none'} "
                          f"(edges here: {reader.edges}); record it with record.edges=[<producer>->{stage}]")
    return edges[0]


def _step_file_error(reader: RecordingReader, step: int) -> str:
    name = f"{step:08d}.msgpack"
    return next((f" ({e})" for e in reader.errors if Path(e.path).name == name), "")


# ------------------------------------------------------------------ the plan

@dataclass
class ReplayPlan:
    """Everything a replay reads, located and verified before any compute."""

    recording: Path
    edge: str
    state_version: int
    state_path: Path
    from_step: int
    records: list[StepRecord]  # state_version .. from_step + steps - 1, in order
    batches: dict[int, list[RolloutBatch]]  # step -> micro-batches in training order
    step_samples: int


def build_replay_plan(reader: RecordingReader, cfg: ConveyorConfig, *, stage: str,
                      from_step: int, steps: int) -> ReplayPlan:
    """Pick the state, the step records and the items of steps ``from_step`` .. +``steps``."""
    if from_step < 0 or steps < 1:
        raise ReplayError(f"--from-step must be >= 0 and --steps >= 1, got {from_step} and {steps}")
    edge = find_input_edge(reader, stage)
    states = list_states(reader.root)
    usable = [v for v in states if v <= from_step]
    if not usable:
        raise ReplayError(
            f"{reader.root / STATES_DIR}: no trainer state at or before step {from_step} "
            f"(found: {[states[v].name for v in states] or 'none'}); the trainer saves one at step 0 "
            f"and every record.state_every steps")
    version = max(usable)
    by_step = {r.step: r for r in reader.steps(on_error="skip")}
    records = []
    for step in range(version, from_step + steps):
        if step not in by_step:
            have = f"{min(by_step)}..{max(by_step)}" if by_step else "none"
            raise ReplayError(f"step {step}: no StepRecord {reader.root / STEPS_DIR / f'{step:08d}.msgpack'}"
                              f"{_step_file_error(reader, step)} (recorded steps: {have})")
        records.append(by_step[step])
    batches = _find_step_batches(reader, edge, records, cfg.initial_max_staleness,
                                 train_late=cfg.dataflow.late_samples == "train")
    return ReplayPlan(recording=reader.root, edge=edge, state_version=version, state_path=states[version],
                      from_step=from_step, records=records, batches=batches,
                      step_samples=cfg.train.prompts_per_step * cfg.rollout.n)


def _find_step_batches(reader: RecordingReader, edge: str, records: list[StepRecord],
                       max_staleness: int, train_late: bool = False) -> dict[int, list[RolloutBatch]]:
    """Step -> its recorded micro-batches. Files are found by name (``*-b<id>.msgpack``)
    and verified; ids not found by name fall back to one scan of the edge's items.
    ``train_late`` (``dataflow.late_samples: train``): the trainer dropped nothing as
    stale, so of several items with one id it trained the first."""
    wanted = {b for r in records for b in r.batch_ids}
    found: dict[int, list[RecordedItem]] = {b: [] for b in wanted}
    edge_dir = reader.manifest.get("edges", {}).get(edge)
    first_step = {b: r.step for r in reversed(records) for b in r.batch_ids}
    if edge_dir:
        for bid in wanted:
            for path in sorted((reader.root / edge_dir).glob(f"*-b{bid}.msgpack")):
                try:
                    item = reader.load(path)
                except RecordingError as exc:
                    raise ReplayError(f"step {first_step[bid]}: batch {bid}: {exc}") from None
                if item.header.edge == edge and item.header.batch_id == bid:
                    found[bid].append(item)
    missing = {b for b in wanted if not found[b]}
    if missing:  # renamed by hand, no manifest, or a header rewritten to another id
        for item in reader.items(edge, on_error="skip"):
            if item.header.batch_id in missing:
                found[item.header.batch_id].append(item)
    queues = {b: sorted(found[b], key=lambda i: i.header.seq) for b in wanted}
    out: dict[int, list[RolloutBatch]] = {}
    for record in records:
        out[record.step] = []
        for bid in record.batch_ids:
            # Of several items with one batch id, the trainer trained the first not too
            # stale at its version (step s runs at version s) and dropped the others.
            # Each item against its own bound (``max_staleness: auto`` raises it during a run).
            fresh = [i for i in queues[bid] if train_late or not is_too_stale(
                record.step, i.header.policy_version,
                batch_bound(getattr(i.value, "max_staleness", None), max_staleness))]
            fresh = fresh or queues[bid]
            if not fresh:
                errors = [str(e) for e in reader.errors if f"-b{bid}." in Path(e.path).name]
                why = f": {'; '.join(errors)}" if errors else (
                    f" (none in {reader.root / (edge_dir or '?')}; record.every="
                    f"{reader.manifest.get('every', '?')} keeps only every k-th item; replay needs every=1)")
                raise ReplayError(f"step {record.step}: batch {bid} has no usable recorded item on {edge}{why}")
            item = fresh[0]
            queues[bid].remove(item)
            if not isinstance(item.value, RolloutBatch):
                raise ReplayError(f"{item.path}: holds a {item.header.payload_type}, the trainer takes RolloutBatch")
            out[record.step].append(item.value)
    return out


# ------------------------------------------------------------------ comparing

@dataclass(frozen=True)
class MetricCheck:
    metric: str
    recorded: float | str
    replayed: float | str
    ok: bool
    rtol: float = RTOL

    def describe(self) -> str:
        if isinstance(self.recorded, str):
            verdict = "identical" if self.recorded == self.replayed else "differs"
            if self.ok and verdict == "differs":
                verdict += " (not required on a GPU)"
            return f"{self.metric} {verdict} (recorded {self.recorded[:16]}, replayed {str(self.replayed)[:16]})"
        diff = abs(float(self.replayed) - float(self.recorded))
        rel = diff / abs(self.recorded) if self.recorded else math.inf if diff else 0.0
        return (f"{self.metric} replayed {self.replayed:.9g} recorded {self.recorded:.9g} "
                f"(abs diff {diff:.3g}, rel {rel:.3g}{'' if self.ok else f' > rtol {self.rtol:g}'})")


def _close(replayed: float, recorded: float, rtol: float = RTOL) -> bool:
    if math.isnan(replayed) or math.isnan(recorded):
        return math.isnan(replayed) and math.isnan(recorded)
    return abs(replayed - recorded) <= rtol * abs(recorded) + ATOL


def compare_step(record: StepRecord, loss: float, grad_norm: float, sha: str | None, *,
                 on_gpu: bool = False) -> list[MetricCheck]:
    """Checks in the order they are reported: loss, grad_norm, weights_sha256 (if given).
    ``on_gpu``: GPU_RTOL for loss and grad norm, and the sha is reported, not required
    (see the module doc)."""
    rtol = GPU_RTOL if on_gpu else RTOL
    checks = [MetricCheck("loss", record.loss, loss, _close(loss, record.loss, rtol), rtol),
              MetricCheck("grad_norm", record.grad_norm, grad_norm, _close(grad_norm, record.grad_norm, rtol), rtol)]
    if sha is not None:
        checks.append(MetricCheck("weights_sha256", record.weights_sha256, sha,
                                  sha == record.weights_sha256 or on_gpu, rtol))
    return checks


@dataclass
class ReplayResult:
    verified: list[int] = field(default_factory=list)  # steps that reproduced
    diverged_step: int | None = None
    checks: list[MetricCheck] = field(default_factory=list)  # of the diverged step

    @property
    def first_divergence(self) -> MetricCheck | None:
        return next((c for c in self.checks if not c.ok), None)


def replay_trainer(engine: Any, plan: ReplayPlan, *, verify: bool, out: Out = print) -> ReplayResult:
    """Run ``plan`` on ``engine`` (a ``TrainerEngine``); see the module guarantees."""
    try:
        engine.load_state(plan.state_path)
    except Exception as exc:  # DeepSpeed reports a damaged state in many ways
        raise ReplayError(f"{plan.state_path}: cannot load the trainer state ({type(exc).__name__}: {exc})") from exc
    if engine.version != plan.state_version:
        raise ReplayError(f"{plan.state_path}: holds version {engine.version}, its name says {plan.state_version}")
    # The trainer's own rules (scales, and the pieces a split micro-batch was trained
    # as), so a replay cannot drift from what the run did.
    train_step = load_builtin("train_recorded_step")
    result = ReplayResult()
    on_gpu = bool(getattr(engine, "weights_on_gpu", False))
    for record in plan.records:
        judged = record.step >= plan.from_step
        if record.rng_state:
            engine.set_rng_state(record.rng_state)
        loss, step_out = train_step(engine, plan.batches[record.step], plan.step_samples, record.metrics)
        # Hashing the weights costs a full serialisation: only for judged steps.
        checks = compare_step(record, loss, float(step_out["grad_norm"]), engine.weights_sha256() if judged else None,
                              on_gpu=on_gpu)
        ok = all(c.ok for c in checks)
        tag = ("ok" if ok else "DIFFERS") if judged else ("warm-up" if ok else "warm-up, differs")
        out(f"step {record.step:>5}  {tag:<8}  batches {record.batch_ids}  loss {loss:.9g}  "
            f"grad_norm {float(step_out['grad_norm']):.9g}" + (f"  sha {checks[-1].replayed[:12]}" if judged else ""))
        if not judged:
            continue
        if ok:
            result.verified.append(record.step)
        elif result.diverged_step is None:
            result.diverged_step, result.checks = record.step, checks
            if verify:
                return result
    return result


# ------------------------------------------------------------------ config and engine

def find_run_config(recording: Path) -> Path | None:
    """``<run dir>/config.yaml`` for ``<run dir>/recording/<consumer>``."""
    path = recording.resolve().parent.parent / "config.yaml"
    return path if path.is_file() else None


def load_replay_config(args: argparse.Namespace, reader: RecordingReader, out: Out) -> ConveyorConfig:
    overrides = list(getattr(args, "overrides", None) or [])
    if args.config:
        cfg = load_config(args.config, overrides)
        source = f"--config {args.config}"
    elif (found := find_run_config(reader.root)) is not None:
        cfg = load_config(found, overrides)
        source = f"{found} (the run's config, found two levels above the recording; --config not given)"
    elif reader.manifest.get("config"):
        from pipeline.config import apply_overrides, decode_config

        cfg = decode_config(apply_overrides(reader.manifest["config"], overrides))
        source = f"the config snapshot in {reader.root / MANIFEST} (--config not given, no run config.yaml found)"
    else:
        raise ConfigError(f"no config: pass --config <run dir>/config.yaml (none next to {reader.root} "
                          f"and {reader.root / MANIFEST} has no config snapshot)")
    out(f"config: {source}" + (f" with overrides {overrides}" if overrides else ""))
    for diff in _training_config_diffs(to_dict(cfg), reader.manifest.get("config") or {}):
        out(f"note: {diff}")
    return cfg


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    return {k: v for key, sub in d.items() for k, v in _flatten(sub, f"{prefix}.{key}" if prefix else key).items()}


def _training_config_diffs(cfg: dict[str, Any], recorded: dict[str, Any]) -> list[str]:
    if not recorded:
        return []
    mine, theirs = _flatten(cfg), _flatten(recorded)
    return [f"{k} is {mine.get(k)!r} here but {theirs.get(k)!r} in the recording's config: replay trains with "
            f"the former, so steps may not reproduce"
            for k in sorted(set(mine) | set(theirs))
            if any(k == f or k.startswith(f + ".") for f in _TRAINING_FIELDS) and mine.get(k) != theirs.get(k)]


def resolve_threads(cfg: ConveyorConfig, records: Iterable[StepRecord]) -> tuple[int, str]:
    """The torch thread count the trainer used, and where that number comes from."""
    recorded = sorted({int(r.metrics["torch_threads"]) for r in records if "torch_threads" in r.metrics})
    if recorded:
        return recorded[-1], "recorded by the trainer" + (f" (varied: {recorded})" if len(recorded) > 1 else "")
    if cfg.train.threads > 0:
        return cfg.train.threads, "train.threads"
    n = max(1, int(cfg.placement.trainer.num_cpus))
    return n, ("not recorded: assumed Ray's OMP_NUM_THREADS for the trainer actor = placement.trainer.num_cpus, "
               "at least 1 (if the run's environment set OMP_NUM_THREADS, pass train.threads=<that>)")


def build_trainer_engine(cfg: ConveyorConfig, threads: int) -> Any:
    """A ``TrainerEngine`` built as ``TrainerStage.setup`` builds it."""
    return load_builtin("build_trainer_engine")(cfg, threads)


# ------------------------------------------------------------------ inspect

def inspect_recording(reader: RecordingReader, *, limit: int, from_step: int = 0, tokenizer: Any = None,
                      out: Out = print) -> int:
    """Print the manifest, step records from ``from_step`` and items (their steps' when
    ``from_step`` > 0, else the first ``limit``); 1 when some file is damaged."""
    m = reader.manifest
    out(f"recording {reader.root}  run {m.get('run_name', '?')!r}  created {m.get('created', '?')}  "
        f"every {m.get('every', '?')}  edges {reader.edges}")
    states = list_states(reader.root)
    out(f"states: {', '.join(f'{p.name} (before step {v})' for v, p in states.items()) or 'none'}")
    every = list(reader.steps(on_error="skip"))
    records = [r for r in every if r.step >= from_step]
    if every and not records:
        steps = [r.step for r in every]
        out(f"\n--from-step {from_step}: the recording's step records run from {min(steps)} to {max(steps)}; "
            f"nothing at or after step {from_step}")
        return EXIT_BAD_INPUT
    out(f"\nsteps from {from_step}: {len(records)}" + (f" (showing {limit})" if len(records) > limit else ""))
    out(f"  {'step':>5}  {'version':>7}  {'loss':>13}  {'grad_norm':>11}  {'weights_sha256':<16}  batch_ids")
    for r in records[:limit]:
        out(f"  {r.step:>5}  {r.policy_version:>7}  {r.loss:>13.6g}  {r.grad_norm:>11.6g}  "
            f"{r.weights_sha256[:16]:<16}  {r.batch_ids}")
    wanted = {b for r in records[:limit] for b in r.batch_ids} if from_step > 0 else None
    trained = {b for r in every for b in r.batch_ids}
    shown = total = 0
    untrained: list[int] = []
    out("\nitems" + (" of the steps above" if wanted is not None else "") + ":")
    for item in reader.items(on_error="skip"):
        total += 1
        bid = item.header.batch_id
        if bid not in trained:
            untrained.append(bid)
        if shown < limit and (wanted is None or bid in wanted):
            shown += 1
            out(describe_item(item, tokenizer))
    out(f"\n{total} items read, {shown} shown (--limit {limit})")
    if untrained and records:
        more = f" ... (+{len(untrained) - 20})" if len(untrained) > 20 else ""
        out(f"items in no step record (dropped as stale, or after the last recorded step): "
            f"batch ids {untrained[:20]}{more}")
    if reader.errors:
        out(f"\nerrors ({len(reader.errors)}):")
        for err in reader.errors:
            out(f"  {err}")
        return EXIT_DIVERGED
    return EXIT_OK


def _load_tokenizer(cfg: ConveyorConfig, out: Out) -> Any:
    try:
        return load_builtin("load_tokenizer")(load_builtin("resolve_model_path")(cfg.model))
    except Exception as exc:  # decoding ids is a bonus; the recorded texts are shown anyway
        out(f"note: token ids not decoded ({type(exc).__name__}: {exc})")
        return None


# ------------------------------------------------------------------ the command

def run_replay_command(args: argparse.Namespace, out: Out = print) -> int:
    """``conveyor replay``; returns the exit status (see the module docstring)."""
    def err(msg: str) -> None:
        print(f"conveyor replay: {msg}", file=sys.stderr)

    try:
        recording = resolve_recording(args.recording, args.stage)
        reader = RecordingReader(recording)
        if args.inspect:
            if args.limit < 0:
                raise ReplayError(f"--limit must be >= 0, got {args.limit}")
            tokenizer = _load_tokenizer(load_config(args.config, args.overrides), out) if args.config else None
            return inspect_recording(reader, limit=args.limit, from_step=args.from_step, tokenizer=tokenizer, out=out)
        if args.stage != "trainer":
            raise ReplayError(f"--stage {args.stage!r}: replay feeds the trainer only (--inspect reads any stage)")
        cfg = load_replay_config(args, reader, out)
        plan = build_replay_plan(reader, cfg, stage=args.stage, from_step=args.from_step, steps=args.steps)
        threads, why = resolve_threads(cfg, plan.records)
        last = args.from_step + args.steps - 1
        out(f"recording {recording} (edge {plan.edge}); state {plan.state_path.name}; torch threads {threads} ({why})")
        warm = (f"warm-up steps {plan.state_version}..{args.from_step - 1} (not verified); "
                if plan.state_version < args.from_step else "")
        out(f"{warm}{'verifying' if args.verify else 'replaying'} steps {args.from_step}..{last}")
        engine = build_trainer_engine(cfg, threads)
        result = replay_trainer(engine, plan, verify=args.verify, out=out)
    except ConfigError as exc:
        err(f"invalid config: {exc}")
        return EXIT_BAD_INPUT
    except (ReplayError, RecordingError) as exc:
        err(str(exc))
        return EXIT_BAD_INPUT
    if result.diverged_step is not None:
        bad = result.first_divergence
        assert bad is not None
        out(f"DIVERGED at step {result.diverged_step}: {bad.metric} differs: {bad.describe()}")
        for c in result.checks:
            if c is not bad:
                out(f"  also {c.describe()}")
        return EXIT_DIVERGED if args.verify else EXIT_OK
    if args.verify and getattr(engine, "weights_on_gpu", False):
        out(f"all {len(result.verified)} steps reproduce on the GPU ({args.from_step}..{last}): loss and grad_norm "
            f"within rtol {GPU_RTOL:g} + atol {ATOL:g} (weights sha256 not required on a GPU)")
    elif args.verify:
        out(f"all {len(result.verified)} steps reproduce ({args.from_step}..{last}): loss and grad_norm within "
            f"rtol {RTOL:g} + atol {ATOL:g}, weights sha256 identical")
    return EXIT_OK
