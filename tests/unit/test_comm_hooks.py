"""Gradient compression: every hook runs on gloo on CPU (which Lightning never registers
them on), counts the bytes it sends, gives the gradients the plain all-reduce gives (to
its precision), and PowerSGD's state survives a checkpoint. Two processes, gloo."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from raytrain.spec import load_spec
from raytrain.spec.sections import DdpSpec, PowerSgdSpec
from raytrain.spec.strategy_checks import strategy_problems
from raytrain.worker.comm_hooks import Compression, powersgd_state, restore_powersgd

KINDS = ("none", "fp16", "bf16", "powersgd")
STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _ranks(rank: int, store_path: str, out: str) -> None:
    """Rank ``rank`` of 2: each hook on a DDP model, ``STEPS`` backward passes of rank-own
    data; the bytes each step sent and the gradients after the last."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from raytrain.worker.comm_hooks import HookState, register

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        found: dict[str, dict] = {}
        for kind in KINDS:
            model = DistributedDataParallel(_model())
            powersgd = powersgd_state(1, 2) if kind == "powersgd" else None
            state = HookState(kind, powersgd)
            assert register(model, state) is True
            sent = []
            torch.manual_seed(rank)
            for _ in range(STEPS):
                model.zero_grad()
                model(torch.randn(32, 64)).square().mean().backward()
                sent.append(state.take_bytes())
            grads = [p.grad.flatten().tolist() for p in model.parameters()]
            found[kind] = {"sent": sent, "grads": grads}
        Path(f"{out}/rank{rank}.json").write_text(json.dumps(found))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # see test_model_parallel: gloo's teardown may abort the interpreter


def test_every_hook_runs_on_gloo_counts_its_bytes_and_gives_the_mean(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_ranks, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    numel = sum(p.numel() for p in _model().parameters())  # 4810
    plain = ranks[0]["none"]
    assert plain["sent"] == [4 * numel] * STEPS  # fp32, every step
    for kind in ("fp16", "bf16"):
        assert ranks[0][kind]["sent"] == [2 * numel] * STEPS  # half the bytes
    # PowerSGD: plain all-reduce for start_iter (2) steps, then rank-1 factors of the two
    # weight matrices ((64 + 64) + (10 + 64) numbers) and the biases (74) whole
    compressed = 4 * ((64 + 64) + (10 + 64) + 64 + 10)
    assert ranks[0]["powersgd"]["sent"] == [4 * numel] * 2 + [compressed] * (STEPS - 2)
    for kind in KINDS:  # every rank ends with the same (averaged) gradients
        assert ranks[0][kind]["grads"] == ranks[1][kind]["grads"]
    flat = torch.tensor([x for g in plain["grads"] for x in g])
    for kind, tolerance in (("fp16", 1e-3), ("bf16", 1e-2)):
        got = torch.tensor([x for g in ranks[0][kind]["grads"] for x in g])
        assert torch.allclose(got, flat, atol=tolerance * flat.abs().max())


def test_powersgds_iteration_and_factors_survive_a_checkpoint_and_errors_restart() -> None:
    saved_from = powersgd_state(1, 10)
    saved_from.iter = 37
    saved_from.p_memory_dict = {0: torch.randn(64, 1)}
    saved_from.q_memory_dict = {0: torch.randn(64, 1)}
    saved_from.error_dict = {0: torch.randn(4810)}
    writer = Compression(DdpSpec(comm_hook="powersgd"))
    writer.state.powersgd = saved_from
    saved = writer.state_dict()
    assert saved["iter"] == 37

    reader = Compression(DdpSpec(comm_hook="powersgd"))
    reader.load_state_dict(saved)
    fresh = powersgd_state(1, 10)
    assert fresh.iter == 0 and not fresh.p_memory_dict  # what a resume without it starts from
    restore_powersgd(fresh, reader._restored or {}, torch.device("cpu"))
    assert fresh.iter == 37  # past start_iter: compressing again once DDP's buckets are
    assert fresh.start_powerSGD_iter == 39  # rebuilt into the layout of the saved factors
    assert torch.equal(fresh.p_memory_dict[0], saved_from.p_memory_dict[0])
    assert torch.equal(fresh.q_memory_dict[0], saved_from.q_memory_dict[0])
    assert fresh.error_dict == {}  # rank 0's errors are not the other ranks': restart at 0
    assert Compression(DdpSpec(comm_hook="fp16")).state_dict() == {}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["strategy.name=fsdp", "strategy.ddp.comm_hook=fp16"], "strategy.ddp"),
        (["strategy.ddp.powersgd.rank=4"], "strategy.ddp.powersgd"),
    ],
)
def test_compression_is_refused_where_it_would_do_nothing(overrides: list[str], field: str) -> None:
    (problem,) = strategy_problems(load_spec("jobs/digits.yaml", overrides))
    assert problem.startswith(f"{field}: ")
    assert PowerSgdSpec().start_iter >= 2  # error feedback needs 2 (torch refuses fewer)
