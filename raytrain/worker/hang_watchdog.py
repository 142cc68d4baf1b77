"""A rank that stops finishing batches: its stacks written, the driver told, its attempt
failed, long before gloo's or NCCL's 30-minute collective timeout would.

``HangWatchdog`` (on every rank, a listener of the step clock) keeps where the rank is
(``Phase``) and when it last moved on: a batch's end, a validation batch's,
the start of an epoch or validation. After a batch that a validation may follow it is
``starting``: Lightning builds the validation's loader and fetches its first batch before
any hook. A
daemon thread looks every ``POLL_S``. Once the rank has gone longer than its phase's
``allowance`` without moving on, the thread:

1. writes the stacks of every thread of this process (Python's frames, as faulthandler
   prints them, with their source lines) to ``{run}/hangs/{token}/rank{r}.txt``, headed by
   where the rank was and the collective it waits in, if any (``collective_of``);
2. sends its ``HangReport`` to the driver (the progress output, MLflow, the status record);
3. marks its report sent (``rank{r}.sent``) and waits, at most ``GRACE_S``, until every
   rank's is, so that no rank's exit gets the others killed before they wrote their
   stacks and told the driver; and
4. ends its process (``os._exit``). Ray Train sees the worker die, and the failure policy
   restarts the attempt from its last committed checkpoint (counted in ``max_failures``).

A hang stops every rank: the others wait for the hung one in their next collective, so
each rank's thread finds it for itself. A rank whose phase allows longer (one waiting in a
checkpoint's barrier) looks every ``PEEK_S``, once it has gone a step's timeout, for a
peer's stacks in the attempt's folder, and writes its own as soon as one is there.
``token``, rank 0's start time broadcast to every rank when training starts, names one
folder per attempt.

The thread needs the GIL to write. A rank hung in C code that holds it writes nothing; the
others still find the hang, and the driver's summary says how many ranks sent no stacks.
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Literal

import lightning.pytorch as pl

from raytrain import storage
from raytrain._compat.lightning import validation_may_follow
from raytrain.checkpoints.layout import HANGS
from raytrain.contract import HangReport, Publish
from raytrain.spec import StorageSpec
from raytrain.spec.sections import HangLimits
from raytrain.worker.step_clock import StepListener, Tick

# The floor of the automatic step timeout, and its multiple of the median step time.
AUTO_FLOOR_S = 60.0
AUTO_STEPS = 20
# Where a rank is between batch ends. ``starting``: from the start of training, of an
# epoch or of a validation to its first batch (compiling, a loader's workers starting);
# ``saving``: a batch's, validation's or epoch's end hooks (reports, checkpoint saves).
Phase = Literal["starting", "data", "forward", "backward", "optimizer", "saving", "validation"]


def step_timeout(limits: HangLimits, step_times: Sequence[float]) -> float:
    """How long a batch may take: ``timeout_s``, or max(``AUTO_FLOOR_S``, ``AUTO_STEPS`` x
    the median of ``step_times``); before a step was timed, the first step's allowance."""
    if limits.timeout_s:
        return limits.timeout_s
    if not step_times:
        return max(limits.first_step_s, AUTO_FLOOR_S)
    return max(AUTO_FLOOR_S, AUTO_STEPS * statistics.median(step_times))


def allowance(phase: Phase, limits: HangLimits, step_times: Sequence[float]) -> float:
    """How long ``phase`` may go on without a batch finishing. Invariant: never below the
    step timeout; ``starting`` gets at least ``first_step_s``, ``saving`` at least
    ``checkpoint_s``: the first batch and a checkpoint's save are not hangs because they
    are slow."""
    base = step_timeout(limits, step_times)
    if phase == "starting":
        return max(base, limits.first_step_s)
    if phase == "saving":
        return max(base, limits.checkpoint_s)
    return base


# Files of torch's collectives: a rank whose main thread is in one waits for the others.
_COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py", "torch/distributed/c10d")


def collective_of(phase: str, files: Sequence[str], world_size: int) -> str | None:
    """The collective a rank waits in, or None: a call into torch.distributed in the thread
    that trains (``files``: its frames' file names, outermost first), or, in a world of more
    than one, the backward pass: DDP waits there for the gradients' all-reduce, and
    backward compute does not take 20 steps' time."""
    for name in reversed(files):
        if any(mark in name.replace("\\", "/") for mark in _COLLECTIVE_FILES):
            return "a torch.distributed collective"
    if phase == "backward" and world_size > 1:
        return "the gradients' all-reduce (backward)"
    return None


logger = logging.getLogger(__name__)

POLL_S = 1.0
PEEK_S = 5.0
GRACE_S = 30.0
HANG_EXIT = 70  # the exit status of a rank ended for a hang
_STACKS = re.compile(r"rank\d+\.txt$")
_SENT = re.compile(r"rank\d+\.sent$")  # a rank's report is with the driver


def stacks_text(
    report: HangReport, frames: dict[int, FrameType], training: int | None, skip: int | None
) -> str:
    """The stacks file: the report's lines, then every thread's stack (most recent call
    last; the thread that trains first: Ray Train runs the train function in a thread of
    its own), without the thread ``skip`` (the watchdog's own)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    where = f"in {report.collective}" if report.collective else "not in a collective"
    lines = [
        f"raytrain hang report: rank {report.rank} of {report.world_size}, node "
        f"{report.node}, pid {report.pid}",
        f"step {report.step}, in {report.phase}: no batch finished for "
        f"{report.idle_s:.1f} s (allowed {report.allowed_s:.1f} s)",
        f"collective: {where}",
        f"found at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(report.at))} "
        f"(unix {report.at:.1f}); attempt {report.attempt}",
        "",
    ]
    for ident in sorted(frames, key=lambda i: i != training):
        if ident == skip:
            continue
        label = " (training)" if ident == training else ""
        lines.append(f"Thread {names.get(ident, '?')} ({ident}){label}, most recent call last:")
        lines.append("".join(traceback.format_stack(frames[ident])).rstrip())
        lines.append("")
    return "\n".join(lines)


def frame_files(frame: FrameType | None) -> list[str]:
    """The file of each frame of a stack, outermost first."""
    return [f.f_code.co_filename for f, _ in traceback.walk_stack(frame)][::-1] if frame else []


class HangFolder:
    """One attempt's folder of hang files, ``{run}/hangs/{token}``: each rank's stacks, and
    its marker that the driver was told (``rank{r}.sent``). A store that fails is logged,
    never raised: a hung rank ends its process either way."""

    def __init__(self, run_dir: str, options: StorageSpec | None):
        self.run_dir, self.options = run_dir, options
        self.token = "0"  # the attempt's: rank 0's start time, broadcast at train start

    @property
    def path(self) -> str:
        return storage.join(self.run_dir, HANGS, self.token)

    def stacks(self, rank: int) -> str:
        return storage.join(self.path, f"rank{rank}.txt")

    def count(self, pattern: re.Pattern[str] = _STACKS) -> int:
        """How many ranks' files of ``pattern`` are there (0 while the store is down)."""
        try:
            found = storage.list_dir(self.path, self.options)
        except Exception:
            return 0
        return sum(1 for info in found if pattern.search(info.base_name))

    def write(self, path: str, text: str, what: str) -> None:
        try:
            storage.write_text(path, text, self.options)
        except Exception:
            logger.exception("raytrain: %s could not be written to %s", what, path)

    def told(self, rank: int, ranks: int, grace_s: float) -> None:
        """Mark ``rank``'s hang told, then wait, at most ``grace_s``, until every one of the
        ``ranks`` has: no rank's exit gets the others killed before they wrote theirs."""
        self.write(storage.join(self.path, f"rank{rank}.sent"), "", "the hang's marker")
        deadline = time.monotonic() + grace_s
        while self.count(_SENT) < ranks and time.monotonic() < deadline:
            time.sleep(0.5)


class RankPosition(StepListener):
    """Where the rank is (``Phase``) and when it last moved on, from the step clock's marks
    (a batch's end, a validation batch's, the start of an epoch or validation), with the
    times of its last 100 steps (the first batch after a start is not timed). After a batch
    that a validation may follow it is ``starting``: Lightning builds the validation's
    loader and fetches its first batch before any hook."""

    def __init__(self, clock: Callable[[], float]):
        self.phase: Phase = "starting"
        self.step = 0
        self._last = clock()  # when the rank last moved on
        self._step_times: deque[float] = deque(maxlen=100)
        self._timed = False  # whether the batch under way is timed (not a first batch)

    def _moved(self, phase: Phase, tick: Tick) -> None:
        self.phase, self._last = phase, tick.now
        if phase == "starting":
            self._timed = False

    def _enter(self, phase: Phase) -> None:
        if self.phase != "starting":  # a first batch keeps its allowance to its end
            self.phase = phase

    def train_started(self, tick: Tick, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._moved("starting", tick)

    def epoch_started(self, tick: Tick) -> None:
        self._moved("starting", tick)

    def batch_started(self, tick: Tick, trainer: pl.Trainer) -> None:
        self.step = trainer.global_step
        self._enter("forward")

    def backward_started(self, tick: Tick) -> None:
        self._enter("backward")

    def optimizer_started(self, tick: Tick) -> None:
        self._enter("optimizer")

    def batch_ended(self, tick: Tick) -> None:
        self.phase = "saving"  # the batch's end hooks: reports, checkpoint saves

    def batch_done(self, tick: Tick, trainer: pl.Trainer) -> None:
        """Every hook of the batch has run (the end marker): the rank moved on."""
        if self._timed:
            self._step_times.append(tick.now - self._last)
        self.phase, self._last, self._timed = "data", tick.now, True
        if validation_may_follow(trainer):  # its loader starts before its hooks
            self._moved("starting", tick)

    def validation_started(self, tick: Tick) -> None:
        self._moved("starting", tick)

    def validation_batch_ended(self, tick: Tick) -> None:
        self._moved("validation", tick)

    def validation_epoch_ended(self, tick: Tick) -> None:
        self._moved("saving", tick)  # the validation's end hooks: metrics computed, synced

    def validation_ended(self, tick: Tick, trainer: pl.Trainer) -> None:
        self._moved("saving", tick)  # a checkpoint at the validation's end

    def epoch_ended(self, tick: Tick) -> None:
        self._moved("saving", tick)


class HangWatchdog(RankPosition):
    """Finds this rank hung (see the module docstring) from where it is (``RankPosition``).
    ``clock`` must be the step clock's (``check`` reads it between marks); it, ``wall``,
    ``exit``, ``thread`` and ``grace_s`` are parameters so that a unit test drives
    ``check`` without a thread, a wait for the other ranks or a process to end."""

    def __init__(
        self,
        *,
        limits: HangLimits,
        run_dir: str,
        options: StorageSpec | None,
        rank: int,
        node: str,
        publish: Publish | None,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
        exit: Callable[[int], Any] = os._exit,
        thread: bool = True,
        grace_s: float = GRACE_S,
    ):
        super().__init__(clock)
        self.limits, self.hangs = limits, HangFolder(run_dir, options)
        self.rank, self.node, self.publish = rank, node, publish
        self._clock, self._wall, self._exit = clock, wall, exit
        self._watches = thread  # False: ``check`` is called by the caller alone
        self.grace_s = grace_s
        self.world_size = 1
        self._peeked_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._training: int | None = None  # the thread Lightning's hooks run in

    def train_started(self, tick: Tick, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.world_size = trainer.world_size
        self._training = threading.get_ident()
        started = time.strftime("%Y%m%d-%H%M%S", time.gmtime(self._wall()))
        self.hangs.token = str(trainer.strategy.broadcast(f"{started}-{os.getpid()}", src=0))
        super().train_started(tick, trainer, pl_module)
        if self.limits.enabled and self._watches and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._watch, name="raytrain-hang-watchdog", daemon=True
            )
            self._thread.start()

    def stopped(self) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop watching (training ended or failed)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=POLL_S + 10)  # a look at a stalled store: not waited out
        self._thread = None

    # -- finding the hang ------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.check():
                return

    def check(self) -> bool:
        """Whether the rank is hung now (see the module docstring); a hung rank is
        reported, and its process ended."""
        phase, idle = self.phase, self._clock() - self._last
        allowed = allowance(phase, self.limits, self._step_times)
        # a rank allowed longer (saving) is hung too once a peer wrote its stacks
        timed_out = idle > step_timeout(self.limits, self._step_times)
        if idle <= allowed and not (timed_out and self._peer_hung()):
            return False
        self._report(phase, idle, allowed)
        return True

    def _peer_hung(self) -> bool:
        now = self._clock()
        if now - self._peeked_at < PEEK_S:
            return False
        self._peeked_at = now
        return self.hangs.count() > 0

    def _report(self, phase: Phase, idle: float, allowed: float) -> None:
        frames = sys._current_frames()
        report = HangReport(
            rank=self.rank,
            world_size=self.world_size,
            node=self.node,
            pid=os.getpid(),
            step=self.step,
            phase=phase,
            idle_s=round(idle, 1),
            allowed_s=round(allowed, 1),
            collective=collective_of(
                phase, frame_files(frames.get(self._training or -1)), self.world_size
            ),
            attempt=self.hangs.token,
            stacks=self.hangs.stacks(self.rank),
            at=self._wall(),
        )
        logger.error("raytrain: %s", report.describe())
        watcher = self._thread.ident if self._thread is not None else None
        try:
            text = stacks_text(report, frames, self._training, skip=watcher)
        except Exception:  # the hang is still told, its file at least headed
            logger.exception("raytrain: the stacks could not be read")
            text = f"raytrain hang report: {report.describe()}\n"
        self.hangs.write(report.stacks, text, "the stacks")
        if self.publish is not None:
            try:
                self.publish(report)
            except Exception:
                logger.exception("raytrain: the hang could not be told to the driver")
        self.hangs.told(self.rank, self.world_size, self.grace_s)
        self._exit(HANG_EXIT)
