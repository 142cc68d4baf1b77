"""``raytrain up`` / ``raytrain down``: a local cluster that stays up between runs.

raytrain up [--num-cpus N] [--num-gpus N] [--warm N]   (exit 0; says so when one is up)
raytrain up --status                                   (exit 0 up, 1 nothing up)
raytrain down                                          (exit 0; says so when none was)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from raytrain.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    import argparse
    from argparse import _SubParsersAction


def add_cluster_commands(sub: _SubParsersAction[argparse.ArgumentParser]) -> None:
    up = sub.add_parser(
        "up",
        help="start a local Ray cluster that stays up: runs join it, "
        "their workers start in warm processes",
    )
    up.add_argument(
        "--num-cpus", type=int, default=None, help="logical CPUs (default: cores + 2 for Ray Data)"
    )
    up.add_argument("--num-gpus", type=int, default=None, help="GPUs (default: those Ray finds)")
    up.add_argument(
        "--warm",
        type=int,
        default=None,
        help="idle worker processes kept with torch and Lightning imported "
        "(default: 2 per training CPU + 5 for a run's helpers)",
    )
    up.add_argument("--status", action="store_true", help="say whether one is up, and its size")
    sub.add_parser("down", help="stop the cluster `raytrain up` started")


# Ray's largest quantity of a resource (ray_constants.MAX_RESOURCE_QUANTITY): more, and
# the server failed as it started, its traceback shown as the reason (exit 1).
MOST_RESOURCE = 10**14


def _bad(flag: str, value: int | None, least: int, most: int | None = None) -> str | None:
    if value is not None and value < least:
        return f"{flag} {value}: must be at least {least}"
    if value is not None and most is not None and value > most:
        return f"{flag} {value}: must be at most {most:,}"
    return None


def cluster_command(args: argparse.Namespace) -> int:
    from raytrain.driver import cluster_record

    try:
        return _cluster_command(args)
    except OSError as exc:  # the record's folder cannot be made or written
        print(
            f"error: {cluster_record.HOME_ENV} ({cluster_record.home()}): {exc.strerror or exc}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT


def _cluster_command(args: argparse.Namespace) -> int:
    from raytrain.driver import cluster_record, local_cluster

    lost = cluster_record.lost_record()
    if lost is not None:  # one is up that these cannot see: never a second, nor "none is up"
        print(f"error: {lost}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.command == "down":
        stopped = local_cluster.down()
        if stopped is None:
            print("raytrain: no cluster is up")
        else:
            print(f"raytrain: stopped the cluster at {stopped.address} (pid {stopped.pid})")
        return EXIT_OK
    if args.status:
        found = cluster_record.running()
        if found is None:
            print("raytrain: no cluster is up")
            return EXIT_FAILED
        print(f"raytrain: up at {found.describe()}")
        return EXIT_OK
    checks = (
        _bad("--num-cpus", args.num_cpus, 1, MOST_RESOURCE),
        _bad("--num-gpus", args.num_gpus, 0, MOST_RESOURCE),
        _bad("--warm", args.warm, 0),
    )
    problems = [p for p in checks if p]
    if problems:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    num_cpus = args.num_cpus or (os.cpu_count() or 1) + local_cluster.DATA_CPUS
    try:
        record, started = local_cluster.up(num_cpus, args.num_gpus, args.warm)
    except local_cluster.UpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if started:
        print(f"raytrain: cluster up at {record.describe()}; `raytrain down` stops it")
    else:
        print(f"raytrain: a cluster is already up at {record.describe()}")
    return EXIT_OK
