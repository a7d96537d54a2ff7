"""Paged attention kernels under Triton's interpreter at small shapes (the GPU twin,
test_paged_attention_gpu.py, runs real lengths): decode with and without split-K, chunks against
a cached prefix, prefill from empty, mixed steps, GQA 1/4/8 and MQA, head dims 64/128 and a
padded one, block sizes 8/16/32, sliding windows."""

import pytest
import torch

from memfit.ops._triton import triton_on_cpu
from memfit.ops.attention.paged import paged_attention
from tests.ops.paged_cases import check_paged, make_paged

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")


@pytest.fixture(autouse=True)
def _interpreter():
    with triton_on_cpu():
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads_q,heads_kv,head_dim,page",
    [(4, 4, 64, 16), (8, 2, 64, 8), (8, 1, 32, 32), (16, 2, 128, 16), (6, 2, 48, 16)],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(heads_q, heads_kv, head_dim, page, dtype, num_splits):
    lengths = [1, 37, 70, 16]
    check_paged([1] * len(lengths), lengths, heads_q, heads_kv, head_dim, page, dtype, "cpu",
                num_splits=num_splits)  # fmt: skip


def test_decode_with_more_splits_than_tiles():
    # a captured step's split count is fixed for any context: short contexts leave splits empty
    check_paged([1] * 4, [1, 5, 37, 70], 8, 2, 64, 16, torch.bfloat16, "cpu", num_splits=16)


def test_decode_default_splits_cover_long_context():
    # the default split count under the interpreter is > 1 for one sequence: the merge runs
    check_paged([1], [300], 8, 2, 64, 16, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads_q,heads_kv,head_dim,page",
    [(4, 4, 64, 16), (8, 2, 64, 8), (8, 1, 32, 32), (6, 2, 48, 16)],
)
def test_chunks_over_a_cached_prefix(heads_q, heads_kv, head_dim, page, dtype):
    # a prefill from empty, a chunk after a prefix, decodes in the same step (mixed)
    check_paged([21, 9, 1, 1], [21, 50, 33, 1], heads_q, heads_kv, head_dim, page, dtype, "cpu")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_step_decodes_split(num_splits):
    # the decodes of a mixed step run in the decode kernel, split, between prefill chunks
    check_paged([1, 21, 1, 9, 1], [70, 21, 5, 50, 33], 8, 2, 64, 16, torch.float32, "cpu",
                num_splits=num_splits)  # fmt: skip


@pytest.mark.parametrize("window", [1, 7, 20])
def test_sliding_window(window):
    check_paged([1, 1], [45, 9], 4, 2, 64, 8, torch.float32, "cpu", window=window, num_splits=2)
    check_paged([12, 3], [40, 3], 4, 2, 64, 8, torch.float32, "cpu", window=window)
    # decodes beside a chunk (in the decode kernel) under the window
    check_paged([1, 12, 1], [45, 40, 9], 4, 2, 64, 8, torch.float32, "cpu", window=window)


@pytest.mark.parametrize("stride, window", [(8, 8), (5, 3), (16, 20), (16, 2)])
def test_strided_summary_columns(stride, window):
    """The Sparse Transformer's strided pattern: the window plus every stride-th column, in
    decodes (split or not), chunks over a prefix and both in one step; page 8 against
    strides that do and do not divide it; a window narrower than the stride (only columns
    before the window are gathered: none past the sequence's pages)."""
    check_paged([1, 1], [45, 9], 4, 2, 64, 8, torch.float32, "cpu", window=window,
                stride=stride, num_splits=2)  # fmt: skip
    check_paged([12, 3], [40, 3], 4, 2, 64, 8, torch.float32, "cpu", window=window,
                stride=stride)  # fmt: skip
    check_paged([1, 12, 1], [45, 40, 90], 4, 2, 64, 8, torch.float32, "cpu", window=window,
                stride=stride)  # fmt: skip


def test_a_stride_needs_a_window():
    q, key_pool, value_pool, metadata = make_paged([1], [9], 4, 2, 64, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="stride must be 0 .none. or >= 2 beside a window"):
        paged_attention(q, key_pool, value_pool, **metadata, stride=4)


def test_window_with_whole_tiles_every_row_sees():
    # 5 new tokens at 95..99, window 40: keys 60..95 are seen by every row (an unmasked tile)
    check_paged([5], [100], 4, 2, 64, 8, torch.float32, "cpu", window=40)


def test_one_sequence_spanning_many_programs():
    check_paged([40], [60], 2, 2, 32, 8, torch.float32, "cpu")  # three query blocks of 16


def test_bad_block_size():
    with pytest.raises(ValueError, match="power of two"):
        check_paged([1], [5], 2, 2, 32, 12, torch.float32, "cpu")


@pytest.mark.parametrize("kv", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_quantized_pools_decode(dtype, num_splits, kv):
    # a quantized cache's pools: one-byte tiles widened in the kernel, fp8's per-head scales
    # folded in, int8's per-token ones on each key's scores and each value's weights; each
    # sequence's first key and value less offsets of their own, given back by the kernel
    check_paged([1] * 4, [1, 37, 70, 16], 8, 2, 64, 16, dtype, "cpu", num_splits=num_splits,
                kv=kv, first=num_splits == 3)  # fmt: skip


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_pools_chunks_window_and_stride(kv):
    check_paged([5, 1, 20], [40, 33, 20], 8, 2, 48, 8, torch.bfloat16, "cpu", kv=kv, first=True)
    check_paged([5, 1], [40, 70], 4, 4, 64, 16, torch.bfloat16, "cpu", window=9, stride=8,
                kv=kv, first=True)  # fmt: skip
    check_paged([5, 1], [40, 70], 4, 4, 64, 16, torch.bfloat16, "cpu", window=80, kv=kv,
                first=True)  # fmt: skip


def test_fp8_pools_refuse_missing_or_misshaped_scales():
    q, key_pool, value_pool, metadata = make_paged([1], [9], 4, 2, 64, 16, torch.float32, "cpu")
    fp8 = key_pool.to(torch.float8_e4m3fn), value_pool.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="v_scale must be"):
        paged_attention(q, *fp8, **metadata, k_scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"k_scale must be \(2,\)"):
        paged_attention(q, *fp8, **metadata, k_scale=torch.ones(3), v_scale=torch.ones(2))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        paged_attention(q, key_pool.to(torch.float16), value_pool, **metadata)
    int8 = key_pool.to(torch.int8), value_pool.to(torch.int8)
    with pytest.raises(ValueError, match="need k_scale and v_scale"):
        paged_attention(q, *int8, **metadata)
    with pytest.raises(ValueError, match=r"k_scale must be \(.*\) torch.float16"):
        paged_attention(q, *int8, **metadata, k_scale=torch.ones(2), v_scale=torch.ones(2))
