"""The paged attention kernels on a GPU at real shapes (the CPU twin, test_paged_attention.py,
runs small ones under the interpreter): contexts from 1 to beyond 16k, block sizes 8/16/32, GQA
ratios 1/4/8 and MQA, head dims 64/128, bf16, fp16 and fp32, decode with the default and forced
split counts, chunks over long prefixes, sliding windows, strided patterns; within 2x of PyTorch's error."""

import pytest
import torch

from tests.ops.paged_cases import check_paged

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page", [8, 16, 32])
@pytest.mark.parametrize(
    "heads_q,heads_kv,head_dim", [(8, 8, 64), (32, 8, 128), (32, 4, 128), (16, 1, 64)]
)
def test_decode(heads_q, heads_kv, head_dim, page, dtype):
    lengths = [1, 17, 300, 4097, 16500, 999]
    check_paged([1] * len(lengths), lengths, heads_q, heads_kv, head_dim, page, dtype, "cuda")


@pytest.mark.parametrize("splits", [1, 2, 7, 64])
def test_decode_splits_of_one_long_sequence(splits):
    check_paged([1], [33000], 32, 8, 128, 16, torch.bfloat16, "cuda", num_splits=splits)


@pytest.mark.parametrize("page", [8, 16, 32])
@pytest.mark.parametrize("heads_q,heads_kv,head_dim", [(32, 8, 128), (8, 8, 64), (16, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunks_over_long_prefixes(heads_q, heads_kv, head_dim, page, dtype):
    check_paged([700, 1, 257, 1, 33], [700, 5000, 17000, 1, 2000], heads_q, heads_kv, head_dim,
                page, dtype, "cuda")  # fmt: skip


@pytest.mark.parametrize("window", [1, 100, 4096])
def test_sliding_window(window):
    check_paged([1, 1, 1], [9000, 50, 4096], 32, 8, 128, 16, torch.bfloat16, "cuda",
                window=window)  # fmt: skip
    check_paged([300, 1], [5000, 700], 32, 8, 128, 16, torch.bfloat16, "cuda", window=window)


@pytest.mark.parametrize("stride, window", [(256, 256), (64, 100)])
def test_strided_summary_columns(stride, window):
    check_paged([1, 1, 1], [9000, 50, 4096], 32, 8, 128, 16, torch.bfloat16, "cuda",
                window=window, stride=stride)  # fmt: skip
    check_paged([300, 1], [5000, 700], 32, 8, 128, 16, torch.bfloat16, "cuda", window=window,
                stride=stride)  # fmt: skip


@pytest.mark.parametrize("kv", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_pools(dtype, kv):
    lengths = [1, 17, 300, 4097, 16500]
    check_paged([1] * len(lengths), lengths, 32, 8, 128, 16, dtype, "cuda", kv=kv)
    check_paged([1] * len(lengths), lengths, 32, 8, 128, 16, dtype, "cuda", kv=kv, first=True)
    check_paged([700, 1, 257], [700, 5000, 17000], 32, 8, 128, 16, dtype, "cuda", kv=kv,
                first=True)  # fmt: skip
    check_paged([300, 1], [5000, 700], 32, 8, 128, 16, dtype, "cuda", window=100, stride=64,
                kv=kv)  # fmt: skip
    check_paged([1, 1, 9], [33, 2000, 61], 12, 4, 64, 16, dtype, "cuda", kv=kv)  # D=64
