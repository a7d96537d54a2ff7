"""Data-parallel training across processes (torch.distributed).

- `launch`: joining torchrun's process group (NCCL on CUDA, gloo on CPU), settings checked equal
  on every rank, decisions agreed across ranks.
- `flat`: the flat, padded buffers ZeRO shards; `buckets`: what its two halves share.
- `sharding`: ZeRO stage 3 as a transform of the model (parameters sharded per unit, gathered
  for its forward and backward), applied after activation checkpointing and compile.
- `zero`: the optimizer side of ZeRO stages 0-3 (gradients reduced, states sharded, the step) and
  ZeRO-Offload of the optimizer (and, with stage 3, of the parameters).
- `checkpoint`: sharded checkpoints of a ZeRO run through torch.distributed.checkpoint, loadable at
  another number of processes, and consolidated safetensors export.

The bytes each stage keeps per rank: `memfit.optim.model_state_bytes`."""

from memfit.distributed.flat import FlatLayout, Piece
from memfit.distributed.sharding import ShardedParameters, shard_parameters
from memfit.distributed.zero import ZeroOptimizer

__all__ = ["FlatLayout", "Piece", "ShardedParameters", "ZeroOptimizer", "shard_parameters"]
