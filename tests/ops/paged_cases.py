"""Shared checks of the paged attention kernels, run on CPU under Triton's interpreter
(test_paged_attention.py) and on a GPU at real shapes (test_paged_attention_gpu.py): random block
tables with shuffled, non-contiguous block ids, against plain attention over each sequence's
gathered keys in fp64 and in the kernel's precision."""

import torch

from memfit.ops.attention.paged import paged_attention
from tests.reference import assert_error_within


def make_paged(query_lens, context_lens, heads_q, heads_kv, head_dim, page, dtype, device, seed=0):
    """A step: sequence s has context_lens[s] tokens in the cache after the step, the last
    query_lens[s] of them new. Returns (q, key_pool, value_pool, metadata kwargs)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    pages = [-(-n // page) for n in context_lens]
    num_blocks = sum(pages) + 3  # a few blocks nobody uses
    order = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.zeros(len(context_lens), max(pages), dtype=torch.int32)
    used = 0
    for s, n in enumerate(pages):
        table[s, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n

    def make(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    key_pool = make(num_blocks, page, heads_kv, head_dim)
    value_pool = make(num_blocks, page, heads_kv, head_dim)
    q = make(sum(query_lens), heads_q, head_dim)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    metadata = {
        "block_table": table.to(device),
        "seq_lens": torch.tensor(context_lens, dtype=torch.int32, device=device),
        "query_start": starts.to(device),
        "max_query_len": max(query_lens),
        "max_seq_len": max(context_lens),
    }
    return q, key_pool, value_pool, metadata


def paged_reference(
    q, key_pool, value_pool, metadata, *, window=None, stride=0, dtype=torch.float64
):
    """Each sequence's keys gathered through its table, each query attending causally (and
    within the window, plus every stride-th column with a stride) in `dtype`: fp64 is exact, the kernel's dtype is PyTorch's own error
    (matrix products in that dtype, softmax in fp32, as SDPA's math does)."""
    heads_q, heads_kv = q.shape[1], key_pool.shape[2]
    page = key_pool.shape[1]
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    starts = metadata["query_start"].tolist()
    for s, length in enumerate(metadata["seq_lens"].tolist()):
        blocks = metadata["block_table"][s, : -(-length // page)].long()
        keys = key_pool[blocks].flatten(0, 1)[:length].to(dtype)  # (length, nkv, hs)
        values = value_pool[blocks].flatten(0, 1)[:length].to(dtype)
        rows = slice(starts[s], starts[s + 1])
        queries = q[rows].to(dtype)  # (n, nh, hs)
        n = queries.shape[0]
        positions = torch.arange(length - n, length, device=q.device)
        j = torch.arange(length, device=q.device)
        allowed = j[None, :] <= positions[:, None]
        if window is not None:
            inside = j[None, :] > positions[:, None] - window
            if stride:
                inside |= ((j + 1) % stride == 0)[None, :]
            allowed &= inside
        keys = keys.repeat_interleave(heads_q // heads_kv, dim=1)
        values = values.repeat_interleave(heads_q // heads_kv, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", queries, keys) * q.shape[-1] ** -0.5
        scores = scores.float() if dtype != torch.float64 else scores
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = scores.softmax(-1).to(dtype)
        out[rows] = torch.einsum("hnm,mhd->nhd", probs, values)
    return out


def quantize_pools(key_pool, value_pool, seed=0, kind="fp8"):
    """Pools as a quantized PagedKVCache stores them: fp8, each kv head's keys (less an offset)
    and values divided by a scale of its own; int8, each token's and head's divided by its own
    (fp16) and rounded. Returns the stored pools, the scales and the values they stand for
    (fp32; the keys without the offset, which changes no softmax)."""
    generator = torch.Generator(device="cpu").manual_seed(seed + 1)
    heads_kv, head_dim = key_pool.shape[2:]
    offset = torch.randn(heads_kv, head_dim, generator=generator).to(key_pool.device)
    if kind == "int8":
        stored, scales, meant = [], [], []
        for x in (key_pool.float() - offset, value_pool.float()):
            scale = (x.abs().amax(-1) / 127).half()
            scale = torch.where(scale > 0, scale, 1.0).half()
            q = (x / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
            stored.append(q)
            scales.append(scale.contiguous())
            meant.append(q.float() * scale.float()[..., None])
        return *stored, *scales, *meant
    scales = (torch.rand(2, heads_kv, generator=generator) * 1.5 + 0.02).to(key_pool.device)
    stored_k = ((key_pool.float() - offset) / scales[0][:, None]).to(torch.float8_e4m3fn)
    stored_v = (value_pool.float() / scales[1][:, None]).to(torch.float8_e4m3fn)
    meant_k = stored_k.float() * scales[0][:, None]
    meant_v = stored_v.float() * scales[1][:, None]
    return stored_k, stored_v, scales[0].contiguous(), scales[1].contiguous(), meant_k, meant_v


def first_position(stored_k, stored_v, k_scale, v_scale, meant_k, meant_v, block_table, seed=0):
    """Each sequence's first key and value stored as a quantized PagedKVCache stores them, less
    offsets of their own (random here), in place; returns the kernels' first_key and
    first_value (in the stored units) that give them back."""
    generator = torch.Generator(device="cpu").manual_seed(seed + 2)
    heads_kv, head_dim = stored_k.shape[2:]
    first_k, first_v = torch.randn(2, heads_kv, head_dim, generator=generator).to(stored_k.device)
    blocks = block_table[:, 0].long()
    for stored, scale, meant, first in ((stored_k, k_scale, meant_k, first_k),
                                        (stored_v, v_scale, meant_v, first_v)):  # fmt: skip
        x = meant[blocks, 0] - first  # (what it stands for, less the offset)
        if stored.dtype == torch.int8:
            token_scale = torch.where(x.abs().amax(-1) > 0, x.abs().amax(-1) / 127, 1.0).half()
            stored[blocks, 0] = (
                (x / token_scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
            )
            scale[blocks, 0] = token_scale
            meant[blocks, 0] = stored[blocks, 0].float() * token_scale.float()[..., None] + first
        else:
            stored[blocks, 0] = (x / scale[:, None]).to(torch.float8_e4m3fn)
            meant[blocks, 0] = stored[blocks, 0].float() * scale[:, None] + first
    if stored_k.dtype == torch.int8:
        return first_k.contiguous(), first_v.contiguous()
    return (first_k / k_scale[:, None]).contiguous(), (first_v / v_scale[:, None]).contiguous()


def check_paged(query_lens, context_lens, heads_q, heads_kv, head_dim, page, dtype, device, *,
                window=None, stride=0, num_splits=None, floor=1e-6, seed=0,
                kv=None, first=False):  # fmt: skip
    """kv 'fp8' or 'int8': the pools quantized (`quantize_pools`), the reference reading the
    values they stand for; `first`: each sequence's first key and value stored less offsets of
    their own (`first_position`)."""
    q, key_pool, value_pool, metadata = make_paged(
        query_lens, context_lens, heads_q, heads_kv, head_dim, page, dtype, device, seed
    )
    scales = {}
    if kv:
        stored_k, stored_v, k_scale, v_scale, key_pool, value_pool = quantize_pools(
            key_pool, value_pool, seed, kv
        )
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        if first:
            scales["first_key"], scales["first_value"] = first_position(
                stored_k, stored_v, k_scale, v_scale, key_pool, value_pool,
                metadata["block_table"], seed,
            )  # fmt: skip
        out = paged_attention(
            q, stored_k, stored_v, **metadata, window=window, stride=stride,
            num_splits=num_splits, **scales,
        )  # fmt: skip
    else:
        out = paged_attention(
            q, key_pool, value_pool, **metadata, window=window, stride=stride,
            num_splits=num_splits,
        )  # fmt: skip
    assert out.dtype == q.dtype and out.shape == q.shape
    exact = paged_reference(q, key_pool, value_pool, metadata, window=window, stride=stride)
    baseline = paged_reference(
        q,
        key_pool.to(dtype),
        value_pool.to(dtype),
        metadata,
        window=window,
        stride=stride,
        dtype=dtype,
    )
    assert_error_within(out, baseline, exact, name="out", floor=floor)
    return out
