"""The FlashAttention forward kernel (see the package docstring for the algorithm): a program
owns BLOCK_M query rows of one (sequence, head) and walks the key/value blocks of its band with
the online softmax, writing out and the log-sum-exp."""

from memfit.ops._triton import tl, triton
from memfit.ops.attention.tiles import _band, _dot, _load_tile, _sequence, _to_dtype


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
        col_ok = cols < seqlen_k
        k = _load_tile(k_ptrs, col_ok, d_ok, MASKED, HEAD_DIM, BLOCK_D)
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
        v = _load_tile(v_ptrs, col_ok, d_ok, MASKED, HEAD_DIM, BLOCK_D)
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
    TUNE_W,  # autotune key only: the band's width (launch._tune_w)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr,
    MERGE: tl.constexpr,
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
    if MERGE:  # a narrow band: one masked loop, pipelined across all its blocks
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, lo, hi, offs_m, offs_d,
            seqlen_k, shift, left, right, qk_scale, True, HEAD_DIM, BLOCK_D, BLOCK_N, INTERPRET,
        )  # fmt: skip
    else:
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, lo, mid_lo, offs_m, offs_d,
            seqlen_k, shift, left, right, qk_scale, True, HEAD_DIM, BLOCK_D, BLOCK_N, INTERPRET,
        )  # fmt: skip
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, mid_lo, mid_hi, offs_m,
            offs_d, seqlen_k, shift, left, right, qk_scale, False, HEAD_DIM, BLOCK_D, BLOCK_N,
            INTERPRET,
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
