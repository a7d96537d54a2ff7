"""The continuous-batching engine: greedy outputs token-identical to full recompute for prompts
of different lengths, also when the pool is so small that sequences are preempted and
recomputed, and with prefill in chunks; sampling parameters and prompts checked up front."""

import contextlib

import pytest
import torch

from memfit.inference import Engine, PagedKVCache, SamplingParams
from memfit.models import PRESETS, build_model
from memfit.ops._triton import interpreter_enabled, triton_on_cpu


def full_recompute(model, prompt, steps):
    """Greedy decoding without a cache: the whole sequence through the model for each token."""
    sequence = torch.tensor([prompt], device=next(model.parameters()).device)
    for _ in range(steps):
        with torch.no_grad():
            next_token = model(sequence)[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
    return sequence[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def model():
    return build_model(PRESETS["tiny"], seed=0).eval()


def prompts(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    vocab = PRESETS["tiny"].vocab_size
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize(
    ("num_blocks", "max_step_tokens", "preempts", "kernels"),
    [
        (32, 2048, False, False),  # roomy
        (6, 2048, True, False),  # preemption
        (32, 4, False, False),  # chunked prefill
        (6, 5, True, True),  # both, with the Triton paged kernels (interpreted)
    ],
)
def test_greedy_outputs_match_full_recompute(model, num_blocks, max_step_tokens, preempts, kernels):
    if kernels and not interpreter_enabled():
        pytest.skip("the kernels on CPU need TRITON_INTERPRET=1 (test_engine_gpu.py runs them)")
    steps, lengths = 6, (3, 9, 5, 11)
    cache = PagedKVCache(
        model.config, num_blocks=num_blocks, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache, max_step_tokens=max_step_tokens)
    batch = prompts(lengths)
    for prompt in batch:
        engine.add(prompt, SamplingParams(max_tokens=steps))
    with triton_on_cpu() if kernels else contextlib.nullcontext():
        outputs = engine.run()
    for prompt, got in zip(batch, outputs, strict=True):
        assert got == full_recompute(model, prompt, steps)
    assert (engine.preemptions > 0) == preempts
    assert engine.peak_blocks <= num_blocks
    assert cache.pool.num_free == num_blocks and not cache.tables


def test_stop_tokens_and_max_tokens_end_a_request(model):
    cache = PagedKVCache(
        model.config, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu"
    )
    batch = prompts((4, 7))
    greedy = [full_recompute(model, p, 5) for p in batch]
    engine = Engine(model, cache)
    engine.add(batch[0], SamplingParams(max_tokens=5, stop_token_ids=[greedy[0][2]]))
    engine.add(batch[1], SamplingParams(max_tokens=2))
    first, second = engine.run()
    assert first == greedy[0][: greedy[0].index(greedy[0][2])]
    assert second == greedy[1][:2]


def test_seeded_sampling_repeats(model):
    def run():
        cache = PagedKVCache(
            model.config, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu"
        )
        engine = Engine(model, cache)
        engine.add(prompts((5,))[0], SamplingParams(max_tokens=8, temperature=1.0, seed=7))
        return engine.run()[0]

    assert run() == run()


def test_bad_requests_say_what_is_wrong(model):
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(TypeError):
        SamplingParams(nucleus=0.9)  # an unknown parameter
    cache = PagedKVCache(
        model.config, num_blocks=2, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache)
    with pytest.raises(ValueError, match="exceeds the KV pool's 8"):
        engine.add(list(range(5)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add([])


def test_captured_decode_inputs_give_the_eager_step(model):
    """The decode step's static buffers (what the CUDA graphs replay; run eagerly here), padded to
    a bucket with scratch-block rows, give the logits of an ordinary paged step."""
    from memfit.inference import paged_step
    from memfit.inference.cuda_graphs import DecodeGraphs

    def cache():
        return PagedKVCache(
            model.config, num_blocks=24, block_size=4, dtype=torch.float32, device="cpu"
        )

    batch = prompts((3, 9, 6))
    eager, static = cache(), cache()
    for c in (eager, static):
        paged_step(model, c, [0, 1, 2], batch)  # the prompts' prefill
    graphs = DecodeGraphs(model, static, max_batch=8, max_seq_len=40)
    assert graphs.bucket(3) == 4 and graphs.buckets == [1, 2, 4, 8]
    for step in range(5):  # crosses block boundaries
        tokens = [(7 * step + i) % 200 for i in range(3)]
        expected = paged_step(model, eager, [0, 1, 2], [[t] for t in tokens])
        got = graphs.run([0, 1, 2], tokens)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert static.lengths == eager.lengths
    scratch = static.keys[:, static.scratch_block]
    blocks = static.scratch_block  # the same blocks, the same keys (up to a batch of 4 vs 3)
    torch.testing.assert_close(static.keys[:, :blocks], eager.keys[:, :blocks])
    assert scratch.abs().sum() > 0  # the padding row wrote there, and only there


@pytest.mark.parametrize("kernels", [False, True])
def test_captured_mixed_step_inputs_give_the_eager_step(model, kernels):
    """A step of prefill chunks beside decodes through the static buffers of StepGraphs (what
    its CUDA graphs replay; run eagerly here), padded to a (tokens, sequences) bucket with
    scratch-block tokens and empty sequences: the logits of an ordinary paged step, with the
    reference attention and with the Triton chunk kernel (interpreted)."""
    if kernels and not interpreter_enabled():
        pytest.skip("the kernels on CPU need TRITON_INTERPRET=1 (test_engine_gpu.py runs them)")
    from memfit.inference import paged_step
    from memfit.inference.cuda_graphs import StepGraphs, token_buckets

    def cache():
        return PagedKVCache(
            model.config, num_blocks=40, block_size=4, dtype=torch.float32, device="cpu"
        )

    assert token_buckets(1000) == [16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                                   640, 768, 896, 1000]  # fmt: skip
    assert token_buckets(2048)[-5:] == [1024, 1280, 1536, 1792, 2048] and token_buckets(8) == [8]
    eager, static = cache(), cache()
    first = prompts((3, 9, 6))
    for c in (eager, static):
        paged_step(model, c, [0, 1, 2], first)  # three sequences, then decodes beside new ones
    graphs = StepGraphs(model, static, max_tokens=64, max_seqs=8, max_seq_len=60)
    assert graphs.seq_buckets == [4, 8] and (16, 8) in graphs.buckets()
    assert graphs.bucket(19, 5) == (32, 8) and graphs.bucket(65, 1) is None
    for step, lengths in enumerate([(1, 1, 1, 13), (1, 5, 1, 1, 7), (1, 1, 1, 1, 1)]):
        seqs = list(range(len(lengths)))
        tokens = [[(11 * step + 3 * i + j) % 200 for j in range(n)] for i, n in enumerate(lengths)]
        with triton_on_cpu() if kernels else contextlib.nullcontext():
            expected = paged_step(model, eager, seqs, tokens)
            got = graphs.run(seqs, tokens)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert static.lengths == eager.lengths and static.tables == eager.tables
    blocks = static.scratch_block
    torch.testing.assert_close(static.keys[:, :blocks], eager.keys[:, :blocks])


def test_an_engine_with_step_graphs_matches_full_recompute(model):
    """Mixed steps through StepGraphs (run eagerly on a CPU), with chunked prefill, preemption
    and prefix caching: the greedy outputs of full recompute."""
    from memfit.inference.cuda_graphs import StepGraphs

    batch = prompts((3, 9, 5, 11, 9))
    batch[4][:8] = batch[1][:8]  # two full blocks shared with request 1
    cache = PagedKVCache(
        model.config, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache, max_step_tokens=7, max_running=4, prefix_caching=True)
    engine.step_graphs = StepGraphs(
        model, cache, max_tokens=7, max_seqs=4, max_seq_len=engine.max_context
    )
    ran = []
    run = engine.step_graphs.run
    engine.step_graphs.run = lambda ids, *rest: ran.append(len(ids)) or run(ids, *rest)
    for prompt in batch:
        engine.add(prompt, SamplingParams(max_tokens=6))
    outputs = engine.run()
    for prompt, got in zip(batch, outputs, strict=True):
        assert got == full_recompute(model, prompt, 6)
    assert ran and engine.preemptions > 0 and cache.prefix_hits > 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_asynchronous_mixed_steps_match_full_recompute(model, prefix_caching):
    """Mixed steps each queued before the host reads the tokens of the one before (step graphs
    run eagerly here): requests arriving between steps, chunked prompts beside decodes, a stop
    token (its request's queued row is discarded), an abort while a token is in flight, and a
    shared prefix: the greedy outputs of full recompute, every block back in the pool."""
    from memfit.inference.cuda_graphs import StepGraphs

    batch = prompts((3, 9, 5, 11, 7, 13))
    batch[5][:8] = batch[1][:8]  # two full blocks shared with request 1
    lengths = (6, 13, 9, 11, 8, 5)
    expected = [full_recompute(model, p, n) for p, n in zip(batch, lengths, strict=True)]
    stop = expected[2][3]
    cut = expected[2].index(stop)
    cache = PagedKVCache(
        model.config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache, max_step_tokens=8, max_running=4, prefix_caching=prefix_caching)
    engine.step_graphs = StepGraphs(
        model, cache, max_tokens=8, max_seqs=4, max_seq_len=engine.max_context
    )
    asynchronous = []
    step_async = engine._step_async
    engine._step_async = lambda *args: asynchronous.append(1) or step_async(*args)
    arrivals = {0: [0, 1], 2: [2, 3], 5: [4], 9: [5]}  # step -> requests added before it
    aborted = None
    for step in range(200):
        for i in arrivals.get(step, []):
            params = SamplingParams(max_tokens=lengths[i], stop_token_ids=[stop] if i == 2 else [])
            engine.add(batch[i], params)
        if step == 7:  # request 3 has a token in flight: the client goes away
            assert engine.requests[3].drawn is not None
            engine.abort(3)
            aborted = list(engine.requests[3].output)
        if not (engine.waiting or engine.running) and step > max(arrivals):
            break
        engine.step()
    outputs = engine.run()  # (reads what is still in flight)
    for i in (0, 1, 4, 5):
        assert outputs[i] == expected[i], i
    assert outputs[2] == expected[2][:cut] and engine.requests[2].finish_reason == "stop"
    assert engine.requests[3].finish_reason == "abort" and outputs[3] == aborted
    assert aborted == expected[3][: len(aborted)]
    assert len(asynchronous) > 10 and engine._in_flight is None
    assert (cache.prefix_hits > 0) == prefix_caching
    assert cache.pool.num_free == cache.pool.num_blocks
    assert not cache.tables


def test_a_sampled_request_turns_asynchronous_steps_off(model):
    """A request that needs the sampler (temperature > 0): the step in flight is read first,
    and the steps after it wait for their tokens as before."""
    from memfit.inference.cuda_graphs import StepGraphs

    batch = prompts((5, 9))
    cache = PagedKVCache(
        model.config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache, max_step_tokens=8, max_running=4, seed=0)
    engine.step_graphs = StepGraphs(
        model, cache, max_tokens=8, max_seqs=4, max_seq_len=engine.max_context
    )
    engine.add(batch[0], SamplingParams(max_tokens=10))
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    engine.add(batch[1], SamplingParams(max_tokens=4, temperature=0.9, seed=3))
    engine.step()  # reads the step in flight, queues nothing
    assert engine._in_flight is None and engine.requests[0].drawn is None
    outputs = engine.run()
    assert outputs[0] == full_recompute(model, batch[0], 10) and len(outputs[1]) == 4


@pytest.mark.parametrize("num_blocks", [40, 9])
def test_pipelined_greedy_decoding_matches_full_recompute(model, num_blocks):
    """Decode steps queued before the host has read the last one's tokens (the captured step's
    buffers, run eagerly here): the same greedy outputs, with sequences of different lengths
    that stop by length, by a stop token mid-pipeline (the queued step is discarded) and, with
    9 blocks, a pool that runs short (pipelining pauses; preemption takes over)."""
    from memfit.inference.cuda_graphs import DecodeGraphs

    batch = prompts((3, 9, 5, 11))
    lengths = (6, 13, 9, 11)
    expected = [full_recompute(model, p, n) for p, n in zip(batch, lengths, strict=True)]
    stop = expected[1][4]  # request 1 stops at its fifth token (any earlier one stops too)
    cut = expected[1].index(stop)
    cache = PagedKVCache(
        model.config, num_blocks=num_blocks, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache, max_step_tokens=64, max_running=4)
    engine.graphs = DecodeGraphs(model, cache, max_batch=4, max_seq_len=engine.max_context)
    pipelined = []
    run = engine._decode_pipelined
    engine._decode_pipelined = lambda steps: pipelined.append(1) or run(steps)
    for i, (prompt, n) in enumerate(zip(batch, lengths, strict=True)):
        engine.add(prompt, SamplingParams(max_tokens=n, stop_token_ids=[stop] if i == 1 else []))
    outputs = engine.run()
    assert outputs[0] == expected[0] and outputs[2:] == expected[2:]
    assert outputs[1] == expected[1][:cut]
    assert engine.requests[1].finish_reason == "stop"
    assert pipelined and engine.decode_steps > len(pipelined)
    assert (engine.preemptions > 0) == (num_blocks == 9)
    assert cache.pool.num_free == num_blocks and not cache.tables


def test_pipelined_steps_replay_on_what_the_step_before_left(model):
    """A decode step leaves its argmax and the advanced positions, slots and lengths on the
    device: the next step of the same sequence is not staged from the host, except when it
    enters a new cache block (every 4 tokens here), and the tokens are full recompute's."""
    from memfit.inference.cuda_graphs import DecodeGraphs

    (prompt,) = prompts((5,))
    cache = PagedKVCache(
        model.config, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache, max_step_tokens=64, max_running=4)
    engine.graphs = DecodeGraphs(model, cache, max_batch=4, max_seq_len=engine.max_context)
    engine.add(prompt, SamplingParams(max_tokens=24))
    assert engine.run() == [full_recompute(model, prompt, 24)]
    assert engine.decode_steps == 23
    assert engine.graphs.staged_steps <= 23 / 4 + 1


def test_pipelined_sampling_draws_what_the_plain_steps_draw(model):
    """Seeded sampled rows (temperature, top-p, top-k, min-p, repetition penalty, log-probs)
    decoded in pipelined steps draw the tokens, and report the log-probs, of ordinary steps: a
    queued step's seeded rows count the token still on its way to the host."""
    from memfit.inference.cuda_graphs import DecodeGraphs

    batch = prompts((3, 9, 5, 11))
    params = [
        SamplingParams(max_tokens=9, temperature=0.8, seed=1, logprobs=True),
        SamplingParams(max_tokens=12, temperature=1.2, top_p=0.9, seed=2),
        SamplingParams(max_tokens=7, temperature=0.7, top_k=20, min_p=0.05, seed=3),
        SamplingParams(max_tokens=10, repetition_penalty=1.3, logprobs=True),  # greedy
    ]
    results = []
    for pipelined in (False, True):
        cache = PagedKVCache(
            model.config, num_blocks=40, block_size=4, dtype=torch.float32, device="cpu"
        )
        engine = Engine(model, cache, max_step_tokens=64, max_running=4, seed=0)
        if pipelined:
            engine.graphs = DecodeGraphs(model, cache, max_batch=4, max_seq_len=engine.max_context)
        for prompt, p in zip(batch, params, strict=True):
            engine.add(prompt, p)
        engine.run()
        results.append([(r.output, r.logprobs) for r in engine.requests.values()])
    for (plain_tokens, plain_logprobs), (tokens, logprobs) in zip(*results, strict=True):
        assert tokens == plain_tokens
        if plain_logprobs is not None:
            # the same tokens; the logits differ in the last bits (a padded step vs paged_step)
            torch.testing.assert_close(logprobs, plain_logprobs, rtol=1e-5, atol=1e-5)


def test_on_step_sees_every_step_and_ends_a_pipelined_run(model):
    """The hook a server streams from: called after every step, pipelined ones too, each time
    with one more token of each sequence; returning True ends the pipelined run after the step
    already queued, and the next `step()` starts another."""
    from memfit.inference.cuda_graphs import DecodeGraphs

    cache = PagedKVCache(
        model.config, num_blocks=40, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache, max_step_tokens=64, max_running=4)
    engine.graphs = DecodeGraphs(model, cache, max_batch=4, max_seq_len=engine.max_context)
    seen, runs = [], []
    engine.on_step = lambda: (
        seen.append([len(r.output) for r in engine.requests.values()]) or (len(seen) == 5)
    )
    run = engine._decode_pipelined
    engine._decode_pipelined = lambda steps: runs.append(len(seen)) or run(steps)
    for prompt in prompts((3, 9)):
        engine.add(prompt, SamplingParams(max_tokens=10))
    engine.run()
    assert seen == [[n, n] for n in range(1, 11)]
    assert runs == [1, 6]  # after the prefill; again after the step queued when told to stop


def test_block_pool_keeps_cached_blocks_until_needed_least_recent_first():
    from memfit.inference.paged_cache import BlockPool

    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.register(a, key=10)
    pool.register(b, key=11)
    pool.register(c, key=10)  # a key already held keeps its block
    pool.release(b)
    pool.release(a)  # both cached and evictable, b the least recent
    assert pool.num_free == 2
    assert pool.take_cached(10) == a and pool.num_free == 1  # revived, in use again
    assert pool.allocate() == b  # evicted: its key is gone
    assert pool.take_cached(11) is None
    pool.release(c)  # not registered: plainly free
    assert pool.free[-1] == c


@pytest.mark.parametrize("num_blocks", [64, 12])
def test_prefix_caching_computes_only_the_suffix(model, num_blocks):
    """A second request behind a cached 13-token prefix computes only what follows its 12
    cached tokens (3 blocks of 4), and both give full recompute's tokens; with 12 blocks the
    cached blocks are evicted under pressure and preemption resumes on them."""
    prefix = prompts((13,), seed=5)[0]
    first, second = prefix + [7, 8], prefix + [9]
    cache = PagedKVCache(
        model.config, num_blocks=num_blocks, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache, max_step_tokens=64, prefix_caching=True)
    engine.add(first, SamplingParams(max_tokens=6))
    assert engine.run() == [full_recompute(model, first, 6)]
    assert cache.prefix_hits == 0
    engine.add(second, SamplingParams(max_tokens=6))
    others = prompts((9, 6, 11), seed=6)
    for prompt in others:  # beside it, unrelated requests (with 12 blocks: eviction, preemption)
        engine.add(prompt, SamplingParams(max_tokens=5))
    outputs = engine.run()
    assert outputs[1] == full_recompute(model, second, 6)
    assert outputs[2:] == [full_recompute(model, p, 5) for p in others]
    assert cache.prefix_hits >= 12
    assert (engine.preemptions > 0) == (num_blocks == 12)
    assert cache.pool.num_free == num_blocks and not cache.tables


@pytest.mark.parametrize("max_step_tokens", [64, 6])
def test_requests_sent_together_behind_one_prefix_compute_it_once(model, max_step_tokens):
    """Three requests behind one 13-token prefix (3 full blocks of 4), added together: the first
    computes the prefix, the others wait a step and start on its cached blocks instead of
    computing it beside it (also when the first's prompt takes several chunks); every output
    equals full recompute's, and an unrelated request is not held up behind them."""
    prefix = prompts((13,), seed=5)[0]
    batch = [prefix + [7, 8], prefix + [9], prefix + [3, 4, 5], prompts((5,), seed=9)[0]]
    cache = PagedKVCache(
        model.config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache, max_step_tokens=max_step_tokens, prefix_caching=True)
    for prompt in batch:
        engine.add(prompt, SamplingParams(max_tokens=4))
    outputs = engine.run()
    assert outputs == [full_recompute(model, p, 4) for p in batch]
    assert cache.prefix_hits == 2 * 12
    assert engine.peak_blocks <= 3 + 3 * 3 + 3  # the prefix once, each its own tail, and one


def test_parallel_samples_share_the_prompt_blocks(model):
    """n = 4 samples of one 15-token prompt (blocks of 4): the followers start on the leader's
    3 cached full blocks, so the four hold 3 shared blocks and their own few, not 4 x 5; every
    sample's greedy tokens equal full recompute."""
    prompt = prompts((15,), seed=7)[0]
    peaks = []
    for shared in (False, True):
        cache = PagedKVCache(
            model.config, num_blocks=40, block_size=4, dtype=torch.float32, device="cpu"
        )
        engine = Engine(model, cache, max_step_tokens=64, prefix_caching=shared)
        first = engine.add(prompt, SamplingParams(max_tokens=4))
        for _ in range(3):
            engine.add(prompt, SamplingParams(max_tokens=4), follows=first)
        outputs = engine.run()
        assert outputs == [full_recompute(model, prompt, 4)] * 4
        peaks.append(engine.peak_blocks)
    assert peaks[0] == 4 * 5  # 15 + 4 tokens: 5 blocks each
    assert peaks[1] <= 3 + 4 * 2  # 3 shared, then each its last prompt block and one more


def test_a_step_may_flatten_more_tokens_than_the_model_context(model):
    """Three 400-token prompts in one step: 1,200 tokens in one row, more than twice the tiny
    model's 512-token context (a bound for one sequence, not for a step of several)."""
    batch = prompts((400, 400, 400), seed=8)
    cache = PagedKVCache(
        model.config, num_blocks=400, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache, max_step_tokens=2048)
    for prompt in batch:
        engine.add(prompt, SamplingParams(max_tokens=2))
    assert engine.run() == [full_recompute(model, p, 2) for p in batch]
    assert engine.steps == 2  # all three prompts in the first
