"""Models for the benchmarks beyond bench/timed.py's."""

from __future__ import annotations

import itertools

import torch

from raytrain.models.digits import DigitsCNN
from raytrain.models.tinygpt import TinyGPT


class BigCheckpointCNN(DigitsCNN):
    """The digits CNN carrying ``state_mb`` MB of frozen weights: its checkpoint is that big,
    while a step costs what the digits CNN's does (frozen weights get no gradient, and DDP
    syncs them once, at the start)."""

    def __init__(self, state_mb: int = 200, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.frozen = torch.nn.Parameter(torch.zeros(state_mb * 2**20 // 4), requires_grad=False)


class MemoryProbeGPT(TinyGPT):
    """``TinyGPT`` that, just before the optimizer step of ``at_step`` (gradients and, from
    step 2, the optimizer's state all exist), writes this rank's model-state bytes to
    ``out_dir/memory-rank{rank}.json``: parameters, gradients and optimizer state, each the
    sum of the distinct storages its tensors live in (an FSDP parameter is a view of its
    rank's flat shard; DDP's gradients are views of its buckets; a DTensor counts its local
    shard). Rank 0 also writes each step's wall time to ``out_dir/steps.json`` at the end."""

    def __init__(self, out_dir: str, at_step: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.out_dir, self.at_step = out_dir, at_step
        self._step_ends: list[float] = []

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        import time

        self._step_ends.append(time.perf_counter())

    def on_train_end(self) -> None:
        import json

        if self.global_rank == 0:
            ends = self._step_ends
            times = [b - a for a, b in itertools.pairwise(ends)]
            with open(f"{self.out_dir}/steps.json", "w") as handle:
                json.dump(times, handle)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        import json

        from raytrain.worker.grad_clip import local_shard

        if self.global_step + 1 != self.at_step:
            return
        seen: set[int] = set()

        def nbytes(tensors: list[torch.Tensor]) -> int:
            total = 0
            for tensor in map(local_shard, tensors):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen and storage.nbytes():
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        params = list(self.trainer.model.parameters())
        state = [
            v
            for s in optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        ]
        out = {
            "parameters": nbytes(params),
            "gradients": nbytes([p.grad for p in params if p.grad is not None]),
            "optimizer": nbytes(state),
            "numel": sum(p.numel() for p in self.parameters()),
        }
        with open(f"{self.out_dir}/memory-rank{self.global_rank}.json", "w") as handle:
            json.dump(out, handle)


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (a step's time is then its own); a CPU has none."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float | None:
    """The GPU's peak allocated memory since the last reset; None on a CPU (not measured)."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


class TimedGPT(TinyGPT):
    """``TinyGPT`` that times each training step after ``warmup`` on the GPU (synchronised)
    and, at the end, writes the median step's tokens/s and the peak memory to ``out``."""

    def __init__(self, out: str, warmup: int = 10, **kwargs):
        super().__init__(**kwargs)
        self.out, self.warmup = out, warmup
        self._times: list[float] = []
        self._tokens = 0
        self._began = 0.0

    def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        import time

        synchronize(self.device)
        if batch_idx == self.warmup:
            reset_peak_memory(self.device)
        self._began = time.perf_counter()

    def on_train_batch_end(self, outputs: object, batch: dict[str, torch.Tensor], idx: int) -> None:
        import time

        synchronize(self.device)
        if idx >= self.warmup:
            self._times.append(time.perf_counter() - self._began)
            rows, width = batch["tokens"].shape
            self._tokens = rows * (width - 1)

    def on_train_end(self) -> None:
        import json

        per_step = sorted(self._times)[len(self._times) // 2]
        peak_gb = peak_memory_gb(self.device)
        with open(self.out, "w") as handle:
            json.dump({"tokens_per_s": self._tokens / per_step, "peak_memory_gb": peak_gb}, handle)
