"""``checkpoint.memory_every_n_steps``: the interval ``auto`` chooses, the keeper's
replace-and-fence rules, which state a restart resumes from, and the snapshot's copy."""

from __future__ import annotations

import io
import math
from collections import OrderedDict, namedtuple

import lightning.pytorch as pl
import pytest
import torch

from raytrain.checkpoints.keeper import StateKeeper, keeps_memory_state, memory_is_newer
from raytrain.checkpoints.memory_interval import (
    BUDGET,
    MOST_MEMORY_STEPS,
    MemoryCost,
    memory_steps,
)
from raytrain.errors import SpecError
from raytrain.spec import load_spec
from raytrain.worker.memory_state import (
    collective_hazards,
    frozen,
    serialised,
    state_bytes,
    too_big,
)
from raytrain.worker.strategy import strategy_problems


def test_every_step_is_kept_where_it_costs_at_most_five_percent_of_a_step() -> None:
    assert memory_steps(0.004, 0.1) == 1  # 4%
    assert memory_steps(0.005, 0.1) == 1  # exactly 5%
    assert memory_steps(0.0051, 0.1) == 2  # just over: every other step
    assert memory_steps(0.05, 0.1) == 10  # half a step: 10 steps keep it at 5%
    assert memory_steps(0.05, 0.1) < memory_steps(0.1, 0.1) == 20  # costlier: rarer
    assert memory_steps(0.05, 0.2) == 5  # slower steps: more often
    # the chosen interval keeps the cost within the budget, and is the smallest that does
    for keep, step in [(0.013, 0.07), (0.3, 0.01), (2.0, 1.5)]:
        n = memory_steps(keep, step)
        assert keep / (n * step) <= BUDGET + 1e-12
        assert n == 1 or keep / ((n - 1) * step) > BUDGET
    # bounds, whatever the figures
    assert memory_steps(0.0, 0.1) == 1
    assert memory_steps(100.0, 1e-9) == MOST_MEMORY_STEPS
    assert memory_steps(0.1, 0.0) == MOST_MEMORY_STEPS
    assert memory_steps(0.1, math.nan) == MOST_MEMORY_STEPS


def test_the_cost_is_measured_as_the_run_goes_and_said_with_its_figures() -> None:
    cost = MemoryCost(window=3)
    assert cost.choose() is None  # nothing measured
    cost.snapshot(0.001)
    cost.stepped(0.1)
    assert cost.choose() is None  # no send finished yet
    cost.sent(0.003)
    choice = cost.choose()
    assert choice is not None and choice.steps == 1 and choice.cost == pytest.approx(0.04)
    text = choice.describe()
    assert "every 1 step(s)" in text and "snapshot 0.001 s" in text and "send 0.003 s" in text
    cost.sent(0.049)  # slower sends (median of the last 2: 0.026): re-chosen
    choice = cost.choose()
    assert choice is not None and choice.steps == memory_steps(0.001 + 0.026, 0.1) == 6
    cost.stepped(0.1)
    cost.stepped(5.0)  # a step with a validation in it: the median is still a step's
    assert cost.choose() == choice
    cost.stepped(0.0)  # not a step: ignored
    assert cost.choose() == choice
    # an interval the spec set is not chosen: what it costs is said
    fixed = cost.choose(as_set=1)
    assert fixed is not None and fixed.steps == 1 and fixed.cost == pytest.approx(0.27)
    assert fixed.describe().endswith("27% of training (as set)")
    assert choice.describe().endswith("(at most 5%)")


def test_the_keeper_holds_the_latest_state_and_refuses_a_fenced_off_group() -> None:
    keeper = StateKeeper()
    token, held = keeper.open()
    assert held is None and keeper.get(0) is None
    assert keeper.put(token, 3, b"three")
    assert keeper.put(token, 4, b"four")  # replaces: one state held
    assert keeper.held_step() == 4 and keeper.get(4) == b"four" and keeper.get(3) is None
    # a restart: the new group's rank 0 opens it; the dead group's late send is refused
    new, held = keeper.open()
    assert new != token and held == 4
    assert not keeper.put(token, 5, b"late") and keeper.refused == 1
    assert keeper.get(4) == b"four"
    assert keeper.put(new, 5, b"five") and keeper.get(5) == b"five"
    # a loss spike: the state is dropped and the group's send on its way is refused, so
    # the rollback's restart finds none and resumes from storage
    keeper.drop()
    assert keeper.held_step() is None and not keeper.put(new, 6, b"after the spike")
    assert keeper.open()[1] is None
    # a keeper Ray started again (its node lost) takes no send meant for the one before
    again = StateKeeper()
    assert not again.put(new, 7, b"for the lost keeper")
    assert again.open()[0] not in (token, new) and again.held_step() is None


def test_a_restart_resumes_from_memory_only_when_it_is_newer_than_storage() -> None:
    assert memory_is_newer(45, 40)
    assert memory_is_newer(1, None)  # nothing committed yet
    assert not memory_is_newer(40, 40)  # the same step: the committed one
    assert not memory_is_newer(38, 40)  # storage is newer (a preemption's checkpoint)
    assert not memory_is_newer(None, 40) and not memory_is_newer(None, None)


def test_memory_every_n_steps_is_a_count_auto_or_off_and_ddp_only() -> None:
    base = "jobs/digits.yaml"
    assert load_spec(base).checkpoint.memory_every_n_steps == "auto"  # on by default
    assert keeps_memory_state(load_spec(base))
    assert not keeps_memory_state(load_spec(base, ["checkpoint.memory_every_n_steps=off"]))
    for value, expected in [("1", 1), ("auto", "auto"), ("off", None), ("null", None)]:
        spec = load_spec(base, [f"checkpoint.memory_every_n_steps={value}"])
        assert spec.checkpoint.memory_every_n_steps == expected
    assert keeps_memory_state(load_spec(base, ["checkpoint.memory_every_n_steps=auto"]))
    fsdp = load_spec(base, ["checkpoint.memory_every_n_steps=1", "strategy.name=fsdp"])
    assert not keeps_memory_state(fsdp)  # a shard per rank: refused before Ray, not dropped
    (problem,) = strategy_problems(fsdp)
    assert problem.startswith("checkpoint.memory_every_n_steps: DDP only")
    # the default asks for it where it can be had: nothing kept, nothing refused
    for name in ("fsdp", "model_parallel"):
        default = load_spec(base, [f"strategy.name={name}"])
        assert not keeps_memory_state(default) and not strategy_problems(default)
    for bad in ("0", "true", "often", "99999999999999999999999"):
        with pytest.raises(SpecError) as excinfo:
            load_spec(base, [f"checkpoint.memory_every_n_steps={bad}"])
        (problem,) = excinfo.value.problems
        assert problem.startswith("checkpoint.memory_every_n_steps:")
        assert "auto, off, or null" in problem


def test_a_snapshot_is_a_copy_that_training_on_cannot_change() -> None:
    Pair = namedtuple("Pair", "a b")
    weight = torch.ones(3)
    steps = [1, 2]
    state = {"state_dict": OrderedDict(w=weight), "loops": {"steps": steps},
             "pair": Pair(torch.zeros(1), "x"), "epoch": 2}  # fmt: skip
    snap = frozen(state)
    weight.add_(1.0)  # the next step
    steps.append(3)
    assert snap["state_dict"]["w"].tolist() == [1.0, 1.0, 1.0]
    assert isinstance(snap["state_dict"], OrderedDict) and snap["loops"]["steps"] == [1, 2]
    assert isinstance(snap["pair"], Pair) and snap["epoch"] == 2
    # its bytes are a checkpoint file's: torch.load(weights_only=True) reads them back
    loaded = torch.load(io.BytesIO(serialised({"w": snap["state_dict"]["w"], "step": 4})),
                        weights_only=True)  # fmt: skip
    assert loaded["step"] == 4 and loaded["w"].tolist() == [1.0, 1.0, 1.0]


class _GatheringModel(pl.LightningModule):
    def on_save_checkpoint(self, checkpoint: dict) -> None:  # a user's: may gather
        checkpoint["extra"] = 1


class _UserCallback(pl.Callback):
    def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule,
                           checkpoint: dict) -> None:  # fmt: skip
        checkpoint["mine"] = 1


def test_auto_keeps_nothing_where_rank_0_could_not_dump_its_state_alone() -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from raytrain.worker.checkpointing import CheckpointCallback

    plain, adam = pl.LightningModule(), torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    # Lightning's own classes and raytrain's (its checkpoint callback has the hook)
    own = [pl.callbacks.EarlyStopping("val_loss"), pl.callbacks.EMAWeightAveraging()]
    assert collective_hazards(plain, [*own, CheckpointCallback.__new__(CheckpointCallback)],
                              [adam]) == []  # fmt: skip
    found = collective_hazards(_GatheringModel(), [_UserCallback()], [adam])
    assert found == ["the model _GatheringModel has its own on_save_checkpoint",
                     "the callback _UserCallback has its own on_save_checkpoint"]  # fmt: skip
    zero = ZeroRedundancyOptimizer.__new__(ZeroRedundancyOptimizer)  # no process group here
    (reason,) = collective_hazards(plain, [], [zero])
    assert "ZeroRedundancyOptimizer gathers its state" in reason


def test_auto_keeps_nothing_where_three_copies_of_the_state_do_not_fit() -> None:
    module = torch.nn.Linear(256, 256)  # 257 x 256 float32
    adam = torch.optim.Adam(module.parameters())
    params = 257 * 256 * 4
    assert state_bytes(module, [adam]) == params  # no moments before the first step
    module(torch.ones(1, 256)).sum().backward()
    adam.step()
    assert state_bytes(module, [adam]) == 3 * params + 2 * 4  # two moments and the steps
    assert not too_big(params, available=6 * params)  # 3 copies: half of what is free
    assert too_big(params, available=6 * params - 1)
