"""Data-parallel training across processes (torch.distributed): ZeRO's flat sharded buffers.

Work in progress for issue 5: the flat buffer layout and ZeRO stages 0-2 (tested with gloo) are
here; stage 3, offload, sharded checkpoints and the engine's --zero arrive on top of them (the
engine still refuses --zero > 0 until they do)."""

from memfit.distributed.flat import FlatLayout, Piece
from memfit.distributed.zero import ZeroOptimizer, zero_state_bytes

__all__ = ["FlatLayout", "Piece", "ZeroOptimizer", "zero_state_bytes"]
