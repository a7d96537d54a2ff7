"""Activation offload: what blocks keep for their backward goes to pinned CPU memory during the
forward and comes back one block ahead during the backward, both copies on a stream of their own
so that they overlap the blocks' compute.

    offload = ActivationOffload(device)
    apply_activation_checkpointing(model, "full", offload=offload)   # the block inputs
    apply_activation_checkpointing(model, "none", offload=offload)   # every saved tensor of at
                                                                      # least min_bytes

With checkpointing, a block keeps only its input, and that is what moves. Without it, the
tensors autograd saves inside each block (a saved-tensor hook) of at least `min_bytes` move,
except leaves (parameters, buffers, the shared rotary tables) and autocast's copies of
parameters: every activation of a block, several
times the block input, so the copies may take longer than the compute (the planner says when).

Forward: block i's input is copied out on the side stream once the compute stream has made it;
the GPU tensor is freed when the block returns (the allocator keeps its memory from reuse until
the copy is done). Backward runs the blocks in reverse: block i's recompute takes its input
back, waiting for its copy in if it is not there yet, and starts the copy in of block i-1, which
overlaps block i's recompute and backward. So about two block inputs are on the GPU at a time
instead of one per layer. A pinned buffer goes back to a pool once its copy in is queued (or
when autograd drops a handle never taken back) and serves the next micro-batch: none is
allocated per step once the first has run.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(eq=False)
class Offloaded:
    """A tensor in CPU memory: its buffer, and what the copy back needs. `index`: its block's
    place in the forward."""

    host: Tensor
    requires_grad: bool
    index: int
    device_copy: Tensor | None = None  # once the copy in has started
    pooled: list[Tensor] = field(default_factory=list)  # the buffer, until it is given back
    copied_in: torch.cuda.Event | None = None
    taken: bool = False


MIN_BYTES = 2**20
"""Without checkpointing: saved tensors smaller than this stay on the GPU (norm statistics and
the like: many small copies would cost more than they free)."""


class ActivationOffload:
    def __init__(self, device: torch.device | str, *, min_bytes: int = MIN_BYTES) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # ("cuda" is not equal to tensors' "cuda:0")
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.min_bytes = min_bytes
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._free: dict[tuple, list[Tensor]] = {}  # pinned buffers by (shape, strides, dtype)
        # this forward's handles, a group per block, in order (weak: autograd owns them)
        self._groups: list[list[weakref.ref[Offloaded]]] = []
        self.buffers_allocated = 0
        """Pinned buffers made so far (they are reused: this stops growing after one step)."""
        self.pinned_bytes = 0
        """Bytes of those buffers."""
        self.bytes_offloaded = 0
        """Bytes copied out so far."""

    # -- forward ----------------------------------------------------------------------------

    def begin_block(self) -> int:
        """A block's forward starts: what it offloads forms a group (the first block of a forward
        starts afresh once the last forward's backward has taken every group back)."""
        if all(saved is None or saved.taken for saved in self._saved(range(len(self._groups)))):
            self._groups = []
        self._groups.append([])
        return len(self._groups) - 1

    def offload(self, x: Tensor) -> Offloaded:
        """A checkpointed block's input: start copying it to CPU memory, as its block's group;
        the caller drops its reference, and `take` hands it back for the recompute."""
        return self._copy_out(x, self.begin_block())

    def pack(self, group: int, keep: set[int], tensor: Tensor):
        """The saved-tensor hook's pack: a large activation goes out; a small tensor, a tensor
        whose storage is in `keep` (its block's parameters and shared inputs) and a parameter
        stay."""
        if (
            tensor.device != self.device
            or tensor.numel() * tensor.element_size() < self.min_bytes
            or tensor.untyped_storage().data_ptr() in keep
            or _of_a_parameter(tensor)
        ):
            return tensor
        return self._copy_out(tensor, group)

    def _copy_out(self, x: Tensor, group: int) -> Offloaded:
        host = self._buffer(x)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(x.detach(), non_blocking=True)
            x.record_stream(self.stream)  # (its memory waits for the copy before reuse)
        else:
            host.copy_(x.detach())
        self.bytes_offloaded += x.numel() * x.element_size()
        saved = Offloaded(host, x.requires_grad, group, pooled=[host])
        self._groups[group].append(weakref.ref(saved))
        # the buffer goes back to the pool once its copy in has been queued, or with the handle
        # if that never comes (a forward without backward)
        weakref.finalize(saved, self._give_back, saved.pooled)
        return saved

    def _give_back(self, pooled: list[Tensor]) -> None:
        # (a copy out into it later is ordered after its copy in: both on the side stream)
        if pooled:
            host = pooled.pop()
            self._free.setdefault(_layout(host), []).append(host)

    def _saved(self, groups) -> list[Offloaded | None]:
        """The handles of these groups (None: dropped)."""
        known = [self._groups[i] for i in groups if 0 <= i < len(self._groups)]
        return [ref() for group in known for ref in group]

    # -- backward ---------------------------------------------------------------------------

    def unpack(self, saved) -> Tensor:
        """The saved-tensor hook's unpack: the tensor back on the device. The first of a group
        brings the whole group in and starts the group before it, whose backward comes next."""
        if isinstance(saved, Tensor):
            return saved
        if saved.device_copy is None:
            for other in self._saved((saved.index, saved.index - 1)):
                if other is not None:
                    self._copy_in(other)
        x = saved.device_copy
        if self.cuda and not saved.taken:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(saved.copied_in)
            x.record_stream(current)  # (made on the side stream, used and freed on this one)
        saved.taken = True  # (the handle keeps its copy: a node may unpack it more than once)
        return x

    def take(self, saved: Offloaded) -> Tensor:
        """A block input back on the device, handed over to its recompute (not kept here)."""
        x = self.unpack(saved)
        saved.device_copy = None
        return x.requires_grad_(saved.requires_grad)

    def _copy_in(self, block: Offloaded) -> None:
        if block.device_copy is not None or block.taken:
            return
        host = block.host
        if self.cuda:
            with torch.cuda.stream(self.stream):  # (after its copy out: the same stream)
                x = torch.empty_strided(
                    host.shape, host.stride(), dtype=host.dtype, device=self.device
                )
                x.copy_(host, non_blocking=True)
                block.copied_in = torch.cuda.Event()
                block.copied_in.record(self.stream)
        else:  # (clone would make a padded layout dense)
            x = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype).copy_(host)
        block.device_copy = x
        self._give_back(block.pooled)

    # -- the pinned pool ----------------------------------------------------------------------

    def _buffer(self, like: Tensor) -> Tensor:
        free = self._free.get(_layout(like))
        if free:
            return free.pop()
        # its strides too where they lay it out densely or with padded rows: a compiled block's
        # backward expects each saved tensor's (a transposed view comes back transposed, a padded
        # one padded); an expanded or sliced view comes back dense (its own strides would overlap
        # or span gaps)
        _, strides, _ = _layout(like)
        host = torch.empty_strided(
            like.shape,
            strides or _contiguous_strides(like.shape),
            dtype=like.dtype,
            device="cpu",
            pin_memory=self.cuda,
        )
        self.buffers_allocated += 1
        self.pinned_bytes += host.untyped_storage().nbytes()
        return host


PADDING_ALLOWED = 1 / 8
"""How much larger than its elements a saved tensor's span may be for its strides to be kept:
compiled code pads rows (Inductor: 1376 columns a row of 1408) and its backward checks the
strides; a view that spans more (a slice of a wider tensor) comes back dense instead."""


def _layout(x: Tensor) -> tuple:
    """What a pooled buffer for `x` must match: shape, dtype, and strides where they lay the
    elements out without overlap in a span at most PADDING_ALLOWED larger than their count (a
    permutation of a dense layout, or one with padded rows); None otherwise: the buffer is
    contiguous."""
    expected, fits = 1, True
    for stride, size in sorted(
        (st, n) for n, st in zip(x.shape, x.stride(), strict=True) if n != 1
    ):
        fits = fits and stride >= expected
        expected = stride * size
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True) if n)
    fits = fits and x.numel() > 0 and span <= (1 + PADDING_ALLOWED) * x.numel()
    return tuple(x.shape), x.stride() if fits else None, x.dtype


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _of_a_parameter(tensor: Tensor) -> bool:
    """A parameter (a leaf that requires grad), a view of one, or autocast's copy of one: the
    optimizer holds those anyway. (A leaf that needs no gradient may be an activation: what a
    fused kernel or a compiled block makes inside its autograd.Function and saves.)"""
    if tensor._base is not None:
        tensor = tensor._base
    if tensor.is_leaf:
        return tensor.requires_grad
    node = tensor.grad_fn
    if node is not None and type(node).__name__ == "ToCopyBackward0":
        return any(
            next_node is not None and type(next_node).__name__ == "AccumulateGrad"
            for next_node, _ in node.next_functions
        )
    return False
