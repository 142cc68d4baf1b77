"""The ``raytrain`` command line: argument parsing only; the work is in the public API.

    raytrain run SPEC [a.b=value ...] [--fresh] [--resume-anyway] [--force] [--verbose]
    raytrain tune SPEC [a.b=value ...] [--fresh] [--force] [--json]   (a spec with tune)
    raytrain validate SPEC [a.b=value ...]
    raytrain export CHECKPOINT OUT
    raytrain report RUN_ID... [--tracking-uri URI] [--out report.png] [--html report.html]
    raytrain submit SPEC [a.b=value ...] --address URL [--follow] [--working-dir DIR] ...
        [--supervise [--max-resubmits N] [--head-wait S]]   (resubmitted when the cluster
        loses it; exit 3: the cluster was given up on)
    raytrain status JOB_ID|SPEC|NAME --storage URI [--json]   (a run's live progress)
    raytrain doctor SPEC|NAME --storage URI [--tracking-uri URI]   (where its time went)
    raytrain pack SRC DEST [--format images|csv|json] [--shard-mb 256] [--skip-bad]
        (many small files as Parquet shards; run again after an interruption, it keeps the
        shards already whole)
    raytrain logs|stop JOB_ID [--address URL]      raytrain list [--address URL]
    raytrain up [--num-cpus N] [--num-gpus N] [--warm N] | up --status | down
        (a local cluster that stays up: runs join it and start in warm processes)
    (a job command sends the cluster's token over plain http only to this machine, or with
    --insecure)

Exit codes: 0 done, 1 training (or the submitted job) failed, 2 bad input: a spec, a file, an
address, a token, a job id (every problem printed, one per line).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from raytrain.cli.slurm import add_slurm_flags
from raytrain.errors import EXIT_OK, RaytrainError, SpecError
from raytrain.util.terminal import printable

if TYPE_CHECKING:
    from argparse import _SubParsersAction

    from raytrain.driver.results import FitResult

JOB_COMMANDS = ("submit", "status", "logs", "stop", "list")


def build_parser() -> argparse.ArgumentParser:
    """The `raytrain` command line: every command and its flags (docs/generate.py writes the
    command reference from it)."""
    parser = argparse.ArgumentParser(
        prog="raytrain", description="Train Lightning modules on Ray: DDP workers, Ray Data."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from raytrain.cli.cluster import add_cluster_commands

    for add in (
        _add_run_and_validate,
        _add_tune,
        _add_export_and_report,
        _add_submit,
        _add_status_and_doctor,
        _add_pack,
        _add_job_controls,
        add_cluster_commands,
    ):
        add(sub)
    return parser


def _add_run_and_validate(sub: _SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser("run", help="train a job spec (resumes a run of the same name)")
    run.add_argument("spec", help="path to a job spec (YAML)")
    run.add_argument("overrides", nargs="*", help="dotted overrides: trainer.max_epochs=2")
    run.add_argument("--fresh", action="store_true", help="delete the run's checkpoints first")
    run.add_argument(
        "--resume-anyway", action="store_true", help="resume even though the spec changed"
    )
    run.add_argument(
        "--force", action="store_true", help="take the run over from a live run holding it"
    )
    run.add_argument(
        "--chaos",
        metavar="MTBF",
        help="inject faults to see what they cost: a worker SIGKILLed every MTBF seconds of "
        "training on average (failure.chaos.mtbf_s); the summary and MLflow give the table",
    )
    run.add_argument("--chaos-seed", metavar="N", help="with --chaos: the faults' seed")
    run.add_argument("--verbose", action="store_true", help="show Ray's and workers' output")
    run.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    validate = sub.add_parser("validate", help="print the resolved spec, or every problem")
    validate.add_argument("spec", help="path to a job spec (YAML)")
    validate.add_argument("overrides", nargs="*", help="dotted overrides: trainer.max_epochs=2")
    for cmd in (run, validate):
        cmd.add_argument(
            "--cli",
            metavar="MODULE:CLASS",
            help="the project's LightningCLI subclass whose parser reads the config "
            "(lightning_cli)",
        )
        cmd.add_argument(
            "--print_config",
            action="store_true",
            help="print the config as LightningCLI's parser resolves it, raytrain's sections "
            "beside, and exit without running",
        )


def _add_tune(sub: _SubParsersAction[argparse.ArgumentParser]) -> None:
    sweep = sub.add_parser("tune", help="run the spec's sweep (its tune section) on Ray Tune")
    sweep.add_argument("spec", help="path to a job spec with a tune section (YAML)")
    sweep.add_argument("overrides", nargs="*", help="dotted overrides: tune.num_samples=8")
    sweep.add_argument("--fresh", action="store_true", help="delete the sweep's folder first")
    sweep.add_argument(
        "--force", action="store_true", help="take the sweep over from a live sweep holding it"
    )
    sweep.add_argument("--verbose", action="store_true", help="show Ray's and workers' output")
    sweep.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def _add_export_and_report(sub: _SubParsersAction[argparse.ArgumentParser]) -> None:
    export = sub.add_parser(
        "export", help="write a checkpoint's model weights (sharded or not) as one state dict"
    )
    export.add_argument("checkpoint", help="a checkpoint folder or URI (checkpoint_...)")
    export.add_argument("out", help="the file to write: .pt (torch) or .safetensors")
    report = sub.add_parser("report", help="curves (PNG) and a table comparing MLflow runs")
    report.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    report.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else mlflow.db")
    report.add_argument("--out", default="report.png", help="the PNG (default: report.png)")
    report.add_argument("--html", help="also write one self-contained HTML page here")


def _add_address(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--address",
        help="the cluster's job server, http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS); "
        "its token comes from $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token",
    )
    cmd.add_argument(
        "--insecure",
        action="store_true",
        help="send the token over plain http to another machine (refused otherwise: use "
        "https, or a tunnel such as `ray dashboard CLUSTER.yaml`)",
    )


def _add_submit(sub: _SubParsersAction[argparse.ArgumentParser]) -> None:
    submit = sub.add_parser("submit", help="run a job spec on a Ray cluster, as a Ray job")
    submit.add_argument("spec", help="path to a job spec (YAML) inside the working dir")
    submit.add_argument("overrides", nargs="*", help="dotted overrides: trainer.max_epochs=2")
    _add_address(submit)
    submit.add_argument("--follow", action="store_true", help="stream the logs to the end")
    submit.add_argument(
        "--working-dir", default=".", help="folder to upload (honours .gitignore; default: .)"
    )
    submit.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PATTERN",
        help="upload files that look secret (.env*, *token*, *.pem, ...) matching this "
        "gitignore pattern anyway",
    )
    submit.add_argument(
        "--pip", action="append", default=[], metavar="REQ", help="a package to install for it"
    )
    submit.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="a job env variable"
    )
    submit.add_argument("--job-id", help="the submission id (default: Ray picks one)")
    submit.add_argument("--fresh", action="store_true", help="delete the run's checkpoints first")
    submit.add_argument(
        "--force", action="store_true", help="take the run over from a live run holding it"
    )
    submit.add_argument(
        "--resume-anyway", action="store_true", help="resume even though the spec changed"
    )
    submit.add_argument(
        "--supervise",
        action="store_true",
        help="follow the job to its end, and submit the same spec again (it resumes from its "
        "last committed checkpoint) when the job is lost to the cluster: its driver died, "
        "or its head went; a failure of the run itself is never submitted again. Exit: 0 "
        "done, 1 the run failed, 2 bad input, 3 the cluster was given up on",
    )
    submit.add_argument(
        "--max-resubmits",
        type=int,
        metavar="N",
        help="with --supervise: submit again at most N times (default: 3)",
    )
    add_slurm_flags(submit)
    submit.add_argument(
        "--head-wait",
        type=float,
        metavar="SECONDS",
        help="with --supervise: how long to wait for the head's job server to answer again "
        "before giving up (default: 600)",
    )


def _add_status_and_doctor(sub: _SubParsersAction[argparse.ArgumentParser]) -> None:
    status = sub.add_parser(
        "status", help="a run's progress: a submitted job's, or a run's by spec or name"
    )
    status.add_argument("target", help="a job id, a job spec (YAML), or a run's name")
    status.add_argument("overrides", nargs="*", help="dotted overrides of the spec")
    status.add_argument("--storage", help="the checkpoint.storage a run NAME is under")
    status.add_argument("--json", action="store_true", help="print the status record as JSON")
    _add_address(status)
    doctor = sub.add_parser("doctor", help="where a run's time went, and what to do about it")
    doctor.add_argument("target", help="a job spec (YAML), or a run's name with --storage")
    doctor.add_argument("overrides", nargs="*", help="dotted overrides of the spec")
    doctor.add_argument("--storage", help="the checkpoint.storage a run NAME is under")
    doctor.add_argument("--tracking-uri", help="the MLflow store (default: the spec's)")


def _add_pack(sub: _SubParsersAction[argparse.ArgumentParser]) -> None:
    pack = sub.add_parser(
        "pack",
        help="rewrite many small files (an image folder, CSV, "
        "JSON Lines) as Parquet shards, read at Parquet's speed",
    )
    pack.add_argument("src", help="the folder or prefix to pack: a path or a URI")
    pack.add_argument("dest", help="where the shards go: a path or a URI (not inside SRC)")
    pack.add_argument(
        "--format",
        default="images",
        choices=("images", "csv", "json"),
        help="what SRC holds (default: images)",
    )
    pack.add_argument(
        "--shard-mb",
        type=float,
        default=256.0,
        help="about this many MB of source files a shard (default 256)",
    )
    pack.add_argument(
        "--skip-bad",
        action="store_true",
        help="images: leave out the files that do not decode, counted",
    )


def _add_job_controls(sub: _SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, text in (
        ("logs", "a job's driver output"),
        ("stop", "stop a job"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("job_id")
        _add_address(cmd)
        if name == "logs":
            cmd.add_argument("--follow", action="store_true", help="stream until the job ends")
        if name == "stop":
            cmd.add_argument("--wait", action="store_true", help="wait until it has stopped")
    _add_address(sub.add_parser("list", help="the cluster's jobs"))


def _print_summary(result: FitResult) -> None:
    for line in _summary(result):
        print(printable(line))


def _summary(result: FitResult) -> list[str]:
    """What ``raytrain run`` prints of a run that ended: its metrics, checkpoints, MLflow."""
    # system/... metrics (step time, data wait, CPU, memory) are in MLflow, not the summary
    metrics = {k: v for k, v in result.metrics.items() if k != "kind" and "/" not in k}
    shown = ", ".join(
        f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items())
    )
    mlflow = f"  mlflow run id: {result.mlflow_run_id} ({result.tracking_uri})"
    if result.already_complete:  # nothing was trained: say what the run had reached
        return [
            f"raytrain: run {result.name} was already complete ({result.wall_time_s:.1f}s)",
            f"  metrics: {shown}",
            f"  latest checkpoint: {result.latest_checkpoint_uri}",
            mlflow,
        ]
    lines = [f"raytrain: run {result.name} finished in {result.wall_time_s:.1f}s"]
    if result.stopped:
        lines.append(f"  stopped early: {result.stopped}")
    lines.append(f"  metrics: {shown}")
    if "val_acc" in result.metrics:
        lines.append(f"  val_acc: {result.metrics['val_acc']:.4f}")
    lines += [f"  best checkpoint: {result.best_checkpoint_uri}", mlflow]
    if result.model_uri:
        lines.append(f"  model: {result.model_uri}")
    if result.chaos is not None:  # failure.chaos: the fault table
        lines += [f"  {text}" for text in result.chaos["lines"]]
    return lines


def _tune(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from raytrain.sweep.runner import tune

    result = tune(
        args.spec, args.overrides, fresh=args.fresh, force=args.force, verbose=args.verbose
    )
    if args.json:
        print(json.dumps(asdict(result), default=str))
        return EXIT_OK
    from raytrain.tracking.report import text_table

    table = result.table()
    keys = list(dict.fromkeys(key for row in table for key in row))
    rows = [[_cell(row.get(key)) for key in keys] for row in table]
    lines = [
        f"raytrain: sweep {result.name}: {len(result.trials)} trials in "
        f"{result.timings.get('total', 0):.1f}s"
    ]
    lines += ["  " + line for line in text_table(keys, rows).splitlines()]
    if result.best is not None:
        lines += [
            f"  best: {result.best.name} ({result.metric} {result.best.score(result.metric):.4f})",
            f"  best spec: {result.best_spec_path} (raytrain run it)",
            f"  best checkpoint: {result.best_checkpoint_uri}",
        ]
    lines.append(f"  mlflow parent run id: {result.mlflow_run_id} ({result.tracking_uri})")
    for line in lines:
        print(printable(line))
    return EXIT_OK


def _cell(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _report(args: argparse.Namespace) -> int:
    """``raytrain report``: its output files checked first (nothing is fetched for a report
    that cannot be written), then the runs fetched, the table printed, the files written."""
    import os

    from raytrain import storage
    from raytrain.errors import StorageError
    from raytrain.tracking.report import build_report, html_page, text_table

    png = storage.output_file(args.out, f"--out {args.out}")
    page = storage.output_file(args.html, f"--html {args.html}") if args.html else None
    if page == png:
        raise StorageError(f"--html {args.html}: the same file as --out; name another")
    report = build_report(args.run_ids, args.tracking_uri)
    os.makedirs(os.path.dirname(png), exist_ok=True)
    with open(png, "wb") as handle:
        handle.write(report.png)
    print(text_table(report.columns, report.rows), end="")
    print(printable(f"raytrain: wrote {args.out}"), file=sys.stderr)
    if page is not None:
        storage.write_text(page, html_page(report))
        print(printable(f"raytrain: wrote {args.html}"), file=sys.stderr)
    return EXIT_OK


def _pack(args: argparse.Namespace) -> int:
    """``raytrain pack``: its arguments checked, the shards written, a summary printed."""
    import math
    import os

    from raytrain import storage
    from raytrain.data.pack import PackError, pack
    from raytrain.errors import StorageError

    if not (args.shard_mb > 0 and math.isfinite(args.shard_mb)):
        raise SpecError(f"--shard-mb {args.shard_mb:g}: must be a number of MB more than 0")
    for name, value in (("SRC", args.src), ("DEST", args.dest)):
        if not value.strip():
            raise SpecError(f"{name}: empty; name a folder or a URI")
    src, dest = storage.resolve(args.src).rstrip("/"), storage.resolve(args.dest).rstrip("/")
    if not storage.is_uri(src):
        src = os.path.realpath(src)  # a link to the folder is the folder
    if not storage.is_uri(dest):
        dest = os.path.realpath(dest)
    if dest == src or dest.startswith(src + "/"):
        raise SpecError(
            f"{args.dest}: inside {args.src}, which it would then be part of: "
            "pack into another folder"
        )
    if not storage.exists(src):
        raise SpecError(f"{args.src}: no such file or folder")
    try:
        done = pack(src, dest, args.format, args.shard_mb, skip_bad=args.skip_bad)
    except PackError as exc:  # about the source, or the destination
        raise SpecError(f"{args.dest if exc.dest else args.src}: {exc}") from None
    except OSError as exc:  # the store's refusal: a read-only folder, a missing bucket
        raise StorageError(
            f"{args.dest}: cannot write the shards there: {storage.describe(exc)}"
        ) from None
    again = f", {done.skipped} of them already there" if done.skipped else ""
    if done.bad_files:
        again += f"; {done.bad_files:,} files that do not decode left out (--skip-bad)"
    print(
        printable(
            f"raytrain: packed {done.files:,} files ({done.bytes / 1e6:,.1f} MB, "
            f"{done.rows:,} rows) into {done.shards} shards at {args.dest}{again} in "
            f"{done.seconds:.1f}s"
        )
    )
    use = "format: images" if args.format == "images" else "format: parquet"
    print(printable(f"  read it with data.train: {{uri: {args.dest}, {use}}}"))
    return EXIT_OK


def _chaos_overrides(args: argparse.Namespace) -> list[str]:
    """``--chaos MTBF [--chaos-seed N]`` as the spec's fields (checked there, by name)."""
    if args.chaos is None:
        if args.chaos_seed is not None:
            raise SpecError("--chaos-seed: only with --chaos MTBF")
        return []
    seed = [] if args.chaos_seed is None else [f"failure.chaos.seed={args.chaos_seed}"]
    return [f"failure.chaos.mtbf_s={args.chaos}", *seed]


def _cluster(args: argparse.Namespace) -> int:
    from raytrain.cli.cluster import cluster_command

    return cluster_command(args)


def _doctor(args: argparse.Namespace) -> int:
    from raytrain.cli.status import doctor_command

    return doctor_command(args)


def _status(args: argparse.Namespace) -> int:
    """A run's status by spec or name; else a submitted job's, by its id."""
    from raytrain.cli.status import names_a_run, run_status_command

    if names_a_run(args):
        return run_status_command(args)
    args.job_id = args.target
    return _jobs(args)


def _jobs(args: argparse.Namespace) -> int:
    from raytrain.cli.jobs import run_job_command

    return run_job_command(args)


def _export(args: argparse.Namespace) -> int:
    from raytrain.checkpoints.export import export_checkpoint

    state = export_checkpoint(args.checkpoint, args.out)
    count = sum(v.numel() for v in state.values())
    print(printable(f"raytrain: wrote {args.out}: {len(state)} tensors, {count:,} values"))
    return EXIT_OK


def _run_or_validate(args: argparse.Namespace) -> int:
    """``run`` and ``validate``: with ``--print_config``, LightningCLI's view of the config;
    ``validate``, the resolved spec; ``run``, the run and its summary (or ``--json``)."""
    if args.cli:
        args.overrides.append(f"lightning_cli={args.cli}")
    if args.print_config:
        from raytrain.spec import load_spec
        from raytrain.spec.lightning_config import print_config

        print(print_config(load_spec(args.spec, args.overrides)), end="")
        return EXIT_OK
    if args.command == "validate":
        from raytrain.driver.launcher import validate
        from raytrain.spec import dump_spec

        print(dump_spec(validate(args.spec, args.overrides)), end="")
        return EXIT_OK
    from raytrain.driver import preempt_request
    from raytrain.driver.launcher import fit

    preempt_request.install()  # SIGUSR1: stop at a committed checkpoint (exit 4)
    args.overrides += _chaos_overrides(args)
    result = fit(
        args.spec,
        args.overrides,
        fresh=args.fresh,
        resume_anyway=args.resume_anyway,
        force=args.force,
        verbose=args.verbose,
    )
    if args.json:
        print(json.dumps(result.__dict__, default=str))
    else:
        _print_summary(result)
    return EXIT_OK


# Each command's handler: the parsed arguments in, the exit code out.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _run_or_validate,
    "validate": _run_or_validate,
    "tune": _tune,
    "export": _export,
    "report": _report,
    "pack": _pack,
    "status": _status,
    "doctor": _doctor,
    **{name: _jobs for name in JOB_COMMANDS if name != "status"},
    "up": _cluster,
    "down": _cluster,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    # Overrides may come after options (`run SPEC --fresh a.b=1`): argparse stops filling a
    # positional list at the first option, so collect the positional leftovers here.
    args, extra = parser.parse_known_args(argv)
    unknown = [arg for arg in extra if arg.startswith("-")]
    if unknown:
        parser.error(printable(f"unrecognized arguments: {' '.join(unknown)}"))
    if extra and not hasattr(args, "overrides"):
        parser.error(printable(f"unrecognized arguments: {' '.join(extra)}"))
    args.overrides = [*getattr(args, "overrides", []), *extra]
    try:
        return COMMANDS[args.command](args)
    except RaytrainError as exc:
        for line in [] if exc.said else exc.problems:
            print(f"error: {printable(line)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("raytrain: interrupted", file=sys.stderr)
        return 130


def run(argv: Sequence[str] | None = None) -> None:
    """The ``raytrain`` console script: ``main``, then exit without tearing the interpreter
    down. Everything the run writes is written and closed by then; what is left is freeing
    torch's, Lightning's and MLflow's modules one by one, 2-3 s measured on 2 cores."""
    import logging
    import os

    code = main(argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
