"""Pipeline parallelism's pure parts: where a model is cut, the micro-batches a batch is
cut into, which rows each rank reads, what a stage keeps, and what the last stage's logs
become on every rank. The schedules themselves run in tests/integration/test_pipeline.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrain.pipeline.model_steps import ModelSteps, rows_of, take_rows
from raytrain.pipeline.relay import LogRelay
from raytrain.pipeline.runner import microbatch_count
from raytrain.pipeline.split import SplitError, chain, stage_ranges
from raytrain.pipeline.stage import ChainStage, Dropped, keep_only
from raytrain.spec import load_spec
from raytrain.spec.strategy_checks import strategy_problems
from raytrain.worker.strategy import data_rank
from tests.integration.models import DigitsBlocks

LINKS = ["stem", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("points", [False, True])
def test_stage_ranges_cut_the_chain_into_that_many_runs_in_order(stages: int, points: bool) -> None:
    split = [LINKS[i] for i in range(1, stages)] if points else []
    runs = stage_ranges(LINKS, split, stages)
    assert len(runs) == stages and all(runs)
    assert [link for run in runs for link in run] == LINKS
    if not points:  # equal runs, the first ones one longer
        assert max(map(len, runs)) - min(map(len, runs)) <= 1
        assert [len(r) for r in runs] == sorted((len(r) for r in runs), reverse=True)


@pytest.mark.parametrize(
    ("points", "stages", "says"),
    [
        (["blocks.9"], 2, "no such child"),
        (["stem"], 2, "the first stage begins there"),
        (["blocks.2", "blocks.1"], 3, "out of order"),
        ([], 7, "only 6 children"),
    ],
)
def test_a_split_the_chain_cannot_take_is_refused_naming_the_point(
    points: list[str], stages: int, says: str
) -> None:
    with pytest.raises(SplitError, match=says):
        stage_ranges(LINKS, points, stages)


def test_the_chain_is_found_by_tracing_and_a_forward_that_is_none_is_refused() -> None:
    assert chain(DigitsBlocks()) == LINKS

    class Skip(nn.Module):  # a residual around its children: not one tensor passed on
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) + x

    with pytest.raises(
        SplitError, match=r"not pass one tensor .* at call_function .*add.* \(after b\)"
    ):
        chain(Skip())


@pytest.mark.parametrize("rows", range(1, 40))
@pytest.mark.parametrize("asked", [1, 2, 4, 8])
def test_microbatch_count_divides_the_batch_and_is_the_asked_where_it_can_be(
    rows: int, asked: int
) -> None:
    got = microbatch_count(asked, rows)
    assert rows % got == 0 and 1 <= got <= asked
    if rows % asked == 0:
        assert got == asked


def test_a_pipelines_ranks_read_one_replicas_rows() -> None:
    spec = load_spec("jobs/tinygpt-pp.yaml", ["scaling.num_workers=4"])
    assert strategy_problems(spec) == [] and spec.strategy.replica_size == 2
    assert spec.strategy.model_parallel.mesh_shape(4) == (2, 2, 1)
    # mesh (pipeline, data_parallel, tensor_parallel), row-major: ranks 0, 1 are stage 0 of
    # replicas 0, 1; ranks 2, 3 stage 1 of them
    assert [data_rank(spec, r, 4) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    three_d = load_spec(
        "jobs/tinygpt-pp.yaml",
        ["scaling.num_workers=8", "strategy.model_parallel.tensor_parallel_size=2"],
    )
    assert three_d.strategy.model_parallel.mesh_shape(8) == (2, 2, 2)
    assert [data_rank(three_d, r, 8)[0] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_a_stage_keeps_its_children_and_drops_the_others_parameters_only() -> None:
    model = DigitsBlocks()
    names = set(model.state_dict())
    stage = ChainStage(model, ["blocks.2", "blocks.3", "head"])
    assert keep_only(model, stage) == ["stem", "blocks.0", "blocks.1"]
    assert isinstance(model.stem, Dropped) and isinstance(model.blocks[0], Dropped)
    kept = set(model.state_dict())
    # the stage's parameters keep their paths in the whole model; the metric stays
    assert kept <= names and {"head.weight", "blocks.2.0.weight"} <= kept
    assert not any(k.startswith(("stem.", "blocks.0.", "blocks.1.")) for k in kept)
    assert hasattr(model, "val_acc")
    with pytest.raises(RuntimeError, match="stem belongs to another pipeline stage"):
        model.stem(torch.zeros(1, 64))


def test_the_steps_input_and_each_microbatchs_loss_come_from_the_models_own_step() -> None:
    model = DigitsBlocks()
    batch = {"pixels": torch.arange(8 * 64).reshape(8, 64) % 17, "label": torch.arange(8) % 10}
    steps = ModelSteps(model)
    (x,) = steps.input(model.training_step, batch, 0)
    assert torch.equal(x, batch["pixels"].float() / 16.0)
    assert rows_of(batch) == 8
    assert torch.equal(take_rows(batch, 2, 4, 8)["label"], batch["label"][2:4])
    relay = LogRelay()
    whole = model(x)
    with relay.recording(model), steps.on(batch, 0, model.training_step, probes=1):
        assert float(steps.loss(whole[:4], torch.arange(4))) == 0.0  # the shape probe
        halves = [steps.loss(whole[a:b], torch.arange(a, b)) for a, b in ((0, 4), (4, 8))]
    plain = nn.functional.cross_entropy(whole, batch["label"])
    assert float(sum(halves) / 2) == pytest.approx(float(plain), abs=1e-6)
    # what the step logged, once per micro-batch, is one mean for the whole batch
    ((name, (value, options)),) = relay.take(8).items()
    assert name == "train_loss" and options == {"batch_size": 8}
    assert value == pytest.approx(float(plain), abs=1e-6)
    assert relay.take(8) == {}
    assert "log" not in vars(model)  # the model's own log is back
