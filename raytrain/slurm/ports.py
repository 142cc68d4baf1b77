"""Each Slurm job's own block of ports for the Ray cluster it starts.

Two jobs that share a node (Slurm packs small jobs) must not share a port: Ray's defaults
(GCS 6379, workers 10002-19999) would collide, and Ray's ``symmetric-run`` is not
multi-tenant. A job takes ``BLOCK`` consecutive ports chosen by its job id, below Linux's
ephemeral range (32768 and up), where outgoing connections take their local ports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FIRST = 10000
BLOCK = 200
BLOCKS = 100  # FIRST + BLOCKS * BLOCK = 30000: below the ephemeral range
WORKER_OFFSET = 10  # the ports below are the node's daemons'; the rest Ray's worker processes


@dataclass(frozen=True)
class PortBlock:
    """The ports of one job's Ray processes on every node, from ``base`` on."""

    base: int

    @property
    def gcs(self) -> int:
        return self.base

    def node_args(self, *, head: bool) -> list[str]:
        """``ray start`` arguments that put every port of a node in this block."""
        b = self.base
        args = [
            *("--node-manager-port", str(b + 2)),
            *("--object-manager-port", str(b + 3)),
            *("--metrics-export-port", str(b + 4)),
            *("--dashboard-agent-listen-port", str(b + 5)),
            *("--dashboard-agent-grpc-port", str(b + 6)),
            *("--runtime-env-agent-port", str(b + 7)),
            *("--min-worker-port", str(b + WORKER_OFFSET)),
            *("--max-worker-port", str(b + BLOCK - 1)),
        ]
        if head:
            args += ["--port", str(self.gcs), "--ray-client-server-port", str(b + 1)]
        return args


def port_block(job_id: int, taken: Callable[[int], bool] = lambda base: False) -> PortBlock:
    """The block of job ``job_id``: block ``job_id mod BLOCKS``, or the next one that is not
    ``taken(base)`` on this node (the head's: any of its node ports in use), wrapping
    around. Worker nodes take the head's block unchecked: a job sharing one of them with
    another whose id is equal modulo ``BLOCKS`` would collide there.

    Invariant: every port of every block lies in [FIRST, FIRST + BLOCKS * BLOCK), blocks do
    not overlap, and two jobs whose ids differ modulo ``BLOCKS`` get different blocks when
    nothing is taken."""
    for step in range(BLOCKS):
        base = FIRST + ((job_id + step) % BLOCKS) * BLOCK
        if not taken(base):
            return PortBlock(base)
    raise RuntimeError(f"every one of {BLOCKS} port blocks from {FIRST} is in use on this node")
