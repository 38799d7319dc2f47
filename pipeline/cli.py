"""The ``conveyor`` command.

    conveyor launch --config PATH [--script FLOW.py] [key.path=value ...]
    conveyor launch --resume RUN_DIR [key.path=value ...]
    conveyor status --config PATH | --run-dir DIR [--watch]
    conveyor replay RECORDING --config PATH [--from-step K --steps N] [--verify] | --inspect
    conveyor bench NAME [--quick]
    conveyor init --template NAME DIR [--force] | --list
    conveyor --version

A bad config (unknown key, wrong type, out of range, invalid graph) stops the command
before any actor starts, prints the dotted path and the reason, and exits with status 2.
So does a path or import the run needs that pre-flight (``pipeline/preflight.py``) finds
missing or broken, and a data file without one usable row: ``launch`` checks before Ray
starts, ``status --config`` runs the same checks before printing the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.config import ConfigError, ConveyorConfig, load_config
from pipeline.dataflow import GraphError
from pipeline.stage import StageError

EXIT_BAD_CONFIG = 2


def _load(args: argparse.Namespace) -> tuple[ConveyorConfig, Any]:
    from pipeline.launch import build_dataflow, record_taps
    from pipeline.preflight import check_imports

    cfg = load_config(args.config, args.overrides)
    check_imports(cfg)  # a node class that does not import is named by its config field
    try:
        df = build_dataflow(cfg)
    except (GraphError, ImportError) as exc:
        raise ConfigError(f"dataflow: {exc}") from None
    record_taps(cfg, df)
    return cfg, df


def _load_resume(args: argparse.Namespace) -> ConveyorConfig:
    """The config of ``launch --resume RUN_DIR``: the run's own (or ``--config``) with the
    overrides, checked against the run's, pointed at its newest complete checkpoint."""
    import msgspec

    from pipeline.checkpoint import resolve_resume
    from pipeline.config import to_dict

    run_dir = Path(args.resume).expanduser().resolve()
    args.config = args.config or str(run_dir / "config.yaml")
    args.overrides = [*args.overrides, f"run.dir={run_dir}"]
    cfg, _ = _load(args)
    from pipeline.preflight import absolutise_paths

    # The saved config went through pre-flight's absolute paths; compare like with like.
    checkpoint, changed, skipped = resolve_resume(run_dir, to_dict(absolutise_paths(cfg)))
    for message in skipped:
        print(f"conveyor: {message}", file=sys.stderr)
    print(f"resuming from {checkpoint}" + (f" (changed: {', '.join(changed)})" if changed else ""), flush=True)
    return msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, resume_from=checkpoint))


def cmd_launch(args: argparse.Namespace) -> int:
    from pipeline.runner import STOP_SIGNALS

    STOP_SIGNALS.install()  # a stop from here on leaves a summary.json (pipeline/runner.py)
    if args.script:
        args.overrides = [*args.overrides, f"run.script={Path(args.script).expanduser().resolve()}"]
    if args.resume:
        cfg = _load_resume(args)
    elif args.config:
        cfg, _ = _load(args)
    else:
        raise ConfigError("launch: expected --config PATH or --resume RUN_DIR")
    from pipeline.checkpoint import find_latest_checkpoint
    from pipeline.launch import launch_run

    try:
        summary = launch_run(cfg)
    except StageError as exc:
        # The run stopped (a dead trainer, say): how to continue it, when it can be.
        if find_latest_checkpoint(cfg.run_dir) is None:
            raise
        print(f"conveyor: {exc}{describe_failure(exc)}\nconveyor: resume with: conveyor launch --resume {cfg.run_dir}",
              file=sys.stderr)
        return 1
    if summary["status"] == "interrupted":
        return 128 + signal.Signals[summary["signal"]].value  # 130 for SIGINT, 143 for SIGTERM
    verified = all(s.get("verified") for s in summary["served"].values())
    return 0 if summary["samples"]["reconciles"] and verified else 1


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    run_dir: Path | None = Path(args.run_dir) if args.run_dir else None
    cfg = df = None
    if args.config:
        cfg, df = _load(args)
        run_dir = run_dir or cfg.run_dir
    live = _read_live_status(run_dir) if run_dir else None
    if live is None:
        if df is None:
            console.print(f"no live run in {run_dir} and no --config given")
            return 1
        from pipeline.launch import build_dataflow, plan_run_placement
        from pipeline.preflight import run_preflight
        from pipeline.status import render_plan

        cfg, checks = run_preflight(cfg)  # a missing path or import, unusable data: exit 2
        print(checks.describe())
        cfg, plan = plan_run_placement(cfg)  # refuses an impossible plan: exit 2
        console.print(render_plan(cfg, build_dataflow(cfg, plan), plan))
        return 0
    from pipeline.status import render_live

    if not args.watch:
        console.print(render_live(live))
        return 0
    from rich.live import Live

    with Live(render_live(live), console=console, refresh_per_second=2) as view:
        while live is not None:
            time.sleep(1.0)
            live = _read_live_status(run_dir)
            if live is not None:
                view.update(render_live(live))
    return 0


def _read_live_status(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``status.json`` if its driver process is still alive."""
    path = run_dir / "status.json"
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    try:
        os.kill(int(status["pid"]), 0)
    except (OSError, KeyError, ValueError):
        return None
    if time.time() - float(status.get("time", 0)) > 60:
        return None
    return status


def cmd_replay(args: argparse.Namespace) -> int:
    from pipeline.replay import run_replay_command

    return run_replay_command(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from pipeline.plugins import load_builtin

    return load_builtin("bench")([args.name, *(["--quick"] if args.quick else []),
                       *(["--minutes", str(args.minutes)] if args.minutes else []),
                       *(["--faults", args.faults] if args.faults else []),
                       *(["--out", str(args.out)] if args.out else [])])


def cmd_init(args: argparse.Namespace) -> int:
    from pipeline.templates import describe_templates, write_template

    if args.list:
        for name, line in describe_templates().items():
            print(f"{name:<12} {line}")
        return 0
    if not args.template or not args.dir:
        raise ConfigError("init: expected --template NAME DIR, or --list")
    written = write_template(args.template, Path(args.dir), force=args.force)
    for path in written:
        print(f"wrote {path}")
    print(f"run it with: cd {args.dir} && conveyor launch --config config.yaml")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor", description="Asynchronous streaming RL post-training.")
    p.add_argument("--version", action="version", version=f"conveyor {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    launch = sub.add_parser("launch", help="run a training job")
    launch.add_argument("--config")
    launch.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest complete checkpoint")
    launch.add_argument("--script", metavar="FILE", help="a Python file whose build_dataflow(cfg) gives the graph "
                                                         "(run.script)")
    launch.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-5")
    launch.set_defaults(fn=cmd_launch)

    status = sub.add_parser("status", help="a live run's state, or the static plan of a config")
    status.add_argument("--config")
    status.add_argument("--run-dir")
    status.add_argument("--watch", action="store_true", help="refresh in place while the run is live")
    status.add_argument("overrides", nargs="*")
    status.set_defaults(fn=cmd_status)

    replay = sub.add_parser("replay", help="feed a recording into one stage, or inspect it")
    replay.add_argument("recording")
    replay.add_argument("--config")
    replay.add_argument("--stage", default="trainer")
    replay.add_argument("--from-step", type=int, default=0)
    replay.add_argument("--steps", type=int, default=1)
    replay.add_argument("--verify", action="store_true")
    replay.add_argument("--inspect", action="store_true")
    replay.add_argument("--limit", type=int, default=20, help="items shown by --inspect")
    replay.add_argument("overrides", nargs="*")
    replay.set_defaults(fn=cmd_replay)

    bench = sub.add_parser("bench", help="run a benchmark from bench/")
    bench.add_argument("name")
    bench.add_argument("--quick", action="store_true")
    bench.add_argument("--minutes", type=float, help="soak only: how long it runs (default 60)")
    bench.add_argument("--faults", help="soak only: 'all' or a comma list of stage,driver,nan,disk_full,"
                                        "ckpt_truncate,engine (default stage,driver)")
    bench.add_argument("--out", help="result directory (default: bench/results in a source checkout, "
                                     "./bench-results elsewhere, ./bench-results/quick with --quick)")
    bench.set_defaults(fn=cmd_bench)

    init = sub.add_parser("init", help="write a job template (config, data, reward/tool module) into DIR")
    init.add_argument("dir", nargs="?", metavar="DIR")
    init.add_argument("--template", metavar="NAME", help="see --list")
    init.add_argument("--list", action="store_true", help="the templates, one line each")
    init.add_argument("--force", action="store_true", help="write into a DIR that is not empty")
    init.set_defaults(fn=cmd_init)
    return p


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """Like ``parse_args``, but ``key=value`` overrides may also come after the options
    (``conveyor replay REC --steps 2 train.lr=1e-5``), where argparse alone refuses them
    once the command's positionals are taken."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    late = [a for a in extra if "=" in a and not a.startswith("-")]
    rest = [a for a in extra if a not in late]
    if rest or (late and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def describe_failure(exc: StageError) -> str:
    """The console's lines after a stage's error: where it was raised, and the file that
    holds its whole traceback (``pipeline.launch.write_failure_traceback``)."""
    where = f"\nconveyor: at {exc.where}" if exc.where else ""
    path = getattr(exc, "traceback_path", None)
    return where + (f"\nconveyor: traceback: {path}" if path else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(argv)
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"conveyor: invalid config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except StageError as exc:
        # summary.json says "failed"; the stage's traceback is in its run's logs/.
        print(f"conveyor: {exc}{describe_failure(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
