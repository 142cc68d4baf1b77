"""Time spent blocked in torch.distributed's collectives, whoever called them, written for
torch 2.13 (``versions.SUPPORTED``).

A rank that waits for a slower one waits inside a collective: DDP's gradient all-reduce,
but also any collective a training step runs itself (the user's own ``all_reduce``,
``self.log(..., sync_dist=True)`` through Lightning's ``_sync_ddp``, torchmetrics' state
sync, SyncBatchNorm's gather, DDP's buffer broadcast before a forward). Measured at one
hook, such a wait reads as the step's own work and hides the straggler.

``CollectiveTimer`` wraps each collective function in ``torch.distributed`` (and in
``distributed_c10d``, through which torch's own helpers call one another) with a clock:
``total`` is the seconds this process spent inside blocking collectives. Only the
outermost call counts (``all_gather_object`` runs ``all_gather`` inside), and only
blocking calls: an ``async_op=True`` call returns at once and is waited on elsewhere (DDP's
all-reduce is timed by its communication hook). Callers that bound a collective by name
before ``install`` keep the unwrapped one; torch, Lightning and torchmetrics reach them as
attributes of the module. Why not a process-group hook: torch's only one,
``ProcessGroup._register_on_completion_hook``, is NCCL-only ("Only ProcessGroupNCCL
supports onCompletion hook, but got gloo backend"). On CUDA a collective returns once it
is queued, so the wait this measures is the host's, not the stream's.

Private: ``torch.distributed._broadcast_coalesced``, DDP's buffer and parameter broadcast.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_coalesced",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "_broadcast_coalesced",
)


def _async_index(fn: Callable[..., Any]) -> int | None:
    """The position of ``fn``'s ``async_op`` parameter (None: it has none)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a C++ binding without a signature
        return None
    return names.index("async_op") if "async_op" in names else None


class CollectiveTimer:
    """Seconds this process has spent inside blocking collectives since ``install``
    (``total``, monotonic), and how many it ran (``calls``). One per process: a second
    ``install`` of the same timer does nothing; ``remove`` puts torch's functions back."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.total = 0.0
        self.calls = 0
        self._local = threading.local()
        self._originals: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if self._originals:
            return
        wrapped: dict[int, Any] = {}
        for module in (dist, distributed_c10d):
            for name in COLLECTIVES:
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                if id(fn) not in wrapped:
                    wrapped[id(fn)] = self._wrap(fn)
                self._originals.append((module, name, fn))
                setattr(module, name, wrapped[id(fn)])

    def remove(self) -> None:
        for module, name, fn in reversed(self._originals):
            setattr(module, name, fn)
        self._originals = []

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        at = _async_index(fn)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            positional = args[at] if at is not None and len(args) > at else False
            queued = kwargs.get("async_op", positional)
            depth = getattr(self._local, "depth", 0)
            if queued or depth:
                return fn(*args, **kwargs)
            self._local.depth = 1
            began = self._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += self._clock() - began
                self.calls += 1
                self._local.depth = 0

        return timed
