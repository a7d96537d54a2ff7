import pytest
import torch

from memfit.distributed import FlatLayout


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("alignment", [1, 8])
def test_shards_are_equal_and_every_element_is_owned_once(world_size, alignment):
    numels = [7, 1, 13, 0, 5, 64, 3]
    layout = FlatLayout(numels, world_size, alignment)
    assert layout.padded_numel == layout.shard_numel * world_size
    assert 0 <= layout.padded_numel - layout.numel < world_size * alignment or layout.numel == 0
    assert all(offset % alignment == 0 for offset in layout.offsets)
    owned = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for rank in range(world_size):
        start, end = layout.shard_bounds(rank)
        assert end - start == layout.shard_numel
        for piece in layout.pieces(rank):
            assert 0 <= piece.shard_start and piece.shard_start + piece.numel <= layout.shard_numel
            owned[piece.index][piece.param_start : piece.param_start + piece.numel] += 1
    assert all((count == 1).all() for count in owned)


def test_pack_views_and_pieces_agree():
    params = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2, 2)]
    layout = FlatLayout.of(params, world_size=3, alignment=4)
    flat = layout.pack(params, layout.empty(torch.float32))
    for view, param in zip(layout.views(flat, [p.shape for p in params]), params, strict=True):
        assert torch.equal(view, param)
        assert view.data_ptr() >= flat.data_ptr()  # a view, not a copy
    for rank in range(3):
        start, end = layout.shard_bounds(rank)
        shard = flat[start:end]
        for piece in layout.pieces(rank):
            expected = params[piece.index].reshape(-1)[
                piece.param_start : piece.param_start + piece.numel
            ]
            assert torch.equal(shard[piece.shard_start : piece.shard_start + piece.numel], expected)
    assert flat[layout.numel :].eq(0).all()


def test_bad_layouts_raise_value_error():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        FlatLayout([3], 0)
    with pytest.raises(ValueError, match="alignment"):
        FlatLayout([3], 2, alignment=0)
    with pytest.raises(ValueError, match="outside world_size 2"):
        FlatLayout([3], 2).shard_bounds(2)
    with pytest.raises(ValueError, match="1-D with 4 elements"):
        FlatLayout([3], 2).views(torch.zeros(5))
