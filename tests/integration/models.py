"""LightningModules for the integration tests: some fail on purpose, one records what it saw."""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch

from raytrain.models.digits import DigitsCNN
from raytrain.models.digits_tuple import DigitsClassifier
from raytrain.models.tinygpt import TinyGPT


class ExplodingCNN(DigitsCNN):
    """Raises from ``training_step`` on rank ``rank`` once ``global_step`` reaches ``at_step``."""

    def __init__(self, at_step: int = 3, rank: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.at_step = at_step
        self.fail_rank = rank

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step >= self.at_step and self.global_rank == self.fail_rank:
            raise ValueError(f"boom at step {self.global_step} on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


class PlainCNN(DigitsCNN):
    """The digits CNN without ``example_input_array``, as a user's own module often is:
    MLflow's input example has to come from the data (its ``forward(pixels)``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.example_input_array = None


class HubCNN(PlainCNN):
    """``PlainCNN`` taking a model hub's token, as a model that logs in to a hub while it is
    built would. It keeps the token neither in its hyperparameters (Lightning saves those
    into every checkpoint) nor on itself (a pickled model would carry it): what a model
    writes into its own checkpoints is the model's."""

    def __init__(self, hub_token: str, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters(ignore=["hub_token"])


class WideLinear(pl.LightningModule):
    """A linear classifier over a wide float vector ``x`` with labels ``y``: data-bound."""

    def __init__(self, features: int, lr: float = 0.01):
        super().__init__()
        self.layer = torch.nn.Linear(features, 2)
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(self.layer(batch["x"]), batch["y"])
        self.log("train_loss", loss, batch_size=len(batch["y"]))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def images_to_pixels(batch: dict) -> dict:
    """A ``data.preprocess`` step: decoded 8x8 grey ``image`` arrays (0..255) become the
    digits model's ``pixels`` (64 values, 0..16); ``label`` passes through."""
    import numpy as np

    images = np.asarray(batch.pop("image"), dtype=np.float32)
    batch["pixels"] = images.reshape(len(images), 64) * (16.0 / 255.0)
    return batch


def slow_images_to_pixels(batch: dict) -> dict:
    """``images_to_pixels`` at 2 ms a row: a preprocess slow enough that the workers wait
    for their batches (a run data-bound on purpose)."""
    import time

    time.sleep(0.002 * len(batch["image"]))
    return images_to_pixels(batch)


def digit_and_id(batch: dict) -> dict:
    """A ``data.preprocess`` step for the counting image test, at 2 ms a row (slow enough
    that the run is data-bound): a 9x8 grey ``image`` whose first 8 rows are a digit's
    pixels (0..255) and whose last row holds the image's index (``[i // 256, i % 256]``)
    becomes ``pixels`` (64 values, 0..16) and ``id``; ``label`` passes through."""
    import time

    time.sleep(0.002 * len(batch["image"]))
    return digit_pixels(batch)


def digit_pixels(batch: dict) -> dict:
    """``digit_and_id`` without the wait."""
    import numpy as np

    images = np.asarray(batch.pop("image"))
    batch["pixels"] = images[:, :8].reshape(len(images), 64).astype(np.float32) * (16.0 / 255.0)
    batch["id"] = images[:, 8, 0].astype(np.int64) * 256 + images[:, 8, 1]
    return batch


NODE_LOG = ("preprocess-nodes", "raytrain-test")  # the named actor's name and namespace


def pixels_where_they_ran(batch: dict) -> dict:
    """A ``data.preprocess`` that passes its batch on and tells the named actor
    ``NODE_LOG`` the node it ran on."""
    import ray

    log = ray.get_actor(NODE_LOG[0], namespace=NODE_LOG[1])
    ray.get(log.record.remote(ray.get_runtime_context().get_node_id(), len(batch["id"])))
    return batch


class KillAtSteps:
    """A LightningModule mixin (before the model class) that SIGKILLs (or sends
    ``signal_name`` to) its own worker process (rank ``rank``) when ``global_step`` reaches
    each of ``at_steps``, once each: workers lost mid-epoch. ``signals``, when given, names
    the signal for each of ``at_steps`` instead (``HANG``: sleep without end, as a rank
    stuck outside any collective would). Appends what happens to ``out_dir/events.jsonl``
    with wall-clock times: each kill, and (rank 0) each start of training and the first
    step it finishes (after a restore: the checkpoint's step + 1).

    With ``run_dir`` (a local run folder) it kills only once Ray Train has committed the
    last checkpoint the worker took (its snapshot names it): a kill right after a report
    would otherwise race the controller's poll, and the run restore from an older one.

    With ``toggle_every`` N (``bench/recovery.py``'s overhead), rank 0 keeps the in-memory
    state in every other block of N steps only (steps 0..N-1 not, N..2N-1 kept, ...), and
    records each step's end (``step_end``: step, time, whether its block keeps): the cost
    of keeping, measured within one run, where two runs on 2 shared cores differ by 30%."""

    def __init__(
        self,
        out_dir: str,
        at_steps: tuple[int, ...] = (30,),
        rank: int = 1,
        run_dir: str | None = None,
        signal_name: str = "SIGKILL",
        signals: tuple[str, ...] | None = None,
        toggle_every: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.toggle_every = toggle_every
        self.out_dir, self.at_steps, self.kill_rank = out_dir, tuple(at_steps), rank
        self.run_dir = run_dir
        names = signals or [signal_name] * len(self.at_steps)
        self.signal_at = dict(zip(self.at_steps, names, strict=True))
        self._first_step_pending = False

    def _record(self, event: str, **fields: float) -> None:
        import json
        import time

        line = json.dumps({"event": event, "at": time.time(), **fields})
        with open(f"{self.out_dir}/events.jsonl", "a") as handle:
            handle.write(line + "\n")

    def on_train_start(self) -> None:
        if self.global_rank == 0:
            self._record("start")
            self._first_step_pending = True
            if self.toggle_every:  # after the callbacks' hook: the first block keeps nothing
                self._keep_in(False)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if self._first_step_pending:
            self._record("first_step", step=self.global_step)
            self._first_step_pending = False
        if self.toggle_every and self.global_rank == 0:  # type: ignore[attr-defined]
            self._toggle()

    def _toggle(self) -> None:
        """Record this step's end (after the callbacks' hooks: a keep's snapshot is in it),
        and let the in-memory state keep in the next step's block or not."""
        import time

        step = self.global_step  # type: ignore[attr-defined]  # steps done: 1 after the first
        keeping = ((step - 1) // self.toggle_every) % 2 == 1
        self._record("step_end", step=step, at_perf=time.perf_counter(), keeping=keeping)
        self._keep_in(step // self.toggle_every % 2 == 1)  # the next step's block

    def _keep_in(self, keeping: bool) -> None:
        from raytrain.worker.memory_state import MemoryState

        for memory in self.trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(memory, MemoryState) and memory.off in (None, "toggled off"):
                memory.off = None if keeping else "toggled off"

    def _wait_for_commit(self) -> None:
        import json
        import time

        taken = max(getattr(cb, "_last_ckpt_step", 0) or 0 for cb in self.trainer.callbacks)
        deadline = time.monotonic() + 60
        while self.run_dir and taken and time.monotonic() < deadline:
            try:
                with open(f"{self.run_dir}/checkpoint_manager_snapshot.json") as handle:
                    latest = json.load(handle)["latest_checkpoint_result"]
                if latest and latest["metrics"]["step"] >= taken:
                    return
            except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
                pass
            time.sleep(0.05)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        import os
        import signal

        step = self.global_step  # type: ignore[attr-defined]
        marker = f"{self.out_dir}/killed-{step}"
        mine = step in self.at_steps and self.global_rank == self.kill_rank
        if mine and not os.path.exists(marker):
            self._wait_for_commit()
            open(marker, "w").close()
            self._record("kill", step=step, signal=self.signal_at[step])
            if self.signal_at[step] == "HANG":  # sleeps without end: a hung rank
                import time

                while True:
                    time.sleep(3600)
            os.kill(os.getpid(), getattr(signal, self.signal_at[step]))
        return super().training_step(batch, batch_idx)


class KillAtStepsCNN(KillAtSteps, DigitsCNN):
    """The digits CNN, killed as ``KillAtSteps`` says."""


class KillAtStepsGPT(KillAtSteps, TinyGPT):
    """The tiny GPT, killed as ``KillAtSteps`` says (FSDP and tensor parallel benches)."""


class SlowCNN(DigitsCNN):
    """The digits CNN with ``step_sleep`` seconds added to every training step, so a run
    lasts long enough to be interrupted from outside."""

    def __init__(self, step_sleep: float = 0.05, **kwargs):
        super().__init__(**kwargs)
        self.step_sleep = step_sleep

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        import time

        time.sleep(self.step_sleep)
        return super().training_step(batch, batch_idx)


class NaNAtStepCNN(DigitsCNN):
    """Returns a NaN loss on rank ``rank`` once ``global_step`` reaches ``at_step``; appends
    a line to ``attempts`` each time training starts, to count retries."""

    def __init__(self, attempts: str, at_step: int = 30, rank: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.attempts, self.at_step, self.nan_rank = attempts, at_step, rank

    def on_train_start(self) -> None:
        if self.global_rank == 0:
            with open(self.attempts, "a") as handle:
                handle.write(f"{self.global_step}\n")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step >= self.at_step and self.global_rank == self.nan_rank:
            return loss * float("nan")
        return loss


class SeenCountCNN(KillAtStepsCNN):
    """``KillAtStepsCNN`` that counts, in a buffer saved with its weights, how many times
    each training row (by ``id``, below ``num_ids``) went into a step: the counts are summed
    over the ranks every step, so a checkpoint holds exactly what the model trained on up to
    it. ``step_rows[s]`` counts the rows (over the ranks) that optimizer step ``s + 1``
    trained on, accumulated batches together. A batch without ``pixels`` has them as the
    columns ``p0``..``p63`` (a CSV set). Each rank also appends ``{"pid", "rank",
    "step", "ids"}`` lines to ``out_dir/ids.jsonl``."""

    def __init__(self, out_dir: str, num_ids: int, **kwargs):
        super().__init__(out_dir=out_dir, **kwargs)
        self.register_buffer("seen", torch.zeros(num_ids, dtype=torch.int64))
        self.register_buffer("step_rows", torch.zeros(4096, dtype=torch.int64))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        import json
        import os

        if "pixels" not in batch:  # a CSV set: the pixels' 64 columns
            batch = {**batch, "pixels": torch.stack([batch[f"p{k}"] for k in range(64)], 1)}
        ids = batch["id"]
        line = json.dumps(
            {
                "pid": os.getpid(),
                "rank": self.global_rank,
                "step": self.global_step,
                "ids": ids.tolist(),
            }
        )
        with open(f"{self.out_dir}/ids.jsonl", "a") as handle:
            handle.write(line + "\n")
        loss = super().training_step(batch, batch_idx)  # may kill this worker first
        counts = torch.bincount(ids, minlength=len(self.seen))
        counts = self.trainer.strategy.reduce(counts, reduce_op="sum")
        self.seen += counts
        self.step_rows[self.global_step] += counts.sum()
        return loss


class NodeEventsCNN(SeenCountCNN):
    """``SeenCountCNN`` for multi-node runs. Every rank records where it starts (``worker``:
    rank, node, world size, step). Rank ``rank`` announces ``doomed`` (with its node) at
    step ``doomed_at`` once its last checkpoint is committed, then waits to be taken down:
    the test removes or drains its node. With ``notice_wait``, it instead waits only until
    its worker has Ray's preemption notice, then trains on. With ``grow_at``, a run on
    fewer than ``grow_to`` workers announces ``shrunk`` at that step (after the commit) and
    waits to be restarted bigger. With ``hold_at``, every rank of the first group that gets
    there waits at that step (after the commit) to be taken down: a preemption's deadline.
    With ``lost_at``, rank ``rank`` announces ``lost`` (with its node) at that step, once,
    after the commit, and waits to be taken down with its node. Each wait gives up after
    ``patience`` seconds."""

    def __init__(
        self,
        out_dir: str,
        num_ids: int,
        *,
        doomed_at: int | None = None,
        rank: int = 1,
        grow_at: int | None = None,
        grow_to: int = 2,
        notice_wait: bool = False,
        hold_at: int | None = None,
        lost_at: int | None = None,
        patience: float = 120,
        **kwargs,
    ):
        super().__init__(out_dir=out_dir, num_ids=num_ids, at_steps=(), rank=rank, **kwargs)
        self.doomed_at, self.grow_at, self.grow_to = doomed_at, grow_at, grow_to
        self.notice_wait, self.patience, self.hold_at = notice_wait, patience, hold_at
        self.lost_at = lost_at
        self._group_started_at: int | None = None

    def on_train_start(self) -> None:
        import ray

        super().on_train_start()
        self._group_started_at = self.global_step
        self._record(
            "worker",
            rank=self.global_rank,
            node=ray.get_runtime_context().get_node_id(),
            world_size=self.trainer.world_size,
            step=self.global_step,
        )

    def _wait_until(self, done: Callable[[], bool]) -> None:
        import time

        deadline = time.monotonic() + self.patience
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        import os

        import ray

        step, world = self.global_step, self.trainer.world_size
        marker = f"{self.out_dir}/doomed-{step}"
        if (
            step == self.doomed_at
            and self.global_rank == self.kill_rank
            and not os.path.exists(marker)
        ):
            self._wait_for_commit()
            open(marker, "w").close()
            self._record("doomed", step=step, node=ray.get_runtime_context().get_node_id())
            if self.notice_wait:
                from raytrain.worker.preemption import ray_preemption_info

                self._wait_until(lambda: ray_preemption_info() is not None)
            else:
                self._wait_until(lambda: False)  # taken down with its node
        lost_marker = f"{self.out_dir}/lost-{step}"
        mine = step == self.lost_at and self.global_rank == self.kill_rank
        if mine and not os.path.exists(lost_marker):
            self._wait_for_commit()
            open(lost_marker, "w").close()
            self._record("lost", step=step, node=ray.get_runtime_context().get_node_id())
            self._wait_until(lambda: False)  # taken down with its node
        if step == self.hold_at and self._group_started_at == 0:
            self._wait_for_commit()
            self._wait_until(lambda: False)  # taken down at the preemption's deadline
        if step == self.grow_at and world < self.grow_to:
            self._wait_for_commit()
            if self.global_rank == 0:
                self._record("shrunk", step=step, world_size=world)
            self._wait_until(lambda: False)  # the resize restarts this group
        return super().training_step(batch, batch_idx)


PROBE_TEXT = b"def probe(x):\n    return [i * x for i in range(10) if i % 2]\n" * 4


def probe_tokens(block: int) -> torch.Tensor:
    """A fixed batch of text, the same for every run: one row of ``block + 1`` bytes."""
    data = (PROBE_TEXT * (block // len(PROBE_TEXT) + 2))[: block + 1]
    return torch.tensor(list(data), dtype=torch.long).unsqueeze(0)


def probe_loss(model: torch.nn.Module, block: int) -> float:
    """``model``'s next-byte loss on the probe text (a plain model, or the FSDP root)."""
    tokens = probe_tokens(block)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    return float(
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, 256).float(), tokens[:, 1:].reshape(-1)
        )
    )


class ProbedGPT(TinyGPT):
    """``TinyGPT`` that measures its loss on a fixed text when training starts (after a
    restore: with the restored weights) and when it ends, through the sharded model, and
    appends ``{"when", "step", "world_size", "loss"}`` to ``out_dir/probes.jsonl``.

    With ``kill_at``: it also measures the loss after each of the ``kill_at - 3`` to
    ``kill_at`` steps (``when: "step"``), and at step ``kill_at`` rank 0, once it has
    sent the state it keeps in memory, records the last step kept (``when: "killed"``)
    and SIGKILLs its own worker, once."""

    def __init__(self, out_dir: str, kill_at: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.out_dir, self.kill_at = out_dir, kill_at

    def _write(self, line: dict) -> None:
        import json

        if self.global_rank == 0:
            with open(f"{self.out_dir}/probes.jsonl", "a") as handle:
                handle.write(json.dumps(line) + "\n")

    def _probe(self, when: str) -> None:
        runner = getattr(self.trainer.strategy, "pipeline_runner", None)
        if runner is not None:  # through the pipeline: every rank takes part
            tokens = {"tokens": probe_tokens(self.hparams.block).to(self.device)}
            with torch.no_grad():
                probe = runner.step(tokens, 0, False, lambda b, _: self._loss(b["tokens"]))
            loss = float(probe)
        else:
            loss = probe_loss(self.trainer.model, self.hparams.block)  # a collective (FSDP)
        self._write(
            {
                "when": when,
                "step": self.global_step,
                "loss": loss,
                "world_size": self.trainer.world_size,
            }
        )

    def on_train_start(self) -> None:
        self._probe("start")

    def on_train_end(self) -> None:
        self._probe("end")

    def _killed(self) -> bool:
        import os

        return os.path.exists(f"{self.out_dir}/killed")

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        # after the callbacks' hook: the state kept in memory at this step is the one probed
        at = self.kill_at
        if at is not None and at - 3 <= self.global_step <= at and not self._killed():
            self._probe("step")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        import os
        import signal

        if self.kill_at == self.global_step and self.global_rank == 0 and not self._killed():
            from raytrain.worker.memory_state import MemoryState

            (memory,) = [c for c in self.trainer.callbacks if isinstance(c, MemoryState)]
            memory.wait_sent()  # the keeper holds the last step kept
            open(f"{self.out_dir}/killed", "w").close()
            self._write({"when": "killed", "step": self.global_step, "kept": memory.last_kept})
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


class DigitsBlocks(pl.LightningModule):
    """A user's model with no pipeline code: a stem, a ``ModuleList`` of blocks and a
    head, its forward a chain a pipeline's ``split_points`` can cut. Validation logs a
    torchmetrics accuracy object, as users do."""

    def __init__(self, width: int = 64, depth: int = 4, lr: float = 0.003):
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.save_hyperparameters()
        self.stem = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU())
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
            for _ in range(depth)
        )
        self.head = torch.nn.Linear(width, 10)
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["pixels"].float() / 16.0)
        loss = torch.nn.functional.cross_entropy(logits, batch["label"])
        self.log("train_loss", loss, batch_size=len(batch["label"]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["pixels"].float() / 16.0)
        self.val_acc.update(logits, batch["label"])
        self.log("val_acc", self.val_acc, on_epoch=True, batch_size=len(batch["label"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])


class ShardedBlocks(DigitsBlocks):
    """``DigitsBlocks`` that shards itself as a model written for FSDP2 alone does: the
    whole model's root, which a pipeline's stage would never call."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self, mesh=self.device_mesh["data_parallel"])


class RankEndsClassifier(DigitsClassifier):
    """``DigitsClassifier`` (``x, y = batch``) whose every rank appends the step and epoch
    its fit ended at to ``out_dir/ends.jsonl``: where a callback stopped each rank."""

    def __init__(self, out_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.out_dir = out_dir

    def on_fit_end(self) -> None:
        import json

        line = json.dumps(
            {"rank": self.global_rank, "step": self.global_step, "epoch": self.current_epoch}
        )
        with open(f"{self.out_dir}/ends.jsonl", "a") as handle:
            handle.write(line + "\n")


class DigitsRows(torch.utils.data.Dataset):
    """A Parquet split of the digits as a map-style dataset of dict samples (``id``,
    ``pixels``, ``label``): the default collate makes the dict batches the digits models
    read."""

    def __init__(self, uri: str):
        import pyarrow.parquet as pq

        table = pq.read_table(uri, columns=["id", "pixels", "label"])
        self.ids = torch.tensor(table.column("id").to_pylist())
        self.pixels = torch.tensor(table.column("pixels").to_pylist(), dtype=torch.float32)
        self.labels = torch.tensor(table.column("label").to_pylist())

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"id": self.ids[index], "pixels": self.pixels[index], "label": self.labels[index]}


class RankRows(torch.utils.data.IterableDataset):
    """``DigitsRows`` as an iterable dataset that gives each rank its part, as an iterable
    dataset must: rows ``rank::world_size``, in the same order every epoch."""

    def __init__(self, rows: DigitsRows, rank: int, world_size: int):
        self.rows, self.indices = rows, range(rank, len(rows), world_size)

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (self.rows[i] for i in self.indices)


class DigitsRowsModule(pl.LightningDataModule):
    """The digits' Parquet splits as a LightningDataModule of ``DigitsRows`` (``iterable``:
    the train split as ``RankRows``); ``setup`` counts its calls per rank in
    ``out_dir/setup.jsonl``."""

    def __init__(
        self, train: str, val: str, out_dir: str, batch_size: int = 24, iterable: bool = False
    ):
        super().__init__()
        self.train_uri, self.val_uri, self.out_dir = train, val, out_dir
        self.batch_size, self.iterable = batch_size, iterable

    def setup(self, stage: str) -> None:
        import json

        with open(f"{self.out_dir}/setup.jsonl", "a") as handle:
            handle.write(json.dumps({"rank": self.trainer.global_rank, "stage": stage}) + "\n")
        self.train, self.val = DigitsRows(self.train_uri), DigitsRows(self.val_uri)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        if self.iterable:
            part = RankRows(self.train, self.trainer.global_rank, self.trainer.world_size)
            return torch.utils.data.DataLoader(part, batch_size=self.batch_size)
        return torch.utils.data.DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.val, batch_size=self.batch_size)


class StartsCNN(DigitsCNN):
    """``DigitsCNN`` that appends, each time its fit starts training (rank 0), its learning
    rate and the step it starts from to ``out_dir/starts.jsonl``: which trials of a sweep
    trained, and from where."""

    def __init__(self, out_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.out_dir = out_dir

    def on_train_start(self) -> None:
        import json

        if self.global_rank == 0:
            line = json.dumps({"lr": self.hparams["lr"], "step": self.global_step})
            with open(f"{self.out_dir}/starts.jsonl", "a") as handle:
                handle.write(line + "\n")


# what a Ray worker started under `srun` inherits: Slurm's view of a 4-node, 8-task job
SLURM_TASK_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "8",
    "SLURM_NNODES": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
}


class SlurmTaskCNN(DigitsCNN):
    """``DigitsCNN`` in a worker that looks like a Slurm task: its ``__init__`` (run in
    each worker before Lightning's Trainer is built) sets ``SLURM_TASK_ENV`` in the
    worker's environment; at the start of training each rank writes the rank, world size
    and cluster environment Lightning took, and whether Lightning's Slurm detection saw
    the job, to ``out_dir/rank{rank}.json``."""

    def __init__(self, out_dir: str, **kwargs):
        import os

        super().__init__(**kwargs)
        self.out_dir = out_dir
        os.environ.update(SLURM_TASK_ENV)

    def on_train_start(self) -> None:
        import json

        from lightning.pytorch.plugins.environments import SLURMEnvironment

        seen = {
            "rank": self.global_rank,
            "world_size": self.trainer.world_size,
            "environment": type(self.trainer.strategy.cluster_environment).__name__,
            "slurm_detected": SLURMEnvironment.detect(),
        }
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as handle:
            json.dump(seen, handle)


class SlowRankCNN(DigitsCNN):
    """``DigitsCNN`` whose rank ``slow_rank`` sleeps ``times`` its own median step time in
    every training step once its first ``calibrate`` steps measured it: a straggler, its
    busy time ``times + 1`` times the others'. With ``collective``, each step then runs
    collectives of its own, as users' steps do: it all-reduces the rows every rank trained
    and logs them with ``sync_dist=True``. The other ranks wait for the straggler there,
    inside their training step, not in the gradients' all-reduce."""

    def __init__(
        self,
        slow_rank: int = 1,
        times: float = 3.0,
        calibrate: int = 10,
        collective: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.slow_rank, self.times, self.calibrate = slow_rank, times, calibrate
        self.collective = collective
        self._walls: list[float] = []
        self._began = 0.0

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        import time

        self._began = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        import time

        if len(self._walls) < self.calibrate:
            self._walls.append(time.perf_counter() - self._began)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        import statistics
        import time

        slept = 0.0
        if self.global_rank == self.slow_rank and len(self._walls) >= self.calibrate:
            slept = self.times * statistics.median(self._walls)
            time.sleep(slept)
        if self.collective:
            rows = torch.tensor(float(len(batch["label"])))
            torch.distributed.all_reduce(rows)  # every rank's rows this step
            size = len(batch["label"])
            self.log("rows_per_step", rows, sync_dist=True, batch_size=size)
            # the straggler's sleep, for a test to hold the named factor to
            self.log("straggler_sleep_s", slept, sync_dist=True, reduce_fx="max", batch_size=size)
        return super().training_step(batch, batch_idx)
