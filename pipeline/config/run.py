"""``run`` and ``record``: the run's name, directory, seed, steps, logging, trackers,
and what the recorder keeps of the queues for replay."""

from __future__ import annotations

from typing import Literal

import msgspec

from pipeline.config.base import NonNegInt, PosInt, _section


class RunConfig(msgspec.Struct, **_section()):
    dir: str = "runs/{name}"
    name: str = "conveyor"
    seed: NonNegInt = 0
    steps: PosInt = 100
    progress: bool = True
    # Experiment trackers (pipeline/trackers.py), any subset; each but TensorBoard is a pip
    # extra (conveyor[mlflow]...): one not installed stops the launch.
    trackers: list[Literal["tensorboard", "mlflow", "wandb", "swanlab", "trackio"]] = msgspec.field(
        default_factory=lambda: ["tensorboard"])
    tensorboard: bool = True  # false: no TensorBoard even where run.trackers names it
    address: str | None = None  # Ray address; default RAY_ADDRESS or a local cluster
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Print the first micro-batch on every edge (wire type, field shapes and dtypes) and
    # check it against what its consumer declares; a mismatch stops the run.
    debug: bool = False
    # A checkpoint directory to continue from (``conveyor launch --resume RUN_DIR`` sets
    # it to the run's newest complete one).
    resume_from: str | None = None
    overwrite: bool = False  # replace a run already in run.dir (otherwise a launch refuses it)
    # Restarts of each rollout, reward and reference actor after its process died (its
    # micro-batches are delivered again); 0: a death stops the run.
    max_restarts: NonNegInt = 5
    # A dead trainer: resume from the newest checkpoint by itself (at most
    # pipeline.launch.AUTO_RESUME_ATTEMPTS times) instead of stopping with the resume command.
    auto_resume: bool = False
    # A Python file defining build_dataflow(cfg) -> DataFlow: the run's graph instead of
    # the built-in one (``conveyor launch --config C --script FILE`` sets it).
    script: str | None = None


class RecordConfig(msgspec.Struct, **_section()):
    """Tap DataFlow edges to disk (``pipeline/recorder.py``)."""

    edges: list[str] = []
    every: PosInt = 1
    dir: str | None = None  # default: <run dir>/recording
    state_every: NonNegInt = 10  # trainer state saved every k steps (replay starts there)
