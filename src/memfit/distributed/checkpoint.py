"""Sharded checkpoints of a ZeroOptimizer through torch.distributed.checkpoint (DCP), loadable at
any world size and ZeRO stage.

A checkpoint is a DCP directory: `.metadata` (written last, by rank 0: a directory without it is
incomplete) and one `__<rank>_0.distcp` file per saving rank. Its entries, by memfit parameter
name (`model.named_parameters()`):

    model.<name>              the parameter, of its shape. Stages 0-2: whole, every rank
                              holds it; DCP writes each replicated plain tensor once, spreading
                              them over the ranks. Stage 3: no rank holds it whole; each rank
                              writes the part its shard holds, as a few chunks (`range_boxes`)
    optim.state.<name>.<key>  a per-element optimizer state (AdamW exp_avg, exp_avg_sq; SGD
                              momentum_buffer): 1-D, the parameter's numel, one chunk per rank
                              that holds a piece of the parameter in its shard
                              a scalar state (AdamW step): 0-d, written once
    optim.param_groups        per group: its hyperparameters and parameter names (rank 0's)
    extra                     the caller's dict (scheduler, scaler, counters...; rank 0's)
    memfit                    format version, world size and stage at save

The optimizer state is saved and loaded per rank: a rank writes only the slices its shard holds
(`FlatLayout.pieces`) and, on load, asks only for the slices its new shard holds; DCP reads the
overlaps of the saved chunks with them. No rank materializes the full optimizer state (stage 0
holds it whole by design; it still writes only its slices, so that the writing is spread).

Why ShardedTensor: a flat bucket gives each rank an arbitrary piece of each parameter (all of
it, none, or a slice at any offset), decided by the bucket layout, not by the parameter. DTensor
derives each rank's chunk of a dimension from its placements (torch.chunk's rule); it cannot say
"elements [37, 91) live on rank 1". ShardedTensor carries explicit offsets and sizes per chunk
(ShardMetadata), DCP writes each rank's local shards as chunks of one global tensor and reshards
on load by chunk overlap. It was DCP's first sharded type and DCP still handles it in 2.13, though
torch marks ShardedTensor deprecated in favour of DTensor (the warnings are silenced here); should
it go, only `_sharded` changes (to DCP's checkpointable protocol, or DTensor once it can express
uneven chunks), not the files. The tensors are built with
`_init_from_local_shards_and_global_metadata`, without communication: every rank computes all
ranks' pieces from the layout (`init_from_local_shards` would all-gather the shard metadata once
per tensor). They exist only for the duration of a save or load.

A stage-3 rank's part of a parameter is a contiguous range of its flattened elements, which a
ShardedTensor of the parameter's shape cannot take as one chunk (a chunk is a box: an offset and
a size per dimension). `range_boxes` splits the range into boxes (in 2-D: a partial first row,
the whole rows, a partial last row), each a contiguous piece of the shard, so the local chunks
are views of the shard: DCP writes from them and loads into them directly. The files have the
same entries at every stage; DCP reshards between them on load by chunk overlap.

Without a process group (one process, e.g. single-GPU offload) or at world size 1 everything is
plain tensors, and DCP runs without collectives (`no_dist`, torch >= 2.7).
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from memfit.distributed.buckets import Bucket
from memfit.distributed.flat import Piece
from memfit.distributed.zero import ZeroOptimizer

__all__ = ["export_safetensors", "load_zero", "save_zero"]

FORMAT_VERSION = 1
_MODEL, _STATE = "model.", "optim.state."
# How the optimizer runs here (kernel choice, graph capture), not training state: a checkpoint
# from fused CUDA AdamW loads into a foreach CPU (offload) one.
_RUNTIME_OPTIONS = ("foreach", "fused", "capturable", "differentiable")


def save_zero(
    path: str | Path, model: nn.Module, zero: ZeroOptimizer, extra: dict | None = None
) -> None:
    """Write `model`'s parameters and `zero`'s optimizer state (sharded) to the DCP directory
    `path`; `extra` is saved as rank 0 has it. Every rank of `zero`'s group calls it."""
    names = _names(model, zero)
    state: dict[str, Any] = _model_entries(model, zero, names)
    # an optimizer whose states are not per element (8-bit AdamW's blocks) gives them in a form
    # that is, through `checkpoint_state`, and takes that form back in load_state_dict
    optimizer = zero.optimizer
    states_of = getattr(optimizer, "checkpoint_state", lambda p: optimizer.state.get(p, {}))
    for bucket, param in zip(zero.buckets, _optimizer_params(zero), strict=True):
        for key, value in states_of(param).items():
            state.update(_state_entries(zero, bucket, names, key, value, param))
    if zero.rank == 0:
        state["optim.param_groups"] = _pack(_groups(zero, names))
        state["extra"] = _pack(dict(extra or {}))
        state["memfit"] = _pack(
            {"format_version": FORMAT_VERSION, "world_size": zero.world_size, "stage": zero.stage}
        )
    with _quiet():
        dcp.save(
            state, checkpoint_id=str(path), process_group=zero.group, no_dist=not zero.distributed
        )


def load_zero(path: str | Path, model: nn.Module, zero: ZeroOptimizer) -> dict:
    """Load a `save_zero` checkpoint into `model` and `zero`, built already, of any world size,
    stage and offload setting; returns the saved `extra`. Every rank of `zero`'s group calls
    it, between steps (gradients are left as they are). A checkpoint of other parameters or
    parameter groups raises ValueError before anything is loaded."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    names = _names(model, zero)
    params = dict(model.named_parameters())
    missing = [name for name in params if _MODEL + name not in saved]
    unexpected = sorted(
        key[len(_MODEL) :]
        for key in saved
        if key.startswith(_MODEL) and key[len(_MODEL) :] not in params
    )
    reshaped = [
        f"{name} {tuple(saved[_MODEL + name].size)} saved, {tuple(p.shape)} here"
        for name, p in params.items()
        if _MODEL + name in saved
        and isinstance(saved[_MODEL + name], TensorStorageMetadata)
        and tuple(saved[_MODEL + name].size) != tuple(p.shape)
    ]
    if missing or unexpected or reshaped:
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, other shapes {reshaped[:5]}"
        )
    # the small objects first, so that a checkpoint that does not fit changes nothing
    header = {key: b"" for key in ("memfit", "optim.param_groups", "extra")}
    _dcp_load(header, path, zero)
    version = _unpack(header["memfit"])["format_version"]
    if version > FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {str(path)!r} has format version {version}; this memfit reads up to "
            f"{FORMAT_VERSION}"
        )
    saved_groups = _unpack(header["optim.param_groups"])
    current = _groups(zero, names)
    if [g["param_names"] for g in saved_groups] != [g["param_names"] for g in current]:
        raise ValueError(
            f"checkpoint {str(path)!r} groups the parameters for the optimizer differently: "
            f"{[len(g['param_names']) for g in saved_groups]} parameters per group saved, "
            f"{[len(g['param_names']) for g in current]} here (or other parameters)"
        )
    # the parameters in place: into the flat buffers (stages 0-2) or the shards (stage 3)
    request: dict[str, Any] = _model_entries(model, zero, names)
    saved_states: dict[str, dict[str, Any]] = {}
    for key, meta in saved.items():
        if key.startswith(_STATE):
            name, state_key = key[len(_STATE) :].rsplit(".", 1)
            saved_states.setdefault(name, {})[state_key] = meta
    states = [  # per bucket: {state key: flat tensor, or the fqns of a per-parameter scalar}
        _request_states(zero, bucket, names, saved_states, param, request)
        for bucket, param in zip(zero.buckets, _optimizer_params(zero), strict=True)
    ]
    _dcp_load(request, path, zero)
    if zero.offload:
        for bucket in zero.buckets:
            if bucket.cpu_shard is not bucket.shard:  # offload params: the shard is the copy
                bucket.cpu_shard.copy_(bucket.shard)
    for found in states:
        for key, value in found.items():
            if isinstance(value, list):
                found[key] = _one(key, [request[fqn] for fqn in value])
    _load_optimizer(zero, saved_groups, states)
    return _unpack(header["extra"])


def export_safetensors(
    path: str | Path, out: str | Path, metadata: dict[str, str] | None = None
) -> Path:
    """The model weights of the DCP checkpoint `path`, whole, as the safetensors file `out`
    (memfit names), with `metadata` added to the file's {"format": "memfit"}. Runs in one
    process, with or without a process group; holds the whole model in CPU memory."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    weights = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in saved.items()
        if key.startswith(_MODEL) and isinstance(meta, TensorStorageMetadata)
    }
    if not weights:
        raise ValueError(f"{str(path)!r} holds no model weights (no {_MODEL}* entries)")
    with _quiet():
        dcp.load(weights, checkpoint_id=str(path), no_dist=True)
    out = Path(out)
    save_file(
        {key[len(_MODEL) :]: tensor.contiguous() for key, tensor in weights.items()},
        str(out),
        metadata={"format": "memfit", **(metadata or {})},
    )
    return out


# -- save ------------------------------------------------------------------------------------


def _state_entries(
    zero: ZeroOptimizer,
    bucket: Bucket,
    names: dict[int, str],
    key: str,
    value: Any,
    param: Tensor,
) -> Iterator[tuple[str, Any]]:
    """DCP entries for one optimizer state of one bucket, per parameter."""
    if isinstance(value, Tensor) and value.dim() == 1 and value.shape == param.shape:
        # the state tensor is the shard (stage 0: the whole bucket, where this shard starts at
        # bucket.start); piece.shard_start counts from the start of the shard
        base = bucket.start if _whole_bucket(zero) else 0
        if zero.world_size == 1:
            for index, p in enumerate(bucket.params):
                offset = bucket.layout.offsets[index]
                yield _STATE + f"{names[id(p)]}.{key}", value[offset : offset + p.numel()]
            return
        chunks = _chunks(zero, bucket)
        for index, p in enumerate(bucket.params):
            fqn = _STATE + f"{names[id(p)]}.{key}"
            yield fqn, _sharded_pieces(zero, value, [p.numel()], chunks[index], base)
    elif isinstance(value, Tensor) and value.dim() == 0:
        for p in bucket.params:  # the same on every rank: DCP writes one copy
            yield _STATE + f"{names[id(p)]}.{key}", value
    elif isinstance(value, Tensor):
        raise ValueError(
            f"optimizer state {key!r} has shape {tuple(value.shape)}: ZeRO checkpoints take "
            f"states shaped like the shard ({tuple(param.shape)}) or scalars"
        )
    elif value is not None:
        for p in bucket.params:
            yield _STATE + f"{names[id(p)]}.{key}", _pack(value)


def _chunks(zero: ZeroOptimizer, bucket: Bucket) -> list[dict[int, Piece]]:
    """Per parameter of `bucket`: rank -> the piece of it in that rank's shard."""
    found: list[dict[int, Piece]] = [{} for _ in bucket.params]
    for rank in range(zero.world_size):
        for piece in bucket.layout.pieces(rank):
            found[piece.index][rank] = piece
    return found


def _sharded(
    zero: ZeroOptimizer,
    size: Sequence[int],
    boxes: list[tuple[int, list[int], list[int]]],
    local: list[Tensor],
    like: Tensor,
) -> Tensor:
    """A tensor of `size` as a ShardedTensor whose chunks are `boxes` (group rank, offsets,
    sizes), every rank's; `local` is this rank's chunks' tensors, in the order of its boxes."""
    if math.prod(size) == 0:
        return torch.empty(size, dtype=like.dtype)
    shards = [
        ShardMetadata(list(offsets), list(sizes), f"rank:{_global(zero, rank)}/{like.device}")
        for rank, offsets, sizes in boxes
    ]
    mine = [shard for (rank, _, _), shard in zip(boxes, shards, strict=True) if rank == zero.rank]
    local_shards = [Shard(t, shard) for t, shard in zip(local, mine, strict=True)]
    pinned = any(t.is_pinned() for t in local)
    properties = TensorProperties(dtype=like.dtype, layout=torch.strided, pin_memory=pinned)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards,
        ShardedTensorMetadata(shards, torch.Size(size), properties),
        process_group=zero.group,
        sharding_spec=EnumerableShardingSpec(shards),
    )


def _groups(zero: ZeroOptimizer, names: dict[int, str]) -> list[dict]:
    found = []
    for group_index, group in enumerate(zero.optimizer.param_groups):
        options = {k: v for k, v in group.items() if k != "params"}
        params = [
            names[id(p)] for b in zero.buckets if b.group_index == group_index for p in b.params
        ]
        found.append({"options": options, "param_names": sorted(params)})
    return found


# -- stage 3: parameters as chunks of the shards ---------------------------------------------


def _model_entries(model: nn.Module, zero: ZeroOptimizer, names: dict[int, str]) -> dict:
    """The `model.<name>` entries, to save or to load into in place: the parameters themselves
    (stages 0-2, and parameters the ZeroOptimizer does not hold), or in stage 3 tensors of their
    shapes over the shards (the parameters' own storage is released there)."""
    entries = {_MODEL + name: p.detach() for name, p in model.named_parameters()}
    if zero.stage == 3:
        for bucket in zero.buckets:
            chunks = None if zero.world_size == 1 else _chunks(zero, bucket)
            for index, param in enumerate(bucket.params):
                if chunks is None:  # one rank: the shard is the whole bucket
                    offset = bucket.layout.offsets[index]
                    view = bucket.shard[offset : offset + param.numel()].view(param.shape)
                else:
                    view = _sharded_pieces(zero, bucket.shard, param.shape, chunks[index])
                entries[_MODEL + names[id(param)]] = view
    return entries


def _sharded_pieces(
    zero: ZeroOptimizer,
    shard: Tensor,
    shape: Sequence[int],
    chunks: dict[int, Piece],
    base: int = 0,
) -> Tensor:
    """A parameter (or a per-element state of it, 1-D) of `shape` as a ShardedTensor: each
    rank's piece of it, a range of its flattened elements, as boxes whose local tensors are
    consecutive views of this rank's `shard` (from `base`: stage 0's state is the whole bucket,
    where this rank's shard starts at bucket.start)."""
    boxes, local = [], []
    for rank, piece in sorted(chunks.items()):
        position = base + piece.shard_start  # where the next box of this piece starts
        for offsets, sizes in range_boxes(shape, piece.param_start, piece.numel):
            boxes.append((rank, offsets, sizes))
            if rank == zero.rank:
                numel = math.prod(sizes)
                local.append(shard[position : position + numel].view(sizes))
                position += numel
    return _sharded(zero, shape, boxes, local, shard)


def range_boxes(shape: Sequence[int], start: int, numel: int) -> list[tuple[list[int], list[int]]]:
    """Elements [start, start + numel) of a row-major tensor of `shape`, flattened, as boxes
    (offsets, sizes), in element order: each box is a contiguous range of the flattened tensor
    and each starts where the previous one ends. In 2-D: the rest of the first row, the whole
    rows, the start of the last row; in N-D at most 2N - 1 boxes. No boxes when numel is 0; a
    0-d tensor's one element is the box ([], [])."""
    shape = [int(d) for d in shape]
    if numel < 0 or start < 0 or start + numel > math.prod(shape):
        raise ValueError(
            f"elements [{start}, {start + numel}) are not within a tensor of shape {tuple(shape)}"
        )
    if numel == 0:
        return []
    if len(shape) <= 1:
        return [([start], [numel])] if shape else [([], [])]
    row = math.prod(shape[1:])  # elements per index of the first dimension
    end = start + numel
    first, last = start // row, (end - 1) // row  # the rows the range touches

    def in_row(index: int, lo: int, count: int) -> list[tuple[list[int], list[int]]]:
        """Boxes of elements [lo, lo + count) of row `index` (a tensor of shape[1:])."""
        return [([index, *o], [1, *s]) for o, s in range_boxes(shape[1:], lo, count)]

    if first == last:
        return in_row(first, start - first * row, numel)
    boxes, tail = [], []
    if start % row:  # the first row in part
        boxes = in_row(first, start % row, row - start % row)
        first += 1
    if end % row:  # the last row in part
        tail = in_row(last, 0, end % row)
        last -= 1
    if first <= last:  # whole rows
        boxes.append(([first] + [0] * (len(shape) - 1), [last - first + 1, *shape[1:]]))
    return boxes + tail


# -- load ------------------------------------------------------------------------------------


def _request_states(
    zero: ZeroOptimizer,
    bucket: Bucket,
    names: dict[int, str],
    saved_states: dict[str, dict[str, Any]],
    param: Tensor,
    request: dict[str, Any],
) -> dict[str, Any]:
    """Add to `request` what this rank needs of one bucket's optimizer states; returns them
    (flat states: the shard-shaped tensor the requested slices are views of)."""
    bucket_names = [names[id(p)] for p in bucket.params]
    keys = {name: set(saved_states.get(name, {})) for name in bucket_names}
    first = keys[bucket_names[0]]
    if any(k != first for k in keys.values()):
        raise ValueError(
            f"the checkpoint has optimizer states {sorted(first)} for {bucket_names[0]!r} but "
            f"not the same for all of {bucket_names}"
        )
    whole = _whole_bucket(zero)
    chunks = [] if whole else _chunks(zero, bucket)
    found: dict[str, Any] = {}
    for key in sorted(first):
        metas = [saved_states[name][key] for name in bucket_names]
        if all(isinstance(m, BytesStorageMetadata) for m in metas):
            found[key] = [_STATE + f"{name}.{key}" for name in bucket_names]
            request.update((fqn, b"") for fqn in found[key])
            continue
        if all(isinstance(m, TensorStorageMetadata) and len(m.size) == 0 for m in metas):
            found[key] = [_STATE + f"{name}.{key}" for name in bucket_names]
            for fqn, meta in zip(found[key], metas, strict=True):
                request[fqn] = torch.empty((), dtype=meta.properties.dtype)
            continue
        for p, meta in zip(bucket.params, metas, strict=True):
            if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != (p.numel(),):
                raise ValueError(
                    f"optimizer state {key!r} of {names[id(p)]!r} in the checkpoint is not a "
                    f"per-element state of its {p.numel()} elements"
                )
        flat = torch.zeros_like(param)  # what AdamW creates; padding stays zero
        found[key] = flat
        for index, p in enumerate(bucket.params):
            fqn = _STATE + f"{names[id(p)]}.{key}"
            if whole:
                offset = bucket.layout.offsets[index]
                request[fqn] = flat[offset : offset + p.numel()]
            else:
                request[fqn] = _sharded_pieces(zero, flat, [p.numel()], chunks[index])
    return found


def _load_optimizer(zero: ZeroOptimizer, saved_groups: list[dict], states: list[dict]) -> None:
    """Hand the loaded states to the wrapped optimizer through its own load_state_dict, which
    places and casts them as torch does (e.g. AdamW's step on the device when fused)."""
    by_param = {
        id(param): found
        for param, found in zip(_optimizer_params(zero), states, strict=True)
        if found
    }
    state_dict: dict[str, Any] = {"state": {}, "param_groups": []}
    position = 0
    for group, saved in zip(zero.optimizer.param_groups, saved_groups, strict=True):
        options = {k: v for k, v in group.items() if k != "params"}
        options.update((k, v) for k, v in saved["options"].items() if k not in _RUNTIME_OPTIONS)
        indices = list(range(position, position + len(group["params"])))
        state_dict["param_groups"].append({**options, "params": indices})
        for index, param in zip(indices, group["params"], strict=True):
            if id(param) in by_param:
                state_dict["state"][index] = dict(by_param[id(param)])
        position += len(indices)
    zero.optimizer.load_state_dict(state_dict)


# -- helpers ---------------------------------------------------------------------------------


def _one(key: str, values: list) -> Any:
    """The bucket's value of a scalar state saved once per parameter (they agree)."""
    values = [v if isinstance(v, Tensor) else _unpack(v) for v in values]
    first = values[0]
    for value in values[1:]:
        same = torch.equal(value, first) if isinstance(first, Tensor) else value == first
        if not same:
            raise ValueError(f"optimizer state {key!r} differs between parameters of a bucket")
    return first


def _names(model: nn.Module, zero: ZeroOptimizer) -> dict[int, str]:
    names = {id(param): name for name, param in model.named_parameters()}
    for bucket in zero.buckets:
        for param in bucket.params:
            if id(param) not in names:
                raise ValueError("the ZeroOptimizer holds a parameter that is not the model's")
    return names


def _optimizer_params(zero: ZeroOptimizer) -> list[Tensor]:
    """Per bucket, the tensor the wrapped optimizer steps (offload: its CPU copy)."""
    return [b.cpu_shard if zero.offload else b.shard for b in zero.buckets]


def _whole_bucket(zero: ZeroOptimizer) -> bool:
    """Whether this rank's optimizer steps the whole bucket (stage 0, or one rank)."""
    return zero.stage == 0 or zero.world_size == 1


def _global(zero: ZeroOptimizer, rank: int) -> int:
    """ShardedTensor placements name global ranks."""
    return dist.get_global_rank(zero.group, rank) if zero.group is not None else rank


def _dcp_load(request: dict[str, Any], path: str | Path, zero: ZeroOptimizer) -> None:
    with _quiet():
        dcp.load(
            request, checkpoint_id=str(path), process_group=zero.group, no_dist=not zero.distributed
        )


def _pack(obj: Any) -> bytes:
    """An object DCP stores as one opaque entry (a nested dict would be flattened into keys)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


class _quiet(warnings.catch_warnings):
    """Silences two warnings DCP gives on every call here: that it runs without a process group
    (intended: one process), and that ShardedTensor is deprecated (see the module docstring)."""

    def __enter__(self) -> None:
        super().__enter__()
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor")
