import json

import pytest
import torch

from memfit.cli.main import main
from memfit.inference.generate import sample
from memfit.inference.paged import paged_step
from memfit.inference.paged_cache import PagedKVCache
from memfit.models import PRESETS, ModelConfig
from memfit.models.llama import build_model
from memfit.planner import GPUS
from memfit.planner.memory import CUDA_CONTEXT_BYTES
from memfit.planner.serve import (
    CUDA_GRAPHS_DRIVER_BYTES,
    KERNEL_MODULES_BYTES,
    SAMPLING_BYTES_PER_LOGIT,
    default_cuda_graph_batch_sizes,
    kv_bytes_per_token,
    kv_pool_bytes,
    plan_serve,
    serve_fixes,
    step_memory,
    weight_bytes,
)

KiB, MiB, GiB = 2**10, 2**20, 2**30

# h 64, q 64 (4 heads of 16), kv 32 (2 heads), f 96, V 100, 2 layers, untied
SMALL = ModelConfig(
    name="small",
    vocab_size=100,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=96,
    max_seq_len=256,
)
LLAMA_3_2_1B = PRESETS["llama-3.2-1b"]  # tied embeddings, GQA 32/8, head_dim 64


def test_small_model_by_hand():
    # parameters per layer: qkv 64 x 128 + out 64 x 64 + gate_up and down 3 x 64 x 96 + 2 norms
    # = 8192 + 4096 + 18432 + 128 = 30848; embeddings 2 x 100 x 64; final norm 64
    params = 2 * 30848 + 12800 + 64
    assert params == 74560
    assert weight_bytes(SMALL, "bf16") == 2 * params
    model = build_model(SMALL, device="meta")
    assert weight_bytes(SMALL, "fp32") == sum(4 * p.numel() for p in model.parameters())
    # K and V x 2 layers x 2 heads x 16 x 2 bytes
    assert kv_bytes_per_token(SMALL, "bf16") == 256
    assert PagedKVCache.bytes_per_block(SMALL, 16, torch.bfloat16) == 16 * 256

    step = step_memory(SMALL, tokens=64, rows=4, table_width=7)
    # inputs: 4 x 8 x 64 (ids, positions, slots, sequence index) + 8 x 4 (logit indices)
    # + 4 x 4 x 7 (block table) + 4 x 4 + 4 x 5 (lengths, starts); then the forward's cos and
    # sin, 2 x 4 x 64 x 16
    assert step["inputs"] == 2048 + 32 + 112 + 16 + 20 == 2228
    inputs = 2228 + 8192
    assert step["attention"] == inputs + 2 * 64 * (3 * 64 + 3 * 64 + 4 * 32) == 75956
    assert step["mlp"] == inputs + 2 * 64 * (3 * 64 + 3 * 96) == 71860
    assert step["last_hidden"] == inputs + 2 * 68 * 64
    assert step["logits"] == inputs + 2 * 4 * (64 + 100)
    assert step["forward"] == 75956
    assert step["sampling"] == 2 * 4 * 100 + 36 * 4 * 100 == 15200
    assert step["peak"] == 75956  # allocated at once
    assert step["held"] == 75956 + 36 * 4 * 100  # the forward's segments and the sampler's

    plan = plan_serve(
        SMALL,
        2 * GiB,
        memory_fraction=0.9,
        block_size=16,
        max_step_tokens=64,
        max_running=4,
        seq_len=100,
        cuda_graph_batch_sizes=(1, 2, 4),
    )
    assert (plan.step_tokens, plan.step_rows, plan.step_peak_bytes) == (64, 4, 75956)
    assert plan.step_held_bytes == 75956 + 14400
    # graphs: the static inputs of batch 4 (4 x 8 x 4 + 4 x 4 x 7 + 4 x 4 + 4 x 5 = 276), the
    # warm-up and capture streams' cuBLAS workspaces, and the pool: batch 4's forward (cos and
    # sin 2 x 4 x 4 x 16 = 512, attention 2 x 4 x 512 = 4096), then batch 2's (256 + 2048) beside
    # batch 4's logits (2 x 4 x 100 = 800), then batch 1's (128 + 1024) beside 800 + 400
    graph_pool = 276 + 2 * 32 * MiB + max(4608, 800 + 2304, 1200 + 1152)
    assert plan.cuda_graph_pool_bytes == graph_pool
    assert plan.cuda_graph_bytes == graph_pool + CUDA_GRAPHS_DRIVER_BYTES
    slack = int(0.05 * (75956 + 14400 + graph_pool))
    assert plan.allocator_slack_bytes == slack
    held = 75956 + 14400
    runtime = 32 * MiB + slack + 600 * MiB + KERNEL_MODULES_BYTES
    available = int(0.9 * 2 * GiB) - 2 * params - held - plan.cuda_graph_bytes - runtime
    assert plan.cuda_context_bytes == CUDA_CONTEXT_BYTES == 600 * MiB  # the training plan's
    assert plan.kernel_modules_bytes == KERNEL_MODULES_BYTES
    assert plan.available_bytes == available
    # whole blocks, one of them the cache's scratch block
    assert plan.num_blocks == available // 4096 - 1
    assert plan.kv_pool_bytes == (plan.num_blocks + 1) * 4096
    assert plan.kv_tokens == 16 * plan.num_blocks
    assert plan.blocks_per_sequence == 7  # ceil(100 / 16)
    assert plan.max_sequences == plan.num_blocks // 7
    assert plan.fits and plan.shortfall_bytes == 0
    assert sum(plan.breakdown.values()) == plan.budget_bytes
    assert 0 <= plan.breakdown["unused"] < 4096
    # the engine sizes its pool from the plan: exactly the planned bytes and blocks
    cache = PagedKVCache.from_budget(
        SMALL, plan.kv_pool_bytes, block_size=16, dtype=torch.bfloat16, device="meta"
    )
    assert cache.pool.num_blocks == plan.num_blocks
    assert 2 * cache.keys.numel() * 2 == plan.kv_pool_bytes
    assert kv_pool_bytes(SMALL, 2 * GiB, max_step_tokens=64, max_running=4, seq_len=100) > 0


def test_gpu_by_name_object_or_bytes_and_dtype_by_name_or_torch():
    h100 = GPUS["h100-sxm"]
    by_name = plan_serve(PRESETS["llama-1b"], "h100-sxm")
    assert by_name == plan_serve(PRESETS["llama-1b"], h100)
    by_bytes = plan_serve(PRESETS["llama-1b"], h100.memory_bytes)
    assert by_bytes.gpu is None and by_bytes.num_blocks == by_name.num_blocks
    assert plan_serve(PRESETS["llama-1b"], h100, dtype=torch.bfloat16) == by_name
    assert plan_serve(PRESETS["llama-1b"], h100, dtype="fp32").kv_bytes_per_token == 2 * (
        by_name.kv_bytes_per_token
    )


def test_presets_on_an_h100_are_sensible():
    h100 = GPUS["h100-sxm"]
    # K and V x 32 layers x 8 heads x 128 x 2 bytes
    assert kv_bytes_per_token(PRESETS["llama-3-8b"]) == 128 * KiB
    assert kv_bytes_per_token(PRESETS["llama-1b"]) == 128 * KiB  # 16 layers x 16 heads (MHA)
    assert kv_bytes_per_token(LLAMA_3_2_1B) == 32 * KiB

    plan = plan_serve(PRESETS["llama-3-8b"], h100, seq_len=4096)
    assert plan.weights_bytes == 2 * 8_030_261_248  # Meta's published count
    assert 50 * GiB < plan.kv_pool_bytes < 60 * GiB
    assert plan.kv_tokens == plan.kv_pool_bytes // (128 * KiB) - 16  # less the scratch block
    assert plan.max_sequences >= 100 and plan.blocks_per_sequence == 256
    # the step peaks in sampling: 36 bytes per logit of 256 rows of 128256
    assert plan.step_peak_bytes == plan.step_phases["sampling"]
    assert plan.step_peak_bytes == 2 * 256 * 128256 + SAMPLING_BYTES_PER_LOGIT * 256 * 128256
    assert sum(plan.breakdown.values()) == plan.budget_bytes
    small = plan_serve(LLAMA_3_2_1B, h100, seq_len=4096)
    assert small.weights_bytes == 2 * 1_235_814_400  # tied embeddings counted once
    assert small.kv_tokens > 4 * plan.kv_tokens and small.fits


def test_each_knob_moves_the_pool_the_right_way():
    model, h100 = PRESETS["llama-3-8b"], GPUS["h100-sxm"]
    base = plan_serve(model, h100)
    assert plan_serve(model, h100, memory_fraction=0.95).num_blocks > base.num_blocks
    assert plan_serve(model, h100, max_step_tokens=16384).num_blocks < base.num_blocks
    assert plan_serve(model, h100, cuda_graph_batch_sizes=()).num_blocks > base.num_blocks
    # the present Engine samples one row at a time: its step peaks in the MLP instead
    one_row = plan_serve(model, h100, sampled_rows=1)
    assert one_row.step_peak_bytes == one_row.step_phases["mlp"] < base.step_peak_bytes
    assert plan_serve(model, h100, block_size=32).kv_bytes_per_block == 2 * base.kv_bytes_per_block
    # the engine's buckets (inference/cuda_graphs.py)
    assert default_cuda_graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_cuda_graph_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert default_cuda_graph_batch_sizes(1) == (1,)


def test_quantized_weights_are_counted_as_stored_plus_one_dequantized_layer():
    from memfit.nn.quant import quantize_head, quantize_model

    model, h100 = PRESETS["llama-3-8b"], GPUS["h100-sxm"]
    base = plan_serve(model, h100)
    int8, int4 = (plan_serve(model, h100, quantize=kind) for kind in ("int8", "int4"))
    assert base.weights_bytes > int8.weights_bytes > int4.weights_bytes
    assert base.num_blocks < int8.num_blocks < int4.num_blocks
    # the stored bytes of a real quantized model (its head in int8, as LLM holds it), plus
    # gate_up in bf16 (the largest layer)
    tiny = build_model(SMALL, dtype=torch.bfloat16)
    quantize_model(tiny, "int4", dtype=torch.bfloat16)
    quantize_head(tiny, dtype=torch.bfloat16)
    stored = sum(t.numel() * t.element_size() for t in [*tiny.parameters(), *tiny.buffers()])
    planned = plan_serve(SMALL, h100, quantize="int4").weights_bytes - 2 * 2 * 96 * 64
    assert stored <= planned <= stored + 512 * 6 * len(tiny.layers) * 4  # allocation granules


def test_a_model_that_does_not_fit_says_by_how_much():
    plan = plan_serve(PRESETS["llama-3-70b"], "h100-sxm", seq_len=4096)
    assert not plan.fits and plan.num_blocks == 0 and plan.kv_pool_bytes == 0
    assert plan.shortfall_bytes > 60 * GiB
    with pytest.raises(ValueError, match=r"does not fit h100-sxm.*weights \(131\.42 GiB\)"):
        plan.check_fits()
    with pytest.raises(ValueError, match="GiB short"):
        kv_pool_bytes(PRESETS["llama-3-70b"], "h100-sxm")
    # a closer miss names the single changes that fit, each of which does
    close = plan_serve(PRESETS["llama-3-8b"], "a10g", seq_len=131072)
    assert not close.fits
    fixes = dict(serve_fixes(close))
    assert any(label.startswith("--seq-len") for label in fixes)
    assert any(label.startswith("--gpu") for label in fixes)
    assert all(fixed.fits for fixed in fixes.values())
    assert "single changes that fit: --seq-len" in close.error_message()


def test_bad_input_names_the_allowed_values():
    with pytest.raises(ValueError, match="int8.*bf16, fp16, fp32"):
        plan_serve(PRESETS["tiny"], "h100-sxm", dtype="int8")
    with pytest.raises(ValueError, match=r"memory_fraction must be in \(0, 1\], got 1.5"):
        plan_serve(PRESETS["tiny"], "h100-sxm", memory_fraction=1.5)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        plan_serve(PRESETS["tiny"], "h100-sxm", block_size=0)
    with pytest.raises(ValueError, match="within 1..max_running=8"):
        plan_serve(PRESETS["tiny"], "h100-sxm", max_running=8, cuda_graph_batch_sizes=(16,))
    with pytest.raises(ValueError, match="unknown GPU 'h100'"):
        plan_serve(PRESETS["tiny"], "h100")
    with pytest.raises(ValueError, match="total memory in bytes"):
        plan_serve(PRESETS["tiny"], -1)


def test_cli_prints_the_serving_plan_and_json(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--serve", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "KV cache pool" in out and "weights" in out and "CUDA graphs" in out
    assert "sequences of 4,096 tokens" in out and "128 KiB per token" in out

    command = ["plan", "--model", "llama-3-8b", "--serve", "--seq-len", "4096", "--json"]
    assert main([*command, "--memory-fraction", "0.8", "--max-step-tokens", "1024"]) == 0
    planned = json.loads(capsys.readouterr().out)
    expected = plan_serve(
        PRESETS["llama-3-8b"], "h100-sxm", seq_len=4096, memory_fraction=0.8, max_step_tokens=1024
    )
    assert planned["fits"] and planned["kv"]["bytes_per_token"] == 128 * KiB
    assert planned["kv"]["num_blocks"] == expected.num_blocks
    assert planned["kv"]["max_sequences"] == expected.max_sequences
    assert sum(planned["breakdown"].values()) == planned["budget_bytes"]


def test_cli_serving_plan_that_does_not_fit(capsys):
    assert main(["plan", "--model", "llama-3-70b", "--serve"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "131.42 GiB" in out and "Traceback" not in out
    assert main(["plan", "--model", "llama-3-70b", "--serve", "--json"]) == 1
    planned = json.loads(capsys.readouterr().out)
    assert not planned["fits"] and planned["shortfall_bytes"] > 60 * GiB
    assert (
        main(["plan", "--model", "llama-3-8b", "--gpu", "a10g", "--serve", "--seq-len", "131072"])
        == 1
    )
    assert "--seq-len" in capsys.readouterr().out
    assert main(["plan", "--serve", "--recommend"]) == 2
    assert "--serve plans one GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_paged_step_allocates_what_the_plan_says_on_cuda():
    """A mixed step (255 decodes and a 1793-token prefill chunk: 2048 tokens, 256 logit rows) of
    llama-3-8b's shapes (one layer) allocates the planned forward peak: the allocator adds its
    rounding and, reusing a freed block, at most an unsplit remainder (under 1 MiB). Sampling all
    rows with top-k and top-p adds SAMPLING_BYTES_PER_LOGIT per logit."""
    config = PRESETS["llama-3-8b"].replace(num_layers=1)
    model = build_model(config, device="cuda").to(torch.bfloat16).eval()
    cache = PagedKVCache(
        config, num_blocks=1024, block_size=16, dtype=torch.bfloat16, device="cuda"
    )
    rows, tokens = 256, 2048
    paged_step(model, cache, list(range(rows - 1)), [[1] * 16] * (rows - 1))
    prefill = torch.randint(0, config.vocab_size, (tokens - rows + 1,)).tolist()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logits = paged_step(model, cache, list(range(rows)), [[2]] * (rows - 1) + [prefill])
    measured = torch.cuda.max_memory_allocated() - base
    width = -(-len(prefill) // 16)
    planned = step_memory(config, tokens=tokens, rows=rows, table_width=width, sample=False)
    assert 0 <= measured - planned["peak"] < MiB

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sample(logits, temperature=0.8, top_k=50, top_p=0.9)
    measured = torch.cuda.max_memory_allocated() - base
    expected = SAMPLING_BYTES_PER_LOGIT * rows * config.vocab_size
    assert measured == pytest.approx(expected, rel=0.01)


def test_an_fp8_kv_cache_holds_twice_the_tokens_and_is_a_fix():
    model, h100 = PRESETS["llama-3-8b"], GPUS["h100-sxm"]
    base, fp8 = plan_serve(model, h100), plan_serve(model, h100, kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token * 2 == base.kv_bytes_per_token == kv_bytes_per_token(model)
    assert fp8.weights_bytes == base.weights_bytes
    # the same memory in blocks of half the bytes (the scratch block taken once)
    assert fp8.num_blocks + 1 - 2 * (base.num_blocks + 1) in (0, 1)
    assert fp8.to_json()["kv"]["dtype"] == "fp8"
    # a plan short of one sequence's blocks: an fp8 cache is one of the changes that fit
    close = plan_serve(model, "l4", seq_len=24576)
    assert not close.fits
    fixes = dict(serve_fixes(close))
    assert "--kv-cache-dtype fp8" in fixes and fixes["--kv-cache-dtype fp8"].fits
    # the other changes keep the quantized weights and the fp8 cache the plan was made with
    quantized = plan_serve(model, "l4", seq_len=65536, quantize="int4", kv_cache_dtype="fp8")
    for _, fixed in serve_fixes(quantized):
        assert fixed.quantize == "int4" and fixed.kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        plan_serve(model, h100, kv_cache_dtype="int3")
    # int8 keeps an fp16 scale a token and kv head beside head_dim bytes: what the cache takes
    from memfit.inference.paged_cache import PagedKVCache

    int8 = plan_serve(model, h100, kv_cache_dtype="int8")
    assert int8.kv_bytes_per_token * 16 == PagedKVCache.bytes_per_block(
        model, 16, torch.bfloat16, "int8"
    )
    assert int8.kv_bytes_per_token * 2 * model.head_dim == base.kv_bytes_per_token * (
        model.head_dim + 2
    )


def test_cli_plans_an_fp8_kv_cache(capsys):
    command = ["plan", "--model", "llama-3-8b", "--serve", "--seq-len", "4096"]
    assert main([*command, "--kv-cache-dtype", "fp8"]) == 0
    assert "64 KiB per token" in capsys.readouterr().out
