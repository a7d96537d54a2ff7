"""Block-sparse FlashAttention (memfit.ops.attention.block_sparse) under Triton's interpreter
against a dense masked reference: every pattern, odd lengths, GQA, a padded head dim, outputs
and dq, dk, dv within 2x of PyTorch's own error in the same precision against fp64; a row that
sees only itself; a row that sees nothing (zero output, no NaN); bitwise reruns."""

import pytest
import torch

from memfit.ops._triton import HAS_TRITON, triton_on_cpu
from memfit.ops.attention import sparse
from memfit.ops.attention.block_sparse import _dense, sparse_attention, sparse_attention_varlen

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
BLOCK = 16
PATTERNS = {
    "local": (sparse.local(20), 77),
    # (a length every tile divides)
    "local, whole tiles": (sparse.local(20), 96),
    "longformer, whole tiles": (sparse.longformer(8, [0, 41]), 64),
    "local bidirectional": (sparse.local(9, causal=False), 77),
    "strided": (sparse.strided(12), 77),
    "longformer": (sparse.longformer(8, [0, 41]), 77),
    "bigbird causal": (sparse.bigbird(8, [0, 30], 1, block=BLOCK, seed=2, causal=True), 77),
    "dilated": (sparse.dilated(4, window=6), 80),
    "only itself": (sparse.local(1), 40),
    "bigbird per head": (sparse.bigbird(8, [0], 2, block=BLOCK, seed=4, heads=4), 77),
    # (random blocks of 2 x 2 tiles)
    "bigbird in larger blocks": (sparse.bigbird(8, [0], 1, block=2 * BLOCK, seed=5), 77),
    "user layout per head": (
        sparse.from_blocks(
            torch.stack(
                [
                    torch.eye(5, dtype=torch.int64).roll(h, 1) | torch.eye(5, dtype=torch.int64)
                    for h in range(4)
                ]
            ),
            block=BLOCK,
            causal=True,
        ),
        77,
    ),  # fmt: skip
}


def inputs(dtype, seqlen, heads=4, heads_kv=2, dim=24, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seqlen, heads_kv, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seqlen, heads_kv, dim, generator=g, dtype=torch.float64)
    grad = torch.randn(batch, seqlen, heads, dim, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], grad.to(dtype)


def run(fn, tensors, grad):
    out = fn(*tensors)
    return [out, *torch.autograd.grad(out, tensors, grad)]


def max_error(got, truth):
    return (got.double() - truth).abs().max().item()


CASES = [(name, dtype) for name in PATTERNS for dtype in (torch.float32, torch.bfloat16)] + [
    ("longformer", torch.float16),
    ("bigbird causal", torch.float16),
]


@pytest.mark.parametrize(
    "name, dtype", CASES, ids=[f"{name}-{str(dtype)[6:]}" for name, dtype in CASES]
)
def test_matches_the_dense_masked_reference(name, dtype):
    pattern, seqlen = PATTERNS[name]
    mask = sparse.dense_mask(pattern, seqlen, pattern.block or BLOCK)
    scale = 24**-0.5
    low, grad = inputs(dtype, seqlen)
    exact = [t.detach().double().requires_grad_() for t in low]  # (the same rounded values)
    truth = run(lambda q, k, v: _dense(q, k, v, mask, scale), exact, grad.double())
    pytorchs = run(lambda q, k, v: _dense_same_precision(q, k, v, mask, scale), low, grad)
    with triton_on_cpu():
        ours = run(lambda q, k, v: sparse_attention(q, k, v, pattern, block=BLOCK), low, grad)
    for what, mine, theirs, exact in zip(
        ("out", "dq", "dk", "dv"), ours, pytorchs, truth, strict=True
    ):
        assert mine.dtype == dtype and torch.isfinite(mine).all(), what
        # (a floor for gradients that are exactly 0, as dk of a row that sees only itself, where
        # delta = rowsum(dout * out) rounds differently than the product it cancels)
        floor = {torch.float32: 1e-5, torch.float16: 1e-4}.get(dtype, 1e-3)
        assert max_error(mine, exact) <= 2 * max_error(theirs, exact) + floor, what


def _dense_same_precision(q, k, v, mask, scale):
    """PyTorch's attention in the inputs' precision (the error to stay within 2x of)."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores.float(), -1).to(q.dtype), v)


def test_a_row_that_sees_nothing_gets_zeros_and_no_gradient():
    blocks = torch.tensor([[1, 0, 0], [0, 0, 0], [1, 1, 1]])
    pattern = sparse.from_blocks(blocks, block=BLOCK)
    (q, k, v), grad = inputs(torch.float32, 40)
    with triton_on_cpu():
        out = sparse_attention(q, k, v, pattern, block=BLOCK)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert not out[:, 16:32].any() and not dq[:, 16:32].any()
    reference = _dense(q, k, v, sparse.dense_mask(pattern, 40, BLOCK), 24**-0.5)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_reruns_are_bitwise_equal():
    pattern = sparse.bigbird(8, [0, 30], 1, block=BLOCK, seed=2)
    tensors, grad = inputs(torch.bfloat16, 77)
    with triton_on_cpu():
        first = run(lambda q, k, v: sparse_attention(q, k, v, pattern, block=BLOCK), tensors, grad)
        second = run(lambda q, k, v: sparse_attention(q, k, v, pattern, block=BLOCK), tensors, grad)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_bad_shapes_say_what_is_wrong():
    (q, k, v), _ = inputs(torch.float32, 32)
    with pytest.raises(ValueError, match="dilation 3 does not divide the sequence length 32"):
        sparse_attention(q, k, v, sparse.dilated(3), block=BLOCK)
    with pytest.raises(ValueError, match="heads_kv dividing its 4 heads"):
        sparse_attention(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1),
                         sparse.local(4), block=BLOCK)  # fmt: skip
    with pytest.raises(ValueError, match=r"window \(39, 0\) reaches past the sequence"):
        sparse_attention(q, k, v, sparse.local(40), block=BLOCK)


@pytest.mark.parametrize(
    "pattern",
    [sparse.longformer(8, [0, 20]), sparse.bigbird(8, [3], 1, block=BLOCK, seed=5, causal=True)],
    ids=["longformer", "bigbird causal"],
)
def test_packed_sequences_each_walk_the_layout_from_their_start(pattern):
    """Three packed sequences (37, 64 and 21 tokens): each equals its own batched run, and
    nothing crosses a boundary (the gradients of one sequence ignore the others)."""
    lengths = [37, 64, 21]
    cu = torch.tensor([0, 37, 101, 122], dtype=torch.int32)
    (q, k, v), grad = inputs(torch.float32, 122, batch=1)
    packed = [t[0].detach().requires_grad_() for t in (q, k, v)]
    with triton_on_cpu():
        ours = run(lambda q, k, v: sparse_attention_varlen(q, k, v, cu, pattern, block=BLOCK),
                   packed, grad[0])  # fmt: skip
    mask = sparse.dense_mask(pattern, 64, BLOCK)
    for (a, b), n in zip(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True), lengths, strict=True):
        piece = [t[a:b][None].detach().double().requires_grad_() for t in packed]
        out = _dense(*piece, mask[:n, :n], 24**-0.5)
        want = [out, *torch.autograd.grad(out, piece, grad[0, a:b][None].double())]
        for got, expected in zip(ours, want, strict=True):
            torch.testing.assert_close(got[a:b].double(), expected[0], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "name",
    ["local", "local, layout kernels", "strided", "longformer", "bigbird", "bigbird 128",
     "dilated", "dilated, layout kernels"],
)  # fmt: skip
@pytest.mark.parametrize("n", [2000, 2048])
def test_on_cuda_against_the_dense_reference(name, n, monkeypatch):
    """The GPU twin: compiled kernels at 64-token tiles (BigBird's 128-token blocks split into
    them), head dim 128, bf16, 2 sequences of 2000 tokens (a partial last tile) or 2048,
    within 2x of PyTorch's bf16 error against fp64. A band alone runs memfit's FlashAttention
    with its window; "layout kernels": the block-sparse kernels instead."""
    from memfit.ops.attention import block_sparse

    if name.endswith("layout kernels"):
        monkeypatch.setattr(block_sparse, "BAND_TO_FLASH", False)
        name = name.split(",")[0]
    pattern = {
        "local": sparse.local(256),
        "strided": sparse.strided(128),
        "longformer": sparse.longformer(128, [0, 1000]),
        "bigbird": sparse.bigbird(128, [0], 2, block=64, seed=1),
        "bigbird 128": sparse.bigbird(128, [0], 2, block=128, seed=1, causal=True),
        "dilated": sparse.dilated(4, window=100),
    }[name]
    mask = sparse.dense_mask(pattern, n).cuda()
    low, grad = inputs(torch.bfloat16, n, heads=8, heads_kv=2, dim=128)
    low = [t.detach().cuda().requires_grad_() for t in low]
    grad = grad.cuda()
    exact = [t.detach().double().requires_grad_() for t in low]
    truth = run(lambda q, k, v: _dense(q, k, v, mask, 128**-0.5), exact, grad.double())
    pytorchs = run(lambda q, k, v: _dense_same_precision(q, k, v, mask, 128**-0.5), low, grad)
    ours = run(lambda q, k, v: sparse_attention(q, k, v, pattern), low, grad)
    for what, mine, theirs, want in zip(
        ("out", "dq", "dk", "dv"), ours, pytorchs, truth, strict=True
    ):
        assert torch.isfinite(mine).all(), what
        assert max_error(mine, want) <= 2 * max_error(theirs, want) + 1e-3, what
    again = run(lambda q, k, v: sparse_attention(q, k, v, pattern), low, grad)
    assert all(torch.equal(a, b) for a, b in zip(ours, again, strict=True))


def test_under_torch_compile_the_kernels_run(monkeypatch):
    """A compiled caller (torch.compile, here with the eager backend) still runs the kernels,
    left out of the graph, not the dense fallback."""
    from memfit.ops.attention import block_sparse

    calls = []
    forward = block_sparse._forward
    monkeypatch.setattr(block_sparse, "_forward", lambda *a: calls.append(1) or forward(*a))
    pattern = sparse.longformer(8, [0])
    (q, k, v), _ = inputs(torch.float32, 40)
    with triton_on_cpu():
        compiled = torch.compile(
            lambda q, k, v: sparse_attention(q, k, v, pattern), backend="eager"
        )
        out = compiled(q, k, v)
    assert calls
    reference = _dense(q, k, v, sparse.dense_mask(pattern, 40, BLOCK), 24**-0.5)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_a_patterns_own_tile_size_is_used():
    """bigbird(block=32): the layout's tiles are the pattern's, without a `block` argument."""
    pattern = sparse.bigbird(8, [0], 1, block=32, seed=1)
    (q, k, v), grad = inputs(torch.float32, 77)
    with triton_on_cpu():
        out = sparse_attention(q, k, v, pattern)
    reference = _dense(q, k, v, sparse.dense_mask(pattern, 77), 24**-0.5)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_packed_sequences_with_a_layout_per_head_on_the_plain_path():
    pattern = sparse.bigbird(8, [0], 1, block=BLOCK, seed=3, heads=4)
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    (q, k, v), _ = inputs(torch.float32, 70, batch=1)
    out = sparse_attention_varlen(q[0], k[0], v[0], cu, pattern, block=BLOCK)
    mask = sparse.dense_mask(pattern, 40, BLOCK)
    first = _dense(q[:, :30], k[:, :30], v[:, :30], mask[..., :30, :30], 24**-0.5)[0]
    torch.testing.assert_close(out[:30], first)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_subsequences_run_flash_attention(monkeypatch, causal):
    """A dilated pattern without a window (dense attention on each subsequence), in bf16, runs
    memfit.flash_attention where its subsequences are long enough (DENSE_TO_FLASH, here 16
    tokens) and gives what the block-sparse kernels give; a windowed one is no dense one."""
    from memfit.ops.attention import block_sparse

    pattern, seqlen = sparse.dilated(4, causal=causal), 80
    monkeypatch.setattr(block_sparse, "DENSE_TO_FLASH", 16)
    calls = []
    forward = block_sparse._forward
    monkeypatch.setattr(block_sparse, "_forward", lambda *a: calls.append(1) or forward(*a))
    low, grad = inputs(torch.bfloat16, seqlen)
    with triton_on_cpu():
        flash = run(lambda q, k, v: sparse_attention(q, k, v, pattern, block=BLOCK), low, grad)
        assert not calls
        monkeypatch.setattr(block_sparse, "DENSE_TO_FLASH", 21)  # (subsequences of 20)
        kernels = run(lambda q, k, v: sparse_attention(q, k, v, pattern, block=BLOCK), low, grad)
        assert calls
    for a, b in zip(flash, kernels, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert not block_sparse._dense_subsequences(sparse.dilated(4, window=6))
    assert not block_sparse._dense_subsequences(sparse.local(20))
    one_side = sparse.Pattern(causal=False, window=(sparse.NO_LIMIT, 3))  # (bounded on the right)
    assert not block_sparse._dense_subsequences(one_side)


def test_a_forward_without_backward_builds_only_its_layout():
    """The backward's layouts are built when a backward runs, not by every forward."""
    from memfit.ops.attention import block_sparse

    pattern = sparse.longformer(8, [3])
    (q, k, v), grad = inputs(torch.float32, 61)
    sparse._block_layout.cache_clear()
    block_sparse._backward_tiles.cache_clear()
    with triton_on_cpu(), torch.no_grad():
        sparse_attention(q, k, v, pattern, block=BLOCK)
    assert sparse._block_layout.cache_info().currsize == 1
    with triton_on_cpu():
        run(lambda q, k, v: sparse_attention(q, k, v, pattern, block=BLOCK), [q, k, v], grad)
    assert sparse._block_layout.cache_info().currsize > 1


def test_a_tile_that_is_not_a_power_of_two_is_refused():
    (q, k, v), _ = inputs(torch.float32, 96)
    with pytest.raises(ValueError, match="the tile size must be a power of two >= 16, got 40"):
        with triton_on_cpu():
            sparse_attention(q, k, v, sparse.bigbird(8, [0], 1, block=40))


def test_the_backward_widens_its_tiles_where_that_adds_little_work():
    """dq and dk/dv programs take 2x-wide tiles unless those multiply many more pairs: a
    strided pattern's dk/dv stays square (each summary column would cost a 2x-wide key tile)."""
    from memfit.ops.attention.block_sparse import _backward_tiles

    eye = torch.eye(8, dtype=torch.int64)
    blocks = sparse.from_blocks(eye | eye.roll(1, 0), block=32)  # (wider tiles: no extra pair)
    assert _backward_tiles(blocks, 256, 16, 2, 1.15) == ((32, 16), (16, 32))
    assert _backward_tiles(sparse.strided(64, window=8), 256, 16, 2, 1.15)[1] == (16, 16)
    assert _backward_tiles(sparse.bigbird(8, [0], 1, block=16), 256, 16, 2, 1.15) == (
        (16, 16),
        (16, 16),
    )


def test_a_band_alone_runs_flash_attention_with_its_window(monkeypatch):
    """In bf16 a band and nothing else (local, bidirectional, dilated with a window; batched or
    packed) runs memfit.flash_attention with the pattern's window and gives what the
    block-sparse kernels give; fp32, a head dim or softmax scale FlashAttention refuses, a band
    with more (strided columns) and BAND_TO_FLASH = False run the kernels."""
    from memfit.ops.attention import block_sparse

    calls = []
    forward = block_sparse._forward
    monkeypatch.setattr(block_sparse, "_forward", lambda *a: calls.append(1) or forward(*a))

    def kernels_ran(fn, tensors, grad):
        calls.clear()
        result = run(fn, tensors, grad)
        return bool(calls), result

    with triton_on_cpu():
        for pattern, seqlen in ((sparse.local(20), 77), (sparse.local(9, causal=False), 77),
                                (sparse.dilated(4, window=6), 80)):  # fmt: skip
            low, grad = inputs(torch.bfloat16, seqlen, dim=32)
            ran, flash = kernels_ran(
                lambda q, k, v, p=pattern: sparse_attention(q, k, v, p), low, grad
            )
            assert not ran, pattern
            monkeypatch.setattr(block_sparse, "BAND_TO_FLASH", False)
            ran, layout = kernels_ran(
                lambda q, k, v, p=pattern: sparse_attention(q, k, v, p), low, grad
            )
            monkeypatch.setattr(block_sparse, "BAND_TO_FLASH", True)
            assert ran, pattern
            for a, b in zip(flash, layout, strict=True):
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        # packed sequences
        lengths = [37, 64, 21]
        cu = torch.tensor([0, 37, 101, 122], dtype=torch.int32)
        (q, k, v), grad = inputs(torch.bfloat16, sum(lengths), batch=1, dim=32)
        packed = [t[0].detach().requires_grad_() for t in (q, k, v)]
        ran, out = kernels_ran(
            lambda q, k, v: sparse_attention_varlen(q, k, v, cu, sparse.local(9)), packed, grad[0]
        )
        assert not ran
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            alone = sparse_attention(*(t[None, a:b] for t in packed), sparse.local(9))
            torch.testing.assert_close(out[0][a:b].float(), alone[0].float(), rtol=1e-2, atol=1e-2)
        # the kernels: fp32, an odd head dim, a zero scale, strided columns
        for dtype, dim, options, pattern in (
            (torch.float32, 32, {}, sparse.local(20)),
            (torch.bfloat16, 12, {}, sparse.local(20)),
            (torch.bfloat16, 32, {"softmax_scale": 0.0}, sparse.local(20)),
            (torch.bfloat16, 32, {}, sparse.strided(12)),
        ):
            low, grad = inputs(dtype, 77, dim=dim)
            ran, _ = kernels_ran(
                lambda q, k, v, p=pattern, o=options: sparse_attention(q, k, v, p, **o), low, grad
            )
            assert ran, (dtype, dim, options, pattern)
