"""Measure the activation memory a forward pass leaves for backward, on any device.

`saved_tensor_bytes` counts what autograd's saved-tensor hooks see. Non-reentrant activation
checkpointing installs hooks of its own inside each checkpointed region, so an outer hook does not
see the block inputs it keeps or the outputs a selective policy caches. `live_forward_bytes`
therefore also measures directly: a dispatch mode records every storage created during the
forward, and the bytes of those still alive when the forward returns (held by the graph for
backward) are the activation memory."""

from __future__ import annotations

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _StorageRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: list[tuple[StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.storages.append(
                    (StorageWeakRef(storage), storage.data_ptr(), storage.nbytes())
                )
        return out


def live_forward_bytes(model, inputs, targets) -> tuple[int, torch.Tensor]:
    """(bytes created by the forward and still alive after it, loss)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    recorder = _StorageRecorder()
    with recorder:
        loss = model(inputs, targets)
    gc.collect()
    # An address can be reused after a storage is freed: only the live storages count, once each.
    alive = {ptr: nbytes for ref, ptr, nbytes in recorder.storages if not ref.expired()}
    exclude = params | {loss.untyped_storage().data_ptr()}
    return sum(nbytes for ptr, nbytes in alive.items() if ptr not in exclude), loss


def saved_tensor_bytes(model, inputs, targets) -> tuple[int, torch.Tensor]:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(inputs, targets)
    return total, loss
