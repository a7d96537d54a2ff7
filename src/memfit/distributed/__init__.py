"""Data-parallel training across processes (torch.distributed): ZeRO's flat sharded buffers.

Work in progress for issue 5: the flat buffer layout is here; the ZeRO stages, offload and
launch arrive on top of it (the engine still refuses --zero > 0 until they do)."""

from memfit.distributed.flat import FlatLayout, Piece

__all__ = ["FlatLayout", "Piece"]
