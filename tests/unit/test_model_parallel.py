"""The model-parallel strategy's parts that need no Ray: the mesh a spec asks for, which
rows each rank reads, TinyGPT's head-grouped projections (what makes its column shards
whole heads), gradient clipping over DTensors, and the data paths it refuses."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from raytrain.errors import SpecError
from raytrain.models.tinygpt import Block, TinyGPT
from raytrain.spec import load_spec, parse_spec
from raytrain.spec.strategy_checks import strategy_problems
from raytrain.worker import grad_clip
from raytrain.worker.strategy import (
    data_rank,
    tensor_group_spans_nodes,
)
from tests.conftest import digits_spec


def test_the_tinygpt_tp_job_asks_for_two_way_tensor_parallelism() -> None:
    spec = load_spec("jobs/tinygpt-tp.yaml")
    mp = spec.strategy.model_parallel
    assert spec.strategy.name == "model_parallel"
    assert (mp.data_parallel_size, mp.tensor_parallel_size) == ("auto", 2)
    assert mp.sizes(2) == (1, 2) and mp.sizes(4) == (2, 2)
    assert strategy_problems(spec) == []
    assert spec.strategy.tensor_parallel_size == 2
    assert load_spec("jobs/tinygpt.yaml").strategy.tensor_parallel_size == 1


def test_the_ranks_of_a_tensor_parallel_group_read_one_replicas_rows() -> None:
    spec = load_spec("jobs/tinygpt-tp.yaml", ["scaling.num_workers=6"])
    # Lightning's mesh is (data_parallel, tensor_parallel), row-major: ranks 0, 1 are one
    # replica's tensor-parallel group
    assert [data_rank(spec, r, 6) for r in range(6)] == [
        (0, 3),
        (0, 3),
        (1, 3),
        (1, 3),
        (2, 3),
        (2, 3),
    ]
    ddp = load_spec("jobs/digits.yaml")
    assert [data_rank(ddp, r, 2) for r in range(2)] == [(0, 2), (1, 2)]


def _shard(block: Block, rank: int, tp: int) -> Block:
    """Rank ``rank``'s part of ``block`` under ColwiseParallel head_qkv and mlp.0, RowwiseParallel
    proj and mlp.2, as plain modules: contiguous row (column-wise) or column (row-wise)
    slices, biases of row-wise layers only on rank 0 (torch adds them once)."""
    import copy

    part = copy.deepcopy(block)

    def rows(linear: torch.nn.Linear) -> None:
        n = linear.out_features // tp
        linear.weight = torch.nn.Parameter(linear.weight[rank * n : (rank + 1) * n])
        linear.bias = torch.nn.Parameter(linear.bias[rank * n : (rank + 1) * n])

    def cols(linear: torch.nn.Linear) -> None:
        n = linear.in_features // tp
        linear.weight = torch.nn.Parameter(linear.weight[:, rank * n : (rank + 1) * n])
        linear.bias = torch.nn.Parameter(linear.bias * (rank == 0))

    rows(part.head_qkv), cols(part.proj), rows(part.mlp[0]), cols(part.mlp[2])
    return part


def test_column_shards_of_head_qkv_hold_whole_heads() -> None:
    """The ranks' partial outputs sum to the block's own, at each of the two points where
    tensor parallelism sums them (after the attention's and the MLP's row-wise layer): each
    rank's contiguous part of head_qkv's features is its heads' query, key and value (grouped
    by head), so it computes those heads' attention alone."""
    torch.manual_seed(0)
    block = Block(dim=32, heads=4).eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        whole = block(x)
        for tp in (2, 4):
            parts = [_shard(block, r, tp) for r in range(tp)]
            a = x + sum(p.attend(block.norm1(x)) for p in parts)
            out = a + sum(p.mlp(block.norm2(a)) for p in parts)
            torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)


@pytest.fixture
def one_rank_mesh() -> Iterator[object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _grads(mesh: object) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Parameters with gradients, half DTensors and half plain (as tensor parallelism
    without FSDP2 leaves them), and plain copies of all."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(1)
    plain = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(4)]
    for p in plain:
        p.grad = torch.randn_like(p) * 5
    mixed = []
    for i, p in enumerate(plain):
        if i % 2:
            q = torch.nn.Parameter(p.detach().clone())
            q.grad = p.grad.clone()
        else:
            placement = [Shard(0)] if i == 0 else [Replicate()]
            q = torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placement))
            q.grad = distribute_tensor(p.grad.clone(), mesh, placement)
        mixed.append(q)
    return mixed, plain


def test_clipping_by_norm_over_dtensors_and_tensors_is_torchs(one_rank_mesh: object) -> None:
    mixed, plain = _grads(one_rank_mesh)
    with pytest.raises(RuntimeError, match=r"mixed torch\.Tensor and DTensor"):
        torch.nn.utils.clip_grad_norm_(mixed, 1.0)  # why grad_clip exists
    expected = torch.nn.utils.clip_grad_norm_(plain, 1.0)
    got = grad_clip.clip_grad_norm_(mixed, 1.0)
    torch.testing.assert_close(got, expected)
    for q, p in zip(mixed, plain, strict=True):
        torch.testing.assert_close(grad_clip.local_shard(q.grad), p.grad)
    # under the limit: nothing changes
    before = [grad_clip.local_shard(q.grad).clone() for q in mixed]
    grad_clip.clip_grad_norm_(mixed, 1e6)
    after = [grad_clip.local_shard(q.grad) for q in mixed]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_clipping_by_value_over_dtensors_and_tensors_is_torchs(one_rank_mesh: object) -> None:
    mixed, plain = _grads(one_rank_mesh)
    torch.nn.utils.clip_grad_value_(plain, 0.5)
    grad_clip.clip_grad_value_(mixed, 0.5)
    for q, p in zip(mixed, plain, strict=True):
        torch.testing.assert_close(grad_clip.local_shard(q.grad), p.grad)


def test_a_set_ray_data_would_stream_is_refused_under_tensor_parallelism(
    digits_dir: Path, tmp_path: Path
) -> None:
    from raytrain.data.sources import check_shardable

    csv = digits_spec(digits_dir, tmp_path)
    csv["data"]["train"] = {"uri": str(tmp_path / "train.csv"), "format": "csv"}
    # preprocessed on CPU nodes: the one path through Ray Data's streaming_split
    csv["data"] |= {
        "preprocess": "tests.integration.models:images_to_pixels",
        "preprocess_on": {"raytrain.io/role": "data"},
    }
    csv["model"] = {"class_path": "raytrain.models.tinygpt:TinyGPT"}
    csv["strategy"] = {"name": "model_parallel", "model_parallel": {"tensor_parallel_size": 2}}
    spec = parse_spec(csv)
    with pytest.raises(SpecError) as excinfo:
        check_shardable(spec, "train", spec.files.train)  # type: ignore[union-attr, arg-type]
    (problem,) = excinfo.value.problems
    assert problem.startswith("data.train: ") and "2 workers to a model replica" in problem
    csv["strategy"]["model_parallel"]["tensor_parallel_size"] = 1  # FSDP2 alone: any shards
    one = parse_spec(csv)
    check_shardable(one, "train", one.files.train)  # type: ignore[union-attr, arg-type]


def test_tinygpt_configure_model_does_nothing_without_a_mesh() -> None:
    model = TinyGPT(layers=1, dim=16, heads=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.configure_model()  # DDP and FSDP call it too
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- two processes (gloo): what the ranks of one run must agree on ----------------------------


def _two_ranks(rank: int, store_path: str, out: str) -> None:
    """Rank ``rank`` of 2: a module initialised from its own seed, then ``broadcast_state``;
    then gradients finite on rank 0 and NaN in rank 1's shard, through ``FiniteGuard``."""
    import json
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from raytrain._compat.model_parallel import broadcast_state
    from raytrain.errors import NonFiniteLossError
    from raytrain.worker.guards import FiniteGuard

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)  # no trainer.seed: every rank its own initialisation
        module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        broadcast_state(module, torch.device("cpu"))
        weights = [t.tolist() for t in module.state_dict().values()]

        mesh = init_device_mesh("cpu", (2,))
        param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
        grad = torch.ones(4, 2)
        grad[3, 0] = float("nan")  # row 3: rank 1's shard only
        param.grad = distribute_tensor(grad, mesh, [Shard(0)])
        model = SimpleNamespace(parameters=lambda: [param])
        try:
            FiniteGuard().on_before_optimizer_step(
                SimpleNamespace(global_step=0, current_epoch=0),
                model,
                None,  # type: ignore[arg-type]
            )
            raised = False
        except NonFiniteLossError:
            raised = True
        with open(f"{out}/rank{rank}.json", "w") as handle:
            json.dump({"weights": weights, "raised": raised}, handle)
        dist.barrier()  # leave together: neither tears the group down under the other
    finally:
        dist.destroy_process_group()
    # What the ranks agreed on is written. Interpreter teardown can then abort a gloo
    # process ("terminate called without an active exception", 1 run in 60 here and in CI
    # at 7a0d1da): gloo's threads still hold work whose tensors need the GIL
    # (pytorch/pytorch#179291). That is torch's exit, not what this test checks.
    os._exit(0)


def test_ranks_start_from_rank_0s_weights_and_stop_together_on_a_nan(tmp_path: Path) -> None:
    """Without these a tensor-parallel group would sum partial results of different
    weights (no seed), and a NaN in one rank's shard would stop that rank alone while the
    other waited in its next collective."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_two_ranks, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    torch.manual_seed(0)
    rank0 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert ranks[0]["weights"] == [t.tolist() for t in rank0.state_dict().values()]
    assert [r["raised"] for r in ranks] == [True, True]


def test_a_loader_each_rank_iterates_itself_is_refused_under_tensor_parallelism() -> None:
    from torch.utils.data import DataLoader, IterableDataset

    from raytrain.worker.user_data import shard

    class Stream(IterableDataset):
        def __iter__(self) -> Iterator[int]:
            yield from range(8)

    loader = DataLoader(Stream(), batch_size=2)
    assert shard(loader, rank=0, world_size=2, seed=0, where="M.train_dataloader") is loader
    with pytest.raises(ValueError, match=r"^M\.train_dataloader: .*tensor_parallel_size 2"):
        shard(loader, rank=0, world_size=1, seed=0, where="M.train_dataloader", tensor_parallel=2)


def test_a_replica_not_a_worker_is_what_batches_and_throughput_count() -> None:
    from types import SimpleNamespace

    from raytrain.spec.global_batch import global_batch
    from raytrain.worker.reporting import MetricsReporter
    from raytrain.worker.schedule import CheckpointSchedule

    spec = load_spec("jobs/tinygpt-tp.yaml", ["scaling.keep_global_batch=true"])
    batching = global_batch(spec, 1)  # 2 workers, tp 2: one replica
    assert (batching.accumulate, batching.samples) == (1, 64)
    reporter = MetricsReporter(
        log_every_n_steps=1, schedule=CheckpointSchedule(None, None), readers_per_row=2
    )
    import time

    reporter.window.rows = 64  # one step's rows on each rank of the group: the same 64
    reporter.window._start = time.perf_counter() - 2.0  # a window of 2 s (and a little)
    trainer = SimpleNamespace(world_size=2, global_step=1)
    out = reporter._train_window(trainer, {})  # type: ignore[arg-type]
    assert out["samples_per_s"] == pytest.approx(32, rel=0.05)  # not 64: one replica's rows


def test_sequence_parallelism_refuses_a_sequence_it_cannot_split_evenly() -> None:
    model = TinyGPT(block=16, layers=1, dim=16, heads=2)
    model.sequence_shards = 2  # as parallelize sets it under sequence parallelism
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 256)
    with pytest.raises(ValueError, match="a sequence of 7 tokens"):
        model(torch.zeros(1, 7, dtype=torch.long))


def test_a_configure_model_the_source_cannot_show_is_checked_by_importing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_dir: Path
) -> None:
    from raytrain.driver.preflight import check_model_located

    (tmp_path / "runtime_base.py").write_text(
        "import lightning.pytorch as pl\n"
        "def make():\n    return type('Base', (pl.LightningModule,), {})\n"
        "Base = make()\n"
        "class Model(Base):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = digits_spec(digits_dir, tmp_path)
    raw["model"] = {"class_path": "runtime_base:Model"}
    raw["strategy"] = {"name": "model_parallel"}
    problems = check_model_located(parse_spec(raw))
    assert len(problems) == 1 and problems[0].startswith("model.class_path: runtime_base:Model")
    assert "defines no configure_model" in problems[0]


def _compositions(total: int) -> Iterator[list[int]]:
    """Every way ``total`` workers split over nodes, in node order."""
    for cuts in itertools.product([False, True], repeat=total - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 0
            size += 1
        yield [*sizes, size]


def test_a_tensor_group_across_nodes_is_told_by_a_nodes_first_worker() -> None:
    # Over every layout of up to 8 workers (ranks numbered node by node, as Ray Train does)
    # and every tensor-parallel size dividing the world: the groups the nodes' first
    # workers flag are exactly those whose ranks sit on more than one node.
    for world in range(1, 9):
        for sizes in _compositions(world):
            node_of = [n for n, size in enumerate(sizes) for _ in range(size)]
            local = [r - node_of.index(node_of[r]) for r in range(world)]
            for tp in (t for t in range(1, world + 1) if world % t == 0):
                spanning = {
                    r // tp
                    for r in range(world)
                    if len(set(node_of[r - r % tp : r - r % tp + tp])) > 1
                }
                flagged = {
                    r // tp for r in range(world) if tensor_group_spans_nodes(r, local[r], tp)
                }
                assert flagged == spanning, (sizes, tp)


def test_the_first_worker_of_a_node_inside_a_group_warns_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from types import SimpleNamespace

    from raytrain.worker.strategy import _warn_if_tensor_group_spans_nodes

    def context(rank: int, local: int, per_node: int) -> SimpleNamespace:
        return SimpleNamespace(
            get_world_rank=lambda: rank,
            get_local_rank=lambda: local,
            get_local_world_size=lambda: per_node,
        )

    _warn_if_tensor_group_spans_nodes(context(4, 0, 2), tp=4)  # nodes of 2 start at 0, 2, 4
    _warn_if_tensor_group_spans_nodes(context(2, 0, 2), tp=4)
    out = capsys.readouterr().err
    assert out.count("warning") == 1 and "ranks 0-3 spans more than one node" in out
    assert "rank 2 begins a node" in out and "(2 on this one)" in out
