"""A step's queries, keys and values from the fused qkv projection into attention's inputs: q
rotated (RoPE), k rotated and v written into their slots of a paged KV pool. One kernel.

Unfused, a decode layer runs the rotation of q and k (one kernel), a copy of v out of the qkv
view, and one indexed write per pool: four launches of a few microseconds each on a step whose
token count is the batch, 64 per step of a 16-layer model. Here a program owns a block of
(token, head) rows of one of q, k or v (scalar selects pick which, so one compiled kernel serves
all three) and writes each row once: q's to a contiguous (tokens, heads_q, head_dim) tensor, k's
and v's to `slots[token]` of their pools.

Numerics: the rotation is `memfit.ops.rotary`'s, term for term (x1 * c1 - x2 * s1 in the tables'
dtype, no FMA contraction, one rounding), so the result equals apply_rotary_qk's bit for bit and
a model gives the same tokens with either path. v passes through unchanged. A quantized
cache's pools also take q and k rotated by a +-1 Hadamard matrix (`key_rotation`), as four
(HALF x HALF) tensor-core products of the halves the program holds: exact products summed in
fp32, so the plain path's product equals it up to the order of the sums.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.ops._triton import (
    gdc_launch_dependents,
    gdc_wait,
    launch,
    pdl_enabled,
    round_to_bf16,
    round_to_e4m3,
    tl,
    triton,
)

__all__ = ["rotary_paged_write", "rotation_scales"]

QUANTIZED = (torch.float8_e4m3fn, torch.int8)  # the pools' one-byte kinds
FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # e4m3's largest finite value
INT8_MAX: tl.constexpr = tl.constexpr(127.0)  # (-127: symmetric)
_BLOCK_ELEMENTS = 2048  # elements of each half of head_dim per program, as the rotary kernel's


@triton.jit(do_not_specialize=["num_tokens"])
def _rotary_paged_write_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    q_out_ptr,
    k_pool_ptr,
    v_pool_ptr,
    k_offset_ptr,
    k_scale_ptr,
    v_scale_ptr,
    rotation_ptr,
    positions_ptr,
    first_offset_ptr,
    num_tokens,
    heads_q,
    heads_kv,
    q_head_blocks,
    kv_head_blocks,
    stride_qkv,
    stride_table,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    HALF: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
    ROUND_FP8_BY_HAND: tl.constexpr,
    QUANT: tl.constexpr,
    INT8: tl.constexpr,
    ROTATE: tl.constexpr,
    FIRST: tl.constexpr,
    Q_ROTATED_SCALE: tl.constexpr,
    K_ROTATED_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token block, head block): head blocks [0, q) are q's, [q, q + kv) k's, the rest
    v's. qkv: (tokens, (heads_q + 2 heads_kv) * 2 HALF), rows q | k | v; tables (tokens, 2 HALF).
    QUANT: fp8 pools, k_scale_ptr and v_scale_ptr the inverse scales (heads_kv,); INT8: int8
    pools, those pointers the per-token scale pools (slots, heads_kv) this kernel writes.
    ROTATE: after RoPE, q and k less its offset (each in the compute dtype) times the
    (2 HALF, 2 HALF) +-1 matrix H at rotation_ptr, then by Q_ROTATED_SCALE and K_ROTATED_SCALE
    (`rotation_scales`). FIRST: a token at position 0 (positions_ptr) has its key and value less
    the offsets at first_offset_ptr (2, heads_kv, 2 HALF), keys' then values', instead of the
    key offset and none. PDL: launched early, it waits for the kernel before before it reads."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    token_block = tl.program_id(0)
    head_block = tl.program_id(1)
    is_q = head_block < q_head_blocks
    is_v = head_block >= q_head_blocks + kv_head_blocks
    kind_start = tl.where(is_q, 0, tl.where(is_v, q_head_blocks + kv_head_blocks, q_head_blocks))
    num_heads = tl.where(is_q, heads_q, heads_kv)
    # the first head of this kind in the qkv row
    first_head = tl.where(is_q, 0, tl.where(is_v, heads_q + heads_kv, heads_q))

    tokens = token_block.to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    heads = (head_block - kind_start) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_HALF)
    token_ok = tokens < num_tokens
    mask = (
        token_ok[:, None, None] & (heads < num_heads)[None, :, None] & (dims < HALF)[None, None, :]
    )

    in_offsets = (
        (tokens * stride_qkv)[:, None, None]
        + ((first_head + heads) * (2 * HALF))[None, :, None]
        + dims[None, None, :]
    )
    table_offsets = (tokens * stride_table)[:, None, None] + (heads * 0)[None, :, None]
    table_offsets += dims[None, None, :]
    cos1 = tl.load(cos_ptr + table_offsets, mask=mask, other=0.0)
    cos2 = tl.load(cos_ptr + table_offsets + HALF, mask=mask, other=0.0)
    sin1 = tl.load(sin_ptr + table_offsets, mask=mask, other=0.0)
    sin2 = tl.load(sin_ptr + table_offsets + HALF, mask=mask, other=0.0)
    x1 = tl.load(qkv_ptr + in_offsets, mask=mask, other=0.0).to(cos1.dtype)
    x2 = tl.load(qkv_ptr + in_offsets + HALF, mask=mask, other=0.0).to(cos1.dtype)
    out1 = tl.where(is_v, x1, x1 * cos1 - x2 * sin1)
    out2 = tl.where(is_v, x2, x2 * cos2 + x1 * sin2)
    if ROUND_BF16_BY_HAND:
        out1, out2 = round_to_bf16(out1), round_to_bf16(out2)

    slots = tl.load(slots_ptr + tokens, mask=token_ok, other=0)
    if is_q:
        if ROTATE:  # (from q as the plain path holds it: in the compute dtype)
            out1, out2 = _rotate(
                out1, out2, rotation_ptr, Q_ROTATED_SCALE, q_out_ptr.dtype.element_ty, HALF,
                BLOCK_TOKENS, BLOCK_HEADS, BLOCK_HALF, ROUND_FP8_BY_HAND,  # (the interpreter)
            )  # fmt: skip
            if ROUND_BF16_BY_HAND:
                out1, out2 = round_to_bf16(out1), round_to_bf16(out2)
        rows = (tokens * heads_q)[:, None, None] + heads[None, :, None]
        q_offsets = rows * (2 * HALF) + dims[None, None, :]
        tl.store(q_out_ptr + q_offsets, out1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(q_out_ptr + q_offsets + HALF, out2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        pool_ptr = tl.where(is_v, v_pool_ptr, k_pool_ptr)
        stride_slot = tl.where(is_v, stride_v_slot, stride_k_slot)
        stride_head = tl.where(is_v, stride_v_head, stride_k_head)
        pool_offsets = (
            (slots * stride_slot)[:, None, None]
            + (heads * stride_head)[None, :, None]
            + dims[None, None, :]
        )
        kv1, kv2 = out1, out2
        if QUANT:
            # quantized pools: the value in the compute dtype (what the plain path quantizes),
            # less the key offset, scaled, saturated and rounded to the pool's grid
            head_ok = heads < heads_kv
            head_offsets = (heads * (2 * HALF))[None, :, None] + dims[None, None, :]
            off_ptrs = k_offset_ptr + head_offsets
            off_mask = head_ok[None, :, None] & (dims < HALF)[None, None, :]
            off1 = tl.where(is_v, 0.0, tl.load(off_ptrs, mask=off_mask, other=0.0))
            off2 = tl.where(is_v, 0.0, tl.load(off_ptrs + HALF, mask=off_mask, other=0.0))
            if FIRST:  # position 0: its own offsets, keys' and values'
                at0 = (tl.load(positions_ptr + tokens, mask=token_ok, other=1) == 0)[:, None, None]
                first_ptrs = first_offset_ptr + tl.where(is_v, heads_kv * (2 * HALF), 0)
                first_ptrs += head_offsets
                off1 = tl.where(at0, tl.load(first_ptrs, mask=off_mask, other=0.0), off1)
                off2 = tl.where(at0, tl.load(first_ptrs + HALF, mask=off_mask, other=0.0), off2)
            compute = q_out_ptr.dtype.element_ty
            kv1 = kv1.to(compute).to(tl.float32) - off1
            kv2 = kv2.to(compute).to(tl.float32) - off2
            if ROTATE:
                if not is_v:
                    if ROUND_BF16_BY_HAND:  # (the products take k - offset in bf16)
                        kv1, kv2 = round_to_bf16(kv1), round_to_bf16(kv2)
                    kv1, kv2 = _rotate(
                        kv1, kv2, rotation_ptr, K_ROTATED_SCALE, compute, HALF, BLOCK_TOKENS,
                        BLOCK_HEADS, BLOCK_HALF, ROUND_FP8_BY_HAND,
                    )  # fmt: skip
            scale_ptr = tl.where(is_v, v_scale_ptr, k_scale_ptr)
            if INT8:  # each (token, head): its largest |value| goes to 127, the scale in fp16
                amax = tl.maximum(tl.max(tl.abs(kv1), 2), tl.max(tl.abs(kv2), 2))
                scale = (amax / INT8_MAX).to(tl.float16).to(tl.float32)
                scale = tl.where(scale > 0, scale, 1.0)
                scale_offsets = slots[:, None] * heads_kv + heads[None, :]
                scale_mask = token_ok[:, None] & head_ok[None, :]
                tl.store(scale_ptr + scale_offsets, scale.to(tl.float16), mask=scale_mask)
                inv = (1.0 / scale)[:, :, None]
                kv1 = tl.minimum(tl.maximum(kv1 * inv, -INT8_MAX), INT8_MAX)
                kv2 = tl.minimum(tl.maximum(kv2 * inv, -INT8_MAX), INT8_MAX)
                # to nearest, ties away from 0 (the cast truncates)
                kv1 = tl.where(kv1 < 0, kv1 - 0.5, kv1 + 0.5).to(tl.int32)
                kv2 = tl.where(kv2 < 0, kv2 - 0.5, kv2 + 0.5).to(tl.int32)
            else:
                inv = tl.load(scale_ptr + heads, mask=head_ok)[None, :, None]
                kv1 = tl.minimum(tl.maximum(kv1 * inv, -FP8_MAX), FP8_MAX)
                kv2 = tl.minimum(tl.maximum(kv2 * inv, -FP8_MAX), FP8_MAX)
                if ROUND_FP8_BY_HAND:
                    kv1, kv2 = round_to_e4m3(kv1), round_to_e4m3(kv2)
        tl.store(pool_ptr + pool_offsets, kv1.to(pool_ptr.dtype.element_ty), mask=mask)
        tl.store(pool_ptr + pool_offsets + HALF, kv2.to(pool_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(
    x1, x2, rotation_ptr, SCALE: tl.constexpr, dtype: tl.constexpr, HALF: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """[x1 | x2] H * SCALE for the (2 HALF, 2 HALF) row-major +-1 matrix H at rotation_ptr, by
    its four (HALF, HALF) quarters; x1, x2 (BLOCK_TOKENS, BLOCK_HEADS, BLOCK_HALF) fp32, zeros
    past HALF, rounded to `dtype` (the compute dtype: exact for q, which is held in it) for the
    products, which are exact (H is +-1), summed in fp32 (tensor cores for bf16 and fp16) and
    scaled by the power of two SCALE: fp32 (BLOCK_TOKENS, BLOCK_HEADS, BLOCK_HALF) each.
    INTERPRET: the products in fp32 (the same sums), from x already rounded to bf16 by hand
    (the interpreter's bf16 is no number type for its dot, and its cast truncates)."""
    r = tl.arange(0, BLOCK_HALF)
    ok = (r < HALF)[:, None] & (r < HALF)[None, :]
    top = rotation_ptr + r[:, None] * (2 * HALF) + r[None, :]
    bottom = top + HALF * (2 * HALF)
    rows: tl.constexpr = BLOCK_TOKENS * BLOCK_HEADS
    if INTERPRET:
        dot_dtype: tl.constexpr = tl.float32
    else:
        dot_dtype: tl.constexpr = dtype
    a = tl.reshape(x1, (rows, BLOCK_HALF))
    b = tl.reshape(x2, (rows, BLOCK_HALF))
    if dtype != tl.bfloat16 or not INTERPRET:
        a, b = a.to(dtype), b.to(dtype)
    a, b = a.to(dot_dtype), b.to(dot_dtype)
    h11 = tl.load(top, mask=ok, other=0.0).to(dot_dtype)
    h12 = tl.load(top + HALF, mask=ok, other=0.0).to(dot_dtype)
    h21 = tl.load(bottom, mask=ok, other=0.0).to(dot_dtype)
    h22 = tl.load(bottom + HALF, mask=ok, other=0.0).to(dot_dtype)
    y1 = tl.dot(b, h21, tl.dot(a, h11, input_precision="ieee"), input_precision="ieee")
    y2 = tl.dot(b, h22, tl.dot(a, h12, input_precision="ieee"), input_precision="ieee")
    shape: tl.constexpr = (BLOCK_TOKENS, BLOCK_HEADS, BLOCK_HALF)
    return tl.reshape(y1 * SCALE, shape), tl.reshape(y2 * SCALE, shape)


def rotation_scales(head_dim: int) -> tuple[float, float]:
    """The powers of two that q H and (k - offset) H are scaled by under a +-1 rotation H
    (H H^T = head_dim I): their product is 1 / head_dim, so the scores are unchanged, and each
    is about 1 / sqrt(head_dim), so both keep about their magnitude."""
    bits = head_dim.bit_length() - 1
    return 2.0 ** -(bits // 2), 2.0 ** -(bits - bits // 2)


def rotary_paged_write(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    slots: Tensor,
    *,
    heads_q: int,
    key_offset: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    key_rotation: Tensor | None = None,
    first_offset: Tensor | None = None,
    positions: Tensor | None = None,
    inverse_scales: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Rotate q and k of `qkv` by the tables, write k and v to `slots` of the pools, return q.

    qkv: (tokens, (heads_q + 2 heads_kv) * head_dim), rows q | k | v, unit stride in the last
    dim; cos, sin: (tokens, head_dim) at the tokens' positions (fp32, `rotary_cos_sin`);
    key_pool, value_pool: (num_blocks, block_size, heads_kv, head_dim) of one layer, qkv's dtype,
    head_dim contiguous; slots: (tokens,) int64, slot s = block s // block_size, offset
    s % block_size. Returns q rotated, (tokens, heads_q, head_dim) contiguous, qkv's dtype.
    Runs where Triton runs (the caller decides; the plain path is apply_rotary_qk + index_copy_).
    Quantized pools (a quantized PagedKVCache) take key_offset (heads_kv, head_dim) fp32, and
    k (rounded to qkv's dtype) is stored as (k - key_offset) / k_scale, v as v / v_scale (as a
    product by the inverse):
    - float8_e4m3fn: k_scale and v_scale (heads_kv,) fp32, saturated to +-448;
    - int8: k_scale and v_scale are the pools' per-token scales (num_blocks, block_size,
      heads_kv) fp16, written here: each token and head's largest |value| over head_dim / 127
      (rounded to fp16), the values rounded to nearest (ties away from 0) within +-127.
    key_rotation, with quantized pools: a (head_dim, head_dim) fp32 matrix H of +-1 with
    H H^T = head_dim I (a Hadamard matrix, `PagedKVCache`'s), head_dim a power of two >= 32.
    After RoPE, q (in qkv's dtype) becomes q H * a and k - key_offset (rounded to qkv's dtype)
    (k - key_offset) H * b before it is scaled and rounded, a * b = 1 / head_dim
    (`rotation_scales`): q . k is unchanged, and each element of a stored key mixes every
    channel with the same weight, so a few outlier channels no longer carry most of a score
    and its rounding error.
    first_offset (2, heads_kv, head_dim) fp32, with quantized pools and `positions` (tokens,),
    the tokens' positions: a token at position 0 has its key stored less first_offset[0] (not
    key_offset) and its value less first_offset[1] (`PagedKVCache`: the first position's
    offsets).
    inverse_scales, fp8 pools: (1 / k_scale, 1 / v_scale), where the caller keeps them (a
    `PagedKVCache` does), so that a call makes no kernels of its own to invert the scales.
    """
    tokens, width = qkv.shape
    _, _, heads_kv, head_dim = key_pool.shape
    if width != (heads_q + 2 * heads_kv) * head_dim or head_dim % 2:
        raise ValueError(
            f"qkv of width {width} does not hold {heads_q} query and 2 x {heads_kv} key/value "
            f"heads of (even) head_dim {head_dim}"
        )
    quant = key_pool.dtype in QUANTIZED
    if value_pool.shape != key_pool.shape or {key_pool.dtype, value_pool.dtype} != {
        key_pool.dtype if quant else qkv.dtype
    }:
        raise ValueError(
            f"key and value pools {tuple(key_pool.shape)} {key_pool.dtype} / "
            f"{tuple(value_pool.shape)} {value_pool.dtype} must match each other and qkv's dtype "
            f"{qkv.dtype} (or both be float8_e4m3fn or int8)"
        )
    int8 = key_pool.dtype == torch.int8
    if quant:
        scales = (key_pool.shape[:3], torch.float16) if int8 else ((heads_kv,), torch.float32)
        wanted = {
            "key_offset": ((heads_kv, head_dim), torch.float32),
            "k_scale": scales,
            "v_scale": scales,
        }
        given = {"key_offset": key_offset, "k_scale": k_scale, "v_scale": v_scale}
        for name, (shape, dtype) in wanted.items():
            t = given[name]
            if t is None or t.shape != shape or t.dtype != dtype or not t.is_contiguous():
                got = None if t is None else (tuple(t.shape), t.dtype)
                raise ValueError(
                    f"{key_pool.dtype} pools need {name}: {tuple(shape)} contiguous {dtype}, "
                    f"got {got}"
                )
        if inverse_scales is not None and (
            int8 or any(t.shape != (heads_kv,) or t.dtype != torch.float32 or not t.is_contiguous()
                        for t in inverse_scales)
        ):  # fmt: skip
            raise ValueError(
                f"inverse_scales are fp8 pools' ({heads_kv},) contiguous float32 1 / k_scale and "
                f"1 / v_scale; got {[(tuple(t.shape), t.dtype) for t in inverse_scales]} for "
                f"{key_pool.dtype} pools"
            )
        if int8:
            extras = (key_offset, k_scale, v_scale)
        elif inverse_scales is not None:
            extras = (key_offset, *inverse_scales)
        else:
            extras = (key_offset, 1 / k_scale, 1 / v_scale)
    else:
        extras = (cos, cos, cos)  # (not read)
    if key_rotation is not None:
        if not quant:
            raise ValueError("key_rotation is for quantized (float8_e4m3fn or int8) pools")
        if (
            key_rotation.shape != (head_dim, head_dim)
            or key_rotation.dtype != torch.float32
            or not key_rotation.is_contiguous()
            or head_dim < 32
            or head_dim & (head_dim - 1)
        ):
            raise ValueError(
                f"key_rotation must be ({head_dim}, {head_dim}) contiguous float32, head_dim a "
                f"power of two >= 32, got {tuple(key_rotation.shape)} {key_rotation.dtype}"
            )
    if first_offset is not None:
        if (
            not quant
            or first_offset.shape != (2, heads_kv, head_dim)
            or first_offset.dtype != torch.float32
            or not first_offset.is_contiguous()
            or positions is None
            or positions.shape != (tokens,)
        ):
            raise ValueError(
                f"first_offset must be (2, {heads_kv}, {head_dim}) contiguous float32, for "
                f"quantized pools, with positions ({tokens},); got "
                f"{tuple(first_offset.shape)} {first_offset.dtype}, positions "
                f"{None if positions is None else tuple(positions.shape)}"
            )
    if qkv.stride(-1) != 1 or key_pool.stride(-1) != 1 or value_pool.stride(-1) != 1:
        raise ValueError("rotary_paged_write needs head_dim contiguous in qkv and the pools")
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be ({tokens}, {head_dim}), got {tuple(cos.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(tokens, heads_q, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_heads = min(
        triton.next_power_of_2(min(heads_q, heads_kv)), max(1, _BLOCK_ELEMENTS // block_half)
    )
    block_tokens = min(
        triton.next_power_of_2(tokens), max(1, _BLOCK_ELEMENTS // (block_heads * block_half))
    )
    rotated = rotation_scales(head_dim)
    if key_rotation is not None:  # (tl.dot takes tiles of at least 16 rows and columns)
        block_half = max(block_half, 16)
        block_heads = max(block_heads, 16 // block_tokens)
    num_warps = min(4, max(1, block_tokens * block_heads * block_half // 512))
    q_blocks, kv_blocks = triton.cdiv(heads_q, block_heads), triton.cdiv(heads_kv, block_heads)
    grid = (triton.cdiv(tokens, block_tokens), q_blocks + 2 * kv_blocks)
    k_slots = key_pool.view(-1, heads_kv, head_dim) if key_pool.is_contiguous() else None
    if k_slots is None or not value_pool.is_contiguous():
        raise ValueError("rotary_paged_write needs contiguous pools (one layer's, as allocated)")
    launch(
        _rotary_paged_write_kernel, grid, qkv.device,
        qkv, cos, sin, slots, q, key_pool, value_pool, *extras,
        key_rotation if key_rotation is not None else cos,
        positions if first_offset is not None else slots,
        first_offset if first_offset is not None else cos, tokens, heads_q, heads_kv, q_blocks,
        kv_blocks, qkv.stride(0), cos.stride(0), heads_kv * head_dim, head_dim,
        heads_kv * head_dim, head_dim,
        HALF=half, BLOCK_TOKENS=block_tokens, BLOCK_HEADS=block_heads, BLOCK_HALF=block_half,
        ROUND_BF16_BY_HAND=qkv.device.type == "cpu" and qkv.dtype == torch.bfloat16, QUANT=quant,
        INT8=int8, ROTATE=key_rotation is not None, FIRST=first_offset is not None,
        Q_ROTATED_SCALE=rotated[0],
        K_ROTATED_SCALE=rotated[1], ROUND_FP8_BY_HAND=qkv.device.type == "cpu", PDL=pdl_enabled(qkv.device), num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip
    return q
