"""FlashAttention in Triton: exact attention in tiles, forward and backward, never materializing
the (seqlen_q, seqlen_k) scores.

Algorithm (Dao et al. 2022, "FlashAttention", and Dao 2023, "FlashAttention-2"): a program owns a
block of BLOCK_M query rows of one (sequence, head) and walks the key/value blocks its rows may
see, keeping a running row maximum m, a running sum l of exp(s - m) and an unnormalized output
accumulator (the online softmax), all in fp32 registers. Scores are scaled by
softmax_scale * log2(e) and exponentiated with exp2. At the end it writes

    out = acc / l          (in the input dtype)
    lse = m + log(l)       (fp32, natural log; -inf for a row that sees no key)

and nothing else is kept for backward. The backward recomputes the probabilities block by block
from q, k and lse: with delta = rowsum(dout * out) (one small kernel),

    p = exp(s - lse),  dv = p^T dout,  dp = dout v^T,  ds = p * (dp - delta),
    dq = scale * ds k,  dk = scale * ds^T q.

One launch runs two kinds of programs (FlashAttention-2's split, as in FlexAttention's backward):
the first walk one key/value block over the query blocks that see it and accumulate dk and dv
in registers, summing over every query head of a GQA group, so K and V are never repeated and
dk/dv need no atomics; the others walk one query block over its key blocks and accumulate dq.
Nothing is added atomically, so the backward is deterministic: reruns are bitwise equal.

Masks. Query row i of a sequence sits at aligned position p = i + seqlen_k - seqlen_q (the causal
diagonal is aligned bottom-right, FlashAttention-2's convention, so a decode step sees the whole
cache) and sees keys j with p - left <= j <= p + right; causal is right = 0. A program visits only
the key blocks that intersect this band (FA2's causal block skipping, FlexAttention's sliding
window block skipping), in three runs: masked blocks at the band's left edge, unmasked blocks in
the middle (no index arithmetic, no bounds checks), masked blocks at the right edge and at the
end of the sequence. Query rows and keys past the sequence end are loaded as zeros and never
stored, so any length works, not only multiples of the block size.

Layouts. q, k, v, out: (batch, seqlen, heads, head_dim) with any strides whose last is 1 (e.g.
views into a fused qkv projection); lse: (batch, heads_q, seqlen_q). Packed variable-length
batches (`flash_attention_varlen`) take (total_tokens, heads, head_dim) and cumulative sequence
offsets cu_seqlens (int32, batch + 1 entries); each program reads its sequence's bounds, so
documents never see each other. Head dims up to 256 that are multiples of 8 run; a head dim that is
not a power of two is padded to one inside the kernel (masked loads), e.g. 96 -> 128.

Block sizes and pipelining depth are autotuned per head dim (Triton's autotuner, on CUDA).
Under Triton's interpreter (tests on CPU) fixed 16x16 blocks run, so that small test shapes still
cover multi-block and partial-block paths.
"""

import math
import types

import torch
from torch import Tensor

import memfit.ops._triton as _triton
from memfit.ops._triton import interpreter_enabled, launch, round_to_bf16

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # e.g. macOS: the kernels below are defined but never launched
    triton = types.SimpleNamespace(jit=lambda fn: fn, autotune=None, Config=None)
    tl = types.SimpleNamespace(constexpr=None)
    _HAS_TRITON = False

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "flash_attention",
    "flash_attention_varlen",
    "head_dim_supported",
]

SUPPORTED_HEAD_DIMS = "multiples of 8 from 16 to 256 (32, 64, 96, 128 and 256 among them)"
_LOG2E = 1.4426950408889634
_NO_LIMIT = 1 << 30  # a window side that no sequence reaches


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _to_dtype(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """Cast fp32 to the compute dtype, rounding to nearest even also under the interpreter."""
    if INTERPRET and dtype == tl.bfloat16:
        return round_to_bf16(x)
    return x.to(dtype)


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """a @ b + acc with fp32 accumulation. Triton's interpreter multiplies bf16 operands wrongly
    (it has no bf16 arithmetic); there the operands, already bf16 values, are widened first."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _sequence(CU, off_b, seqlen, IS_VARLEN: tl.constexpr):
    """(first row, length) of sequence off_b: from cu_seqlens when packed, else (0, seqlen)."""
    if IS_VARLEN:
        start = tl.load(CU + off_b)
        return start, tl.load(CU + off_b + 1) - start
    return off_b * 0, seqlen  # a tensor, like the packed case's


@triton.jit
def _band(start, seqlen_other, shift, first, last, BLOCK: tl.constexpr, BLOCK_OTHER: tl.constexpr):
    """The runs of BLOCK-sized blocks (aligned to 0) along the other axis that a block of
    BLOCK_OTHER rows starting at `start` must visit, for a band where row r sees columns
    [r + shift - first, r + shift + last] (first/last = _NO_LIMIT when unbounded) within
    [0, seqlen_other). Returns (lo, mid_lo, mid_hi, hi): masked [lo, mid_lo), unmasked
    [mid_lo, mid_hi) (every row of the block sees every column, all in bounds), masked [mid_hi, hi).
    """
    lo = tl.maximum(start + shift - first, 0)
    lo = (lo // BLOCK) * BLOCK
    hi = tl.minimum(start + BLOCK_OTHER + shift + last, seqlen_other)
    hi = tl.maximum(hi, lo)
    # first column every row sees: start + BLOCK_OTHER - 1 + shift - first, rounded up to a block
    mid_lo = tl.maximum(start + BLOCK_OTHER - 1 + shift - first, 0)
    mid_lo = tl.minimum(tl.maximum(((mid_lo + BLOCK - 1) // BLOCK) * BLOCK, lo), hi)
    # one past the last column every row sees, rounded down to a block
    mid_hi = tl.maximum(tl.minimum(start + shift + last + 1, seqlen_other), 0)
    mid_hi = tl.minimum(tl.maximum((mid_hi // BLOCK) * BLOCK, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _fwd_blocks(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    lo,
    hi,
    offs_m,
    offs_d,
    seqlen_k,
    shift,
    left,
    right,
    qk_scale,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d[None, :] < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k_ptrs = k_base + cols[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]
        kv_ok = (cols[:, None] < seqlen_k) & d_ok
        if MASKED:
            k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=d_ok, other=0.0)
        else:
            k = tl.load(k_ptrs)
        qk = _dot(q, tl.trans(k), None, INTERPRET)
        if MASKED:
            rows = offs_m[:, None] + shift
            keep = (cols[None, :] < seqlen_k) & (cols[None, :] >= rows - left)
            keep = keep & (cols[None, :] <= rows + right)
            qk = tl.where(keep, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # a row that has seen no key yet keeps m = -inf; subtract 0 instead (no -inf - -inf)
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            qk = qk - m_sub[:, None]
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_ij
            qk = qk * qk_scale - m_ij[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(v_ptrs, mask=kv_ok, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            v = tl.load(v_ptrs, mask=d_ok, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = _dot(_to_dtype(p, v.dtype, INTERPRET), v, acc, INTERPRET)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    CU_Q,
    CU_K,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_on,
    stride_oh,
    stride_lb,
    stride_lh,
    seqlen_q,
    seqlen_k,
    left,
    right,
    qk_scale,
    num_heads,
    TUNE_N,  # autotune key only: the longest sequence, rounded to a power of two
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if REVERSE:  # causal: the longest rows first, so the last wave is the short ones
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_bh = tl.program_id(1)
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    q_start, seqlen_q = _sequence(CU_Q, off_b, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = _sequence(CU_K, off_b, seqlen_k, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    off_b64 = off_b.to(tl.int64)
    q_base = Q + off_b64 * stride_qb + q_start.to(tl.int64) * stride_qn + off_h * stride_qh
    k_base = (
        K + off_b64 * stride_kb + k_start.to(tl.int64) * stride_kn + (off_h // GROUP) * stride_kh
    )
    v_base = (
        V + off_b64 * stride_vb + k_start.to(tl.int64) * stride_vn + (off_h // GROUP) * stride_vh
    )

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m[:, None] < seqlen_q
    io_mask = row_ok & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=io_mask, other=0.0)

    shift = seqlen_k - seqlen_q
    lo, mid_lo, mid_hi, hi = _band(start_m, seqlen_k, shift, left, right, BLOCK_N, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, lo, mid_lo, offs_m, offs_d,
        seqlen_k, shift, left, right, qk_scale, True, HEAD_DIM, BLOCK_D, BLOCK_N, INTERPRET,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, mid_lo, mid_hi, offs_m, offs_d,
        seqlen_k, shift, left, right, qk_scale, False, HEAD_DIM, BLOCK_D, BLOCK_N, INTERPRET,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, mid_hi, hi, offs_m, offs_d,
        seqlen_k, shift, left, right, qk_scale, True, HEAD_DIM, BLOCK_D, BLOCK_N, INTERPRET,
    )  # fmt: skip

    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(
        seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf")
    )
    o_base = Out + off_b64 * stride_ob + q_start.to(tl.int64) * stride_on + off_h * stride_oh
    tl.store(
        o_base + offs_m[:, None] * stride_on + offs_d[None, :],
        _to_dtype(acc, Out.dtype.element_ty, INTERPRET),
        mask=io_mask,
    )
    lse_base = LSE + off_b64 * stride_lb + off_h * stride_lh + q_start
    tl.store(lse_base + offs_m, lse, mask=offs_m < seqlen_q)


@triton.jit
def _bwd_preprocess_kernel(
    Out,
    DO,
    LSE,
    DELTA,
    LSE2,
    CU_Q,
    stride_ob,
    stride_on,
    stride_oh,
    stride_dob,
    stride_don,
    stride_doh,
    stride_lb,
    stride_lh,
    seqlen_q,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dout * out) and lse2 = lse * log2(e) (+inf for a row that saw no key, so
    that its p = exp2(s - lse2) is 0), fp32, laid out like lse."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    q_start, seqlen_q = _sequence(CU_Q, off_b, seqlen_q, IS_VARLEN)
    if start_m >= seqlen_q:
        return
    off_b64 = off_b.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + offs_m[:, None]).to(tl.int64)
    o = tl.load(
        Out + off_b64 * stride_ob + rows * stride_on + off_h * stride_oh + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    do = tl.load(
        DO + off_b64 * stride_dob + rows * stride_don + off_h * stride_doh + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = off_b64 * stride_lb + off_h * stride_lh + q_start + offs_m
    tl.store(DELTA + row, delta, mask=offs_m < seqlen_q)
    lse = tl.load(LSE + row, mask=offs_m < seqlen_q, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(LSE2 + row, lse, mask=offs_m < seqlen_q)


@triton.jit
def _bwd_dkdv_blocks(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    stride_qn,
    stride_don,
    stride_qh,
    stride_doh,
    stride_lh,
    lo,
    hi,
    offs_n,
    offs_d,
    seqlen_q,
    shift,
    left,
    right,
    qk_scale,
    MASKED: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Accumulate one key block's dk, dv over the query blocks [lo, hi) of the GROUP query
    heads that share it (the *_base pointers are the first head's). Computed transposed (keys x
    queries) so the block's k and v stay the left operands."""
    offs_m0 = tl.arange(0, BLOCK_M)
    d_ok = offs_d[None, :] < HEAD_DIM
    # One counted loop over (head, query block). A strided range(lo, hi, BLOCK_M), or a loop over
    # heads around this one, makes ptxas serialize the wgmma pipeline of the chained loops (C7515:
    # accumulators redefined between stages), which costs ~15% on Hopper.
    num_blocks = tl.cdiv(hi - lo, BLOCK_M)
    for i in range(0, GROUP * num_blocks):
        g = i // num_blocks
        start_m = tl.multiple_of(lo + (i - g * num_blocks) * BLOCK_M, BLOCK_M)
        offs_m = start_m + offs_m0
        row_ok = offs_m < seqlen_q
        q_ptrs = q_base + g * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
        do_ptrs = do_base + g * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :]
        lse_ptrs = lse_base + g * stride_lh + offs_m
        delta_ptrs = delta_base + g * stride_lh + offs_m
        if MASKED:
            q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)
            # rows past the end get lse = +inf, so p = 0 there
            lse = tl.load(lse_ptrs, mask=row_ok, other=float("inf"))
        elif BLOCK_D != HEAD_DIM:
            q = tl.load(q_ptrs, mask=d_ok, other=0.0)
            lse = tl.load(lse_ptrs)
        else:
            q = tl.load(q_ptrs)
            lse = tl.load(lse_ptrs)
        if MASKED:
            do = tl.load(do_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)
            delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            do = tl.load(do_ptrs, mask=d_ok, other=0.0)
            delta = tl.load(delta_ptrs)
        else:
            do = tl.load(do_ptrs)
            delta = tl.load(delta_ptrs)
        # both products first: the tensor cores compute dpT while exp2 runs
        qkT = _dot(k, tl.trans(q), None, INTERPRET)
        dpT = _dot(v, tl.trans(do), None, INTERPRET)
        pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
        if MASKED:
            rows = offs_m[None, :] + shift
            keep = (offs_n[:, None] >= rows - left) & (offs_n[:, None] <= rows + right)
            pT = tl.where(keep, pT, 0.0)
        dv = _dot(_to_dtype(pT, do.dtype, INTERPRET), do, dv, INTERPRET)
        dsT = pT * (dpT - delta[None, :])
        dk = _dot(_to_dtype(dsT, q.dtype, INTERPRET), q, dk, INTERPRET)
    return dk, dv


@triton.jit
def _bwd_dq_blocks(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    lo,
    hi,
    offs_m,
    offs_d,
    seqlen_k,
    shift,
    left,
    right,
    qk_scale,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Accumulate one query block's dq over the key blocks [lo, hi)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d[None, :] < HEAD_DIM
    for i in range(0, tl.cdiv(hi - lo, BLOCK_N)):  # counted: see _bwd_dkdv_blocks
        start_n = tl.multiple_of(lo + i * BLOCK_N, BLOCK_N)
        cols = start_n + offs_n0
        k_ptrs = k_base + cols[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]
        if MASKED:
            kv_ok = (cols[:, None] < seqlen_k) & d_ok
            k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
            v = tl.load(v_ptrs, mask=kv_ok, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=d_ok, other=0.0)
            v = tl.load(v_ptrs, mask=d_ok, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = _dot(q, tl.trans(k), None, INTERPRET)
        dp = _dot(do, tl.trans(v), None, INTERPRET)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASKED:
            rows = offs_m[:, None] + shift
            keep = (cols[None, :] < seqlen_k) & (cols[None, :] >= rows - left)
            keep = keep & (cols[None, :] <= rows + right)
            p = tl.where(keep, p, 0.0)
        ds = p * (dp - delta[:, None])
        dq = _dot(_to_dtype(ds, k.dtype, INTERPRET), k, dq, INTERPRET)
    return dq


@triton.jit
def _bwd_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    DK,
    DV,
    CU_Q,
    CU_K,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_dob,
    stride_don,
    stride_doh,
    stride_dqb,
    stride_dqn,
    stride_dqh,
    stride_dkb,
    stride_dkn,
    stride_dkh,
    stride_dvb,
    stride_dvn,
    stride_dvh,
    stride_lb,
    stride_lh,
    seqlen_q,
    seqlen_k,
    left,
    right,
    qk_scale,
    softmax_scale,
    num_heads_kv,
    TUNE_N,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M1: tl.constexpr,
    BLOCK_N1: tl.constexpr,
    BLOCK_M2: tl.constexpr,
    BLOCK_N2: tl.constexpr,
):
    """Programs [0, num_n_blocks) compute dk, dv of one key block (all GROUP query heads);
    programs [num_n_blocks, num_n_blocks + GROUP * num_m_blocks) compute dq of one query block."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(seqlen_k, BLOCK_N1)  # seqlen_q/k are the longest ones when packed
    num_m_blocks = tl.cdiv(seqlen_q, BLOCK_M2)
    off_bh = tl.program_id(1)
    off_b = off_bh // num_heads_kv
    off_hk = off_bh % num_heads_kv
    q_start, seqlen_q = _sequence(CU_Q, off_b, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = _sequence(CU_K, off_b, seqlen_k, IS_VARLEN)
    off_b64 = off_b.to(tl.int64)
    q_start64 = q_start.to(tl.int64)
    k_start64 = k_start.to(tl.int64)
    shift = seqlen_k - seqlen_q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    lse_b = LSE + off_b64 * stride_lb + q_start
    delta_b = DELTA + off_b64 * stride_lb + q_start
    if pid < num_n_blocks:
        start_n = pid * BLOCK_N1
        if start_n >= seqlen_k:
            return
        offs_n = start_n + tl.arange(0, BLOCK_N1)
        kv_mask = (offs_n[:, None] < seqlen_k) & d_ok
        k_base = K + off_b64 * stride_kb + k_start64 * stride_kn + off_hk * stride_kh
        v_base = V + off_b64 * stride_vb + k_start64 * stride_vn + off_hk * stride_vh
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
        # query rows that see this key block: the band seen from the keys' side
        lo, mid_lo, mid_hi, hi = _band(start_n, seqlen_q, -shift, right, left, BLOCK_M1, BLOCK_N1)
        off_h = off_hk * GROUP  # the group's first query head
        q_base = Q + off_b64 * stride_qb + q_start64 * stride_qn + off_h * stride_qh
        do_base = DO + off_b64 * stride_dob + q_start64 * stride_don + off_h * stride_doh
        lse_base = lse_b + off_h * stride_lh
        delta_base = delta_b + off_h * stride_lh
        dk, dv = _bwd_dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qn, stride_don, stride_qh,
            stride_doh, stride_lh, lo, mid_lo, offs_n, offs_d, seqlen_q, shift, left, right,
            qk_scale, True, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M1, INTERPRET,
        )  # fmt: skip
        dk, dv = _bwd_dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qn, stride_don, stride_qh,
            stride_doh, stride_lh, mid_lo, mid_hi, offs_n, offs_d, seqlen_q, shift, left, right,
            qk_scale, False, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M1, INTERPRET,
        )  # fmt: skip
        dk, dv = _bwd_dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qn, stride_don, stride_qh,
            stride_doh, stride_lh, mid_hi, hi, offs_n, offs_d, seqlen_q, shift, left, right,
            qk_scale, True, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M1, INTERPRET,
        )  # fmt: skip
        dk = dk * softmax_scale
        dk_base = DK + off_b64 * stride_dkb + k_start64 * stride_dkn + off_hk * stride_dkh
        dv_base = DV + off_b64 * stride_dvb + k_start64 * stride_dvn + off_hk * stride_dvh
        tl.store(
            dk_base + offs_n[:, None] * stride_dkn + offs_d[None, :],
            _to_dtype(dk, DK.dtype.element_ty, INTERPRET),
            mask=kv_mask,
        )
        tl.store(
            dv_base + offs_n[:, None] * stride_dvn + offs_d[None, :],
            _to_dtype(dv, DV.dtype.element_ty, INTERPRET),
            mask=kv_mask,
        )
    else:
        pid = pid - num_n_blocks
        g = pid // num_m_blocks
        pid_m = pid % num_m_blocks
        if REVERSE:
            pid_m = num_m_blocks - 1 - pid_m
        start_m = pid_m * BLOCK_M2
        if start_m >= seqlen_q:
            return
        off_h = off_hk * GROUP + g
        offs_m = start_m + tl.arange(0, BLOCK_M2)
        io_mask = (offs_m[:, None] < seqlen_q) & d_ok
        rows = offs_m[:, None] * stride_qn
        q_base = Q + off_b64 * stride_qb + q_start64 * stride_qn + off_h * stride_qh
        do_base = DO + off_b64 * stride_dob + q_start64 * stride_don + off_h * stride_doh
        q = tl.load(q_base + rows + offs_d[None, :], mask=io_mask, other=0.0)
        do = tl.load(
            do_base + offs_m[:, None] * stride_don + offs_d[None, :], mask=io_mask, other=0.0
        )
        row_ok = offs_m < seqlen_q
        lse = tl.load(lse_b + off_h * stride_lh + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_b + off_h * stride_lh + offs_m, mask=row_ok, other=0.0)
        k_base = K + off_b64 * stride_kb + k_start64 * stride_kn + off_hk * stride_kh
        v_base = V + off_b64 * stride_vb + k_start64 * stride_vn + off_hk * stride_vh
        dq = tl.zeros([BLOCK_M2, BLOCK_D], dtype=tl.float32)
        lo, mid_lo, mid_hi, hi = _band(start_m, seqlen_k, shift, left, right, BLOCK_N2, BLOCK_M2)
        dq = _bwd_dq_blocks(
            dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, lo, mid_lo, offs_m,
            offs_d, seqlen_k, shift, left, right, qk_scale, True, HEAD_DIM, BLOCK_D, BLOCK_N2,
            INTERPRET,
        )  # fmt: skip
        dq = _bwd_dq_blocks(
            dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, mid_lo, mid_hi, offs_m,
            offs_d, seqlen_k, shift, left, right, qk_scale, False, HEAD_DIM, BLOCK_D, BLOCK_N2,
            INTERPRET,
        )  # fmt: skip
        dq = _bwd_dq_blocks(
            dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, mid_hi, hi, offs_m,
            offs_d, seqlen_k, shift, left, right, qk_scale, True, HEAD_DIM, BLOCK_D, BLOCK_N2,
            INTERPRET,
        )  # fmt: skip
        dq = dq * softmax_scale
        dq_base = DQ + off_b64 * stride_dqb + q_start64 * stride_dqn + off_h * stride_dqh
        tl.store(
            dq_base + offs_m[:, None] * stride_dqn + offs_d[None, :],
            _to_dtype(dq, DQ.dtype.element_ty, INTERPRET),
            mask=io_mask,
        )


# --------------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------------

# Autotuner candidates per padded head dim, from sweeps on an H100 (bf16, triton 3.6; BLOCK_M 64
# with 4 warps won the forward at every length: two programs share an SM and overlap one's softmax
# with the other's matrix products). Tensor-descriptor (TMA) loads were measured too and lost
# 3-7% in the forward and tied in the backward, so the kernels use plain pointer loads.
# Forward: (BLOCK_M, BLOCK_N, num_warps, num_stages).
_FWD_CONFIGS = {
    32: [(64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3)],
    64: [(64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3)],
    128: [(64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3)],
    256: [(64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (64, 64, 8, 2)],
}
# Backward: (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages); dk/dv programs walk
# query blocks of BLOCK_M1 under a key block of BLOCK_N1, dq programs the converse.
_BWD_CONFIGS = {
    32: [(64, 64, 64, 64, 4, 3), (64, 128, 128, 64, 8, 3), (64, 128, 128, 64, 4, 3)],
    64: [(64, 64, 64, 64, 4, 3), (64, 128, 128, 64, 8, 3), (64, 128, 128, 64, 4, 3)],
    128: [(64, 128, 128, 64, 8, 3), (64, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 4)],
    256: [(32, 64, 64, 32, 4, 2), (64, 64, 64, 64, 8, 2), (32, 64, 64, 32, 8, 2), (16, 64, 64, 16, 4, 2)],
}  # fmt: skip
_INTERPRET_FWD = {"BLOCK_M": 16, "BLOCK_N": 16}
_INTERPRET_BWD = {"BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16}
_TUNE_KEY = ["HEAD_DIM", "BLOCK_D", "GROUP", "IS_VARLEN", "REVERSE", "TUNE_N"]
_tuned: dict[tuple[str, int], object] = {}


def _kernel(kind: str, block_d: int):
    """(kernel, fixed meta-parameters): the autotuned kernel for this padded head dim on GPUs,
    the plain kernel with small fixed blocks under the interpreter."""
    if interpreter_enabled():
        if kind == "fwd":
            return _fwd_kernel, _INTERPRET_FWD
        return _bwd_kernel, _INTERPRET_BWD
    key = (kind, block_d)
    if key not in _tuned:
        table = max(block_d, 32)
        if kind == "fwd":
            configs = [
                triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                for m, n, w, s in _FWD_CONFIGS[table]
            ]
            _tuned[key] = triton.autotune(configs, key=_TUNE_KEY)(_fwd_kernel)
        else:
            configs = [
                triton.Config(
                    {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2},
                    num_warps=w,
                    num_stages=s,
                )
                for m1, n1, m2, n2, w, s in _BWD_CONFIGS[table]
            ]
            _tuned[key] = triton.autotune(configs, key=_TUNE_KEY)(_bwd_kernel)
    return _tuned[key], {}


# --------------------------------------------------------------------------------------------
# Launchers (no validation here: the public functions below validate)
# --------------------------------------------------------------------------------------------


def _layout(t: Tensor) -> tuple[int, int, int]:
    """(batch, row, head) strides of a (batch, seqlen, heads, dim) or packed (tokens, heads, dim)
    tensor; the batch stride of a packed tensor is 0."""
    if t.dim() == 4:
        return t.stride(0), t.stride(1), t.stride(2)
    return 0, t.stride(0), t.stride(1)


def _shape(q: Tensor, k: Tensor, cu_seqlens_q: Tensor | None) -> tuple[int, int, int, int]:
    """(batch, heads_q, heads_kv, head_dim)."""
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
    return batch, q.shape[-2], k.shape[-2], q.shape[-1]


def _tune_n(n: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), 1 << 16)


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right, scale):
    batch, heads, heads_kv, head_dim = _shape(q, k, cu_seqlens_q)
    varlen = cu_seqlens_q is not None
    out = (torch.zeros if varlen else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    lse_shape = (heads, q.shape[0]) if varlen else (batch, heads, q.shape[1])
    lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return out.zero_(), lse
    block_d = max(16, triton.next_power_of_2(head_dim))
    kernel, meta = _kernel("fwd", block_d)
    stride_lse = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))

    def grid(m):
        return (triton.cdiv(max_seqlen_q, m["BLOCK_M"]), batch * heads)

    launch(
        kernel, grid, q.device,
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        *_layout(q), *_layout(k), *_layout(v), *_layout(out), *stride_lse,
        max_seqlen_q, max_seqlen_k, left, right, scale * _LOG2E, heads,
        _tune_n(max(max_seqlen_q, max_seqlen_k)),
        GROUP=heads // heads_kv, HEAD_DIM=head_dim, BLOCK_D=block_d, IS_VARLEN=varlen,
        REVERSE=right < _NO_LIMIT, INTERPRET=interpreter_enabled(), **meta,
    )  # fmt: skip
    return out, lse


def _backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right,
    scale,
):  # fmt: skip
    batch, heads, heads_kv, head_dim = _shape(q, k, cu_seqlens_q)
    varlen = cu_seqlens_q is not None
    alloc = torch.zeros if varlen else torch.empty
    dq = alloc(q.shape, dtype=q.dtype, device=q.device)
    dk = alloc(k.shape, dtype=k.dtype, device=k.device)
    dv = alloc(v.shape, dtype=v.dtype, device=v.device)
    if batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0 or q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    block_d = max(16, triton.next_power_of_2(head_dim))
    interpret = interpreter_enabled()
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    stride_lse = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    pre_block = 16 if interpret else 64
    launch(
        _bwd_preprocess_kernel, (triton.cdiv(max_seqlen_q, pre_block), batch * heads), q.device,
        out, dout, lse, delta, lse2, cu_seqlens_q, *_layout(out), *_layout(dout), *stride_lse,
        max_seqlen_q, heads, HEAD_DIM=head_dim, BLOCK_D=block_d, IS_VARLEN=varlen,
        BLOCK_M=pre_block,
    )  # fmt: skip
    group = heads // heads_kv
    kernel, meta = _kernel("bwd", block_d)

    def grid(m):
        n_blocks = triton.cdiv(max_seqlen_k, m["BLOCK_N1"])
        return (n_blocks + group * triton.cdiv(max_seqlen_q, m["BLOCK_M2"]), batch * heads_kv)

    launch(
        kernel, grid, q.device,
        q, k, v, dout, lse2, delta, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
        *_layout(q), *_layout(k), *_layout(v), *_layout(dout), *_layout(dq), *_layout(dk),
        *_layout(dv), *stride_lse,
        max_seqlen_q, max_seqlen_k, left, right, scale * _LOG2E, scale, heads_kv,
        _tune_n(max(max_seqlen_q, max_seqlen_k)),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, IS_VARLEN=varlen,
        REVERSE=right < _NO_LIMIT, INTERPRET=interpret, **meta,
    )  # fmt: skip
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile (the block around them still compiles), visible to
# selective activation checkpointing by name, differentiable through register_autograd.
# --------------------------------------------------------------------------------------------

_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, int left, int right, float softmax_scale) "
    "-> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int left, int right, "
    "float softmax_scale) -> (Tensor, Tensor, Tensor)"
)


def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args):
    batch, heads, _, _ = _shape(q, k, cu_seqlens_q)
    lse_shape = (heads, q.shape[0]) if cu_seqlens_q is not None else (batch, heads, q.shape[1])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def _backward_fake(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.args = (max_seqlen_q, max_seqlen_k, left, right, scale)
    ctx.mark_non_differentiable(lse)


def _saved_backward(ctx, dout, backward) -> tuple:
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


def _autograd_backward(ctx, dout, dlse):
    return _saved_backward(ctx, dout, torch.ops.memfit.flash_attn_backward)


def _define_ops() -> None:
    if hasattr(torch.ops.memfit, "flash_attn_forward"):  # module imported twice (tests)
        return
    fwd = torch.library.custom_op(
        "memfit::flash_attn_forward", mutates_args=(), schema=_FWD_SCHEMA
    )(_forward)
    fwd.register_fake(_forward_fake)
    fwd.register_autograd(_autograd_backward, setup_context=_setup_context)
    bwd = torch.library.custom_op(
        "memfit::flash_attn_backward", mutates_args=(), schema=_BWD_SCHEMA
    )(_backward)
    bwd.register_fake(_backward_fake)


_define_ops()


class _FlashAttention(torch.autograd.Function):
    """The same forward and backward as the ops above, called directly: the eager fast path.
    torch.library's Python wrappers cost ~1 ms of host time per forward+backward on torch 2.11
    (more than the kernels at 1-2k tokens); this costs what the launches cost."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _saved_backward(ctx, dout, _backward)


def _attend(q, k, v, cu_seqlens_q, cu_seqlens_k, *args) -> tuple[Tensor, Tensor]:
    """(out, lse) through the registered op where something must see it (torch.compile, a
    dispatch mode such as selective checkpointing or fake tensors, tensor subclasses), else
    through _FlashAttention."""
    direct = (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and type(q) is Tensor
        and type(k) is Tensor
        and type(v) is Tensor
    )
    if direct:
        return _FlashAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)
    return torch.ops.memfit.flash_attn_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention softmax(q k^T * scale + mask) v without the (seqlen_q, seqlen_k) matrix.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    heads_q a multiple of heads_kv (GQA/MQA: K and V are read per group, never repeated); fp16
    or bf16, on CUDA. Returns out like q, and with return_lse=True also the fp32 log-sum-exp of
    each row's scores, (batch, heads_q, seqlen_q) (-inf for a row that sees no key; not
    differentiable).

    causal: query i sees keys up to i + seqlen_k - seqlen_q (aligned bottom-right).
    window=(left, right): the query at aligned position p sees keys p-left .. p+right (None or -1
    for no limit on that side); with causal, right is 0. Mistral's sliding window W is
    window=(W - 1, 0). softmax_scale defaults to head_dim ** -0.5.
    """
    _check(q, k, v, packed=False)
    left, right = _window(window, causal)
    scale = _scale(softmax_scale, q.shape[-1])
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    out, lse = _attend(q, k, v, None, None, q.shape[1], k.shape[1], left, right, scale)
    return (out, lse) if return_lse else out


def flash_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """`flash_attention` over packed sequences of different lengths; no token attends across a
    boundary.

    q: (total_q, heads_q, head_dim), k, v: (total_k, heads_kv, head_dim); sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v
    (int32, batch + 1 entries starting at 0). max_seqlen_q/k: the longest sequences (computed
    from cu_seqlens, with a device sync, when not given). lse: (heads_q, total_q).
    """
    _check(q, k, v, packed=True)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
            raise ValueError(
                f"{name} must be a 1-D int32 tensor of cumulative lengths, got {_describe(cu)}"
            )
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
        if cu.numel() < 1:
            raise ValueError(f"{name} needs batch + 1 >= 1 entries, got none")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.numel()} entries and cu_seqlens_k "
            f"{cu_seqlens_k.numel()}: both need batch + 1"
        )
    if max_seqlen_q is None:
        max_seqlen_q = _longest(cu_seqlens_q)
    if max_seqlen_k is None:
        max_seqlen_k = _longest(cu_seqlens_k)
    left, right = _window(window, causal)
    scale = _scale(softmax_scale, q.shape[-1])
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    out, lse = _attend(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right, scale
    )
    return (out, lse) if return_lse else out


def _longest(cu_seqlens: Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def _describe(t) -> str:
    if not isinstance(t, Tensor):
        return type(t).__name__
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def _check(q, k, v, *, packed: bool) -> None:
    dims = 3 if packed else 4
    layout = "(tokens, heads, head_dim)" if packed else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D tensor {layout}, got {_describe(t)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"flash_attention takes float16 or bfloat16, got {q.dtype} (under autocast the "
            "projections already return bf16; for fp32 use memfit.functional.attention)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if not _HAS_TRITON:
        raise ValueError("flash_attention needs triton, which is not installed")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and _triton._cpu_requested):
        raise ValueError(
            f"flash_attention runs on CUDA tensors, got {q.device} (on CPU use "
            "memfit.functional.attention with backend='sdpa')"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]} but k and v have {k.shape[0]}")
    head_dim, heads_q, heads_kv = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but k and v have {k.shape[-1]}")
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv}")
    if not head_dim_supported(head_dim):
        raise ValueError(f"head_dim={head_dim} is not supported: {SUPPORTED_HEAD_DIMS}")


def head_dim_supported(head_dim: int) -> bool:
    return head_dim % 8 == 0 and 16 <= head_dim <= 256


def _window(window, causal: bool) -> tuple[int, int]:
    if window is None:
        left = right = None
    else:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(f"window must be (left, right) or None, got {window!r}") from None
    sides = []
    for name, side in (("left", left), ("right", right)):
        if side is None or side == -1:
            sides.append(_NO_LIMIT)
        elif isinstance(side, int) and not isinstance(side, bool) and side >= 0:
            sides.append(min(side, _NO_LIMIT))
        else:
            raise ValueError(f"window {name} must be an int >= 0, -1 or None, got {side!r}")
    if causal:
        sides[1] = 0
    return sides[0], sides[1]


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    if not isinstance(softmax_scale, (int, float)) or not (
        math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(softmax_scale)


def _unit_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
