"""Rank 0 keeps its training state in memory, outside the training processes, and a
restarted group resumes from it (``checkpoint.memory_every_n_steps``; the keeper and the
choice of state: ``checkpoints.keeper``).

``MemoryState`` runs on rank 0 at the end of every optimizer step that is due. It takes a
snapshot of the full Lightning state, the content of a checkpoint at this step with the
loops' and the loader's position (copied off the live tensors on the training thread, so
the next step cannot change it), and hands it to a background thread that serialises it
and sends it to the keeper. Never two sends at once: a keep due while the last is still
on its way is skipped. Under ``auto`` the interval is chosen from the measured cost
(``checkpoints.memory_interval``) at each keep, and rank 0 tells the driver when it
changes. A loader that keeps no position is kept only where a checkpoint would be
(never mid-epoch): not at all, here.

``restore_from_memory`` runs on every rank before ``fit``: rank 0 opens the keeper (fencing
off the dead group's sends) and decides, every rank takes its decision by a broadcast,
fetches the state by its step and writes it to a local file, which ``fit`` resumes from as
from a checkpoint in storage. Every rank must have it, or all resume from storage.
"""

from __future__ import annotations

import io
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lightning.pytorch as pl
import torch

from raytrain._compat.lightning import dump_state
from raytrain.checkpoints.keeper import memory_is_newer
from raytrain.checkpoints.layout import CKPT_FILE
from raytrain.checkpoints.memory_interval import MemoryChoice, MemoryCost
from raytrain.worker.loader_position import keeps_position

SEND_TIMEOUT_S = 300


def frozen(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU and every container copied, so that
    training on cannot change it while it is serialised in the background."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        copied = value.copy()
        for key, item in value.items():
            copied[key] = frozen(item)
        return copied
    if isinstance(value, list):
        return [frozen(item) for item in value]
    if isinstance(value, tuple):
        items = [frozen(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def serialised(state: dict[str, Any]) -> bytes:
    """``state`` as a Lightning checkpoint file's bytes (what ``torch.save`` writes)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


# Lightning's and raytrain's own classes: their checkpoint hooks wait on no other rank.
_OWN_MODULES = ("lightning.", "pytorch_lightning.", "raytrain.")
# Under ``auto``, the most of the memory available on rank 0's node a keep may take: the
# snapshot, its serialised bytes and the object store's copy are each about the state.
MEMORY_SHARE = 0.5


def collective_hazards(module: Any, callbacks: list[Any], optimizers: list[Any]) -> list[str]:
    """Why rank 0 cannot dump a checkpoint alone, as far as can be told: a user's
    ``on_save_checkpoint`` (the model's or a callback's) may wait on the other ranks (a
    gather, a barrier), and an optimizer with ``consolidate_state_dict`` (torch's
    ``ZeroRedundancyOptimizer``) gathers its shards, a collective. ``auto`` keeps nothing
    where any is found: rank 0 would hang there alone."""
    found = []
    own = type(module).on_save_checkpoint is pl.LightningModule.on_save_checkpoint
    if not own and not type(module).__module__.startswith(_OWN_MODULES):
        found.append(f"the model {type(module).__qualname__} has its own on_save_checkpoint")
    for callback in callbacks:
        kind = type(callback)
        if kind.__module__.startswith(_OWN_MODULES):
            continue
        if kind.on_save_checkpoint is not pl.Callback.on_save_checkpoint:
            found.append(f"the callback {kind.__qualname__} has its own on_save_checkpoint")
    for optimizer in optimizers:
        if hasattr(optimizer, "consolidate_state_dict"):
            found.append(f"the optimizer {type(optimizer).__qualname__} gathers its state "
                         "across the ranks (consolidate_state_dict)")  # fmt: skip
    return found


def state_bytes(module: Any, optimizers: list[Any]) -> int:
    """The bytes of the tensors a checkpoint of ``module`` and ``optimizers`` holds:
    parameters, buffers and the optimizers' state (its moments, after the first step)."""
    total = sum(t.numel() * t.element_size() for t in module.state_dict().values()
                if isinstance(t, torch.Tensor))  # fmt: skip
    for optimizer in optimizers:
        for per_param in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in per_param.values()
                         if isinstance(v, torch.Tensor))  # fmt: skip
    return total


def too_big(nbytes: int, available: int) -> bool:
    """Whether keeping a state of ``nbytes`` needs more than ``MEMORY_SHARE`` of the
    ``available`` memory: a keep holds about three copies at once (the snapshot, its
    bytes, the object store's)."""
    return 3 * nbytes > MEMORY_SHARE * available


class MemoryState(pl.Callback):
    """Keeps rank 0's state in the keeper every ``every_n_steps`` steps (None: ``auto``)
    (see the module docstring). ``token``: what ``restore_from_memory`` opened the keeper
    with. ``train_loader`` returns the train loader. ``on_choice`` is told the figures of
    each new ``auto`` choice (rank 0's reporter sends them to the driver)."""

    def __init__(
        self,
        keeper: Any,
        token: int,
        every_n_steps: int | None,
        train_loader: Callable[[], Any] = lambda: None,
        on_choice: Callable[[MemoryChoice], None] | None = None,
    ):
        self.keeper, self.token = keeper, token
        self.auto = every_n_steps is None
        self.every_n_steps = every_n_steps or 1
        self.train_loader = train_loader
        self.on_choice = on_choice
        self.cost = MemoryCost()
        self.kept = 0
        self.skipped = 0  # due while the last send was still on its way
        self._last_step = -1
        self._last_keep: int | None = None
        self._step_ended: float | None = None
        self._sending: Future[tuple[float, bool]] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._told: int | None = None  # the auto interval last said
        self.off: str | None = None  # why nothing more is kept in this group

    def forget(self) -> None:
        """The keeper lets go of its state and takes no more of this group's (a loss spike:
        its rollback resumes from storage; ``SpikeGuard`` calls this on rank 0). A keeper
        that does not answer is warned about: the rollback goes on (the restart does not
        resume from memory while the rollback is pending: ``restore_from_memory``)."""
        import ray

        self._stop("a loss spike: the rollback resumes from storage")
        try:
            ray.get(self.keeper.drop.remote(), timeout=60)
        except Exception as exc:
            print(f"raytrain: warning: the in-memory state's keeper did not drop its state "
                  f"({type(exc).__name__}: {exc})", flush=True)  # fmt: skip

    def _stop(self, why: str, say: bool = False) -> None:
        """Keep nothing more in this group, for ``why`` (said once, with ``say``)."""
        if self.off is None:
            self.off = why
            if say:
                print(f"raytrain: checkpoint.memory_every_n_steps: {why}", flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        self._last_keep = trainer.global_step
        self._step_ended = time.perf_counter()
        if self.auto and trainer.global_rank == 0:
            callbacks = list(getattr(trainer, "callbacks", []))
            hazards = collective_hazards(pl_module, callbacks, trainer.optimizers)
            if hazards:
                self._stop(f"auto keeps nothing: {'; '.join(hazards)}, which may wait on the "
                           "other ranks while rank 0 dumps its state alone (set a number of "
                           "steps to keep it anyway)", say=True)  # fmt: skip

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        step = trainer.global_step
        if trainer.global_rank != 0 or step == self._last_step:  # accumulating gradients
            return
        self._last_step = step
        now = time.perf_counter()
        if self._step_ended is not None:
            self.cost.stepped(now - self._step_ended)
        due = step - (self._last_keep or 0) >= self.every_n_steps
        if self.off is None and due and keeps_position(self.train_loader()):
            self._keep(trainer, step)
        self._step_ended = time.perf_counter()  # the snapshot is not the step's time

    def _keep(self, trainer: pl.Trainer, step: int) -> None:
        sending = self._sending
        if sending is not None and not sending.done():
            self.skipped += 1
            return
        if sending is not None:
            self._sent(sending)
        if self.off is not None:  # the send just finished was refused
            return
        if self.auto and self.kept == 0:  # the first keep: the optimizers' state exists now
            import psutil

            size = state_bytes(trainer.lightning_module, trainer.optimizers)
            available = psutil.virtual_memory().available
            if too_big(size, available):
                self._stop(f"auto keeps nothing: the state is {size / 2**30:.3g} GiB and a "
                           f"keep holds about 3 copies; {available / 2**30:.3g} GiB are free "
                           "here", say=True)  # fmt: skip
                return
        began = time.perf_counter()
        state = frozen(dump_state(trainer))
        self.cost.snapshot(time.perf_counter() - began)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytrain-memory")
        self._sending = self._pool.submit(self._send, step, state)
        self._last_keep = step
        self.kept += 1
        self._retune()

    def _send(self, step: int, state: dict[str, Any]) -> tuple[float, bool]:
        """Serialise and send (the background thread); returns the CPU seconds it took
        this thread (its cost to training: waiting for the keeper's answer costs none) and
        whether the keeper took it."""
        import ray

        began = time.thread_time()
        data = serialised(state)
        reply = self.keeper.put.remote(self.token, step, data)
        spent = time.thread_time() - began
        return spent, bool(ray.get(reply, timeout=SEND_TIMEOUT_S))

    def _sent(self, sending: Future[tuple[float, bool]]) -> None:
        self._sending = None
        try:
            spent, taken = sending.result()
        except Exception as exc:  # a keeper gone: training goes on, restores use storage
            print(f"raytrain: warning: the in-memory state was not kept: {exc}", flush=True)
            return
        self.cost.sent(spent)
        if not taken:  # a keeper Ray started again, or a spike's drop: this group is done
            self._stop("the keeper refused this group's state (it was started again, or "
                       "dropped its state): nothing more is kept until the next restart",
                       say=True)  # fmt: skip

    def _retune(self) -> None:
        """Under ``auto``: the interval for the figures so far, said when first chosen and
        when it is twice or half the last one said (on digits the choice wanders between
        3 and 8 steps with the machine's load: each step of that said would be noise).
        An interval the spec set is not chosen: what it costs is said once, when a full
        window of sends has been measured."""
        if not self.auto:
            if self._told is None and self.cost.measured == self.cost.window:
                choice = self.cost.choose(as_set=self.every_n_steps)
                if choice is not None and self.on_choice is not None:
                    self._told = choice.steps
                    self.on_choice(choice)
            return
        choice = self.cost.choose()
        if choice is None:
            return
        self.every_n_steps = choice.steps
        told = self._told
        if told is None or not told / 2 < choice.steps < told * 2:
            self._told = choice.steps
            if self.on_choice is not None:
                self.on_choice(choice)

    def finish(self) -> None:
        """Wait for the send on its way (its figures count) and stop the thread."""
        if self._sending is not None:
            self._sent(self._sending)  # bounded: the send waits SEND_TIMEOUT_S at most
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish()


def restore_from_memory(
    keeper: Any, storage_step: int | None, rollback_pending: bool = False
) -> tuple[int | None, str | None]:
    """Every rank, before ``fit``: open the keeper (rank 0) and, if the state it holds is
    newer than the checkpoint in storage (at ``storage_step``), fetch it into a local file.
    Returns the keeper's token for rank 0's ``MemoryState`` (None: the keeper could not be
    reached, so nothing is kept this group) and the file to resume from (None: resume
    from storage). Every rank gets the same answer. A keeper lost with its node (Ray
    starts it again, empty) or unreachable is no state: the restart uses storage. So does
    a ``rollback_pending`` (a loss spike not yet rolled back past: its rollback goes to
    storage even if the keeper could not drop the state before the spike)."""
    import ray
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    token: int | None = None
    chosen = -1
    if rank == 0:
        try:
            token, held = ray.get(keeper.open.remote(), timeout=60)
        except Exception as exc:  # the keeper's node lost, or Ray restarting it
            print(f"raytrain: warning: the in-memory state's keeper did not answer "
                  f"({type(exc).__name__}): resuming from storage", flush=True)  # fmt: skip
        else:
            if memory_is_newer(held, storage_step) and not rollback_pending:
                chosen = int(held or 0)
    chosen = int(_agree([chosen], "max")[0])
    if chosen < 0:
        return token, None
    try:
        data = ray.get(keeper.get.remote(chosen), timeout=SEND_TIMEOUT_S)
    except Exception:  # lost since rank 0 asked: every rank resumes from storage
        data = None
    if int(_agree([0 if data is None else 1], "min")[0]) == 0:
        return token, None
    folder = tempfile.mkdtemp(prefix="raytrain-memory-")
    path = os.path.join(folder, CKPT_FILE)
    with open(path, "wb") as handle:
        handle.write(data)
    if rank == 0:
        storage = "none" if storage_step is None else f"step {storage_step}"
        print(f"raytrain: resuming from the in-memory state at step {chosen} (the "
              f"checkpoint in storage: {storage})", flush=True)  # fmt: skip
    return token, path


def _agree(values: list[int], op: str) -> list[int]:
    """``values`` reduced over the ranks (``max`` or ``min``), by the group Ray Train set
    up; as they are without one."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return [int(v) for v in tensor.tolist()]
