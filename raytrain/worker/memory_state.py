"""The training state kept in memory, outside the training processes, and a restarted
group resumes from it (``checkpoint.memory_every_n_steps``; the keeper and the choice of
state: ``checkpoints.keeper``).

``MemoryState`` runs at the end of every optimizer step that is due, in one of two ways:

- **alone** (``KeepAlone``; DDP: rank 0 holds the whole state): rank 0 takes a snapshot of
  the full Lightning state, the content of a checkpoint at this step with the loops' and the
  loader's position (its tensors copied off the live ones into one byte buffer on the
  training thread, so the next step cannot change it: ``packing.pack``), and hands it to
  two background threads: one writes it to the node's copy (``local_state``: a file in
  the node's memory, which a process's loss leaves), the other sends it to the keeper
  (which a node's loss leaves), less often (``checkpoints.memory_interval``). The other
  ranks do nothing.
- **together** (``KeepTogether``; FSDP and model parallelism: each rank holds a shard, and
  a state dict is a collective): every rank saves the checkpoint as a storage checkpoint would
  (``trainer.save_checkpoint``, Lightning's own sharded writer) into a node-local scratch
  folder (``/dev/shm`` where it has room), and each node's first rank reads its node's
  files there and sends them to the keeper in the background, one part per node. What
  every rank must agree on (a keep is a collective) is agreed by one small all-reduce at
  each due step: whether a send is still on its way anywhere, whether any rank cannot
  keep, and rank 0's interval under ``auto``.

Never two sends (or writes) at once: a keep due while the last is still on its way is
skipped (alone, a keep waits for the last write; a send due while the last is on its way
waits for the next keep); so is
one due at an epoch's last batch (taken before the epoch's end runs, its restore began the
next epoch with no batches), which the next step's keep makes up. Under
``auto`` the interval is chosen from rank 0's measured cost
(``checkpoints.memory_interval``) and rank 0 tells the driver when it changes. A loader
that keeps no position is kept only where a checkpoint would be (never mid-epoch): not
at all, here.

``restore_from_memory`` runs on every rank before ``fit``: rank 0 opens the keeper (fencing
off the dead group's sends), each node's first rank looks for a node copy of the
keeper's key, and all-reduces give every rank the newest of the keeper's step, the node
copies' and storage's. Each node's first rank then puts that state into one folder of
the same path on every node, which ``fit`` resumes from as from a checkpoint in storage:
from the keeper, one transfer per node, not per rank; from a node copy, read where it is,
and broadcast by its holder to the ranks of a node that lacks it (rank 0 restarted on
another node). Every node must have it, or all resume from storage.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from raytrain._compat.lightning import dump_state, epoch_last_batch
from raytrain.checkpoints.keeper import Files, memory_is_newer
from raytrain.checkpoints.layout import CKPT_FILE
from raytrain.checkpoints.memory_interval import MemoryChoice, MemoryCost
from raytrain.checkpoints.node_slots import (
    remove_state,
    slot_paths,
    state_roots,
)
from raytrain.worker.loader_position import keeps_position
from raytrain.worker.local_state import NodeCopy, newest_state, read_state

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch.optim import Optimizer

from raytrain.worker.packing import (
    PACKED_DATA,
    PACKED_STATE,
    pack,
    packed_files,
    place,
    skeleton_bytes,
    unpack,
)

SEND_TIMEOUT_S = 300
# A send's result: the CPU seconds it took the sending thread, and whether the keeper took it
Sent = tuple[float, bool]
# A node copy's write: the CPU seconds it took the writing thread, and the send it started
Written = tuple[float, "Future[Sent] | None"]


# Lightning's and raytrain's own classes: their checkpoint hooks wait on no other rank.
_OWN_MODULES = ("lightning.", "pytorch_lightning.", "raytrain.")
# Under ``auto``, the most of the memory available on rank 0's node a keep may take: the
# snapshot, its serialised bytes and the object store's copy are each about the state.
MEMORY_SHARE = 0.5


def collective_hazards(
    module: pl.LightningModule, callbacks: list[Callback], optimizers: list[Optimizer]
) -> list[str]:
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
            found.append(
                f"the optimizer {type(optimizer).__qualname__} gathers its state "
                "across the ranks (consolidate_state_dict)"
            )
    return found


def _local_bytes(tensor: torch.Tensor) -> int:
    """The bytes this rank holds of ``tensor`` (a DTensor's local shard, not its whole)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def state_bytes(module: torch.nn.Module, optimizers: list[Optimizer]) -> int:
    """The bytes of the tensors this rank's part of a checkpoint of ``module`` and
    ``optimizers`` holds: parameters, buffers and the optimizers' state (its moments,
    after the first step); under FSDP and tensor parallelism, this rank's shards. Read
    off the tensors, not a state dict (under FSDP that is a collective)."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    total = sum(_local_bytes(t) for t in tensors)
    for optimizer in optimizers:
        for per_param in optimizer.state.values():
            total += sum(_local_bytes(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    return total


def read_files(folder: str) -> Files:
    """Every file under ``folder`` (none: empty), by its path relative to it."""
    files: Files = {}
    for where, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(where, name)
            with open(path, "rb") as handle:
                files[os.path.relpath(path, folder)] = handle.read()
    return files


def write_files(folder: str, files: Files) -> None:
    """Write ``files`` (``read_files``'s) under ``folder``; a path that would leave it is
    refused."""
    root = os.path.realpath(folder)
    for relative, data in files.items():
        path = os.path.realpath(os.path.join(root, relative))
        if os.path.commonpath([root, path]) != root:
            raise ValueError(f"a kept file outside its folder: {relative!r}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(data)


def scratch_root(need: int) -> str:
    """Where a node writes its shards of a keep: ``/dev/shm`` (memory) where it has room
    for ``need`` bytes, else the temporary directory."""
    shm = "/dev/shm"
    try:
        if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= need:
            return shm
    except OSError:
        pass
    return tempfile.gettempdir()


def too_big(nbytes: int, available: int) -> bool:
    """Whether keeping a state of ``nbytes`` needs more than ``MEMORY_SHARE`` of the
    ``available`` memory: a keep holds about three copies at once (the snapshot, its
    bytes, the object store's)."""
    return 3 * nbytes > MEMORY_SHARE * available


class Threads:
    """One background thread for each kind of work (``write``: the node copy's, ``send``:
    the keeper's), so that two of a kind never run at once."""

    def __init__(self) -> None:
        self._pools: dict[str, ThreadPoolExecutor] = {}

    def submit(self, thread: str, work: Callable[..., Any], *args: Any) -> Future[Any]:
        pool = self._pools.get(thread)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"raytrain-{thread}")
            self._pools[thread] = pool
        return pool.submit(work, *args)

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False)


class KeeperSends:
    """The sends of kept states to the keeper (opened with ``token``), on the send thread;
    at most one on its way (``sending``). Kept together, each node sends ``part`` of
    ``parts``. Each send's CPU time goes to ``cost``."""

    def __init__(self, keeper: Any, token: int, cost: MemoryCost, threads: Threads):
        self.keeper, self.token, self.cost, self.threads = keeper, token, cost, threads
        self.part, self.parts = 0, 1
        self.sending: Future[Sent] | None = None

    @property
    def busy(self) -> bool:
        return self.sending is not None and not self.sending.done()

    def submit(self, step: int, files: Callable[[], dict[str, Any]]) -> Future[Sent]:
        """Send a packed state's ``files`` (made on the send thread: a serialisation is
        its work); the caller keeps the future (``sending``) on the training thread."""
        return self.threads.submit("send", self._send, step, files)

    def submit_folder(self, step: int, folder: str) -> None:
        """Send this node's files of the keep together at ``step`` (then free the folder)."""
        self.sending = self.threads.submit("send", self._send_folder, step, folder)

    def _send(self, step: int, files: Callable[[], dict[str, Any]]) -> Sent:
        """The send (the send thread): the CPU seconds it took this thread (its cost to
        training: waiting for the keeper's answer costs none) and whether it was taken."""
        import ray

        began = time.thread_time()
        reply = self.keeper.put.remote(self.token, step, files())
        spent = time.thread_time() - began
        return spent, bool(ray.get(reply, timeout=SEND_TIMEOUT_S))

    def _send_folder(self, step: int, folder: str) -> Sent:
        import ray

        began = time.thread_time()
        files = read_files(folder)
        shutil.rmtree(folder, ignore_errors=True)
        reply = self.keeper.put.remote(self.token, step, files, self.part, self.parts)
        spent = time.thread_time() - began
        return spent, bool(ray.get(reply, timeout=SEND_TIMEOUT_S))

    def collect(self) -> str | None:
        """Take the send on its way (waiting for it: ``SEND_TIMEOUT_S`` at most) and its
        figures; returns why this group keeps no more (None: it may)."""
        sending, self.sending = self.sending, None
        if sending is None:
            return None
        try:
            spent, taken = sending.result()
        except Exception as exc:  # a keeper gone: training goes on, restores use storage
            print(f"raytrain: warning: the in-memory state was not kept: {exc}", flush=True)
            return None
        self.cost.sent(spent)
        if not taken:  # a keeper Ray started again, or a spike's drop: this group is done
            return (
                "the keeper refused this group's state (it was started again, or "
                "dropped its state): nothing more is kept until the next restart"
            )
        return None


class NodeCopies:
    """Rank 0's copy of each state it keeps alone in its node's memory (``NodeCopy``: a
    file a process's loss leaves), written on the write thread; a keep's send to the keeper
    starts from the written copy. A copy that fails ends the node's copies: the keeper's
    go on."""

    def __init__(self, scratch: str, key: int, sends: KeeperSends, threads: Threads):
        self.scratch, self.key, self.sends, self.threads = scratch, key, sends, threads
        self.node: NodeCopy | None = None
        self.writing: Future[Written] | None = None

    def open(self, trainer: pl.Trainer) -> None:
        """At the first keep: the node's copy (``/dev/shm`` where it has room for its two
        slots), clearing slots a group before left in another place. No key (no keeper
        answered), or no room anywhere: none."""
        if not self.key:
            return
        need = 2 * state_bytes(trainer.lightning_module, trainer.optimizers) + 2**20
        root = scratch_root(need)
        for other in state_roots():
            if other != root:
                for path in slot_paths(other, self.scratch):
                    remove_state(path)
        self.node = NodeCopy(root, self.scratch, self.key)

    def begin(self, step: int, state: Any, send: bool) -> bool:
        """Copy ``state`` into the node's memory (on this thread) and finish the copy on
        the write thread, starting the keeper's send there with ``send``; False when the
        copy failed (no room left in /dev/shm, say), which ends the node's copies."""
        assert self.node is not None
        skeleton, placed, nbytes = place(state)
        try:
            self.node.begin(placed, nbytes)
        except Exception as exc:
            print(
                f"raytrain: warning: the in-memory state's copy on the node failed "
                f"({type(exc).__name__}: {exc}); the keeper's goes on",
                flush=True,
            )
            self.drop(wait=False)
            return False
        self.writing = self.threads.submit("write", self._write, step, skeleton, nbytes, send)
        return True

    def _write(self, step: int, skeleton: object, nbytes: int, send: bool) -> Written:
        """End the copy (the write thread) and, with ``send``, start its send to the
        keeper; returns the CPU seconds it took this thread and the send."""
        began = time.thread_time()
        head = skeleton_bytes(skeleton)
        node = self.node
        sending = None
        if node is not None:
            node.finish(step, head, nbytes)
            if send:
                files = {PACKED_STATE: head, PACKED_DATA: node.data(nbytes)}
                sending = self.sends.submit(step, lambda: files)
        return time.thread_time() - began, sending

    def collect(self, cost: MemoryCost) -> None:
        """Take the write on its way (waiting for it), its figures and the send it started;
        a write that failed ends the node's copies (the keeper's go on)."""
        writing, self.writing = self.writing, None
        if writing is None:
            return
        try:
            spent, sending = writing.result()
        except Exception as exc:  # no room, or the folder gone: the keeper's copy is left
            print(
                f"raytrain: warning: the in-memory state's copy on the node was not "
                f"written ({type(exc).__name__}: {exc}); the keeper's goes on",
                flush=True,
            )
            self.drop(wait=False)
            return
        cost.written(spent)
        if sending is not None:
            self.sends.sending = sending

    def drop(self, wait: bool = True) -> None:
        """Copy nothing more to the node and remove its copy (``wait``: for the write on
        its way first, so that it cannot put one back)."""
        writing, self.writing = self.writing, None
        if wait and writing is not None:
            writing.exception()  # done either way; its error is moot
        if self.node is not None:
            self.node.remove()
            self.node = None


class MemoryTuning:
    """How often a state is kept (``every_n_steps``) and, kept alone, sent to the keeper
    (``send_every``): as the spec set them, or under ``auto`` (``every_n_steps`` None)
    chosen from ``cost``'s figures. ``on_choice`` is told each choice worth saying (rank
    0's reporter sends it to the driver)."""

    def __init__(
        self,
        every_n_steps: int | None,
        cost: MemoryCost,
        on_choice: Callable[[MemoryChoice], None] | None,
        together: bool,
    ):
        self.auto = every_n_steps is None
        self.every_n_steps = every_n_steps or 1
        self.send_every = self.every_n_steps  # alone: the keeper's interval
        self.cost, self.on_choice, self.together = cost, on_choice, together
        self._told: int | None = None  # the auto interval last said
        self.proposal = 0  # together, rank 0: the auto interval the next keep agrees on

    def retune(self) -> None:
        """Under ``auto`` (rank 0): the interval for the figures so far, said when first
        chosen and when it is twice or half the last one said (on digits the choice
        wanders between 3 and 8 steps with the machine's load: each step of that said
        would be noise). Kept together, the ranks take it at the next keep's agreement.
        An interval the spec set is not chosen: what it costs is said once, when a full
        window of sends has been measured."""
        if not self.auto:
            choice = self.cost.choose(as_set=self.every_n_steps)
            if choice is not None and choice.send_steps is not None:
                self.send_every = choice.send_steps  # the node copy's as set, the keeper's chosen
            full = self.cost.measured == self.cost.window
            if self._told is None and full and choice is not None and self.on_choice:
                self._told = choice.steps
                self.on_choice(choice)
            return
        choice = self.cost.choose()
        if choice is None:
            return
        if self.together:
            self.proposal = choice.steps
        else:
            self.every_n_steps = choice.steps
            self.send_every = choice.send_steps or choice.steps
        told = self._told
        if told is None or not told / 2 < choice.steps < told * 2:
            self._told = choice.steps
            if self.on_choice is not None:
                self.on_choice(choice)


class MemoryState(pl.Callback):
    """Keeps the training state in the keeper every ``every_n_steps`` steps (None:
    ``auto``): the schedule, and what stops it, shared by the two ways of keeping
    (``KeepAlone``, ``KeepTogether``: see the module docstring). ``token``: what
    ``restore_from_memory`` opened the keeper with, ``key`` its key for node copies.
    ``train_loader`` returns the train loader. ``on_choice`` is told the figures of each
    new ``auto`` choice. ``scratch``: the name of the node-local folder of the run's
    copies, one per run (a group that starts clears what a lost one left there)."""

    together = False  # every rank takes part in a keep

    def __init__(
        self,
        keeper: Any,
        token: int,
        every_n_steps: int | None,
        train_loader: Callable[[], Any] = lambda: None,
        on_choice: Callable[[MemoryChoice], None] | None = None,
        scratch: str = "raytrain-keep",
        key: int = 0,
    ):
        self.keeper, self.train_loader, self.scratch = keeper, train_loader, scratch
        self.cost = MemoryCost()
        self.tuning = MemoryTuning(every_n_steps, self.cost, on_choice, self.together)
        self.threads = Threads()
        self.sends = KeeperSends(keeper, token, self.cost, self.threads)
        self.copies = NodeCopies(scratch, key, self.sends, self.threads)
        self.kept = 0
        self.last_kept: int | None = None  # the step of this group's last keep
        self.skipped = 0  # due while the last send was still on its way
        self.rank = 0
        self._last_step = -1
        self._last_keep: int | None = None
        self._step_ended: float | None = None
        self.off: str | None = None  # why nothing more is kept in this group

    def forget(self) -> None:
        """The keeper lets go of its state and takes no more of this group's (a loss spike:
        its rollback resumes from storage; ``SpikeGuard`` calls this on rank 0). A keeper
        that does not answer is warned about: the rollback goes on (the restart does not
        resume from memory while the rollback is pending: ``restore_from_memory``)."""
        import ray

        self._stop("a loss spike: the rollback resumes from storage")
        self.copies.drop()
        for root in state_roots():  # this node's copies, even of a group before that kept
            for path in slot_paths(root, self.scratch):
                remove_state(path)
        try:
            ray.get(self.keeper.drop.remote(), timeout=60)
        except Exception as exc:
            print(
                f"raytrain: warning: the in-memory state's keeper did not drop its state "
                f"({type(exc).__name__}: {exc})",
                flush=True,
            )

    def _stop(self, why: str, say: bool = False) -> None:
        """Keep nothing more in this group, for ``why`` (said once, with ``say``)."""
        if self.off is None:
            self.off = why
            if say:
                print(f"raytrain: checkpoint.memory_every_n_steps: {why}", flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rank = trainer.global_rank
        self._last_step = trainer.global_step
        self._last_keep = trainer.global_step
        self._step_ended = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        idx: int,
    ) -> None:
        step = trainer.global_step
        takes_part = self.together or self.rank == 0
        if not takes_part or step == self._last_step:  # accumulating gradients
            return
        self._last_step = step
        now = time.perf_counter()
        if self._step_ended is not None:
            self.cost.stepped(now - self._step_ended)
        due = step - (self._last_keep or 0) >= self.tuning.every_n_steps
        # not an epoch's last batch: that state, kept before the epoch's end ran, resumed
        # into an epoch of no batches (a soak trained 4 epochs of 6); the next step is kept
        due = due and not epoch_last_batch(trainer)
        if self.off is None and due and keeps_position(self.train_loader()):
            self.keep(trainer, step)
        self._step_ended = time.perf_counter()  # the snapshot is not the step's time

    def keep(self, trainer: pl.Trainer, step: int) -> None:
        """Keep the state at ``step`` (the way's own)."""
        raise NotImplementedError

    def _kept(self, step: int) -> None:
        self._last_keep = self.last_kept = step
        self.kept += 1

    def _too_big(self, trainer: pl.Trainer) -> str | None:
        """Under ``auto``, at the first keep (the optimizers' state exists now): why this
        rank's state is too big to keep (None: it is not)."""
        if not self.tuning.auto or self.kept:
            return None
        import psutil

        size = state_bytes(trainer.lightning_module, trainer.optimizers)
        available = psutil.virtual_memory().available
        if not too_big(size, available):
            return None
        whose = f"rank {self.rank}'s part of " if self.together else ""
        return (
            f"auto keeps nothing: {whose}the state is {size / 2**30:.3g} GiB and a keep "
            f"holds about 3 copies; {available / 2**30:.3g} GiB are free here"
        )

    def wait_sent(self) -> None:
        """Wait for the write and the send on their way, if any (their figures count)."""
        self.copies.collect(self.cost)  # may hand over a send
        refused = self.sends.collect()  # bounded: SEND_TIMEOUT_S at most
        if refused is not None:
            self._stop(refused, say=True)

    def finish(self) -> None:
        """Wait for the send on its way, stop the threads and clear the node's copy (the
        run's training is over: nothing resumes from them)."""
        self.wait_sent()
        self.threads.shutdown()
        self.copies.drop()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish()


class KeepAlone(MemoryState):
    """DDP: rank 0 holds the whole state and keeps it alone (see the module docstring)."""

    _last_send: int | None = None  # the step of the last keep sent to the keeper

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self.tuning.auto and self.rank == 0:
            callbacks = list(getattr(trainer, "callbacks", []))
            hazards = collective_hazards(pl_module, callbacks, trainer.optimizers)
            if hazards:
                self._stop(
                    f"auto keeps nothing: {'; '.join(hazards)}, which may wait on the "
                    "other ranks while rank 0 dumps its state alone (set a number of "
                    "steps to keep it anyway)",
                    say=True,
                )

    def keep(self, trainer: pl.Trainer, step: int) -> None:
        """Snapshot into the node's copy (when the last write is done) and send it to the
        keeper every ``send_every`` steps (when the last send is done). Without a node
        copy, a snapshot of its own (``pack``) is sent at each keep that finds the last
        send done."""
        copies, sends = self.copies, self.sends
        if copies.writing is not None and copies.writing.done():
            copies.collect(self.cost)  # may hand over the send it started
        busy = sends.busy
        if sends.sending is not None and not busy:
            refused = sends.collect()
            if refused is not None:
                self._stop(refused, say=True)
                return
        if self.kept == 0:
            copies.open(trainer)
        if (copies.writing is not None) if copies.node is not None else busy:
            self.skipped += 1
            return
        big = self._too_big(trainer)
        if big is not None:
            self._stop(big, say=True)
            return
        last = self._last_send
        send = not busy and (
            copies.node is None or last is None or step - last >= self.tuning.send_every
        )
        began = time.perf_counter()
        state = dump_state(trainer)
        copied = copies.node is not None
        if copied and not copies.begin(step, state, send):
            copied, send = False, not busy  # the node's copies ended: the keeper's goes on
        if not copied:
            skeleton, buffer = pack(state)
            if send:
                sends.sending = sends.submit(step, lambda: packed_files(skeleton, buffer))
        self.cost.snapshot(time.perf_counter() - began)
        if send:
            self._last_send = step
        self._kept(step)
        self.tuning.retune()


class KeepTogether(MemoryState):
    """FSDP and model parallelism: each rank holds a shard, and every rank takes part in
    a keep (see the module docstring)."""

    together = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sender = True  # sends its node's files to the keeper: each node's first rank
        self.base = ""  # the node-local folder keeps are written to
        self._problem: str | None = None  # why this rank can keep no more

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # a collective: every rank's callback runs it
        self.sender = trainer.local_rank == 0
        self.sends.part = self.rank
        self.sends.parts = int(_agree([int(self.sender)], "sum")[0])
        need = 4 * state_bytes(pl_module, trainer.optimizers) * trainer.world_size
        root = trainer.strategy.broadcast(scratch_root(need) if self.rank == 0 else "")
        self.base = os.path.join(root, self.scratch)
        if self.sender:  # what a lost group left here goes
            shutil.rmtree(self.base, ignore_errors=True)
            os.makedirs(self.base, exist_ok=True)

    def keep(self, trainer: pl.Trainer, step: int) -> None:
        """Agree, save this step's checkpoint into the node-local folder (a collective),
        and send the node's files (its first rank)."""
        busy = self.sends.busy
        if self.sends.sending is not None and not busy:
            self._problem = self._problem or self.sends.collect()
        self._problem = self._problem or self._too_big(trainer)
        proposal = self.tuning.proposal if self.rank == 0 else 0
        any_busy, any_problem, interval = _agree(
            [int(busy), int(self._problem is not None), proposal], "max"
        )
        if any_problem:  # every rank stops here; the ranks that found why say it
            self._stop(
                self._problem or "another rank cannot keep its part", say=self._problem is not None
            )
            return
        if any_busy:
            self.skipped += 1
            return
        if interval > 0:
            self.tuning.every_n_steps = interval
        began = time.perf_counter()
        folder = os.path.join(self.base, f"step-{step}")
        trainer.save_checkpoint(os.path.join(folder, CKPT_FILE))  # ends with a barrier
        self.cost.snapshot(time.perf_counter() - began)
        if self.sender:
            self.sends.submit_folder(step, folder)
        self._kept(step)
        if self.rank == 0:
            self.tuning.retune()

    def finish(self) -> None:
        """As every keep's, and the node-local folder goes."""
        super().finish()
        if self.sender and self.base:
            shutil.rmtree(self.base, ignore_errors=True)


@dataclass(frozen=True)
class Restored:
    """What ``restore_from_memory`` found, the same on every rank: the keeper's token and
    key for ``MemoryState`` (token None: the keeper could not be reached, so nothing is
    kept this group), and the checkpoint to resume from (None: from storage)."""

    token: int | None
    key: int
    checkpoint: str | None


def restore_from_memory(
    keeper: Any, storage_step: int | None, rollback_pending: bool = False, scratch: str = ""
) -> Restored:
    """Every rank, before ``fit``: open the keeper (rank 0), find the newest state kept,
    the keeper's or a node's copy (``scratch``: the run's keep folder name), and, if it is
    newer than the checkpoint in storage (at ``storage_step``), fetch it into a local
    folder (each node's first rank, for its node). A keeper lost with its node (Ray starts
    it again, empty, with another key) or unreachable is no state: the restart uses
    storage. So does a ``rollback_pending`` (a loss spike not yet rolled back past: its
    rollback goes to storage even if the keeper could not drop the state before the
    spike)."""
    import ray

    rank = _rank()
    token, held, key = -1, -1, -1
    if rank == 0:
        try:
            opened = ray.get(keeper.open.remote(), timeout=60)
        except Exception as exc:  # the keeper's node lost, or Ray restarting it
            print(
                f"raytrain: warning: the in-memory state's keeper did not answer "
                f"({type(exc).__name__}): resuming from storage",
                flush=True,
            )
        else:
            token, key = opened.token, opened.key
            held = -1 if opened.step is None or rollback_pending else opened.step
    token, held, key, rollback = _agree([token, held, key, int(rollback_pending)], "max")
    if token < 0:
        return Restored(None, 0, None)
    on_node = None
    if scratch and not rollback and _local_rank() == 0:
        on_node = newest_state(scratch, key)
    node_step = _agree([on_node[0] if on_node is not None else -1], "max")[0]
    newest = max(held, node_step)
    if not memory_is_newer(newest if newest >= 0 else None, storage_step):
        _clear_copies(on_node, rank, scratch)
        return Restored(token, key, None)
    folder = _same_folder(rank)
    if node_step > held:
        fetched = _fetch_node_copy(folder, key, node_step, on_node)
        where = "the node's copy of the in-memory state"
    else:
        fetched = _fetch_from_keeper(folder, keeper, held)
        where = "the in-memory state"
    _clear_copies(on_node, rank, scratch)
    if _agree([int(fetched)], "min")[0] == 0:
        shutil.rmtree(folder, ignore_errors=True)
        return Restored(token, key, None)
    if rank == 0:
        storage = "none" if storage_step is None else f"step {storage_step}"
        print(
            f"raytrain: resuming from {where} at step {newest} (the checkpoint in "
            f"storage: {storage})",
            flush=True,
        )
    return Restored(token, key, os.path.join(folder, CKPT_FILE))


def _clear_copies(on_node: tuple[int, str] | None, rank: int, scratch: str) -> None:
    """Once the state to resume from is chosen (and fetched): a node copy on a node other
    than rank 0's is obsolete (rank 0 writes its copies on its own node), and removed."""
    if on_node is not None and rank != 0:
        for root in state_roots():
            for path in slot_paths(root, scratch):
                remove_state(path)


def _fetch_from_keeper(folder: str, keeper: Any, step: int) -> bool:
    """Each node's first rank: fetch the keeper's state at ``step`` into ``folder``; the
    others: nothing. Whether this rank has what it needs (a state lost since rank 0 asked:
    False)."""
    import ray

    if _local_rank() != 0:
        return True
    try:
        files = ray.get(keeper.get.remote(step), timeout=SEND_TIMEOUT_S)
        if files is not None:
            _write_checkpoint(folder, files)
    except Exception:  # lost since rank 0 asked: every rank resumes from storage
        return False
    return files is not None


def _fetch_node_copy(folder: str, key: int, step: int, on_node: tuple[int, str] | None) -> bool:
    """Every rank: put the node copy at ``step`` into ``folder`` on every node. Each node's
    first rank that has it reads its own; where a node lacks it (rank 0 moved to another
    node since), the lowest rank that has it sends it to every rank by a broadcast, and
    the first rank of each node writes it. Whether this rank has what it needs."""
    import torch.distributed as dist

    first = _local_rank() == 0
    mine = on_node is not None and on_node[0] == step
    everywhere = _agree([int(mine or not first)], "min")[0] == 1
    files = None
    if on_node is not None and mine:  # a copy that cannot be read is removed: not again
        files = read_state(on_node[1], key, step)
        if files is None:
            remove_state(on_node[1])
    if not everywhere:
        big = 2**62
        holder = _agree([_rank() if files is not None else big], "min")[0]
        if holder == big:
            return False
        carried = [files]
        dist.broadcast_object_list(carried, src=holder)
        files = carried[0]
    if not first:
        return True
    if files is None:
        return False
    try:  # a state that does not unpack (a global outside the allow-list): storage
        _write_checkpoint(folder, files)
    except Exception as exc:
        print(
            f"raytrain: warning: the node's copy of the in-memory state at step {step} "
            f"did not load ({type(exc).__name__}: {exc}); resuming from storage",
            flush=True,
        )
        if on_node is not None:
            remove_state(on_node[1])
        return False
    return True


def _write_checkpoint(folder: str, files: Files) -> None:
    """Write a kept state's ``files`` into ``folder`` as the checkpoint ``fit`` resumes
    from: a packed state as the file ``torch.save`` would have written, a sharded one's
    files as they are."""
    state = unpack(files)
    if state is not None:
        torch.save(state, os.path.join(folder, CKPT_FILE))
    else:
        write_files(folder, files)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _local_rank() -> int:
    """This worker's rank on its node (Ray Train's; 0 outside a Ray Train worker)."""
    try:
        import ray.train

        return int(ray.train.get_context().get_local_rank())
    except Exception:
        return 0


def _same_folder(rank: int) -> str:
    """A new local folder at one path on every node: rank 0's, made where it is missing
    (Lightning's sharded reader takes rank 0's path on every rank)."""
    import torch.distributed as dist

    path = [tempfile.mkdtemp(prefix="raytrain-memory-") if rank == 0 else ""]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(path, src=0)
    os.makedirs(path[0], exist_ok=True)
    return path[0]


def _agree(values: list[int], op: str) -> list[int]:
    """``values`` reduced over the ranks (``max``, ``min`` or ``sum``), by the group Ray
    Train set up; as they are without one."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}
    dist.all_reduce(tensor, op=ops[op])
    return [int(v) for v in tensor.tolist()]
