"""rotary_paged_write (one kernel: q and k rotated, k and v into their pool slots) against the
plain path it replaces (apply_rotary_qk, then index_copy_ into the pools): equal bit for bit, on
CPU under Triton's interpreter and, where there is one, on the GPU at a decode batch and a
prefill chunk."""

import contextlib

import pytest
import torch

from memfit.ops._triton import triton_on_cpu
from memfit.ops.paged_write import rotary_paged_write
from memfit.ops.rotary import apply_rotary_qk, rotary_cos_sin

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # CPU: the interpreter


def _case(tokens, heads_q, heads_kv, head_dim, dtype, device, page=16, blocks=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = (heads_q + 2 * heads_kv) * head_dim
    # a (1, tokens, width) projection output, as the Linear gives it, plus a column of padding
    # so that the row stride is not the width
    qkv = torch.randn(tokens, width + 8, generator=generator).to(dtype)[:, :width].to(device)
    positions = torch.randperm(blocks * page, generator=generator)[:tokens].to(device)
    cos, sin = rotary_cos_sin(positions, head_dim, 10000.0, None, device=device)
    # distinct slots, scattered over non-contiguous blocks
    slots = torch.randperm(blocks * page, generator=generator)[:tokens].to(device)
    pools = [
        torch.zeros(blocks, page, heads_kv, head_dim, dtype=dtype, device=device) for _ in "kv"
    ]
    return qkv, cos, sin, slots, pools


def _reference(qkv, cos, sin, slots, pools, heads_q, heads_kv, head_dim):
    tokens = qkv.shape[0]
    q, k, v = qkv.split([heads_q * head_dim, heads_kv * head_dim, heads_kv * head_dim], -1)
    q, k = apply_rotary_qk(
        q.reshape(1, tokens, heads_q, head_dim), k.reshape(1, tokens, heads_kv, head_dim), cos, sin
    )
    keys, values = (p.clone() for p in pools)
    keys.view(-1, heads_kv, head_dim).index_copy_(0, slots, k[0])
    values.view(-1, heads_kv, head_dim).index_copy_(0, slots, v.reshape(tokens, heads_kv, head_dim))
    return q[0], keys, values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,heads_q,heads_kv,head_dim",
    [(1, 32, 8, 64), (5, 8, 2, 128), (37, 4, 4, 64), (3, 8, 1, 48), (19, 6, 2, 32)],
)
def test_equals_rotation_then_indexed_writes(tokens, heads_q, heads_kv, head_dim, dtype, device):
    if device == "cuda":
        tokens *= 7  # a prefill-sized chunk too
    qkv, cos, sin, slots, pools = _case(tokens, heads_q, heads_kv, head_dim, dtype, device)
    with triton_on_cpu() if device == "cpu" else contextlib.nullcontext():
        expected = _reference(qkv, cos, sin, slots, pools, heads_q, heads_kv, head_dim)
        keys, values = pools
        q = rotary_paged_write(qkv, cos, sin, keys, values, slots, heads_q=heads_q)
    for got, want in zip((q, keys, values), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rejects_mismatched_shapes():
    qkv, cos, sin, slots, (keys, values) = _case(4, 8, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="does not hold 4 query"):
        rotary_paged_write(qkv, cos, sin, keys, values, slots, heads_q=4)
    with pytest.raises(ValueError, match="must match each other"):
        rotary_paged_write(qkv, cos, sin, keys, values.bfloat16(), slots, heads_q=8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads_q,heads_kv,head_dim", [(5, 8, 2, 128), (19, 6, 2, 32)])
def test_fp8_pools_equal_the_plain_quantization(tokens, heads_q, heads_kv, head_dim, dtype, device):
    # an fp8 cache's write: (k - offset) / k_scale and v / v_scale, saturated, bit for bit as
    # PagedKVCache.update stores them on the plain path; a large value saturates to 448
    qkv, cos, sin, slots, _ = _case(tokens, heads_q, heads_kv, head_dim, dtype, device)
    qkv[0, heads_q * head_dim] = 1e4
    generator = torch.Generator().manual_seed(1)
    offset = torch.randn(heads_kv, head_dim, generator=generator).to(device)
    k_scale = torch.exp2(torch.randint(-6, 2, (heads_kv,), generator=generator).float()).to(device)
    v_scale = torch.exp2(torch.randint(-6, 2, (heads_kv,), generator=generator).float()).to(device)
    pools = [
        torch.zeros(40, 16, heads_kv, head_dim, dtype=torch.float8_e4m3fn, device=device)
        for _ in "kv"
    ]
    q_ref, k_ref, v_ref = _reference(
        qkv, cos, sin, slots, [torch.zeros(p.shape, dtype=dtype, device=device) for p in pools],
        heads_q, heads_kv, head_dim,
    )  # fmt: skip
    want_k = ((k_ref.float() - offset) / k_scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    want_v = (v_ref.float() / v_scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    with triton_on_cpu() if device == "cpu" else contextlib.nullcontext():
        q = rotary_paged_write(
            qkv, cos, sin, *pools, slots, heads_q=heads_q, key_offset=offset, k_scale=k_scale,
            v_scale=v_scale,
        )  # fmt: skip
    assert torch.equal(q, q_ref)
    written = slots.cpu()
    for got, want in zip(pools, (want_k, want_v), strict=True):
        got, want = got.view(-1, heads_kv, head_dim).cpu(), want.view(-1, heads_kv, head_dim).cpu()
        assert torch.equal(got[written].view(torch.uint8), want[written].view(torch.uint8))
    assert pools[0].view(-1, heads_kv, head_dim)[slots[0], 0].float().abs().max() == 448


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_inverse_scales_given_store_the_same_bytes(device):
    qkv, cos, sin, slots, _ = _case(7, 4, 2, 32, torch.float32, device)
    offset = torch.randn(2, 32, generator=torch.Generator().manual_seed(2)).to(device)
    k_scale, v_scale = (
        torch.tensor([0.25, 2.0], device=device),
        torch.tensor([0.5, 0.125], device=device),
    )
    stored = []
    for inverse in (None, (1 / k_scale, 1 / v_scale)):
        pools = [torch.zeros(40, 16, 2, 32, dtype=torch.float8_e4m3fn, device=device) for _ in "kv"]
        with triton_on_cpu() if device == "cpu" else contextlib.nullcontext():
            rotary_paged_write(
                qkv, cos, sin, *pools, slots, heads_q=4, key_offset=offset, k_scale=k_scale,
                v_scale=v_scale, inverse_scales=inverse,
            )  # fmt: skip
        stored.append([p.view(torch.uint8) for p in pools])
    assert all(torch.equal(a, b) for a, b in zip(*stored, strict=True))
    assert stored[0][0].any()
    int8 = [torch.zeros(40, 16, 2, 32, dtype=torch.int8, device=device) for _ in "kv"]
    scales = [torch.ones(40, 16, 2, dtype=torch.float16, device=device) for _ in "kv"]
    fp8 = [torch.zeros(40, 16, 2, 32, dtype=torch.float8_e4m3fn, device=device) for _ in "kv"]
    for bad_pools, given, inverse in (
        (int8, scales, (k_scale, v_scale)),
        (fp8, (k_scale, v_scale), (k_scale, torch.ones(3, device=device))),
    ):
        with pytest.raises(ValueError, match="inverse_scales are fp8 pools'"):
            rotary_paged_write(
                qkv, cos, sin, *bad_pools, slots, heads_q=4, key_offset=offset, k_scale=given[0],
                v_scale=given[1], inverse_scales=inverse,
            )  # fmt: skip


def test_fp8_pools_need_offset_and_scales():
    qkv, cos, sin, slots, _ = _case(3, 4, 2, 32, torch.float32, "cpu")
    pools = [torch.zeros(40, 16, 2, 32, dtype=torch.float8_e4m3fn) for _ in "kv"]
    with pytest.raises(ValueError, match="pools need key_offset"):  # (before any launch)
        rotary_paged_write(qkv, cos, sin, *pools, slots, heads_q=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads_q,heads_kv,head_dim", [(5, 8, 2, 128), (19, 6, 2, 32)])
def test_int8_pools_store_each_tokens_scale(tokens, heads_q, heads_kv, head_dim, dtype, device):
    # an int8 cache's write: per token and kv head, the scale of its largest |value| (keys less
    # the offset) in fp16 beside it, the values rounded to nearest; so each stored vector is
    # within half a level of what it stands for and uses the full range
    qkv, cos, sin, slots, _ = _case(tokens, heads_q, heads_kv, head_dim, dtype, device)
    qkv[0, heads_q * head_dim] = 1e4  # one large key: its token's scale follows it
    generator = torch.Generator().manual_seed(1)
    offset = torch.randn(heads_kv, head_dim, generator=generator).to(device)
    pools = [torch.zeros(40, 16, heads_kv, head_dim, dtype=torch.int8, device=device) for _ in "kv"]
    scales = [torch.ones(40, 16, heads_kv, dtype=torch.float16, device=device) for _ in "kv"]
    _, k_ref, v_ref = _reference(
        qkv, cos, sin, slots, [torch.zeros(p.shape, dtype=dtype, device=device) for p in pools],
        heads_q, heads_kv, head_dim,
    )  # fmt: skip
    with triton_on_cpu() if device == "cpu" else contextlib.nullcontext():
        rotary_paged_write(
            qkv, cos, sin, *pools, slots, heads_q=heads_q, key_offset=offset, k_scale=scales[0],
            v_scale=scales[1],
        )  # fmt: skip
    written = slots.cpu()
    for pool, scale, ref in zip(
        pools, scales, (k_ref.float() - offset, v_ref.float()), strict=True
    ):
        meant = ref.view(-1, heads_kv, head_dim)[slots].cpu()
        stored = pool.view(-1, heads_kv, head_dim).cpu()[written].float()
        scale = scale.view(-1, heads_kv).cpu()[written].float()
        want = (meant.abs().amax(-1) / 127).half().float()
        torch.testing.assert_close(scale, want, rtol=2**-10, atol=0)
        assert stored.abs().amax(-1).eq(127).all()  # every vector spans the range
        error = (stored * scale[..., None] - meant).abs()
        assert (error <= scale[..., None] * (0.5 + 1e-3)).all()  # to nearest


def test_int8_pools_need_fp16_scale_pools():
    qkv, cos, sin, slots, _ = _case(3, 4, 2, 32, torch.float32, "cpu")
    pools = [torch.zeros(40, 16, 2, 32, dtype=torch.int8) for _ in "kv"]
    with pytest.raises(ValueError, match=r"k_scale: \(40, 16, 2\) contiguous torch.float16"):
        rotary_paged_write(
            qkv, cos, sin, *pools, slots, heads_q=4, key_offset=torch.zeros(2, 32),
            k_scale=torch.ones(2), v_scale=torch.ones(2),
        )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads_q,heads_kv,head_dim", [(1, 8, 2, 64), (19, 6, 3, 32)])
def test_rotated_keys_and_queries_match_the_plain_path(
    tokens, heads_q, heads_kv, head_dim, dtype, kind, device
):
    # key_rotation H (+-1): q H a returned and (k - offset) H b quantized, as PagedKVCache's
    # plain path does it; exact products summed in fp32 in another order, so q within an ulp
    # and the stored keys equal but for the rare element at a rounding boundary, a level off
    from memfit.inference.paged_cache import key_rotation
    from memfit.ops.paged_write import rotation_scales

    qkv, cos, sin, slots, _ = _case(tokens, heads_q, heads_kv, head_dim, dtype, device)
    generator = torch.Generator().manual_seed(1)
    offset = torch.randn(heads_kv, head_dim, generator=generator).to(device)
    rotation = key_rotation(head_dim).to(device)
    a, b = rotation_scales(head_dim)
    assert a * b == 1 / head_dim
    one_byte = torch.float8_e4m3fn if kind == "fp8" else torch.int8
    pools = [torch.zeros(40, 16, heads_kv, head_dim, dtype=one_byte, device=device) for _ in "kv"]
    if kind == "fp8":
        scales = [torch.full((heads_kv,), 2.0**-5, device=device) for _ in "kv"]
    else:
        scales = [torch.ones(40, 16, heads_kv, dtype=torch.float16, device=device) for _ in "kv"]
    q_ref, k_ref, _ = _reference(
        qkv, cos, sin, slots, [torch.zeros(p.shape, dtype=dtype, device=device) for p in pools],
        heads_q, heads_kv, head_dim,
    )  # fmt: skip
    with triton_on_cpu() if device == "cpu" else contextlib.nullcontext():
        q = rotary_paged_write(
            qkv, cos, sin, *pools, slots, heads_q=heads_q, key_offset=offset, k_scale=scales[0],
            v_scale=scales[1], key_rotation=rotation,
        )  # fmt: skip
    want_q = (q_ref.float() @ rotation * a).to(dtype)
    # (fp32: sums in another order, a few ulps of the sum of |terms|; bf16: then an ulp)
    terms = q_ref.float().abs() @ rotation.abs() * a
    bound = terms * 2**-20 + want_q.float().abs() * (2**-7 if dtype == torch.bfloat16 else 0)
    assert ((q.float() - want_q.float()).abs() <= bound).all()
    if dtype == torch.bfloat16:
        assert (q == want_q).float().mean() > 0.98
    meant = (k_ref.float().view(-1, heads_kv, head_dim)[slots] - offset).to(dtype).float()
    meant = meant @ rotation * b
    stored = pools[0].view(-1, heads_kv, head_dim)[slots].float()
    if kind == "fp8":
        want = (meant / scales[0][:, None]).to(torch.float8_e4m3fn).float()
        level = want.abs().clamp(min=2**-6) * 2**-3  # e4m3: 3 mantissa bits
    else:
        scale = scales[0].view(-1, heads_kv)[slots].float()[..., None]
        torch.testing.assert_close(
            scale, (meant.abs().amax(-1, keepdim=True) / 127).half().float(), rtol=2**-10, atol=0
        )
        want, level = (meant / scale).round(), torch.ones_like(meant)
    assert ((stored - want).abs() <= level * 1.001).all()
    assert (stored == want).float().mean() > 0.98
    # and a query's scores are those of the unrotated q and k - offset
    group = heads_q // heads_kv
    unrotated = k_ref.float().view(-1, heads_kv, head_dim)[slots] - offset
    want_scores = (q_ref.float() * unrotated.repeat_interleave(group, 1)).sum(-1)
    scores = (q.float() * meant.repeat_interleave(group, 1)).sum(-1)
    torch.testing.assert_close(scores, want_scores, rtol=0.02, atol=0.02 * head_dim**0.5)


def test_a_rotation_needs_quantized_pools_and_its_shape():
    qkv, cos, sin, slots, pools = _case(3, 4, 2, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="key_rotation is for quantized"):
        rotary_paged_write(qkv, cos, sin, *pools, slots, heads_q=4, key_rotation=torch.eye(32))
    fp8 = [torch.zeros(40, 16, 2, 32, dtype=torch.float8_e4m3fn) for _ in "kv"]
    with pytest.raises(ValueError, match=r"key_rotation must be \(32, 32\)"):
        rotary_paged_write(
            qkv, cos, sin, *fp8, slots, heads_q=4, key_offset=torch.zeros(2, 32),
            k_scale=torch.ones(2), v_scale=torch.ones(2), key_rotation=torch.eye(16),
        )  # fmt: skip
