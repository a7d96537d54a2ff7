"""Inference benchmarks on one GPU, each competitor measured in the same process.

    python benchmarks/inference.py                      # every part
    python benchmarks/inference.py --parts kernel       # kernel, prefill, throughput, batch1

- kernel: memfit's paged decode kernel (bf16, GQA 32/8 unless said, a random block table of
  16-token blocks) against torch SDPA on a contiguous cache (`enable_gqa=True`), both as achieved
  bandwidth: bytes = K and V read once; and the device-to-device copy bandwidth (bytes read +
  written), the practical limit. Both kernels are timed replayed from CUDA graphs, as the
  engine's decode step runs them (eager times, which include Python's launch cost, are kept
  beside). `--sweep` times the kernel's launch configurations as well.
- prefill: the chunk kernel (2048 new tokens over a cached prefix of 0, 8k and 30k tokens, one
  sequence, bf16, GQA 32/8, D=128) against memfit's FlashAttention over the same keys stored
  contiguously: what the block table costs a prefill, in TFLOP/s of the causal product.
- throughput: 256 requests, prompt lengths uniform in 64..512 (seeded), 256 new tokens each (no
  early stop), llama-3.2-1b shapes with random bf16 weights: memfit's engine (`LLM.generate`)
  against Hugging Face transformers' continuous batching (`generate_batch`, paged), both warm
  (the second call is timed). Also the KV waste of memfit's run, sampled each step:
  (slots of the allocated blocks - tokens stored) / slots of the allocated blocks.
- kv_fp8: fp8 and int8 KV caches against bf16 (`LLM(kv_cache_dtype=...)`): the throughput workload
  above with the KV pool fixed at --kv-budget-gib for each (a one-byte pool holds about twice
  the tokens, so more requests run at once), tokens/s, steps and preemptions; and the decode
  kernel alone over fp8, int8 and bf16 pools (the KERNEL_CASES with head dim 128), time and
  the bytes it reads per second; with --sweep, the decode configurations over one-byte pools
  (DECODE_CONFIGS_FP8, DECODE_CONFIGS_INT8).
- weights: the throughput workload over bf16, int8 and int4 weights (`LLM(quantize=...)`) of
  --weights-model (llama-3-8b shapes), the KV pool fixed at --kv-budget-gib for each: tokens/s,
  steps and the time of a decode step when many sequences decode together.
- batch1: one prompt of 128 tokens, 256 new tokens, tokens/s and time per token, against the
  limit of reading the weights and the KV cache once per token at the measured copy bandwidth,
  for llama-3.2-1b and llama-3-8b shapes.

Results: benchmarks/results/inference.json (`--out DIR` elsewhere).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from memfit.ops.attention import paged as paged_ops  # noqa: E402

GiB = 2**30
KERNEL_CASES = [  # (batch, context, heads_q, heads_kv, head_dim)
    (64, 4096, 32, 8, 128),
    (16, 16384, 32, 8, 128),
    (128, 2048, 32, 8, 64),
    (1, 32768, 32, 8, 128),
]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting the read and the write."""
    src = torch.empty(GiB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = harness.median(harness.time_calls(lambda: dst.copy_(src), warmup=3, repeat=20))
    return 2 * GiB / seconds


def _paged_case(batch, context, heads_q, heads_kv, head_dim, page, device):
    blocks_per_seq = -(-context // page)
    num_blocks = batch * blocks_per_seq
    generator = torch.Generator(device="cpu").manual_seed(0)
    table = torch.randperm(num_blocks, generator=generator).view(batch, blocks_per_seq)
    shape = (num_blocks, page, heads_kv, head_dim)
    key_pool = torch.randn(shape, dtype=torch.bfloat16, device=device)
    value_pool = torch.randn(shape, dtype=torch.bfloat16, device=device)
    q = torch.randn(batch, heads_q, head_dim, dtype=torch.bfloat16, device=device)
    metadata = {
        "block_table": table.to(device=device, dtype=torch.int32),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "query_start": torch.arange(batch + 1, dtype=torch.int32, device=device),
        "max_query_len": 1,
        "max_seq_len": context,
    }
    return q, key_pool, value_pool, table, metadata


def kernel(device: torch.device, copy_bw: float, sweep: bool) -> list[dict]:
    rows = []
    for case in KERNEL_CASES:
        rows.append(_kernel_case(*case, device=device, copy_bw=copy_bw, sweep=sweep))
        torch.cuda.empty_cache()
    return rows


def _kernel_case(batch, context, heads_q, heads_kv, head_dim, *, device, copy_bw, sweep) -> dict:
    q, key_pool, value_pool, table, metadata = _paged_case(
        batch, context, heads_q, heads_kv, head_dim, 16, device
    )
    kv_bytes = 2 * batch * context * heads_kv * head_dim * 2
    # SDPA on the same keys and values laid out contiguously (B, heads_kv, L, D)
    k = key_pool[table.to(device)].flatten(1, 2).transpose(1, 2).contiguous()
    v = value_pool[table.to(device)].flatten(1, 2).transpose(1, 2).contiguous()
    q4 = q[:, :, None, :]

    def sdpa():
        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    def memfit(splits=None):
        return paged_ops.paged_attention(q, key_pool, value_pool, **metadata, num_splits=splits)

    ref = sdpa()[:, :, 0].float()
    err = (memfit().float() - ref).abs().max().item()
    t_sdpa, t_memfit = harness.graph_seconds(sdpa), harness.graph_seconds(memfit)
    eager_sdpa = harness.median(harness.time_calls(sdpa, warmup=5, repeat=50))
    eager_memfit = harness.median(harness.time_calls(memfit, warmup=5, repeat=50))
    row = {
        "batch": batch, "context": context, "heads_q": heads_q, "heads_kv": heads_kv,
        "head_dim": head_dim, "block_size": 16, "kv_bytes": kv_bytes,
        "splits": paged_ops.decode_splits(batch, heads_kv, context, device),
        "memfit_ms": t_memfit * 1e3, "sdpa_ms": t_sdpa * 1e3,
        "memfit_tb_s": kv_bytes / t_memfit / 1e12, "sdpa_tb_s": kv_bytes / t_sdpa / 1e12,
        "memfit_over_sdpa": t_sdpa / t_memfit, "memfit_of_copy": kv_bytes / t_memfit / copy_bw,
        "max_abs_diff_vs_sdpa": err, "memfit_eager_ms": eager_memfit * 1e3,
        "sdpa_eager_ms": eager_sdpa * 1e3,
    }  # fmt: skip
    if sweep:
        row["sweep"] = _sweep(memfit, kv_bytes, batch, heads_kv, context, device)
    print(
        f"decode B={batch} L={context} D={head_dim}: memfit {row['memfit_tb_s']:.2f} TB/s "
        f"({t_memfit * 1e3:.3f} ms, {row['splits']} splits), SDPA {row['sdpa_tb_s']:.2f} "
        f"TB/s, ratio {row['memfit_over_sdpa']:.2f}, {row['memfit_of_copy']:.0%} of copy, "
        f"max diff {err:.1e}",
        flush=True,
    )
    return row


def _sweep(memfit, kv_bytes, batch, heads_kv, context, device) -> list[dict]:
    """Achieved TB/s of each (BLOCK_N, warps, stages) and split count around the default."""
    block_d = 64 if memfit().shape[-1] <= 64 else 128
    default = paged_ops.DECODE_CONFIGS[block_d]
    base = paged_ops.decode_splits(batch, heads_kv, context, device)
    out = []
    try:
        for config in [(32, 2, 3), (32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3)]:
            paged_ops.DECODE_CONFIGS[block_d] = config
            for splits in sorted({max(1, base // 2), base, base * 2, base * 4}):
                seconds = harness.graph_seconds(lambda s=splits: memfit(s), calls=10, repeat=10)
                out.append({"config": config, "splits": splits, "tb_s": kv_bytes / seconds / 1e12})
    finally:
        paged_ops.DECODE_CONFIGS[block_d] = default
    best = max(out, key=lambda r: r["tb_s"])
    print(f"  sweep best: {best}", flush=True)
    return out


PREFILL_CASES = [(0, 2048), (8192, 2048), (30720, 2048)]  # (cached prefix, new tokens), B=1


def prefill(device: torch.device, sweep: bool) -> list[dict]:
    """The chunk kernel (new tokens over a cached prefix and themselves, causal) against memfit's
    FlashAttention over the same keys laid out contiguously (its causal mask aligned
    bottom-right): what paging costs a prefill. TFLOP/s of the causal product."""
    rows = []
    for prefix, new in PREFILL_CASES:
        rows.append(_prefill_case(prefix, new, device=device, sweep=sweep))
        torch.cuda.empty_cache()
    return rows


def _prefill_case(prefix: int, new: int, *, device, sweep: bool) -> dict:
    from memfit.ops.attention import flash_attention

    heads_q, heads_kv, head_dim, page = 32, 8, 128, 16
    total = prefix + new
    q, key_pool, value_pool, table, _ = _paged_case(
        1, total, heads_q, heads_kv, head_dim, page, device
    )
    q = torch.randn(new, heads_q, head_dim, dtype=torch.bfloat16, device=device)
    metadata = {
        "block_table": table.to(device=device, dtype=torch.int32),
        "seq_lens": torch.tensor([total], dtype=torch.int32, device=device),
        "query_start": torch.tensor([0, new], dtype=torch.int32, device=device),
        "max_query_len": new,
        "max_seq_len": total,
    }
    k = key_pool[table.to(device)].flatten(1, 2)[:, :total]  # (1, total, nkv, d)
    v = value_pool[table.to(device)].flatten(1, 2)[:, :total]
    flops = 4 * heads_q * head_dim * (new * prefix + new * (new + 1) / 2)

    def memfit():
        return paged_ops.paged_attention(q, key_pool, value_pool, **metadata)

    def flash():
        return flash_attention(q[None], k, v, causal=True)

    err = (memfit().float() - flash()[0].float()).abs().max().item()
    t_memfit, t_flash = (
        harness.graph_seconds(memfit, calls=5),
        harness.graph_seconds(flash, calls=5),
    )
    row = {
        "prefix": prefix, "new_tokens": new, "memfit_ms": t_memfit * 1e3,
        "flash_ms": t_flash * 1e3, "memfit_tflops": flops / t_memfit / 1e12,
        "flash_tflops": flops / t_flash / 1e12, "max_abs_diff_vs_flash": err,
    }  # fmt: skip
    if sweep:
        default, found = paged_ops.CHUNK_CONFIGS[128], []  # (head dim 128)
        try:
            for config in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2), (128, 32, 4, 3),
                           (64, 32, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)]:  # fmt: skip
                paged_ops.CHUNK_CONFIGS[128] = config
                seconds = harness.graph_seconds(memfit, calls=5, repeat=10)
                found.append({"config": config, "tflops": flops / seconds / 1e12})
        finally:
            paged_ops.CHUNK_CONFIGS[128] = default
        row["sweep"] = found
        print(f"  sweep best: {max(found, key=lambda r: r['tflops'])}", flush=True)
    print(
        f"prefill {new} over {prefix}: memfit {row['memfit_tflops']:.0f} TFLOP/s "
        f"({t_memfit * 1e3:.2f} ms), contiguous flash {row['flash_tflops']:.0f} TFLOP/s, "
        f"max diff {err:.1e}",
        flush=True,
    )
    return row


# ----------------------------------------------------------------------------------------------


def _prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def throughput(device: torch.device, requests: int, new_tokens: int) -> dict:
    from memfit.inference import LLM, SamplingParams

    prompts = _prompts(requests, 64, 512, 128256)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    llm = LLM("llama-3.2-1b", device=device)
    memfit = _engine_run(llm, prompts, params)
    generated, seconds = memfit["generated_tokens"], memfit["seconds"]
    print(
        f"memfit engine: {memfit['tokens_per_s']:,.0f} tokens/s ({generated} tokens in "
        f"{seconds:.2f} s), KV waste {memfit['kv_waste_mean']:.2%}, peak {memfit['peak_gib']:.1f} "
        f"GiB, {memfit['preemptions']} preemptions",
        flush=True,
    )
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    hf = _hf_generate_batch(prompts, new_tokens, device)
    return {"requests": requests, "new_tokens": new_tokens, "memfit": memfit, "hf": hf,
            "speedup": memfit["tokens_per_s"] / hf["tokens_per_s"]}  # fmt: skip


def _engine_run(llm, prompts, params) -> dict:
    """One timed `generate` of every prompt (the engine warm), with the engine's counters."""
    llm.generate(prompts[:8], params, progress=False)  # warm-up: kernels compiled, graphs made
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, progress=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    stats = llm.last_stats
    return {
        "tokens_per_s": generated / seconds, "seconds": seconds, "generated_tokens": generated,
        "peak_gib": torch.cuda.max_memory_allocated() / GiB, "steps": stats["steps"],
        "preemptions": stats["preemptions"], "kv_waste_mean": stats["kv_waste_mean"],
        "kv_blocks": stats["kv_blocks"], "kv_blocks_peak": stats["kv_blocks_peak"],
        "decode_steps": stats["decode_steps"], "decode_seconds": stats["decode_seconds"],
    }  # fmt: skip


def weights(
    device: torch.device, model: str, requests: int, new_tokens: int, budget_gib: float
) -> dict:
    """The workload of `throughput` over bf16, int8 and int4 weights (`LLM(quantize=...)`), the
    KV pool fixed at budget_gib for each: what weight-only quantization does to throughput when
    many sequences decode together (each step's products then have a row a running sequence)."""
    from memfit.inference import LLM, SamplingParams

    prompts = _prompts(requests, 64, 512, 128256)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    result = {"model": model, "requests": requests, "new_tokens": new_tokens,
              "kv_budget_gib": budget_gib}  # fmt: skip
    for kind in (None, "int8", "int4"):
        llm = LLM(model, device=device, kv_cache_bytes=int(budget_gib * GiB), quantize=kind)
        row = _engine_run(llm, prompts, params)
        row["decode_ms_per_step"] = row["decode_seconds"] / max(row["decode_steps"], 1) * 1e3
        result[kind or "bf16"] = row
        print(
            f"{model} {kind or 'bf16'} weights: {row['tokens_per_s']:,.0f} tokens/s, "
            f"{row['steps']} steps, {row['decode_ms_per_step']:.2f} ms a decode step, "
            f"{row['preemptions']} preemptions, peak {row['peak_gib']:.1f} GiB",
            flush=True,
        )
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for kind in ("int8", "int4"):
        result[f"{kind}_over_bf16"] = result[kind]["tokens_per_s"] / result["bf16"]["tokens_per_s"]
    return result


FP8_SWEEP_CASES = KERNEL_CASES + [(256, 512, 32, 8, 128)]
FP8_SWEEP_CONFIGS = [(64, 4, 3), (64, 2, 3), (64, 4, 4), (128, 2, 3), (128, 4, 2), (128, 4, 3),
                     (128, 8, 2), (128, 8, 3), (256, 8, 2)]  # fmt: skip


def _fp8_sweep(device: torch.device) -> list[dict]:
    """The decode kernel over fp8 and int8 pools under each of FP8_SWEEP_CONFIGS (BLOCK_N,
    warps, stages), against bf16 pools under their own configuration."""
    return [row for case in FP8_SWEEP_CASES for row in _fp8_sweep_case(*case, device=device)]


def _one_byte_pools(key_pool, value_pool, kind):
    """(pools, scales) as a quantized cache of `kind` stores `key_pool` and `value_pool`: fp8
    at one scale a head (0.25), int8 at one a token and head (fp16)."""
    if kind == "fp8":
        scales = torch.full((key_pool.shape[2],), 0.25, device=key_pool.device)
        return [(x.float() / 0.25).to(torch.float8_e4m3fn) for x in (key_pool, value_pool)], [
            scales,
            scales,
        ]
    pools, scales = [], []
    for x in (key_pool, value_pool):
        scale = (x.float().abs().amax(-1) / 127).clamp_min(1e-4).half()
        pools.append((x.float() / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8))
        scales.append(scale)
    return pools, scales


def _fp8_sweep_case(batch, context, heads_q, heads_kv, head_dim, *, device) -> list[dict]:
    q, key_pool, value_pool, _, metadata = _paged_case(
        batch, context, heads_q, heads_kv, head_dim, 16, device
    )

    def bf16():
        return paged_ops.paged_attention(q, key_pool, value_pool, **metadata)

    t_bf16, rows = harness.graph_seconds(bf16), []
    for kind in ("fp8", "int8"):
        pools, (k_scale, v_scale) = _one_byte_pools(key_pool, value_pool, kind)
        table = paged_ops.DECODE_CONFIGS_FP8 if kind == "fp8" else paged_ops.DECODE_CONFIGS_INT8
        default = table[head_dim]

        def run(pools=pools, k_scale=k_scale, v_scale=v_scale):
            return paged_ops.paged_attention(
                q, *pools, **metadata, k_scale=k_scale, v_scale=v_scale
            )

        for config in FP8_SWEEP_CONFIGS:
            table[head_dim] = config
            t = harness.graph_seconds(run)
            rows.append({"batch": batch, "context": context, "head_dim": head_dim, "kind": kind,
                         "config": list(config), f"{kind}_us": t * 1e6,
                         "bf16_us": t_bf16 * 1e6})  # fmt: skip
            print(f"{kind} sweep B={batch} L={context} D={head_dim} {config}: {t * 1e6:.1f} us "
                  f"(bf16 {t_bf16 * 1e6:.1f})", flush=True)  # fmt: skip
        table[head_dim] = default
    return rows


def kv_fp8(
    device: torch.device, requests: int, new_tokens: int, budget_gib: float, sweep: bool
) -> dict:
    from memfit.inference import LLM, SamplingParams

    prompts = _prompts(requests, 64, 512, 128256)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    result = {"model": "llama-3.2-1b", "requests": requests, "new_tokens": new_tokens,
              "kv_budget_gib": budget_gib}  # fmt: skip
    for kind in ("auto", "fp8", "int8"):
        llm = LLM(
            "llama-3.2-1b", device=device, kv_cache_bytes=int(budget_gib * GiB),
            kv_cache_dtype=kind,
        )  # fmt: skip
        row = _engine_run(llm, prompts, params)
        row["kv_tokens"] = llm.cache.pool.num_blocks * llm.cache.block_size
        result["bf16" if kind == "auto" else kind] = row
        print(
            f"KV {kind}: {row['tokens_per_s']:,.0f} tokens/s, pool {row['kv_tokens']:,} tokens, "
            f"{row['preemptions']} preemptions, {row['steps']} steps",
            flush=True,
        )
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for kind in ("fp8", "int8"):
        result[f"{kind}_over_bf16"] = result[kind]["tokens_per_s"] / result["bf16"]["tokens_per_s"]
    result["kv_tokens_ratio"] = result["fp8"]["kv_tokens"] / result["bf16"]["kv_tokens"]
    result["int8_kv_tokens_ratio"] = result["int8"]["kv_tokens"] / result["bf16"]["kv_tokens"]
    result["kernel"] = [
        _fp8_kernel_case(*case, device=device) for case in KERNEL_CASES if case[4] == 128
    ]
    if sweep:
        result["sweep"] = _fp8_sweep(device)
    return result


def _fp8_kernel_case(batch, context, heads_q, heads_kv, head_dim, *, device) -> dict:
    """The decode kernel over fp8 and int8 pools against the same kernel over bf16 ones (CUDA
    graphs)."""
    q, key_pool, value_pool, _, metadata = _paged_case(
        batch, context, heads_q, heads_kv, head_dim, 16, device
    )
    (k8, v8), (scales, _) = _one_byte_pools(key_pool, value_pool, "fp8")
    widened = paged_ops.paged_attention(q, k8.to(q.dtype) * 0.25, v8.to(q.dtype) * 0.25, **metadata)

    def bf16():
        return paged_ops.paged_attention(q, key_pool, value_pool, **metadata)

    def fp8():
        return paged_ops.paged_attention(q, k8, v8, **metadata, k_scale=scales, v_scale=scales)

    i8, token_scales = _one_byte_pools(key_pool, value_pool, "int8")
    widened_i8 = paged_ops.paged_attention(
        q, *(x.to(q.dtype) * s[..., None].to(q.dtype) for x, s in zip(i8, token_scales, strict=True)),
        **metadata,
    )  # fmt: skip

    def int8():
        return paged_ops.paged_attention(
            q, *i8, **metadata, k_scale=token_scales[0], v_scale=token_scales[1]
        )

    err = (fp8().float() - widened.float()).abs().max().item()
    err_i8 = (int8().float() - widened_i8.float()).abs().max().item()
    t_bf16, t_fp8, t_i8 = (
        harness.graph_seconds(bf16),
        harness.graph_seconds(fp8),
        harness.graph_seconds(int8),
    )
    elements = 2 * batch * context * heads_kv * head_dim
    scale_bytes = 2 * batch * context * heads_kv * 2
    row = {
        "batch": batch, "context": context, "heads_q": heads_q, "heads_kv": heads_kv,
        "head_dim": head_dim, "bf16_ms": t_bf16 * 1e3, "fp8_ms": t_fp8 * 1e3,
        "bf16_tb_s": 2 * elements / t_bf16 / 1e12, "fp8_tb_s": elements / t_fp8 / 1e12,
        "fp8_speedup": t_bf16 / t_fp8, "max_abs_diff_vs_widened": err,
        "int8_ms": t_i8 * 1e3, "int8_tb_s": (elements + scale_bytes) / t_i8 / 1e12,
        "int8_speedup": t_bf16 / t_i8, "int8_max_abs_diff_vs_widened": err_i8,
    }  # fmt: skip
    print(
        f"decode B={batch} L={context}: bf16 {row['bf16_ms']:.3f} ms, fp8 {row['fp8_ms']:.3f} ms "
        f"({row['fp8_speedup']:.2f}x, {row['fp8_tb_s']:.2f} TB/s), int8 {row['int8_ms']:.3f} ms "
        f"({row['int8_speedup']:.2f}x, {row['int8_tb_s']:.2f} TB/s), max diff vs the widened "
        f"pools {err:.1e} / {err_i8:.1e}",
        flush=True,
    )
    return row


def _hf_generate_batch(prompts, new_tokens, device) -> dict:
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from memfit.models import PRESETS

    shape = PRESETS["llama-3.2-1b"]
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.max_seq_len,
        rms_norm_eps=shape.rms_norm_eps, rope_theta=shape.rope_theta,
        rope_scaling=shape.rope_scaling, tie_word_embeddings=shape.tie_embeddings,
    )  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)  # built straight in bf16, as memfit's model is
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    try:  # its paged cache's attention (generate_batch also switches to it on its own)
        model.set_attn_implementation("sdpa_paged")
    except (AttributeError, ValueError) as error:
        print(f"HF: could not select sdpa_paged up front ({error})", flush=True)
    generation = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    model.generate_batch(prompts[:8], generation_config=generation, progress_bar=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=generation, progress_bar=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    result = {
        "tokens_per_s": generated / seconds, "seconds": seconds, "generated_tokens": generated,
        "peak_gib": torch.cuda.max_memory_allocated() / GiB,
        "transformers": transformers.__version__,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }  # fmt: skip
    print(f"HF generate_batch: {result['tokens_per_s']:,.0f} tokens/s", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def batch1(device: torch.device, copy_bw: float, presets: list[str], new_tokens: int) -> list:
    from memfit.inference import LLM, SamplingParams
    from memfit.models import PRESETS

    rows = []
    for name in presets:
        config = PRESETS[name]
        llm = LLM(name, device=device)
        prompt = _prompts(1, 128, 128, config.vocab_size)
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True), progress=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompt, params, progress=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        # time per decode token from the engine's own clock (the prefill step excluded)
        per_token = llm.last_stats["decode_seconds"] / max(llm.last_stats["decode_steps"], 1)
        # the captured decode step alone, replayed back to back: its GPU time, without the
        # host's scheduling and sampling between steps
        graph = llm.engine.graphs.graphs[1]
        graph_s = harness.median(harness.time_calls(graph.replay, warmup=3, repeat=50))
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.model.parameters())
        kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
        mean_context = 128 + new_tokens / 2
        limit_s = (weight_bytes + kv_per_token * mean_context) / copy_bw
        row = {
            "model": name, "prompt": 128, "new_tokens": new_tokens,
            "tokens_per_s": 1 / per_token, "ms_per_token": per_token * 1e3,
            "end_to_end_tokens_per_s": new_tokens / seconds, "weight_bytes": weight_bytes,
            "limit_ms_per_token": limit_s * 1e3, "of_limit": limit_s / per_token,
            "graph_ms_per_token": graph_s * 1e3, "graph_of_limit": limit_s / graph_s,
        }  # fmt: skip
        print(
            f"batch-1 decode {name}: {row['tokens_per_s']:.1f} tokens/s, {per_token * 1e3:.3f} "
            f"ms/token, limit {limit_s * 1e3:.3f} ms: {row['of_limit']:.1%} of the bandwidth limit "
            f"(the captured step alone: {graph_s * 1e3:.3f} ms, {row['graph_of_limit']:.1%})",
            flush=True,
        )
        rows.append(row)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["kernel", "prefill", "throughput", "batch1"])
    parser.add_argument("--sweep", action="store_true", help="time kernel configurations too")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch1-models", nargs="+", default=["llama-3.2-1b", "llama-3-8b"])
    parser.add_argument(
        "--kv-budget-gib", type=float, default=1.0, help="kv_fp8, weights: the KV pool of each run"
    )
    parser.add_argument("--weights-model", default="llama-3-8b", help="weights: the model")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/inference.py needs a CUDA GPU")
    device = torch.device("cuda")
    run = {"env": harness.environment()}
    copy_bw = copy_bandwidth(device)
    run["copy_tb_s"] = copy_bw / 1e12
    print(f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s", flush=True)
    if "kernel" in args.parts:
        run["kernel"] = kernel(device, copy_bw, args.sweep)
    if "prefill" in args.parts:
        run["prefill"] = prefill(device, args.sweep)
    if "throughput" in args.parts:
        run["throughput"] = throughput(device, args.requests, args.new_tokens)
    if "kv_fp8" in args.parts:
        run["kv_fp8"] = kv_fp8(
            device, args.requests, args.new_tokens, args.kv_budget_gib, args.sweep
        )
    if "weights" in args.parts:
        run["weights"] = weights(
            device, args.weights_model, args.requests, args.new_tokens, args.kv_budget_gib
        )
    if "batch1" in args.parts:
        run["batch1"] = batch1(device, copy_bw, args.batch1_models, args.new_tokens)
    if args.out is not None:
        harness.RESULTS = args.out
    print(f"results: {harness.append_results('inference', run)}")


if __name__ == "__main__":
    main()
