"""Where Ray Data's tasks run (``sources.data_nodes``), and ``data.preprocess_on``'s
checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain.data.sources import data_nodes
from raytrain.errors import SpecError
from raytrain.spec import parse_spec
from tests.conftest import digits_spec


def _data(**fields):
    spec = digits_spec(Path("/tmp/d"), Path("/tmp/w"))
    spec["data"].update(fields)
    return parse_spec(spec).data


def _node(node_id: str, gpus: float = 0, alive: bool = True) -> dict:
    return {
        "NodeID": node_id,
        "Alive": alive,
        "Resources": {"CPU": 8.0, **({"GPU": gpus} if gpus else {})},
    }


NODES = [_node("gpu-a", 8), _node("cpu-b"), _node("cpu-a"), _node("cpu-dead", alive=False)]


def test_a_gpu_run_sends_ray_datas_tasks_to_the_alive_nodes_without_gpus() -> None:
    assert data_nodes(_data(), True, lambda: NODES) == {"ray.io/node-id": "in(cpu-a,cpu-b)"}


@pytest.mark.parametrize(
    ("nodes", "use_gpu"),
    [(NODES, False), ([_node("gpu-a", 8), _node("gpu-b", 4)], True), ([_node("cpu-a")], True)],
)
def test_anywhere_without_a_gpu_run_or_without_both_kinds_of_node(nodes, use_gpu) -> None:
    assert data_nodes(_data(), use_gpu, lambda: nodes) is None


def test_the_spec_says_otherwise() -> None:
    chosen = {"raytrain.io/role": "data"}
    assert data_nodes(_data(preprocess_on=chosen), True, lambda: NODES) == chosen
    assert data_nodes(_data(preprocess_on={}), True, lambda: NODES) is None  # {}: anywhere


@pytest.mark.parametrize(
    ("selector", "says"),
    [
        ({"bad key": "x"}, "not a node label's name"),
        ({"role": "in()"}, "not a label value"),
        ({"role": "a b"}, "not a label value"),
    ],
)
def test_a_bad_selector_is_named(selector, says) -> None:
    with pytest.raises(SpecError) as caught:
        _data(preprocess_on=selector)
    (line,) = caught.value.problems
    assert line.startswith("data.preprocess_on: ") and says in line
