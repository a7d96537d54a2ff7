"""Data-parallel training across processes (torch.distributed).

- `launch`: joining torchrun's process group (NCCL on CUDA, gloo on CPU), settings checked equal
  on every rank, decisions agreed across ranks.
- `flat`: the flat, padded buffers ZeRO shards.
- `zero`: ZeRO stages 0-2 and ZeRO-Offload of the optimizer (`memfit train --zero S --offload
  optimizer`).
- `checkpoint`: sharded checkpoints of a ZeRO run through torch.distributed.checkpoint, loadable at
  another number of processes, and consolidated safetensors export.

Stage 3 (parameter sharding) is not in this version yet."""

from memfit.distributed.flat import FlatLayout, Piece
from memfit.distributed.zero import ZeroOptimizer, zero_state_bytes

__all__ = ["FlatLayout", "Piece", "ZeroOptimizer", "zero_state_bytes"]
