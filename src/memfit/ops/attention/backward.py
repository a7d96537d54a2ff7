"""The FlashAttention backward kernels (see the package docstring): delta = rowsum(dout * out),
then one launch whose programs accumulate either one key/value block's dk and dv (over every
query head of its GQA group, no atomics) or one query block's dq."""

from memfit.ops._triton import tl, triton
from memfit.ops.attention.tiles import (
    _band,
    _dot,
    _load_rows,
    _load_tile,
    _sequence,
    _to_dtype,
)


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
        q = _load_tile(q_ptrs, row_ok, d_ok, MASKED, HEAD_DIM, BLOCK_D)
        # rows past the end get lse = +inf, so p = 0 there
        lse = _load_rows(lse_ptrs, row_ok, float("inf"), MASKED)
        do = _load_tile(do_ptrs, row_ok, d_ok, MASKED, HEAD_DIM, BLOCK_D)
        delta = _load_rows(delta_ptrs, row_ok, 0.0, MASKED)
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
        col_ok = cols < seqlen_k
        k = _load_tile(k_ptrs, col_ok, d_ok, MASKED, HEAD_DIM, BLOCK_D)
        v = _load_tile(v_ptrs, col_ok, d_ok, MASKED, HEAD_DIM, BLOCK_D)
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
    TUNE_W,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr,
    MERGE: tl.constexpr,
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
        if MERGE:  # a narrow band: one masked loop (the forward's MERGE)
            dk, dv = _bwd_dkdv_blocks(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qn, stride_don,
                stride_qh, stride_doh, stride_lh, lo, hi, offs_n, offs_d, seqlen_q, shift, left,
                right, qk_scale, True, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M1, INTERPRET,
            )  # fmt: skip
        else:
            dk, dv = _bwd_dkdv_blocks(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qn, stride_don,
                stride_qh, stride_doh, stride_lh, lo, mid_lo, offs_n, offs_d, seqlen_q, shift,
                left, right, qk_scale, True, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M1, INTERPRET,
            )  # fmt: skip
            dk, dv = _bwd_dkdv_blocks(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qn, stride_don,
                stride_qh, stride_doh, stride_lh, mid_lo, mid_hi, offs_n, offs_d, seqlen_q, shift,
                left, right, qk_scale, False, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M1, INTERPRET,
            )  # fmt: skip
            dk, dv = _bwd_dkdv_blocks(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qn, stride_don,
                stride_qh, stride_doh, stride_lh, mid_hi, hi, offs_n, offs_d, seqlen_q, shift,
                left, right, qk_scale, True, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M1, INTERPRET,
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
        if MERGE:
            dq = _bwd_dq_blocks(
                dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, lo, hi, offs_m,
                offs_d, seqlen_k, shift, left, right, qk_scale, True, HEAD_DIM, BLOCK_D, BLOCK_N2,
                INTERPRET,
            )  # fmt: skip
        else:
            dq = _bwd_dq_blocks(
                dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, lo, mid_lo, offs_m,
                offs_d, seqlen_k, shift, left, right, qk_scale, True, HEAD_DIM, BLOCK_D, BLOCK_N2,
                INTERPRET,
            )  # fmt: skip
            dq = _bwd_dq_blocks(
                dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, mid_lo, mid_hi,
                offs_m, offs_d, seqlen_k, shift, left, right, qk_scale, False, HEAD_DIM, BLOCK_D,
                BLOCK_N2, INTERPRET,
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
