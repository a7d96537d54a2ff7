"""Launch configurations (autotuned per head dim on GPUs, fixed small blocks under the
interpreter) and the launchers of the forward and backward kernels: allocate, grid, launch.
No validation here: the public functions of `interface.py` validate."""

import torch
from torch import Tensor

from memfit.ops._triton import interpreter_enabled, launch, triton
from memfit.ops.attention.backward import _bwd_kernel, _bwd_preprocess_kernel
from memfit.ops.attention.forward import _fwd_kernel
from memfit.ops.attention.tiles import NO_LIMIT

LOG2E = 1.4426950408889634

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
# A narrow band (a sliding window of at most NARROW_BAND keys, launch._tune_w) takes only the
# candidates whose tiles are at most 64 on each side: a tile of 128 rows walks 128 more keys of
# the band's edges per row. On an H100 (window 512, 16k, head dim 128) the 64 x 64 forward took
# 0.24 ms against 0.29-0.48 for the others, the 64-tile backward 0.73 against 0.80-1.04, and
# the autotuner's timings, a few hundred microseconds each, did not always pick them. Wider
# windows (where the edges are a smaller part of the band) are tuned among every candidate but
# _NARROW_ONLY's: a backward whose dk/dv programs walk query blocks of 32 (and dq programs key
# blocks of 32) wastes half as many rows at a band's edges, 0.70-0.73 ms against 0.70-0.74 for
# the 64-tile one there (H100, merged loops: MERGE_BAND), and is for narrow bands alone.
NARROW_BAND = 512
_NARROW_ONLY = {128: [(32, 64, 64, 32, 4, 3)]}
_INTERPRET_FWD = {"BLOCK_M": 16, "BLOCK_N": 16}
_INTERPRET_BWD = {"BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16}
_TUNE_KEY = ["HEAD_DIM", "BLOCK_D", "GROUP", "IS_VARLEN", "REVERSE", "TUNE_N", "TUNE_W"]
_tuned: dict[tuple[str, int], object] = {}


def _key(config) -> tuple:
    """A candidate as the tuples of _FWD_CONFIGS / _BWD_CONFIGS write it."""
    blocks = [v for k, v in config.kwargs.items() if k.startswith("BLOCK")]
    return (*blocks, config.num_warps, config.num_stages)


def _narrow_band_configs(configs, named_args, **kwargs):
    """The autotuner's pruning (NARROW_BAND): for a narrow band, the candidates with tiles of
    at most 64 (all of them when none has); for anything else, all but _NARROW_ONLY's."""
    band = named_args.get("TUNE_W", kwargs.get("TUNE_W", 0))
    narrow_only = {key for keys in _NARROW_ONLY.values() for key in keys}
    if not 0 < band <= NARROW_BAND:
        return [c for c in configs if _key(c) not in narrow_only] or configs
    small = [
        c for c in configs if max(v for k, v in c.kwargs.items() if k.startswith("BLOCK")) <= 64
    ]
    return small or configs


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
            _tuned[key] = triton.autotune(
                configs,
                key=_TUNE_KEY,
                prune_configs_by={"early_config_prune": _narrow_band_configs},
            )(_fwd_kernel)
        else:
            configs = [
                triton.Config(
                    {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2},
                    num_warps=w,
                    num_stages=s,
                )
                for m1, n1, m2, n2, w, s in _BWD_CONFIGS[table] + _NARROW_ONLY.get(table, [])
            ]
            _tuned[key] = triton.autotune(
                configs,
                key=_TUNE_KEY,
                prune_configs_by={"early_config_prune": _narrow_band_configs},
            )(_bwd_kernel)
    return _tuned[key], {}


_best: dict[tuple, dict] = {}


def _launch_tuned(kind: str, block_d: int, grid, device, args: tuple, key: tuple, meta: dict):
    """Launch the autotuned kernel: its first call per `key` (the autotune key's values and the
    dtype) tunes it; later calls launch the tuned configuration directly, without the
    autotuner's per-call work over every argument (a noticeable part of a call's host time
    when the kernels are short)."""
    kernel, fixed = _kernel(kind, block_d)
    if fixed:  # (the interpreter: fixed small blocks, nothing tuned)
        launch(kernel, grid, device, *args, **fixed, **meta)
        return
    key = (kind, block_d, *key, *sorted(meta.items()))
    config = _best.get(key)
    if config is None:
        launch(kernel, grid, device, *args, **meta)
        _best[key] = kernel.best_config.all_kwargs()
    else:
        launch(kernel.fn, grid, device, *args, **meta, **config)


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


def _tune_w(left: int, right: int, seqlen_k: int) -> int:
    """The autotune key's band: the keys a query row may see under a sliding window narrower
    than the sequence, rounded like TUNE_N (0 without one): a window's tiles are tuned apart
    from dense attention's at the same length (NARROW_BAND)."""
    width = left + right + 1
    return _tune_n(width) if width < seqlen_k else 0


MERGE_BAND = True


def _merge(tune_w: int) -> bool:
    """Whether the kernels walk a narrow band (NARROW_BAND) in one masked loop instead of three
    (masked edge, unmasked middle, masked edge): with a band of a few blocks, each loop's
    software pipeline starts and drains for one or two blocks."""
    return MERGE_BAND and 0 < tune_w <= NARROW_BAND


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right, scale):
    batch, heads, heads_kv, head_dim = _shape(q, k, cu_seqlens_q)
    varlen = cu_seqlens_q is not None
    out = (torch.zeros if varlen else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    lse_shape = (heads, q.shape[0]) if varlen else (batch, heads, q.shape[1])
    # (every row's lse is written but for packed rows past cu_seqlens_q[-1]: -inf there)
    if varlen:
        lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    block_d = max(16, triton.next_power_of_2(head_dim))
    stride_lse = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    tune = (_tune_n(max(max_seqlen_q, max_seqlen_k)), _tune_w(left, right, max_seqlen_k))

    def grid(m):
        return (triton.cdiv(max_seqlen_q, m["BLOCK_M"]), batch * heads)

    args = (
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        *_layout(q), *_layout(k), *_layout(v), *_layout(out), *stride_lse,
        max_seqlen_q, max_seqlen_k, left, right, scale * LOG2E, heads, *tune,
    )  # fmt: skip
    meta = dict(
        GROUP=heads // heads_kv, HEAD_DIM=head_dim, BLOCK_D=block_d, IS_VARLEN=varlen,
        REVERSE=right < NO_LIMIT, MERGE=_merge(tune[1]), INTERPRET=interpreter_enabled(),
    )  # fmt: skip
    _launch_tuned("fwd", block_d, grid, q.device, args, (*tune, q.dtype), meta)
    return out, lse


def delta_and_lse2(
    out: Tensor, dout: Tensor, lse: Tensor, cu_seqlens_q: Tensor | None, max_seqlen_q: int,
    batch: int, heads: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The backward's first kernel: delta = rowsum(dout * out) and lse2 = lse * log2(e), laid
    out like lse (the block-sparse backward's too)."""
    varlen = cu_seqlens_q is not None
    head_dim = out.shape[-1]
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    stride_lse = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    block = 16 if interpreter_enabled() else 64
    launch(
        _bwd_preprocess_kernel, (triton.cdiv(max_seqlen_q, block), batch * heads), out.device,
        out, dout, lse, delta, lse2, cu_seqlens_q, *_layout(out), *_layout(dout), *stride_lse,
        max_seqlen_q, heads, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), IS_VARLEN=varlen, BLOCK_M=block,
    )  # fmt: skip
    return delta, lse2


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
    delta, lse2 = delta_and_lse2(out, dout, lse, cu_seqlens_q, max_seqlen_q, batch, heads)
    stride_lse = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    group = heads // heads_kv
    tune = (_tune_n(max(max_seqlen_q, max_seqlen_k)), _tune_w(left, right, max_seqlen_k))

    def grid(m):
        n_blocks = triton.cdiv(max_seqlen_k, m["BLOCK_N1"])
        return (n_blocks + group * triton.cdiv(max_seqlen_q, m["BLOCK_M2"]), batch * heads_kv)

    args = (
        q, k, v, dout, lse2, delta, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
        *_layout(q), *_layout(k), *_layout(v), *_layout(dout), *_layout(dq), *_layout(dk),
        *_layout(dv), *stride_lse,
        max_seqlen_q, max_seqlen_k, left, right, scale * LOG2E, scale, heads_kv, *tune,
    )  # fmt: skip
    meta = dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, IS_VARLEN=varlen,
        REVERSE=right < NO_LIMIT, MERGE=_merge(tune[1]), INTERPRET=interpret,
    )  # fmt: skip
    _launch_tuned("bwd", block_d, grid, q.device, args, (*tune, q.dtype, dout.dtype), meta)
    return dq, dk, dv
