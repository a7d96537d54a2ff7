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
instead of one per layer. The pinned buffers go back to a pool once their copy in is done and
serve the next micro-batch: none is allocated per step once the first has run.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    copied_in: torch.cuda.Event | None = None
    taken: bool = False


MIN_BYTES = 2**20
"""Without checkpointing: saved tensors smaller than this stay on the GPU (norm statistics and
the like: many small copies would cost more than they free)."""


class ActivationOffload:
    def __init__(self, device: torch.device | str, *, min_bytes: int = MIN_BYTES) -> None:
        self.device = torch.device(device)
        self.min_bytes = min_bytes
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._free: dict[tuple, list[Tensor]] = {}  # pinned buffers by (shape, dtype)
        self._returning: list[tuple[torch.cuda.Event | None, Tensor]] = []
        self._groups: list[list[Offloaded]] = []  # this forward's, a group per block, in order
        self.buffers_allocated = 0
        """Pinned buffers made so far (they are reused: this stops growing after one step)."""
        self.bytes_offloaded = 0
        """Bytes copied out so far."""

    # -- forward ----------------------------------------------------------------------------

    def begin_block(self) -> int:
        """A block's forward starts: what it offloads forms a group (the first block of a forward
        starts afresh once the last forward's backward has taken every group back)."""
        if self._groups and all(saved.taken for group in self._groups for saved in group):
            self._groups = []
        self._groups.append([])
        return len(self._groups) - 1

    def offload(self, x: Tensor) -> Offloaded:
        """A checkpointed block's input: start copying it to CPU memory, as its block's group;
        the caller drops its reference, and `take` hands it back for the recompute."""
        return self._copy_out(x, self.begin_block())

    def pack(self, group: int, tensor: Tensor):
        """The saved-tensor hook's pack: a large activation goes out, anything else stays."""
        if (
            tensor.device != self.device
            or tensor.numel() * tensor.element_size() < self.min_bytes
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
        saved = Offloaded(host, x.requires_grad, group)
        self._groups[group].append(saved)
        return saved

    # -- backward ---------------------------------------------------------------------------

    def unpack(self, saved) -> Tensor:
        """The saved-tensor hook's unpack: the tensor back on the device. The first of a group
        brings the whole group in and starts the group before it, whose backward comes next."""
        if isinstance(saved, Tensor):
            return saved
        if saved.device_copy is None:
            for index in (saved.index, saved.index - 1):
                for other in self._groups[index] if index >= 0 else ():
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
                x = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                x.copy_(host, non_blocking=True)
                block.copied_in = torch.cuda.Event()
                block.copied_in.record(self.stream)
        else:
            x = host.clone()
        block.device_copy = x
        self._returning.append((block.copied_in, host))

    # -- the pinned pool ----------------------------------------------------------------------

    def _buffer(self, like: Tensor) -> Tensor:
        still = []
        for event, host in self._returning:  # buffers whose copy in is done are free again
            if event is None or event.query():
                self._free.setdefault((tuple(host.shape), host.dtype), []).append(host)
            else:
                still.append((event, host))
        self._returning = still
        free = self._free.get((tuple(like.shape), like.dtype))
        if free:
            return free.pop()
        self.buffers_allocated += 1
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.cuda)


def _of_a_parameter(tensor: Tensor) -> bool:
    """A leaf (a parameter, a buffer, or a tensor made outside autograd such as the rotary
    tables every block shares), a view of one, or autocast's copy of a parameter: the optimizer
    or the model holds those anyway, or moving them would copy one tensor once per block."""
    if tensor._base is not None:
        tensor = tensor._base
    if tensor.is_leaf:
        return True
    node = tensor.grad_fn
    if node is not None and type(node).__name__ == "ToCopyBackward0":
        return any(
            next_node is not None and type(next_node).__name__ == "AccumulateGrad"
            for next_node, _ in node.next_functions
        )
    return False
