"""The node-local copy of rank 0's kept state (``checkpoint.memory_every_n_steps`` under
DDP): two files in the node's memory (``/dev/shm``, where it has room), which outlive the
training process but not the node.

Why a copy beside the keeper's: a fault is most often one process's loss (a worker killed,
hung, out of memory), and the node's memory survives that. A state copied into it costs no
other process, where a send to the keeper costs the keeper's process and Ray's object store
CPU that training shares: on 2 cores, keeping every step in the keeper cost digits ~45% of
its throughput, ~2.5 times what the sender's own accounting said. So the state is copied
here often and sent to the keeper, which survives a node's loss, rarely
(``checkpoints.memory_interval``): the layout of Gemini's and NVIDIA's in-memory
checkpoints (a local copy, a remote one).

Each file (a *slot*) is mapped into rank 0's memory, and the keeps use the two in turn. A
keep copies the tensors straight into the slot's data (no buffer in between: the copy is
the write; its views of the slot are made once per layout), and the writing thread then
adds the rest (``packing``'s small torch file) and the header. The order makes a torn
slot impossible to take for a whole one: the header is cleared before the data is
touched and written last, so a process killed mid-keep leaves that slot invalid and the
other one, the keep before, whole. A slot is ``HEADER`` (magic, the keeper's key, the
step, the data's and the rest's sizes), the data from ``DATA_AT``, then the rest.

The keeper's key (a random number per keeper, so per driver) marks whose copy it is: a
rerun's new driver never resumes from one an earlier driver's run left (a driver's loss
resumes from storage, as documented), and removes it. Files are created ``0600``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from typing import TYPE_CHECKING, Any

import torch

from raytrain._compat.torch import copy_all
from raytrain.checkpoints.keeper import Files
from raytrain.checkpoints.node_slots import SLOTS, remove_state, slot_paths, state_roots
from raytrain.worker.packing import ALIGN, PACKED_DATA, PACKED_STATE, TensorSlot

if TYPE_CHECKING:
    import numpy as np

MAGIC = b"RTSTATE2"
HEADER = struct.Struct("<8sqqqq")  # magic, key, step, data's bytes, the rest's bytes
DATA_AT = 64  # where the data starts: aligned as ``packing`` aligns each tensor
HEAD_ROOM = 2**16  # the room a slot keeps for the rest (``packing``'s torch file), at least


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class NodeCopy:
    """Rank 0's two slots under ``root`` (see the module docstring), for the keeper with
    ``key``. ``begin`` (the training thread) clears the next slot's header and returns
    its views to copy the tensors into; ``finish`` (the writing thread) adds the rest and
    the header. One keep at a time: the caller waits for ``finish`` before the next
    ``begin``."""

    def __init__(self, root: str, scratch: str, key: int):
        self.paths = slot_paths(root, scratch)
        self.key = key
        self._maps: list[mmap.mmap | None] = [None] * SLOTS
        self._views: list[tuple[Any, list[torch.Tensor]] | None] = [None] * SLOTS
        # the first keep goes where it overwrites the older of a group before's slots
        steps = [state_step(path, key) for path in self.paths]
        self._next = min(range(SLOTS), key=lambda s: -1 if (t := steps[s]) is None else t)
        self._head = 0  # the size of the last keep's rest
        self.slot = -1  # the slot of the keep begun last

    def begin(self, placed: list[tuple[torch.Tensor, TensorSlot]], nbytes: int) -> None:
        """Start a keep in the next slot: clear its header, and copy ``placed`` (each
        tensor with its slot in a buffer of ``nbytes``: ``packing.place``) into its data."""
        slot = self.slot = self._next
        self._next = (slot + 1) % SLOTS
        # room for the rest too, as big as the last one's twice: it rarely grows
        room = self._room(slot, DATA_AT + _aligned(nbytes) + max(HEAD_ROOM, 2 * self._head))
        room[: HEADER.size] = bytes(HEADER.size)
        copy_all(self._slot_views(slot, placed), [tensor for tensor, _ in placed])

    def finish(self, step: int, head: bytes, nbytes: int) -> None:
        """End the keep begun: the rest (``head``) after the data, then the header."""
        slot = self.slot
        at = DATA_AT + _aligned(nbytes)
        self._head = len(head)
        room = self._room(slot, at + len(head))
        room[at : at + len(head)] = head
        header = HEADER.pack(MAGIC, self.key, step, nbytes, len(head))
        room[len(MAGIC) : HEADER.size] = header[len(MAGIC) :]
        room[: len(MAGIC)] = MAGIC  # last: a header cut short has no magic

    def data(self, nbytes: int) -> np.ndarray:
        """A copy of the data of the keep begun last, as a numpy array (for the keeper's
        send: Ray hands an array to an actor out of band, where a ``bytes`` is pickled
        in band: 36 ms of the sending thread for the widened CNN's 5 MB, against ~1 ms)."""
        import numpy as np

        room = self._maps[self.slot]
        assert room is not None
        return np.frombuffer(room, dtype=np.uint8, count=nbytes, offset=DATA_AT).copy()

    def remove(self) -> None:
        """Unmap and remove both slots."""
        self._views = [None] * SLOTS
        for index, room in enumerate(self._maps):
            if room is not None:
                with contextlib.suppress(BufferError):  # a view still held: the GC frees it
                    room.close()
            self._maps[index] = None
        for path in self.paths:
            remove_state(path)

    def _room(self, slot: int, size: int) -> mmap.mmap:
        """The slot's mapping, at least ``size`` bytes (grown, and its views made again,
        when it is not)."""
        room = self._maps[slot]
        if room is not None and len(room) >= size:
            return room
        self._views[slot] = None
        grown = max(size, 2 * len(room)) if room is not None else size
        if room is not None:
            with contextlib.suppress(BufferError):  # a view still held: the GC frees it
                room.close()
        fd = os.open(self.paths[slot], os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # its memory taken now: a full /dev/shm fails here (OSError), not later as a
            # SIGBUS on a write through the mapping
            os.posix_fallocate(fd, 0, grown)
            self._maps[slot] = mmap.mmap(fd, grown)
        finally:
            os.close(fd)
        room = self._maps[slot]
        assert room is not None
        return room

    def _slot_views(
        self, slot: int, placed: list[tuple[torch.Tensor, TensorSlot]]
    ) -> list[torch.Tensor]:
        """Each placed tensor's view of the slot's data, made once per layout."""
        layout = tuple((f.offset, f.nbytes, f.dtype, f.shape) for _, f in placed)
        cached = self._views[slot]
        if cached is not None and cached[0] == layout:  # plain tuples: compared in C
            return cached[1]
        room = self._maps[slot]
        assert room is not None
        whole = torch.frombuffer(room, dtype=torch.uint8)
        views = []
        for offset, nbytes, dtype, shape in layout:
            raw = whole[DATA_AT + offset : DATA_AT + offset + nbytes]
            views.append(raw.view(getattr(torch, dtype)).view(shape))
        self._views[slot] = (layout, views)
        return views


def _header(raw: bytes, key: int, size: int) -> tuple[int, int, int] | None:
    """(step, data's bytes, the rest's bytes) of a whole slot of ``size`` bytes whose
    header is ``raw`` and whose key is ``key``; None otherwise."""
    if len(raw) < HEADER.size:
        return None
    magic, owner, step, nbytes, head = HEADER.unpack_from(raw)
    if magic != MAGIC or owner != key or head <= 0 or size < DATA_AT + _aligned(nbytes) + head:
        return None
    return int(step), int(nbytes), int(head)


def state_step(path: str, key: int) -> int | None:
    """The step of the whole slot at ``path`` if it is the keeper with ``key``'s (None: no
    file, cleared or torn, or another driver's; another driver's is removed)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(HEADER.size)
            size = os.fstat(handle.fileno()).st_size
    except OSError:
        return None
    found = _header(raw, key, size)
    theirs = len(raw) == HEADER.size and raw[:8] == MAGIC and HEADER.unpack(raw)[1] != key
    if theirs:
        remove_state(path)
    return None if found is None else found[0]


def read_state(path: str, key: int, step: int) -> Files | None:
    """The packed state's files (``packing.unpack``'s input) in the slot at ``path``, if
    it is the keeper with ``key``'s at ``step`` (None: it is not, or not whole)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    found = _header(raw, key, len(raw))
    if found is None or found[0] != step:
        return None
    _, nbytes, head = found
    at = DATA_AT + _aligned(nbytes)
    return {PACKED_STATE: raw[at : at + head], PACKED_DATA: raw[DATA_AT : DATA_AT + nbytes]}


def newest_state(scratch: str, key: int) -> tuple[int, str] | None:
    """(step, path) of the newest whole slot of the keeper with ``key`` on this node, in
    any of ``state_roots`` (None: none)."""
    found = []
    for root in state_roots():
        for path in slot_paths(root, scratch):
            step = state_step(path, key)
            if step is not None:
                found.append((step, path))
    return max(found) if found else None
