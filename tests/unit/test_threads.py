"""``choose_threads``: the user's OMP_NUM_THREADS wins when it is a positive integer;
otherwise the whole CPUs the worker was given, at least one."""

from __future__ import annotations

import pytest

from raytrain.worker.threads import OMP_ENV, choose_threads


@pytest.mark.parametrize(
    "cpus, environ, threads, says",
    [
        (1, {}, 1, "the CPU(s) each worker was given"),
        (4, {}, 4, "the CPU(s) each worker was given"),
        (2.5, {}, 2, "given"),
        (0.5, {}, 1, "given"),
        (1, {OMP_ENV: "3"}, 3, "OMP_NUM_THREADS=3, as set"),
        (4, {OMP_ENV: "0"}, 4, "'0' is not a positive integer"),
        (2, {OMP_ENV: "many"}, 2, "'many' is not a positive integer"),
        (2, {OMP_ENV: "-1"}, 2, "not a positive integer"),
    ],
)
def test_threads_follow_the_users_setting_or_the_cpus_given(
    cpus: float, environ: dict[str, str], threads: int, says: str
) -> None:
    choice = choose_threads(cpus, environ)
    assert choice.threads == threads
    assert says in choice.reason
    assert choice.describe().startswith(f"{threads} intra-op thread")
