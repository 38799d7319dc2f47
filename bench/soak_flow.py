# conveyor launch --config configs/quickstart.yaml --script bench/soak_flow.py
"""The soak's graph when it injects NaNs (``bench soak --faults nan``): the run's own
graph (as the launch builds it from the config) with ``NaNFault``
(``bench/soak_faults.py``) between the trainer and the node that fed it. Its trigger
lies in ``$CONVEYOR_SOAK_FAULT_DIR`` (the soak sets it), else in ``<run dir>/faults``.
The node restarts like the stages around it (``run.max_restarts``)."""

import os
from pathlib import Path

import msgspec

from bench.soak_faults import FAULT_DIR_ENV, NAN_TRIGGER, NaNFault
from pipeline.dataflow import DataFlow


def build_dataflow(cfg) -> DataFlow:
    from pipeline.launch import build_dataflow as build_own

    df = build_own(msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, script=None)))
    trainer = df.nodes["trainer"]
    fault_dir = Path(os.environ.get(FAULT_DIR_ENV) or Path(cfg.run_dir) / "faults")
    fault_dir.mkdir(parents=True, exist_ok=True)
    df.add_node("nan_fault", NaNFault, trainer.input_from, max_restarts=cfg.run.max_restarts,
                trigger=str(fault_dir / NAN_TRIGGER))
    trainer.input_from = "nan_fault"
    order = [*[n for n in df.nodes if n not in ("nan_fault", "trainer")], "nan_fault", "trainer"]
    df.nodes = {name: df.nodes[name] for name in order}
    return df
