"""Each rank's step split into its parts, summarised per report window: where time goes.

``StepTimeline`` (on every rank, a listener of the step clock: ``worker.step_clock``)
times each training batch's parts from the clock's marks, in the order Lightning makes
them:

- ``data_wait``: from the previous batch's end to this one's start (Lightning fetching it);
- ``forward``: from the batch's start to ``on_before_backward`` (the training step), less
  its time in collectives;
- ``backward``: the backward pass, less ``comm_wait``;
- ``comm_wait``: time spent waiting in collectives, wherever in the step they ran. Under
  DDP, how long the backward pass waited for the gradients' all-reduce after its last
  gradient bucket was ready (a DDP communication hook marks each bucket; the hook then
  runs torch's own all-reduce); and in every part, the time inside any blocking
  collective the step ran itself: the user's own all-reduce, ``self.log(...,
  sync_dist=True)``, torchmetrics' sync, DDP's buffer broadcast
  (the clock's ``CollectiveTimer``, measured at torch.distributed's functions, not at one
  hook). A rank waiting here waits for a slower one; a wait at a
  collective inside the training step no longer reads as the waiting rank's forward work.
  Under FSDP its own all-gathers and reduce-scatters are asynchronous and not counted;
- ``optimizer``: from ``on_before_optimizer_step`` to the batch's end hooks, less its time
  in collectives;
- ``hooks``: the batch's end hooks: reports, checkpoint saves (a checkpoint's stall), the
  preemption check;
- ``busy``: the rank's own work, data wait + forward + backward + optimizer: what it would
  take if no other rank held it up. A straggler is a rank whose busy time stands out.

Every ``log_every_n_steps`` optimizer steps each rank sends one fixed-size summary, the
p50, p90 and mean of every part over the window, with its rank and node (``publish``). The
driver (``driver.timeline``) compares the ranks. A unit test drives the windows with a step
clock of its own.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import lightning.pytorch as pl

from raytrain.contract import Publish, TimelineWindow
from raytrain.worker.comm_hooks import HookState, register
from raytrain.worker.step_clock import StepListener, Tick

PARTS = ("data_wait", "forward", "backward", "comm_wait", "optimizer", "hooks", "busy", "step")


def summarize(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each part's [p50, p90, mean] over a window's batches (nearest-rank p90). The mean
    keeps what the quantiles hide: a wait that comes once a window (a streamed block's
    arrival) is where a window's time went, though most batches did not wait."""
    out: dict[str, list[float]] = {}
    for part, values in samples.items():
        if values:
            ranked = sorted(values)
            p90 = ranked[min(len(ranked) - 1, max(0, round(0.9 * len(ranked)) - 1))]
            out[part] = [statistics.median(ranked), p90, statistics.fmean(ranked)]
    return out


class StepTimeline(StepListener):
    """Times each batch's parts (see the module docstring) from the step clock's marks.
    ``clock`` must be the step clock's: the gradients' hook reads it between marks."""

    def __init__(
        self,
        *,
        every_n_steps: int,
        publish: Publish | None,
        rank: int,
        node: str,
        clock: Callable[[], float] = time.perf_counter,
        hook_state: HookState | None = None,
    ):
        """``hook_state``: the DDP communication hook's state this timeline registers
        with itself in it (``comm_hooks``; the gradient compression's, when the run has
        one), else a plain all-reduce's."""
        self.hook_state = hook_state or HookState()
        self.every_n_steps = max(1, every_n_steps)
        self.publish = publish
        self.rank, self.node = rank, node
        self._clock = clock
        self._samples: dict[str, list[float]] = {part: [] for part in PARTS}
        self._now: dict[str, float] = {}  # this batch's part so far
        self._marks: dict[str, Tick] = {}
        self._last_end: float | None = None  # the previous batch's end (None: paused)
        self._sent_step = -1
        self._ready_at: float | None = None  # the last gradient bucket's readiness
        self.comm_measured = False

    def _add(self, part: str, seconds: float) -> None:
        self._now[part] = self._now.get(part, 0.0) + seconds

    def _since(self, mark: str, tick: Tick) -> tuple[float, float]:
        """Seconds from ``mark`` to ``tick``, and of them the seconds in collectives
        (0 and 0 if the batch has no such mark)."""
        began = self._marks.get(mark, tick)
        return tick.now - began.now, max(tick.waited - began.waited, 0.0)

    # -- the clock's marks, in Lightning's order -------------------------------------------

    def train_started(self, tick: Tick, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # under DDP comm_wait is sent only with the hook: the gradients' wait is most of it
        self.hook_state.timeline = self
        hooked = register(getattr(trainer.strategy, "model", None), self.hook_state)
        self.comm_measured = hooked if hooked is not None else trainer.world_size > 1

    def batch_started(self, tick: Tick, trainer: pl.Trainer) -> None:
        wait = tick.now - self._last_end if self._last_end is not None else 0.0
        self._now = {"data_wait": wait}
        self._marks = {"start": tick, "forward": tick}
        self._ready_at = None

    def backward_started(self, tick: Tick) -> None:
        # forward: since the batch's start, or the last backward's end
        ran, waited = self._since("forward", tick)
        self._add("forward", max(ran - waited, 0.0))
        self._add("comm_wait", waited)
        self._marks["backward"] = tick

    def grads_ready(self) -> None:
        """A gradient bucket is ready (the communication hook's mark)."""
        self._ready_at = self._clock()

    def backward_ended(self, tick: Tick) -> None:
        total, in_collectives = self._since("backward", tick)
        waited = tick.now - self._ready_at if self._ready_at is not None else 0.0
        waited = min(max(waited, 0.0) + in_collectives, total)
        self._add("comm_wait", waited)
        self._add("backward", total - waited)
        self._marks["forward"] = tick  # a next backward's forward starts here

    def optimizer_started(self, tick: Tick) -> None:
        self._marks["optimizer"] = tick

    def batch_ended(self, tick: Tick) -> None:
        if "optimizer" in self._marks:
            ran, waited = self._since("optimizer", tick)
            self._now["optimizer"] = max(ran - waited, 0.0)
            self._add("comm_wait", waited)
        else:
            self._now["optimizer"] = 0.0
        self._marks["hooks"] = tick

    def batch_done(self, tick: Tick, trainer: pl.Trainer) -> None:
        """Every hook of the batch has run: the batch's parts join the window, which is
        sent every ``every_n_steps`` optimizer steps."""
        parts = self._now
        parts["hooks"] = self._since("hooks", tick)[0]
        parts["busy"] = sum(
            parts.get(p, 0.0) for p in ("data_wait", "forward", "backward", "optimizer")
        )
        parts["step"] = self._since("start", tick)[0] + parts.get("data_wait", 0.0)
        for part in PARTS:
            self._samples[part].append(parts.get(part, 0.0))
        self._last_end = tick.now
        step = trainer.global_step
        if step and step % self.every_n_steps == 0 and step != self._sent_step:
            self._sent_step = step  # (accumulated batches share their optimizer step)
            self.send(step, trainer.world_size)

    # Validation and an epoch's end are not waits for data; from an epoch's start (its
    # loader's new iterator) or a validation's end, the wait for the next batch is.
    def validation_started(self, tick: Tick) -> None:
        self._last_end = None

    def epoch_ended(self, tick: Tick) -> None:
        self._last_end = None

    def epoch_started(self, tick: Tick) -> None:
        self._last_end = tick.now

    def validation_ended(self, tick: Tick, trainer: pl.Trainer) -> None:
        if not trainer.sanity_checking:
            self._last_end = tick.now

    # -- the window's summary --------------------------------------------------------------

    def send(self, step: int, world_size: int) -> None:
        """The window's summary to the driver; the next window starts."""
        summary = summarize(self._samples)
        self._samples = {part: [] for part in PARTS}
        if self.publish is None or not summary:
            return
        if not self.comm_measured:
            summary.pop("comm_wait", None)
        self.publish(
            TimelineWindow(
                rank=self.rank, node=self.node, step=step, world_size=world_size, parts=summary
            )
        )
