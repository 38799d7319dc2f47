"""``placement``: which devices each stage runs on, or the one-GPU shorthands
(``streaming``, ``colocate``)."""

from __future__ import annotations

from typing import Literal

import msgspec

from pipeline.config.base import NonNegFloat, NonNegInt, PosFloat, _section


class PlacementEntry(msgspec.Struct, **_section()):
    """Where one stage runs (``pipeline/placement.py`` plans and checks it).

    ``gpus``: GPU indices (replica r on ``gpus[r % len]``); a list in YAML
    (``rollout: [0]``) is shorthand for ``{gpus: [0]}``. ``exclusive``: no other stage
    may use those GPUs. ``num_gpus``: a Ray GPU count per replica instead of indices.
    ``resources``: custom Ray resources each replica asks for (``{node_b: 0.01}``), which
    puts the stage on the nodes that offer them (``ray start --resources``).
    """

    num_cpus: NonNegFloat = 0.0
    num_gpus: NonNegFloat = 0.0
    gpus: list[NonNegInt] | None = None
    exclusive: bool = False
    resources: dict[str, PosFloat] = {}

    def __post_init__(self) -> None:
        reserved = sorted(set(self.resources) & {"CPU", "GPU", "memory", "object_store_memory"})
        if reserved:
            raise ValueError(f"resources: {reserved} are not custom resources (use num_cpus / num_gpus)")


class PlacementConfig(msgspec.Struct, **_section()):
    """``placement: auto`` (the default, an empty mapping) lets the planner choose GPUs
    (on one GPU also whether vLLM streams beside the trainer or takes turns with it,
    from the memory plan: ``pipeline/gpu_split.py``);
    naming GPUs (or ``num_gpus``) for any stage makes the plan explicit: stages not
    named then get no GPU. ``placement: colocate`` (``mode: colocate``) puts every GPU
    stage on the trainer ranks' GPUs and time-shares them: vLLM sleeps (its weights and
    KV cache freed) while the trainer steps, and wakes with the new weights
    (``pipeline/placement.py``); it runs lock-step and on-policy."""

    mode: Literal["auto", "colocate"] = "auto"
    # NVIDIA MPS for stage processes that share a GPU, so that their kernels run side by
    # side instead of taking turns (``pipeline/mps.py``): true starts a daemon of the
    # run's own (exit 2 where it cannot; none under colocate, whose stages take turns
    # anyway); auto does where two stage processes share a GPU outside colocate and the
    # driver's nvidia-cuda-mps-control is found, else says why not (the default).
    mps: bool | Literal["auto"] = "auto"
    source: PlacementEntry = PlacementEntry()
    rollout: PlacementEntry = PlacementEntry()
    reward: PlacementEntry = PlacementEntry()
    reference: PlacementEntry = PlacementEntry()
    reward_model: PlacementEntry = PlacementEntry()
    critic: PlacementEntry = PlacementEntry()
    trainer: PlacementEntry = PlacementEntry()
