"""The quantized KV caches (PagedKVCache(kv_dtype="fp8" or "int8")): about half the bytes a
block, calibrated key offsets (and fp8's power-of-two scales; int8's per-token ones), the same
stored bytes and tokens from the Triton path (under the interpreter) and the plain one, greedy
tokens that agree with a full-precision cache, also through preemption.
Kernel-level checks: tests/ops/test_paged_write.py, tests/ops/test_paged_attention.py; the
perplexity on a real model: benchmarks/quant_quality.py --kv fp8 int8."""

import contextlib

import pytest
import torch

from memfit.inference import LLM, PagedKVCache, SamplingParams, generate_paged
from memfit.models import PRESETS, build_model
from memfit.ops._triton import triton_on_cpu
from memfit.ops.paged_write import rotation_scales

CONFIG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def model():
    return build_model(CONFIG, seed=0).eval()


def _rows(count, length, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (count, length), generator=generator).tolist()


def test_an_fp8_cache_holds_twice_the_tokens():
    options = {"block_size": 16, "device": "cpu"}
    bf16 = PagedKVCache.from_budget(CONFIG, 2**20, dtype=torch.bfloat16, **options)
    fp8 = PagedKVCache.from_budget(CONFIG, 2**20, dtype=torch.bfloat16, kv_dtype="fp8", **options)
    assert fp8.keys.dtype == fp8.values.dtype == torch.float8_e4m3fn
    assert PagedKVCache.bytes_per_block(CONFIG, 16, torch.bfloat16, "fp8") * 2 == (
        PagedKVCache.bytes_per_block(CONFIG, 16, torch.bfloat16)
    )
    assert fp8.pool.num_blocks + 1 - 2 * (bf16.pool.num_blocks + 1) in (0, 1)
    with pytest.raises(ValueError, match="kv_dtype must be None or one of"):
        PagedKVCache(CONFIG, num_blocks=4, dtype=torch.float32, device="cpu", kv_dtype="int2")


def test_an_int8_cache_holds_its_tokens_and_their_scales():
    options = {"block_size": 16, "device": "cpu"}
    bf16 = PagedKVCache.from_budget(CONFIG, 2**20, dtype=torch.bfloat16, **options)
    int8 = PagedKVCache.from_budget(CONFIG, 2**20, dtype=torch.bfloat16, kv_dtype="int8", **options)
    assert int8.keys.dtype == int8.values.dtype == torch.int8
    assert int8.key_token_scale.shape == int8.keys.shape[:-1]
    assert int8.key_token_scale.dtype == torch.float16
    per_head = CONFIG.head_dim + 2  # int8 elements and an fp16 scale, for k and for v
    assert PagedKVCache.bytes_per_block(CONFIG, 16, torch.bfloat16, "int8") == (
        2 * CONFIG.num_layers * 16 * CONFIG.num_kv_heads * per_head
    )
    ratio = (int8.pool.num_blocks + 1) / (bf16.pool.num_blocks + 1)
    assert abs(ratio - 2 * CONFIG.head_dim / per_head) < 0.02


def _calibration_keys(model, rows):
    """Each row's keys and values through a full-precision cache: (layers, rows, tokens, heads,
    dim) each, rows of one length."""
    plain = PagedKVCache(CONFIG, num_blocks=64, block_size=8, dtype=torch.float32, device="cpu")
    from memfit.inference.paged import paged_step

    for index, row in enumerate(rows):
        paged_step(model, plain, [index], [row])
    length = len(rows[0])
    return (
        torch.stack(
            [pool[:, plain.tables[i]].flatten(1, 2)[:, :length] for i in range(len(rows))], 1
        )
        for pool in (plain.keys, plain.values)
    )


def test_calibration_sets_the_mean_key_and_power_of_two_scales(model):
    rows = _rows(3, 40, seed=3)
    keys, values = _calibration_keys(model, rows)
    cache = PagedKVCache(
        CONFIG, num_blocks=24, block_size=8, dtype=torch.float32, device="cpu", kv_dtype="fp8"
    )
    cache.calibrate(model, rows)
    # the later positions' mean key; position 0 (three samples, too few for offsets of its own)
    # takes the same offset and none for its value
    offset = keys[:, :, 1:].mean((1, 2))
    torch.testing.assert_close(cache.key_offset, offset)
    torch.testing.assert_close(cache.first_offset[:, 0], offset)
    assert cache.first_offset[:, 1].eq(0).all()
    assert cache.first_key.abs().max() < 1e-5 and cache.first_value.eq(0).all()
    # the keys are stored rotated (less their offset): the scales are the rotated keys'
    rotation, dim = cache.key_rotation, CONFIG.head_dim
    assert rotation.abs().eq(1).all() and torch.equal(rotation @ rotation.T, dim * torch.eye(dim))
    rotated = (keys - offset[:, None, None]) @ rotation * rotation_scales(dim)[1]
    for scale, x in (
        (cache.key_scale, rotated.flatten(1, 2)),
        (cache.value_scale, values.flatten(1, 2)),
    ):
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
        amax = x.abs().amax(dim=(1, 3))
        # the largest value lands in (448 / 8, 448 / 4]: a factor 4 of headroom, no more than 8
        assert (amax / scale <= 448 / 4).all() and (amax / scale > 448 / 8).all()
    assert not cache.tables  # the calibration's own cache was temporary
    int8 = PagedKVCache(
        CONFIG, num_blocks=24, block_size=8, dtype=torch.float32, device="cpu", kv_dtype="int8"
    )
    int8.calibrate(model, rows)
    torch.testing.assert_close(int8.key_offset, offset)
    assert int8.key_scale.eq(1).all()  # (its scales are each token's)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("kernels", [False, True])
def test_a_first_position_apart_takes_offsets_of_its_own(model, kind, kernels):
    # every row starts with token 7: position 0's key and value are the same in every row (as
    # an attention sink's nearly are), unlike the later positions'
    rows = [[7] + row[1:] for row in _rows(3, 40, seed=3)] + [[7]] * 8
    keys, values = _calibration_keys(model, rows[:3])
    cache = PagedKVCache(
        CONFIG, num_blocks=24, block_size=8, dtype=torch.float32, device="cpu", kv_dtype=kind
    )
    cache.calibrate(model, rows)
    offset = keys[:, :, 1:].mean((1, 2))
    torch.testing.assert_close(cache.key_offset, offset)
    torch.testing.assert_close(cache.first_offset[:, 0], keys[:, 0, 0])
    torch.testing.assert_close(cache.first_offset[:, 1], values[:, 0, 0])
    # what the kernels add back at key 0: (first key offset - key offset), rotated as the keys
    # are, and the first value offset, in the units of the stored keys and values
    delta = (keys[:, 0, 0] - offset) @ cache.key_rotation * rotation_scales(CONFIG.head_dim)[1]
    scales = (cache.key_scale[..., None], cache.value_scale[..., None]) if kind == "fp8" else (1, 1)
    torch.testing.assert_close(cache.first_key, delta / scales[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.first_value, values[:, 0, 0] / scales[1])
    # a sequence of that first token stores zeros there, and attention gets its key and value
    # back exactly: the logits of the full-precision cache (a quantized one without the first
    # offsets misses them by fp8's or int8's rounding)
    logits, longer = {}, [7, *_rows(1, 11, seed=9)[0]]
    for name in ("full", "quantized", "without"):
        with triton_on_cpu() if kernels else contextlib.nullcontext():
            quantized = PagedKVCache(
                CONFIG, num_blocks=4, block_size=8, dtype=torch.float32, device="cpu",
                kv_dtype=None if name == "full" else kind,
            )  # fmt: skip
            if name != "full":
                calibration = cache.calibration()
                if name == "without":  # position 0 takes the others' offsets
                    calibration["first_offset"][:, 0] = calibration["key_offset"]
                    calibration["first_offset"][:, 1] = 0
                quantized.load_calibration(calibration)
            with torch.no_grad():
                metadata = quantized.step_metadata([0], [1])
                one = model(torch.tensor([[7]]), kv_cache=quantized, metadata=metadata)
                metadata = quantized.step_metadata([1], [len(longer)])
                logits[name] = one, model(
                    torch.tensor([longer]), kv_cache=quantized, metadata=metadata
                )  # fmt: skip
    torch.testing.assert_close(logits["quantized"][0], logits["full"][0], rtol=1e-5, atol=1e-5)
    assert (logits["without"][0] - logits["full"][0]).abs().max() > 1e-3
    # a longer sequence: every query weighs key 0 by its score (the key's correction) and the
    # later keys are rounded either way; the first position's offsets bring it closer
    errors = {
        name: (logits[name][1] - logits["full"][1]).norm() for name in ("quantized", "without")
    }
    assert errors["quantized"] < 0.8 * errors["without"], errors


def test_first_positions_spread_out_take_the_others_offsets(model):
    # twelve rows (enough samples) whose first tokens differ: their keys spread as the later
    # positions' do, so position 0 keeps the others' key offset and no value offset
    rows = _rows(12, 6, seed=4)
    assert len({row[0] for row in rows}) == 12
    cache = PagedKVCache(
        CONFIG, num_blocks=24, block_size=8, dtype=torch.float32, device="cpu", kv_dtype="fp8"
    )
    cache.calibrate(model, rows)
    torch.testing.assert_close(cache.first_offset[:, 0], cache.key_offset)
    assert cache.first_offset[:, 1].eq(0).all() and cache.first_value.eq(0).all()


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_a_calibration_loads_into_another_cache_with_what_derives_from_it(model, kind):
    rows = [[7] + row[1:] for row in _rows(3, 20, seed=3)] + [[7]] * 8
    options = {"num_blocks": 24, "block_size": 8, "dtype": torch.float32, "device": "cpu"}
    calibrated = PagedKVCache(CONFIG, kv_dtype=kind, **options)
    calibrated.calibrate(model, rows)
    state = calibrated.calibration()
    assert set(state) == set(PagedKVCache.CALIBRATION)
    assert state["key_offset"].data_ptr() != calibrated.key_offset.data_ptr()  # a copy
    other = PagedKVCache(CONFIG, kv_dtype=kind, **options)
    other.load_calibration(state)
    derived = ("first_key", "first_value", "key_scale_inverse", "value_scale_inverse")
    for name in (*PagedKVCache.CALIBRATION, *derived):
        assert torch.equal(getattr(other, name), getattr(calibrated, name)), name
    assert other.first_key.abs().max() > 0  # (the first position's offsets are in use)
    if kind == "fp8":
        torch.testing.assert_close(other.key_scale_inverse, 1 / other.key_scale)
    # the same tokens from either cache
    prompts = [row[:n] for row, n in zip(_rows(3, 20, seed=5), (7, 12, 20), strict=True)]
    outputs = [
        generate_paged(model, prompts, cache, SamplingParams(max_tokens=5))
        for cache in (calibrated, other)
    ]
    assert outputs[0] == outputs[1]
    # bad calibrations say what is wrong; nothing is set
    before = other.key_offset.clone()
    fresh = PagedKVCache(CONFIG, kv_dtype=kind, **options)
    with pytest.raises(ValueError, match="calibration key_offset: this cache holds"):
        fresh.load_calibration(state | {"key_offset": torch.zeros(1, 2)})
    assert fresh.key_offset.eq(0).all()
    with pytest.raises(ValueError, match="a calibration has key_offset"):
        fresh.load_calibration({"key_offset": state["key_offset"]})
    other.append(0, 3)
    with pytest.raises(ValueError, match="before storing sequences"):
        other.load_calibration(state)
    assert torch.equal(other.key_offset, before)
    with pytest.raises(ValueError, match="for a quantized cache"):
        PagedKVCache(CONFIG, **options).load_calibration(state)
    with pytest.raises(ValueError, match="a quantized cache's"):
        PagedKVCache(CONFIG, **options).calibration()


def test_calibration_refuses_a_plain_or_used_cache(model):
    plain = PagedKVCache(CONFIG, num_blocks=8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="for a quantized cache"):
        plain.calibrate(model, _rows(1, 8, 0))
    cache = PagedKVCache(CONFIG, num_blocks=8, dtype=torch.float32, device="cpu", kv_dtype="fp8")
    with pytest.raises(ValueError, match="at least one row"):
        cache.calibrate(model, [])
    cache.append(0, 3)
    with pytest.raises(ValueError, match="before storing sequences"):
        cache.calibrate(model, _rows(1, 8, 0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (GPU: test_engine_gpu)")
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_generation_agrees_with_a_full_precision_cache(model, window, kind):
    config = CONFIG.replace(sliding_window=window)
    model = build_model(config, seed=0).eval()
    prompts = [row[:n] for row, n in zip(_rows(4, 50, seed=1), (30, 17, 50, 9), strict=True)]
    reference = PagedKVCache(
        config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu", kv_dtype=kind
    )
    reference.calibrate(model, _rows(2, 64, seed=2))
    outputs, stored = {}, {}
    for name, kv_dtype, kernels in (("full", None, False), ("plain", kind, False),
                                    ("triton", kind, True)):  # fmt: skip
        with triton_on_cpu() if kernels else contextlib.nullcontext():
            cache = PagedKVCache(
                config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu",
                kv_dtype=kv_dtype,
            )  # fmt: skip
            if kv_dtype:  # the same calibration for both paths
                cache.load_calibration(reference.calibration())
            outputs[name] = generate_paged(model, prompts, cache, SamplingParams(max_tokens=12))
            stored[name] = cache.keys[0].view(torch.uint8), cache.values[0].view(torch.uint8)
            if kv_dtype == "int8":
                stored[name] += (cache.key_token_scale[0], cache.value_token_scale[0])
    # the Triton write and read give the plain path's tokens, and the first layer's bytes (later
    # layers' keys follow attention outputs, whose last bits differ between the two paths; the
    # rotation's sums, in another order, may move a rare key across a rounding boundary: one
    # step of the grid)
    assert outputs["triton"] == outputs["plain"]
    apart = stored["triton"][0].int() - stored["plain"][0].int()
    assert apart.abs().max() <= 1 and apart.ne(0).float().mean() < 1e-3
    assert torch.equal(stored["triton"][1], stored["plain"][1])
    for triton_scales, plain_scales in zip(stored["triton"][2:], stored["plain"][2:], strict=True):
        # int8's per-token scales: the rotations' last bits may move one across an fp16 rounding
        torch.testing.assert_close(triton_scales, plain_scales, rtol=2**-10, atol=0)
    tokens = sum(len(row) for row in outputs["full"])
    agree = sum(
        a == b
        for full, quantized in zip(outputs["full"], outputs["plain"], strict=True)
        for a, b in zip(full, quantized, strict=True)
    )
    assert agree / tokens >= 0.95, f"{kind} KV agrees on {agree} of {tokens} greedy tokens"


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_prefill_logits_are_close_to_a_full_precision_cache(model, kind):
    from memfit.inference.paged import paged_step

    batch = [row[:n] for row, n in zip(_rows(3, 40, seed=4), (40, 9, 23), strict=True)]
    logits = {}
    for kv_dtype in (None, kind):
        cache = PagedKVCache(
            CONFIG, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu",
            kv_dtype=kv_dtype,
        )  # fmt: skip
        if kv_dtype:
            cache.calibrate(model, _rows(2, 64, seed=2))
        logits[kv_dtype] = paged_step(model, cache, [0, 1, 2], batch)
    error = (logits[kind] - logits[None]).norm() / logits[None].norm()
    assert 1e-4 < error < 0.05  # quantized (not equal), and a few percent at most


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_llm_takes_a_quantized_cache_and_refuses_other_kinds(kind):
    llm = LLM("tiny", kv_cache_dtype=kind, kv_cache_bytes=2**20)
    assert llm.cache.kv_dtype == kind and llm.cache.key_offset.ne(0).any()  # calibrated
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5), progress=False)[0]
    assert len(out.token_ids) == 5
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        LLM("tiny", kv_cache_dtype="int4")


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_preemption_recomputes_what_a_roomy_pool_keeps(model, kind):
    """A pool too small for the batch preempts sequences and writes their keys and values again
    on resuming: quantized with the same offsets and scales, they give the roomy pool's tokens."""
    from memfit.inference import Engine

    calibration = PagedKVCache(
        CONFIG, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu", kv_dtype=kind
    )
    calibration.calibrate(model, _rows(2, 64, seed=2))
    prompts = [row[:n] for row, n in zip(_rows(4, 12, seed=5), (3, 9, 5, 11), strict=True)]
    outputs, preemptions = {}, {}
    for num_blocks in (32, 6):
        cache = PagedKVCache(
            CONFIG, num_blocks=num_blocks, block_size=4, dtype=torch.float32, device="cpu",
            kv_dtype=kind,
        )  # fmt: skip
        cache.load_calibration(calibration.calibration())
        engine = Engine(model, cache)
        for prompt in prompts:
            engine.add(prompt, SamplingParams(max_tokens=6))
        outputs[num_blocks] = engine.run()
        preemptions[num_blocks] = engine.preemptions
        assert cache.pool.num_free == num_blocks and not cache.tables
    assert preemptions[32] == 0 and preemptions[6] > 0
    assert outputs[6] == outputs[32]
