"""``python -m bench NAME [--quick] [--out DIR]`` (and ``conveyor bench NAME [--quick]``).

Each benchmark measures its baseline in the same run, prints its ratios and writes
``DIR/NAME/<date>_<sha7>_<label>.json`` and ``.png`` (default ``bench/results``);
``catalogue`` rewrites ``bench/results/README.md`` from those files. ``--quick`` runs tiny
sizes in seconds, for smoke tests; its figures are not meant to be read. ``all`` runs
every benchmark in turn. Benchmarks never fail on time: the exit status is 0 when the
benchmark ran, 1 when it could not (the JSON then says why, where it got that far).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common import RESULTS_DIR
from pipeline.plugins import import_object

BENCHMARKS: dict[str, str] = {
    "overlap": "bench.overlap:run",
    "queue_hop": "bench.queue_hop:run",
    "weight_sync": "bench.weight_sync:run",
    "rollout_overhead": "bench.rollout_overhead:run",
    "e2e": "bench.e2e:run",
    "ppo_vs_grpo": "bench.ppo_vs_grpo:run",  # task correctness vs trained samples, same steps each
    "admission": "bench.admission:run",
    "soak": "bench.soak:run",  # --minutes N (default 60): memory growth, then kills and a resume
    "soak_memory": "bench.soak_memory:run",  # --minutes N (default 20): memory growth, allocator settings side by side
    "staleness": "bench.staleness:run",
    "gpu_e2e": "bench.gpu_e2e:run",  # needs a CUDA GPU; "skipped" without one
    "rollout_gpu": "bench.rollout_gpu:run",  # needs a CUDA GPU; "skipped" without one
    "trainer_gpu": "bench.trainer_gpu:run",  # needs a CUDA GPU; "skipped" without one
    "gpu_scale": "bench.gpu_scale:run",  # 1 GPU vs 2 (skips what the GPUs present cannot run)
    "gpu_scale_8": "bench.gpu_scale_8:run",  # 8 GPUs (halved on 4-7); "skipped" on fewer
    "templates": "bench.templates:run",  # learning trends of the dpo, tool_rl and curriculum templates
    "longtail": "bench.longtail:run",  # long-tail lengths: streaming, lock-step, colocate, TRL (--scale, --reward)
    "trainer_memory": "bench.trainer_memory:run",  # a trainer pass at real shapes; needs a CUDA GPU (not with --quick)
}
SOAKS = ("soak", "soak_memory")
MODEL_BENCHES = ("gpu_e2e", "longtail", "trainer_memory")  # those that take --model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("name", choices=[*BENCHMARKS, "all", "catalogue"])
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds (smoke test)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"result directory (default: {RESULTS_DIR} in a source checkout, else ./bench-results; "
                        "with --quick ./bench-results/quick, so a smoke run never replaces a committed result)")
    p.add_argument("--minutes", type=float, help="soak and soak_memory only: how long they run (default 60, 20)")
    p.add_argument("--faults", help="soak only: the faults of its second half, 'all' or a comma list of "
                                    "stage,driver,nan,disk_full,ckpt_truncate,engine (default stage,driver; "
                                    "bench/soak_faults.py)")
    p.add_argument("--systems", help="gpu_e2e: comma-separated rows in order, repeats allowed (default "
                                     "async,sync,colocate,trl; also async_in_process, ..., colocate_subprocess); "
                                     "a Conveyor row may carry overrides: colocate[train.chunk_size=256;run.seed=1]. "
                                     "gpu_scale: a subset of shared_1gpu,colocate_1gpu,disaggregated_2gpu,"
                                     "replicas_ranks_2gpu. longtail: streaming,lockstep,colocate,trl, overrides "
                                     "as gpu_e2e's")
    p.add_argument("--model", help="gpu_e2e: the job at a real shape built locally (stages/models/shapes.py: "
                                   "qwen2.5_0.5b, qwen3_0.6b, qwen3_1.7b, qwen3_4b, qwen3_8b, llama3.2_1b, "
                                   "llama3.1_8b, gemma3_1b); default rows engines,async,colocate,trl. "
                                   "longtail: a shape or tiny (default qwen3_0.6b; tiny with --quick or --reward). "
                                   "trainer_memory: one shape (default qwen3_0.6b, gemma3_1b, qwen3_4b)")
    p.add_argument("--scale", type=float, help="longtail: the completion lengths' factor (median 1k, p99 8k, cap 16k "
                                               "tokens at 1; default 1 on a GPU, 1/64 on a CPU)")
    p.add_argument("--steps", type=int, help="longtail: optimizer steps per row (default the config's)")
    p.add_argument("--add-to", type=Path, help="longtail: an earlier result (JSON) of the same job on the same GPU "
                                                "model; its rows come first in this call's result")
    p.add_argument("--join", type=Path, nargs="+", metavar="RESULT",
                   help="longtail: run nothing; write one result from the rows of these earlier ones (the same job "
                        "on the same GPU model, split over calls by a time limit)")
    p.add_argument("--set", nargs="+", metavar="KEY=VALUE", dest="job",
                   help="gpu_e2e: config overrides for every row's job, TRL's included (it follows "
                        "train.gradient_checkpointing and the trainer's pass size), e.g. "
                        "train.gradient_checkpointing=true")
    p.add_argument("--kv-cache-gib", type=parse_kv_cache_gib, metavar="first|off|GIB",
                   help="longtail: vLLM's KV cache in the Conveyor rows (not colocate's, nor a row that changes the "
                        "GPU's split): 'first' (default on a GPU) the size the first finished row's vLLM made, so "
                        "every row generates with one cache; a size in GiB; 'off' each row's plan")
    p.add_argument("--reward", action="store_true", help="longtail: the quickstart task with long-tail lengths, "
                                                         "reporting each row's wall time to reach a reward")
    return p


def parse_kv_cache_gib(text: str) -> str | float:
    """``--kv-cache-gib``: ``first``, ``off`` or a size in GiB > 0."""
    if text in ("first", "off"):
        return text
    try:
        gib = float(text)
    except ValueError:
        gib = 0.0
    if not gib > 0:
        raise argparse.ArgumentTypeError(f"expected first, off or a size in GiB > 0, got {text!r}")
    return gib


def default_out_dir(quick: bool, results_dir: Path = RESULTS_DIR, cwd: Path | None = None) -> Path:
    """Where results go without ``--out``: the committed ``bench/results`` of a source
    checkout for full runs; never an installed package's directory, and never the
    committed results for a ``--quick`` run."""
    here = (cwd or Path.cwd()) / "bench-results"
    if quick:
        return here / "quick"
    return results_dir if (results_dir.parent.parent / "pyproject.toml").is_file() else here


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is not None:
        from stages.models.shapes import get_shape

        if args.name not in MODEL_BENCHES:
            parser.error(f"--model: only gpu_e2e, longtail and trainer_memory run at a chosen shape, not {args.name}")
        try:
            if not (args.name == "longtail" and args.model == "tiny"):
                get_shape(args.model)
        except ValueError as exc:
            parser.error(f"--model: {exc}")
    for flag in ("scale", "steps", "reward", "add_to", "join", "kv_cache_gib"):
        if getattr(args, flag) not in (None, False) and args.name != "longtail":
            parser.error(f"--{flag.replace('_', '-')}: only longtail takes it, not {args.name}")
    if args.job is not None:
        if args.name != "gpu_e2e":
            parser.error(f"--set: only gpu_e2e takes job overrides, not {args.name}")
        bad = [kv for kv in args.job if "=" not in kv]
        if bad:
            parser.error(f"--set: overrides are key=value, got {bad}")
    if args.faults is not None:
        from bench.soak_faults import parse_faults

        if args.name != "soak":
            parser.error(f"--faults: only soak injects faults, not {args.name}")
        try:
            args.faults = parse_faults(args.faults)
        except ValueError as exc:
            parser.error(str(exc))
    if args.scale is not None and not args.scale > 0:
        parser.error(f"--scale: expected > 0, got {args.scale}")
    if args.steps is not None and args.steps < 2:
        parser.error(f"--steps: expected >= 2 (one warm-up step, one measured), got {args.steps}")
    if args.systems is not None or args.job:
        from bench.gpu_e2e import check_rows, parse_systems
        from bench.gpu_scale import parse_configs

        if args.systems is not None and args.name not in ("gpu_e2e", "gpu_scale", "longtail"):
            parser.error(f"--systems: only gpu_e2e, gpu_scale and longtail have rows to choose, not {args.name}")
        try:
            if args.name == "longtail":
                from bench.longtail import check_rows as check_longtail_rows
                from bench.longtail import parse_systems as parse_longtail

                check_longtail_rows(parse_longtail(args.systems), args.reward)
            elif args.name == "gpu_e2e":
                check_rows(parse_systems(args.systems, args.model), job=tuple(args.job or ()))
            else:
                parse_configs(args.systems)
        except ValueError as exc:
            parser.error(str(exc))
    if args.name == "catalogue":
        from bench.catalogue import write_catalogue

        print(write_catalogue())
        return 0
    if args.out is None:
        args.out = default_out_dir(args.quick)
    if args.join:
        from bench.longtail import join

        try:
            payload = join(args.join, args.out)
        except ValueError as exc:
            parser.error(str(exc))
        print(f"longtail: joined {len(args.join)} results -> {payload['result_path']}")
        return 0 if payload["status"] == "ok" else 1
    # "all" leaves the long soaks out: they are run on their own.
    names = [n for n in BENCHMARKS if n not in SOAKS] if args.name == "all" else [args.name]
    try:
        import ray
    except ImportError:  # a machine with torch alone runs the benchmarks that need no Ray (trainer_memory)
        ray = None
    started_ray = ray is not None and not ray.is_initialized()
    status = 0
    try:
        for name in names:
            t0 = time.time()
            run = import_object(BENCHMARKS[name], f"bench {name}")
            extra = {"minutes": args.minutes} if args.minutes and name in SOAKS else {}
            if args.faults and name == "soak":
                extra["faults"] = args.faults
            if args.systems and name in ("gpu_e2e", "gpu_scale", "longtail"):
                extra["systems"] = args.systems
            if args.model and name in MODEL_BENCHES:
                extra["model"] = args.model
            if args.job and name == "gpu_e2e":
                extra["job"] = tuple(args.job)
            if name == "longtail":
                extra.update({k: v for k, v in (("scale", args.scale), ("steps", args.steps)) if v is not None})
                extra.update({"reward": True} if args.reward else {})
                extra.update({"add_to": args.add_to} if args.add_to else {})
                extra.update({"kv_cache_gib": args.kv_cache_gib} if args.kv_cache_gib is not None else {})
            payload = run(quick=args.quick, out_dir=args.out, **extra)
            ok = payload.get("status", "ok") in ("ok", "skipped")
            status = status or (0 if ok else 1)
            print(f"{name}: {'done' if ok else payload.get('status')} in {time.time() - t0:.0f}s -> "
                  f"{args.out}", flush=True)
    finally:
        if ray is not None and started_ray and ray.is_initialized():
            ray.shutdown()  # only a cluster this command started; a caller's stays up
    return status


if __name__ == "__main__":
    sys.exit(main())
