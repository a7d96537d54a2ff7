"""The fp8 KV cache (PagedKVCache(kv_dtype="fp8")): half the bytes a block, calibrated key
offsets and power-of-two scales, the same stored bytes and tokens from the Triton path (under
the interpreter) and the plain one, and greedy tokens that agree with a full-precision cache.
Kernel-level checks: tests/ops/test_paged_write.py, tests/ops/test_paged_attention.py; the
perplexity on a real model: benchmarks/quant_quality.py --kv fp8."""

import contextlib

import pytest
import torch

from memfit.inference import LLM, PagedKVCache, SamplingParams, generate_paged
from memfit.models import PRESETS, build_model
from memfit.ops._triton import triton_on_cpu

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


def test_calibration_sets_the_mean_key_and_power_of_two_scales(model):
    rows = _rows(2, 40, seed=3)
    plain = PagedKVCache(CONFIG, num_blocks=16, block_size=8, dtype=torch.float32, device="cpu")
    from memfit.inference.paged import paged_step

    for index, row in enumerate(rows):
        paged_step(model, plain, [index], [row])
    keys = torch.cat(
        [plain.keys[:, plain.tables[i]].flatten(1, 2)[:, :40] for i in range(2)], 1
    )  # (layers, tokens, heads, dim)
    values = torch.cat(
        [plain.values[:, plain.tables[i]].flatten(1, 2)[:, :40] for i in range(2)], 1
    )
    cache = PagedKVCache(
        CONFIG, num_blocks=16, block_size=8, dtype=torch.float32, device="cpu", kv_dtype="fp8"
    )
    cache.calibrate(model, rows)
    torch.testing.assert_close(cache.key_offset, keys.mean(1))
    for scale, x in (
        (cache.key_scale, keys - keys.mean(1, keepdim=True)),
        (cache.value_scale, values),
    ):
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
        amax = x.abs().amax(dim=(1, 3))
        # the largest value lands in (448 / 8, 448 / 4]: a factor 4 of headroom, no more than 8
        assert (amax / scale <= 448 / 4).all() and (amax / scale > 448 / 8).all()
    assert not cache.tables  # the calibration's own cache was temporary


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
def test_fp8_generation_agrees_with_a_full_precision_cache(model, window):
    config = CONFIG.replace(sliding_window=window)
    model = build_model(config, seed=0).eval()
    prompts = [row[:n] for row, n in zip(_rows(4, 50, seed=1), (30, 17, 50, 9), strict=True)]
    reference = PagedKVCache(
        config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu", kv_dtype="fp8"
    )
    reference.calibrate(model, _rows(2, 64, seed=2))
    outputs, stored = {}, {}
    for name, kv_dtype, kernels in (("full", None, False), ("plain", "fp8", False),
                                    ("triton", "fp8", True)):  # fmt: skip
        with triton_on_cpu() if kernels else contextlib.nullcontext():
            cache = PagedKVCache(
                config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu",
                kv_dtype=kv_dtype,
            )  # fmt: skip
            if kv_dtype:  # the same calibration for both paths
                for name_ in ("key_offset", "key_scale", "value_scale"):
                    getattr(cache, name_).copy_(getattr(reference, name_))
            outputs[name] = generate_paged(model, prompts, cache, SamplingParams(max_tokens=12))
            stored[name] = cache.keys[0].view(torch.uint8), cache.values[0].view(torch.uint8)
    # the Triton write and read give the plain path's tokens, and the first layer's bytes (later
    # layers' keys follow attention outputs, whose last bits differ between the two paths)
    assert outputs["triton"] == outputs["plain"]
    assert torch.equal(stored["triton"][0], stored["plain"][0])
    assert torch.equal(stored["triton"][1], stored["plain"][1])
    tokens = sum(len(row) for row in outputs["full"])
    agree = sum(
        a == b
        for full, fp8 in zip(outputs["full"], outputs["plain"], strict=True)
        for a, b in zip(full, fp8, strict=True)
    )
    assert agree / tokens >= 0.95, f"fp8 KV agrees on {agree} of {tokens} greedy tokens"


def test_fp8_prefill_logits_are_close_to_a_full_precision_cache(model):
    from memfit.inference.paged import paged_step

    batch = [row[:n] for row, n in zip(_rows(3, 40, seed=4), (40, 9, 23), strict=True)]
    logits = {}
    for kv_dtype in (None, "fp8"):
        cache = PagedKVCache(
            CONFIG, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu",
            kv_dtype=kv_dtype,
        )  # fmt: skip
        if kv_dtype:
            cache.calibrate(model, _rows(2, 64, seed=2))
        logits[kv_dtype] = paged_step(model, cache, [0, 1, 2], batch)
    error = (logits["fp8"] - logits[None]).norm() / logits[None].norm()
    assert 1e-4 < error < 0.05  # quantized (not equal), and a few percent at most


def test_llm_takes_an_fp8_cache_and_refuses_other_kinds():
    llm = LLM("tiny", kv_cache_dtype="fp8", kv_cache_bytes=2**20)
    assert llm.cache.kv_dtype == "fp8" and llm.cache.key_scale.ne(1).any()  # calibrated
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5), progress=False)[0]
    assert len(out.token_ids) == 5
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        LLM("tiny", kv_cache_dtype="int8")
