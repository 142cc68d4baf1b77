"""``checkpoint.memory_every_n_steps``: the interval ``auto`` chooses, the keeper's
replace-and-fence rules, which state a restart resumes from, and the snapshot's copy."""

from __future__ import annotations

import io
import math
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

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
from raytrain.checkpoints.node_slots import keep_scratch_name
from raytrain.errors import SpecError
from raytrain.spec import load_spec
from raytrain.spec.strategy_checks import strategy_problems
from raytrain.worker.memory_state import (
    collective_hazards,
    read_files,
    state_bytes,
    too_big,
    write_files,
)
from raytrain.worker.packing import pack, packed_files, serialised, skeleton_bytes, unpack


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


def _file(text: str) -> dict[str, bytes]:
    return {"checkpoint.ckpt": text.encode()}


def test_the_keeper_holds_the_latest_state_and_refuses_a_fenced_off_group() -> None:
    keeper = StateKeeper()
    opened = keeper.open()
    token, held = opened.token, opened.step
    assert held is None and keeper.get(0) is None
    assert keeper.put(token, 3, _file("three"))
    assert keeper.put(token, 4, _file("four"))  # replaces: one state held
    assert keeper.held_step() == 4 and keeper.get(4) == _file("four") and keeper.get(3) is None
    # a restart: the new group's rank 0 opens it; the dead group's late send is refused
    reopened = keeper.open()
    new, held = reopened.token, reopened.step
    assert new != token and held == 4 and reopened.key == opened.key
    assert not keeper.put(token, 5, _file("late")) and keeper.refused == 1
    assert keeper.get(4) == _file("four")
    assert keeper.put(new, 5, _file("five")) and keeper.get(5) == _file("five")
    # a loss spike: the state is dropped and the group's send on its way is refused, so
    # the rollback's restart finds none and resumes from storage
    key = keeper.key
    keeper.drop()
    assert keeper.held_step() is None and not keeper.put(new, 6, _file("after the spike"))
    assert keeper.key != key  # the node copies from before the spike are not its own
    assert keeper.open().step is None
    # a keeper Ray started again (its node lost) takes no send meant for the one before
    again = StateKeeper()
    assert not again.put(new, 7, _file("for the lost keeper"))
    assert again.open().token not in (token, new) and again.held_step() is None
    assert again.key != keeper.key  # its node-local copies are not the lost keeper's


def test_a_state_kept_in_parts_is_held_once_every_part_has_come() -> None:
    """Under FSDP each node sends its shards: a state half sent (a node lost mid-keep)
    never replaces the last whole one, and its parts go when a newer step's come."""
    keeper = StateKeeper()
    token = keeper.open().token
    node0 = {"ckpt/.metadata": b"m", "ckpt/__0_0.distcp": b"a"}
    node1 = {"ckpt/__1_0.distcp": b"b"}
    assert keeper.put(token, 2, node0, part=0, parts=2)
    assert keeper.held_step() is None  # node 1's shards have not come
    assert keeper.put(token, 2, node1, part=2, parts=2)
    assert keeper.held_step() == 2 and keeper.get(2) == {**node0, **node1}
    assert keeper.put(token, 3, node1, part=2, parts=2)  # step 3: node 0's never comes
    assert keeper.held_step() == 2 and keeper.get(2) == {**node0, **node1}
    assert keeper.put(token, 4, node0, part=0, parts=2)  # step 4's first part: 3's go
    assert keeper.put(token, 4, {"ckpt/__1_0.distcp": b"c"}, part=2, parts=2)
    assert keeper.get(4) == {**node0, "ckpt/__1_0.distcp": b"c"} and keeper.get(2) is None
    # a late part of a dead group is refused, whatever its step
    assert keeper.open().step == 4 and not keeper.put(token, 5, node0, part=0, parts=2)


def test_kept_files_are_written_back_under_their_folder_only(tmp_path: Path) -> None:
    source = tmp_path / "keep" / "step-3"
    (source / "checkpoint.ckpt").mkdir(parents=True)
    (source / "checkpoint.ckpt" / ".metadata").write_bytes(b"meta")
    (source / "checkpoint.ckpt" / "__0_0.distcp").write_bytes(b"shard")
    files = read_files(str(source))
    assert files == {"checkpoint.ckpt/.metadata": b"meta", "checkpoint.ckpt/__0_0.distcp": b"shard"}
    assert read_files(str(tmp_path / "missing")) == {}  # a node whose ranks wrote nothing
    target = tmp_path / "restore"
    write_files(str(target), files)
    assert read_files(str(target)) == files
    with pytest.raises(ValueError, match="outside its folder"):
        write_files(str(target), {"../escaped": b"x"})
    assert not (tmp_path / "escaped").exists()
    # one scratch folder per run folder, the same on every node
    name = keep_scratch_name("s3://bucket/runs/job")
    assert name == keep_scratch_name("s3://bucket/runs/job") != keep_scratch_name("/runs/job")
    assert name.startswith("raytrain-keep-")


def test_a_restart_resumes_from_memory_only_when_it_is_newer_than_storage() -> None:
    assert memory_is_newer(45, 40)
    assert memory_is_newer(1, None)  # nothing committed yet
    assert not memory_is_newer(40, 40)  # the same step: the committed one
    assert not memory_is_newer(38, 40)  # storage is newer (a preemption's checkpoint)
    assert not memory_is_newer(None, 40) and not memory_is_newer(None, None)


def test_memory_every_n_steps_is_a_count_auto_or_off_under_every_strategy() -> None:
    base = "jobs/digits.yaml"
    assert load_spec(base).checkpoint.memory_every_n_steps == "auto"  # on by default
    assert keeps_memory_state(load_spec(base))
    assert not keeps_memory_state(load_spec(base, ["checkpoint.memory_every_n_steps=off"]))
    for value, expected in [("1", 1), ("auto", "auto"), ("off", None), ("null", None)]:
        spec = load_spec(base, [f"checkpoint.memory_every_n_steps={value}"])
        assert spec.checkpoint.memory_every_n_steps == expected
    assert keeps_memory_state(load_spec(base, ["checkpoint.memory_every_n_steps=auto"]))
    # every strategy keeps it: under FSDP and model parallelism each rank its shard
    for name in ("fsdp", "model_parallel"):
        for value in ("1", "auto"):
            spec = load_spec(
                base, [f"checkpoint.memory_every_n_steps={value}", f"strategy.name={name}"]
            )
            assert keeps_memory_state(spec) and not strategy_problems(spec)
    for bad in ("0", "true", "often", "99999999999999999999999"):
        with pytest.raises(SpecError) as excinfo:
            load_spec(base, [f"checkpoint.memory_every_n_steps={bad}"])
        (problem,) = excinfo.value.problems
        assert problem.startswith("checkpoint.memory_every_n_steps:")
        assert "auto, off, or null" in problem


def test_a_snapshot_is_a_copy_that_training_on_cannot_change() -> None:
    weight = torch.ones(3)
    steps = [1, 2]
    state = {
        "state_dict": OrderedDict(w=weight),
        "loops": {"steps": steps},
        "pair": (torch.zeros(1), "x"),
        "epoch": 2,
    }
    skeleton, buffer = pack(state)
    weight.add_(1.0)  # the next step
    steps.append(3)
    snap = unpack({key: bytes(value) for key, value in packed_files(skeleton, buffer).items()})
    assert snap is not None and snap["state_dict"]["w"].tolist() == [1.0, 1.0, 1.0]
    assert isinstance(snap["state_dict"], OrderedDict) and snap["loops"]["steps"] == [1, 2]
    assert isinstance(snap["pair"], tuple) and snap["pair"][1] == "x" and snap["epoch"] == 2


def test_a_state_sent_whole_is_packed_and_unpacked_to_the_same_tensors() -> None:
    """DDP's keep sends one buffer of the tensors' bytes beside a small torch file of the
    rest: a restore unpacks the same values, dtypes and containers, and reads the rest as a
    checkpoint is read (``weights_only``: a pickled payload is refused)."""
    adam = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    weights = OrderedDict(
        w=torch.randn(4, 5).t(),
        half=torch.ones(3).bfloat16(),
        empty=torch.zeros(0, 2),
        count=torch.tensor(7),
    )
    state = {
        "state_dict": weights,
        "optimizer_states": [adam],
        "epoch": 2,
        "loops": {"fit_loop": {"rows": (1, 2)}},
    }
    files = packed_files(*pack(state))
    assert set(files) == {"packed/state", "packed/data"}
    assert len(files["packed/state"]) < 4096  # the tensors are not in it
    tensors = 20 * 4 + 3 * 2 + 0 + 8 + 4 + 6 * 4  # each at an aligned offset
    assert tensors <= files["packed/data"].nbytes < tensors + 6 * 64
    # the keeper holds bytes (a copy of the array Ray handed it)
    back = unpack({key: bytes(value) for key, value in files.items()})
    assert back is not None and back["epoch"] == 2 and back["loops"] == state["loops"]
    assert isinstance(back["state_dict"], OrderedDict)
    for key, tensor in weights.items():
        restored = back["state_dict"][key]
        assert restored.dtype == tensor.dtype and torch.equal(restored, tensor), key
        assert restored.shape == tensor.shape
    assert torch.equal(
        back["optimizer_states"][0]["state"][0]["exp_avg"], adam["state"][0]["exp_avg"]
    )
    # what a restore writes is a checkpoint file torch.load(weights_only=True) reads
    loaded = torch.load(io.BytesIO(serialised(back)), weights_only=True)
    assert torch.equal(loaded["state_dict"]["half"], weights["half"])
    assert unpack({"checkpoint.ckpt/.metadata": b"m"}) is None  # sharded files: not packed
    # the rest is read with weights_only: a payload in it is refused, not run
    hostile = {"packed/state": skeleton_bytes({"x": _UserCallback()}), "packed/data": b""}
    with pytest.raises(pickle.UnpicklingError):
        unpack(hostile)


class _GatheringModel(pl.LightningModule):
    def on_save_checkpoint(self, checkpoint: dict) -> None:  # a user's: may gather
        checkpoint["extra"] = 1


class _UserCallback(pl.Callback):
    def on_save_checkpoint(
        self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict
    ) -> None:
        checkpoint["mine"] = 1


def test_auto_keeps_nothing_where_rank_0_could_not_dump_its_state_alone() -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from raytrain.worker.checkpointing import CheckpointCallback

    plain, adam = pl.LightningModule(), torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    # Lightning's own classes and raytrain's (its checkpoint callback has the hook)
    own = [pl.callbacks.EarlyStopping("val_loss"), pl.callbacks.EMAWeightAveraging()]
    assert (
        collective_hazards(plain, [*own, CheckpointCallback.__new__(CheckpointCallback)], [adam])
        == []
    )
    found = collective_hazards(_GatheringModel(), [_UserCallback()], [adam])
    assert found == [
        "the model _GatheringModel has its own on_save_checkpoint",
        "the callback _UserCallback has its own on_save_checkpoint",
    ]
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


def test_the_node_copy_is_sent_rarely_and_written_within_its_own_share() -> None:
    from raytrain.checkpoints.memory_interval import NODE_BUDGET, SEND_BUDGET

    assert pytest.approx(BUDGET) == NODE_BUDGET + SEND_BUDGET
    cost = MemoryCost()
    cost.snapshot(0.0005)
    cost.sent(0.002)
    cost.stepped(0.015)
    assert cost.choose() is not None and cost.choose().write_s is None  # type: ignore[union-attr]
    assert cost.choose().steps == memory_steps(0.0025, 0.015)  # type: ignore[union-attr]
    cost.written(0.0006)  # digits' figures (2 ranks on 2 cores): a write is measured
    choice = cost.choose()
    assert choice is not None and choice.write_s == 0.0006
    assert choice.steps == memory_steps(0.0011, 0.015, NODE_BUDGET) == 2
    assert choice.send_steps == memory_steps(0.002, 0.015, SEND_BUDGET) == 27
    assert choice.cost <= BUDGET
    assert "on the node every 2 step(s), in the keeper every 27 step(s)" in choice.describe()
    # the keeper's copy is never kept more often than the node's
    cost.sent(0.0)
    cost.sent(0.0)
    assert cost.choose().send_steps == cost.choose().steps  # type: ignore[union-attr]
    # a number set: the node's copy as set, the keeper's as auto chooses it
    fixed = cost.choose(as_set=1)
    assert fixed is not None and fixed.steps == 1 and fixed.as_set
    assert fixed.send_steps == max(1, memory_steps(0.0, 0.015, SEND_BUDGET))


def _copy_on_node(node: Any, step: int, state: dict[str, Any]) -> None:
    """One whole keep of ``state`` at ``step`` into ``node`` (a ``NodeCopy``)."""
    from raytrain.worker.packing import place

    skeleton, placed, nbytes = place(state)
    node.begin(placed, nbytes)
    node.finish(step, skeleton_bytes(skeleton), nbytes)


def test_the_node_copy_is_whole_or_absent_and_only_its_own_keepers(tmp_path: Path) -> None:
    from raytrain.worker.local_state import NodeCopy, read_state, slot_paths, state_step

    node = NodeCopy(str(tmp_path), "run", key=11)
    weights = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    _copy_on_node(node, 3, {"w": weights, "flags": torch.tensor([True, False]), "step": 3})
    first, second = slot_paths(str(tmp_path), "run")
    assert state_step(first, 11) == 3 and state_step(second, 11) is None
    files = read_state(first, 11, 3)
    assert files is not None and read_state(first, 11, 4) is None
    state = unpack(files)
    assert state is not None and torch.equal(state["w"], weights) and state["step"] == 3
    assert state["flags"].tolist() == [True, False]
    # the next keep goes to the other slot; the one after, back to the first
    _copy_on_node(node, 4, {"w": weights + 1, "flags": torch.tensor([False, False]), "step": 4})
    assert (state_step(first, 11), state_step(second, 11)) == (3, 4)
    assert node.data(weights.numel() * 4).tobytes() == (weights + 1).contiguous().numpy().tobytes()
    # a keep cut short (the process killed after its copy, before the header): that slot
    # is not a state, the other is whole
    from raytrain.worker.packing import place

    skeleton, placed, nbytes = place({"w": weights + 2, "flags": torch.zeros(2).bool(), "step": 5})
    node.begin(placed, nbytes)
    assert (state_step(first, 11), state_step(second, 11)) == (None, 4)
    node.finish(5, skeleton_bytes(skeleton), nbytes)
    assert state_step(first, 11) == 5
    unpacked = unpack(read_state(first, 11, 5) or {})
    assert unpacked is not None and torch.equal(unpacked["w"], weights + 2)
    # a state of another layout: the slot grows, the views are made again
    big = torch.randn(40_000)  # 160 kB: more than the slot holds
    _copy_on_node(node, 6, {"w": big, "step": 6})
    unpacked = unpack(read_state(second, 11, 6) or {})
    assert unpacked is not None and torch.equal(unpacked["w"], big)
    # a header cut short (its fields written, not yet its magic, which goes last), or
    # with no rest: not a state
    raw = bytearray(Path(first).read_bytes())
    Path(first).write_bytes(bytes(8) + raw[8:])
    assert state_step(first, 11) is None
    from raytrain.worker.local_state import HEADER, MAGIC

    Path(first).write_bytes(HEADER.pack(MAGIC, 11, 7, 0, 0) + raw[HEADER.size :])
    assert state_step(first, 11) is None
    Path(first).write_bytes(bytes(raw))
    # a group after a restart starts in the slot holding the older step (5 against 6)
    assert state_step(first, 11) == 5 and state_step(second, 11) == 6
    again = NodeCopy(str(tmp_path), "run", key=11)
    _copy_on_node(again, 7, {"w": big, "step": 7})
    assert (state_step(first, 11), state_step(second, 11)) == (7, 6)
    # another driver's keeper: not resumed from, and removed
    assert state_step(first, 12) is None and not Path(first).exists()
    node.remove()
    assert not Path(second).exists()


def _restore_on_two_nodes(rank: int, store: str, work: str) -> None:
    """One of two ranks, each the first of its own node (outside Ray Train every rank's
    local rank is 0): rank 0 holds the node copy at step 7, rank 1 none."""
    import torch.distributed as dist

    from raytrain.checkpoints.layout import CKPT_FILE
    from raytrain.worker.local_state import NodeCopy
    from raytrain.worker.memory_state import _fetch_node_copy
    from raytrain.worker.packing import place

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        folder = Path(work) / f"node{rank}"
        folder.mkdir()
        on_node = None
        if rank == 0:
            node = NodeCopy(work, "run", key=5)
            _copy_on_node(node, 7, {"w": torch.arange(4.0), "step": 7})
            on_node = (7, node.paths[0])
        assert _fetch_node_copy(str(folder), 5, 7, on_node)
        state = torch.load(folder / CKPT_FILE, weights_only=True)
        assert torch.equal(state["w"], torch.arange(4.0)) and state["step"] == 7
        # no rank holds the step asked for: none has what it needs, and all say so
        assert not _fetch_node_copy(str(folder), 5, 8, on_node)
        # a copy that does not load (a global outside the allow-list): no rank hangs, every
        # rank says it has nothing, and the copy is removed
        if rank == 0:
            _, placed, nbytes = place({"w": torch.arange(4.0), "step": 9})
            node.begin(placed, nbytes)
            node.finish(9, skeleton_bytes({"x": _UserCallback()}), nbytes)
            on_node = (9, node.paths[1])
        assert not _fetch_node_copy(str(folder), 5, 9, on_node)
        if rank == 0:
            assert not Path(node.paths[1]).exists()
    finally:
        dist.destroy_process_group()


def test_a_node_without_the_copy_gets_it_from_the_rank_that_holds_it(tmp_path: Path) -> None:
    # rank 0 restarted on another node than the one whose memory holds its copy: the
    # holder broadcasts it, and every node resumes from the same step
    import torch.multiprocessing as mp

    mp.spawn(_restore_on_two_nodes, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
