"""The engine on a GPU (the CPU twin is test_engine.py): the Triton paged kernels and decode
steps replayed from CUDA graphs give the greedy tokens of full recompute for a mixed batch, with
a roomy pool and with one so small that sequences are preempted; the offline LLM API sizes its
pool from the GPU and reports its stats."""

import gc

import pytest
import torch

from memfit.inference import LLM, Engine, PagedKVCache, SamplingParams
from memfit.inference.paged import paged_step
from memfit.models import PRESETS, build_model
from tests.inference.test_engine import full_recompute, prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(("num_blocks", "max_step_tokens"), [(64, 2048), (8, 6)])
def test_graphs_and_kernels_match_full_recompute(num_blocks, max_step_tokens):
    model = build_model(PRESETS["tiny"], device="cuda", seed=0).eval()
    steps, lengths = 12, (3, 9, 5, 11, 1, 17)
    cache = PagedKVCache(
        model.config, num_blocks=num_blocks, block_size=4, dtype=torch.float32, device="cuda"
    )
    engine = Engine(
        model, cache, max_step_tokens=max_step_tokens, max_running=8, max_seq_len=64,
        cuda_graphs=True,
    )  # fmt: skip
    batch = prompts(lengths)
    for prompt in batch:
        engine.add(prompt, SamplingParams(max_tokens=steps))
    outputs = engine.run()
    for prompt, got in zip(batch, outputs, strict=True):
        assert got == full_recompute(model, prompt, steps)
    assert engine.decode_steps > 0
    assert (engine.preemptions > 0) == (num_blocks == 8)
    assert cache.pool.num_free == num_blocks and not cache.tables


def test_llm_on_a_preset_fills_the_gpu_and_reports():
    gc.collect()
    held = torch.cuda.memory_allocated()  # by earlier tests of this process: the LLM leaves it
    llm = LLM("tiny", memory_fraction=0.3, max_running=16)
    total = torch.cuda.get_device_properties(0).total_memory
    pool = llm.cache.keys.numel() * llm.cache.keys.element_size() * 2
    assert 0.2 * total - held < pool < 0.3 * total - held
    outputs = llm.generate(prompts((5, 30, 2)), SamplingParams(max_tokens=20), progress=False)
    assert [len(o.token_ids) for o in outputs] == [20, 20, 20]
    assert all(o.finish_reason == "length" for o in outputs)
    stats = llm.last_stats
    assert stats["generated_tokens"] == 60 and stats["decode_steps"] > 0
    assert 0 <= stats["kv_waste_mean"] < 1


def test_pipelined_sampling_equals_unpipelined_steps(monkeypatch):
    """Sampled rows (seeded, with penalties and log-probs) in pipelined steps draw what the same
    captured steps draw one at a time."""
    model = build_model(PRESETS["tiny"], device="cuda", seed=0).eval()
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, seed=5, logprobs=True),
        SamplingParams(max_tokens=14, temperature=1.1, top_p=0.8, seed=6),
        SamplingParams(max_tokens=17, temperature=0.6, top_k=30, repetition_penalty=1.2, seed=7),
    ]
    results = []
    for pipelined in (True, False):
        if not pipelined:
            monkeypatch.setattr(Engine, "_can_pipeline", lambda self: False)
        cache = PagedKVCache(
            model.config, num_blocks=64, block_size=4, dtype=torch.float32, device="cuda"
        )
        engine = Engine(model, cache, max_running=4, max_seq_len=64, cuda_graphs=True, seed=0)
        for prompt, p in zip(prompts((4, 13, 7)), params, strict=True):
            engine.add(prompt, p)
        outputs = engine.run()
        assert [len(o) for o in outputs] == [20, 14, 17]
        results.append([(r.output, r.logprobs) for r in engine.requests.values()])
    assert [tokens for tokens, _ in results[0]] == [tokens for tokens, _ in results[1]]
    torch.testing.assert_close(results[0][0][1], results[1][0][1])


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_cache_in_graphs_gives_the_eager_tokens_and_close_logits(dtype, kind):
    model = build_model(PRESETS["tiny"], device="cuda", seed=0).to(dtype).eval()
    steps, lengths = 16, (3, 9, 5, 40, 1, 17)
    batch = prompts(lengths)
    calibration = [list(range(7, 71)), list(range(100, 164))]

    def quantized_cache():
        cache = PagedKVCache(
            model.config, num_blocks=64, block_size=4, dtype=dtype, device="cuda", kv_dtype=kind
        )
        cache.calibrate(model, calibration)
        return cache

    outputs = {}
    for graphs in (False, True):
        engine = Engine(
            model, quantized_cache(), max_step_tokens=2048, max_running=8, max_seq_len=80,
            cuda_graphs=graphs,
        )  # fmt: skip
        for prompt in batch:
            engine.add(prompt, SamplingParams(max_tokens=steps))
        outputs[graphs] = engine.run()
    assert outputs[True] == outputs[False]
    # a prefill's logits through the quantized cache against a full-precision one: a few percent
    # apart (the random tiny model's near-flat logits make greedy continuations a poor measure
    # here; CPU: test_kv_quant.py; a real model's agreement: benchmarks/quant_quality.py --kv)
    full = PagedKVCache(model.config, num_blocks=64, block_size=4, dtype=dtype, device="cuda")
    want = paged_step(model, full, list(range(len(batch))), batch).float()
    got = paged_step(model, quantized_cache(), list(range(len(batch))), batch).float()
    assert (got - want).norm() / want.norm() < 0.05


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_llm_with_a_quantized_cache_holds_twice_the_blocks(kind):
    gc.collect()
    full = LLM("tiny", memory_fraction=0.3, max_running=16)
    blocks = full.cache.pool.num_blocks
    del full
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM("tiny", memory_fraction=0.3, max_running=16, kv_cache_dtype=kind)
    # (within 1%: what the first LLM leaves allocated counts against the second's budget; int8
    # keeps an fp16 scale a token and head beside each head_dim bytes)
    config = llm.config
    ratio = 2 if kind == "fp8" else 2 * config.head_dim / (config.head_dim + 2)
    assert abs(llm.cache.pool.num_blocks - ratio * blocks) <= 0.01 * blocks
    outputs = llm.generate(prompts((5, 30, 2)), SamplingParams(max_tokens=20), progress=False)
    assert [len(o.token_ids) for o in outputs] == [20, 20, 20]


def test_int4_weights_decode_the_same_in_graphs_and_eager_and_in_fp32_products(monkeypatch):
    """A model held in int4 on the GPU: its batch-1 decode steps (the packed-half GEMV, groups of
    128 and, for down's 352 features, of 32) give the same greedy tokens replayed from CUDA
    graphs as eagerly, and mostly the tokens of the fp32-product kernel (near ties may differ)."""
    from memfit.ops.quant import gemv as gemv_module

    batch = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def tokens(cuda_graphs):
        llm = LLM("tiny", device="cuda", quantize="int4", max_running=1, memory_fraction=0.3,
                  cuda_graphs=cuda_graphs)  # fmt: skip
        return [out.token_ids for out in llm.generate(batch, params, progress=False)]

    graphs = tokens(True)
    assert graphs == tokens(False)
    monkeypatch.setattr(gemv_module, "INT4_HALF", False)
    fp32 = tokens(True)
    same = sum(a == b for x, y in zip(graphs, fp32, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.75 * 8 * len(batch), (graphs, fp32)
