"""``raytrain._compat.ray_train`` against a real Ray cluster: what the unit tests cannot pin."""

from __future__ import annotations

import time

import pytest


def test_a_dead_controllers_placement_group_is_removed_on_a_cluster_without_a_dashboard(
    ray_cluster: None,
) -> None:
    """The session cluster is raytrain's embedded one: no dashboard, so no state API. A
    placement group made by an actor that dies while its job lives stays reserved until the
    job ends unless a cleaner removes it; Ray's cleaner asks the state API and never sees
    the death (a sweep's later trials then waited for CPUs without end)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    from raytrain._compat.ray_train_controller import GcsPlacementGroupCleaner

    @ray.remote(num_cpus=0)
    class Controller:
        def reserve(self) -> tuple[str, object]:
            group = placement_group([{"CPU": 1}])
            ray.get(group.ready())
            return ray.get_runtime_context().get_actor_id(), group

    controller = Controller.remote()  # type: ignore[attr-defined]
    controller_id, group = ray.get(controller.reserve.remote())
    assert placement_group_table(group)["state"] == "CREATED"
    cleaner = (
        ray.remote(num_cpus=0)(GcsPlacementGroupCleaner)
        .options(lifetime="detached")
        .remote(controller_id, check_interval_s=0.2, get_actor_timeout_s=1, stop_timeout=2)
    )
    ray.get(cleaner.register_placement_group.remote(group))
    ray.get(cleaner.start_monitoring.remote())
    assert placement_group_table(group)["state"] == "CREATED"  # the controller lives
    ray.kill(controller)
    deadline = time.monotonic() + 60
    while placement_group_table(group)["state"] != "REMOVED":
        if time.monotonic() > deadline:
            pytest.fail(f"the placement group is still {placement_group_table(group)}")
        time.sleep(0.2)
