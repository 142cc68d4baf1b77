"""``start_local``'s record of what it changed in the caller's environment, undone at
shutdown, without Ray (the real start is in tests/integration/test_streaming.py)."""

from __future__ import annotations

from raytrain.driver.ray_runtime import EnvChanges, RayHandle


def test_undo_removes_what_was_added_and_restores_what_was_changed() -> None:
    before = {"HOME": "/home/u", "KEEP": "1", "RAY_worker_niceness": "5"}
    env = dict(before)
    env.update(ADDED="0", RAY_worker_niceness="0")  # as a start would
    del env["KEEP"]
    changes = EnvChanges.between(before, env)
    assert changes.before == {"ADDED": None, "KEEP": "1", "RAY_worker_niceness": "5"}
    changes.undo(env)
    assert env == before


def test_undo_keeps_what_the_caller_set_since() -> None:
    before = {"A": "1"}
    env = {"A": "2", "B": "0"}
    changes = EnvChanges.between(before, env)
    env["A"] = "caller"  # the caller changed it again while the cluster ran
    del env["B"]  # and removed this one
    env["C"] = "new"  # and set one start_local never touched
    changes.undo(env)
    assert env == {"A": "caller", "C": "new"}


def test_a_handle_without_a_cluster_restores_on_shutdown_once() -> None:
    import os

    key = "RAYTRAIN_TEST_ENV_UNDO"
    assert key not in os.environ
    before = dict(os.environ)
    os.environ[key] = "set by a start"
    try:
        changes = EnvChanges.between(before, os.environ)
        handle = RayHandle(started_here=False, address=None, env_changes=changes)
        handle.shutdown()  # Ray is not running: only the environment is undone
        assert key not in os.environ
        os.environ[key] = "set again by the caller"
        handle.shutdown()
        assert os.environ[key] == "set again by the caller"
    finally:
        os.environ.pop(key, None)


def test_the_integration_test_pins_the_embedded_variables() -> None:
    from raytrain.driver.ray_runtime import EMBEDDED_ENV
    from tests.integration.test_streaming import EMBEDDED

    assert EMBEDDED == EMBEDDED_ENV
