"""Batched sampling (memfit.inference.sampling) against plain per-row references: greedy, the
penalty, the top-k/top-p/min-p cuts (ties included), logprobs; seeded rows that repeat in any
batch; the drawn distribution against the exact one; the hash's uniformity; stop strings; and
SamplingParams' checks. Every random input comes from a fixed seed, so the statistical tests are
deterministic: their bounds are chi-square quantiles at p = 1e-6, not retried."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from memfit.inference.sampling import (
    Sampler,
    StopStringChecker,
    exponential_noise,
    find_stop_string,
    hash_uniform,
    seeded_row_keys,
)
from memfit.inference.sampling_params import SamplingParams

# chi-square quantiles at p = 1e-6 by degrees of freedom: a correct sampler exceeds one once in
# a million runs, and with fixed seeds a passing test passes every time
CHI2_BOUND = {1: 23.9, 2: 27.6, 3: 30.7, 4: 33.4, 5: 35.9, 6: 38.3, 7: 40.5, 255: 377.1}


def assert_draws_follow(tokens, exact, case):
    """No draw outside the kept tokens, and a chi-square of the counts within the bound."""
    draws = len(tokens)
    counts = torch.bincount(tokens, minlength=len(exact)).double()
    kept = exact > 0
    assert counts[~kept].sum() == 0
    expected = exact[kept] * draws
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
    assert chi2 < CHI2_BOUND[int(kept.sum()) - 1], (case, counts.tolist(), expected.tolist())


@dataclass
class Request:
    id: int
    params: SamplingParams
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)


# -- references (the plain per-row rules, in a loop) --------------------------------------------


def repetition_penalty_reference(logits: torch.Tensor, seen: list[int], penalty: float):
    """Hugging Face's RepetitionPenaltyLogitsProcessor on one row: gather, divide the positive
    and multiply the negative, scatter."""
    ids = torch.tensor(seen, dtype=torch.long)
    score = logits.gather(0, ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(0, ids, score)


def sampling_logits_reference(logits: torch.Tensor, params: SamplingParams, seen: list[int]):
    """One row (V,) fp32 -> the logits it is drawn from, -inf where cut, by sorting: penalty,
    temperature, top-k, top-p (over what top-k kept), min-p; ties at a cut are kept."""
    x = logits.float()
    if params.repetition_penalty != 1 and seen:
        x = repetition_penalty_reference(x, seen, params.repetition_penalty)
    if params.greedy:
        return x
    x = x / params.temperature
    if params.top_k > 0:
        kth = x.sort(descending=True).values[min(params.top_k, x.numel()) - 1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1:
        values = x.double().sort(descending=True).values
        probs = values.softmax(0).tolist()
        mass, last = 0.0, values[0]
        for value, prob in zip(values.tolist(), probs, strict=True):
            if mass >= params.top_p:
                break
            mass, last = mass + prob, value
        x = x.masked_fill(x.double() < last, -math.inf)
    if params.min_p > 0:
        probs = x.double().softmax(0)
        x = x.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    return x


def random_params(generator: torch.Generator, *, greedy_share=0.2) -> SamplingParams:
    """Every combination of the options, at random."""

    def uniform() -> float:
        return float(torch.rand((), generator=generator))

    if uniform() < greedy_share:
        penalty = 1.0 if uniform() < 0.5 else 0.5 + 1.5 * uniform()
        return SamplingParams(repetition_penalty=penalty)
    return SamplingParams(
        temperature=0.3 + 1.5 * uniform(),
        top_k=int(torch.randint(1, 60, (), generator=generator)) if uniform() < 0.5 else 0,
        top_p=0.05 + 0.9 * uniform() if uniform() < 0.5 else 1.0,
        min_p=0.3 * uniform() if uniform() < 0.4 else 0.0,
        repetition_penalty=0.5 + 1.5 * uniform() if uniform() < 0.4 else 1.0,
        seed=int(torch.randint(0, 2**31, (), generator=generator)) if uniform() < 0.5 else None,
    )


def tied_logits(rows: int, vocab: int, generator: torch.Generator, dtype=torch.float32):
    """Random logits on a grid of 1/4, so rows are full of exact ties (at every cut too)."""
    logits = torch.randn(rows, vocab, generator=generator) * 3
    return (logits * 4).round().div(4).to(dtype)


# -- greedy, logprobs -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_greedy_is_argmax(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = tied_logits(37, 1003, generator, dtype)
    sampler = Sampler(1003)
    batch = sampler.prepare([Request(i, SamplingParams()) for i in range(37)])
    out = sampler.sample(logits, batch)
    assert batch.all_greedy
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_greedy_rows_of_a_mixed_batch_are_argmax():
    generator = torch.Generator().manual_seed(1)
    logits = tied_logits(24, 500, generator, torch.bfloat16)
    params = [
        SamplingParams() if row % 3 else SamplingParams(temperature=1.0, top_k=7, seed=row)
        for row in range(24)
    ]
    sampler = Sampler(500)
    out = sampler.sample(logits, sampler.prepare([Request(i, p) for i, p in enumerate(params)]))
    greedy = [row for row in range(24) if row % 3]
    assert torch.equal(out.token_ids[greedy], logits[greedy].argmax(-1))


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_are_the_raw_log_softmax_at_the_token(greedy):
    generator = torch.Generator().manual_seed(2)
    logits = tied_logits(9, 301, generator, torch.bfloat16)
    params = SamplingParams(logprobs=True, repetition_penalty=1.3)
    if not greedy:
        params = dataclasses.replace(params, temperature=0.7, top_p=0.9)
    sampler = Sampler(301, seed=0)
    batch = sampler.prepare([Request(i, params, prompt=[i, 2 * i]) for i in range(9)])
    out = sampler.sample(logits, batch)
    expected = logits.float().log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    tokens, logprobs = out.to_lists()
    assert tokens == out.token_ids.tolist() and logprobs == out.logprobs.tolist()


# -- penalty and truncation against the references ---------------------------------------------


def test_reference_penalty_is_hugging_faces():
    transformers = pytest.importorskip("transformers")
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 50, generator=generator)
    seen = [3, 7, 7, 49, 0]
    processor = transformers.RepetitionPenaltyLogitsProcessor(1.7)
    expected = processor(torch.tensor([seen]), logits.clone())[0]
    torch.testing.assert_close(repetition_penalty_reference(logits[0], seen, 1.7), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("full_sort", [False, True], ids=["topk-depth", "full-sort"])
def test_cuts_match_the_sort_reference(full_sort, dtype):
    """Random rows, each with its own parameters, in one batch; logits full of ties. Without
    full_sort every top-p row also has a top-k, so the cut works on topk(max k) values. bf16
    logits are cut as they are, without a copy to fp32 (unless a row is penalized)."""
    generator = torch.Generator().manual_seed(4 + full_sort)
    rows, vocab = 61, 257
    logits = tied_logits(rows, vocab, generator, dtype)
    params = [random_params(generator) for _ in range(rows)]
    if dtype == torch.bfloat16:  # no penalty: the rows stay bf16
        params = [dataclasses.replace(p, repetition_penalty=1.0) for p in params]
    if not full_sort:
        params = [dataclasses.replace(p, top_k=p.top_k or 40) if p.top_p < 1 else p for p in params]
    assert any(p.top_p < 1 and p.top_k > 0 for p in params)
    assert full_sort == any(p.top_p < 1 and p.top_k == 0 and not p.greedy for p in params)
    requests = [
        Request(i, p, prompt=torch.randint(vocab, (5,), generator=generator).tolist())
        for i, p in enumerate(params)
    ]
    sampler = Sampler(vocab)
    batch = sampler.prepare(requests)
    deepest = max(p.top_k for p in params if not p.greedy)
    assert batch.truncation_depth == (vocab if full_sort else deepest)
    actual = sampler.sampling_logits(logits, batch)
    for row, request in enumerate(requests):
        expected = sampling_logits_reference(logits[row], request.params, request.prompt)
        assert torch.equal(actual[row].isfinite(), expected.isfinite()), (row, request.params)
        torch.testing.assert_close(actual[row], expected, msg=lambda m, r=row: f"row {r}: {m}")
    # the drawn tokens are among the kept ones
    tokens = sampler.sample(logits, batch).token_ids
    assert actual.gather(1, tokens[:, None]).isfinite().all()


def test_top_k_keeps_ties_and_top_k_1_is_argmax():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.5, 1.0], [3.0, 0.0, 0.0, 0.0, 0.0]])
    sampler = Sampler(5)
    batch = sampler.prepare(
        [Request(0, SamplingParams(temperature=1.0, top_k=2))]
        + [Request(1, SamplingParams(temperature=5.0, top_k=1))]
    )
    kept = sampler.sampling_logits(logits, batch).isfinite()
    assert kept.tolist() == [[True, True, True, False, True], [True, False, False, False, False]]
    # top-p renormalizes over all that top-k kept, ties beyond the k-th included: over the five
    # tokens the first has 0.40 of the mass and the second is needed (then its ties), while over
    # two it would have 0.73 and be alone
    batch = sampler.prepare([Request(0, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))] * 2)
    tied = torch.tensor([[2.0, 1.0, 1.0, 1.0, 1.0], [-1.0, 1.0, 1.0, 0.5, 1.0]])
    kept = sampler.sampling_logits(tied, batch).isfinite()
    assert kept.tolist() == [[True, True, True, True, True], [False, True, True, False, True]]
    for _ in range(20):
        batch = sampler.prepare([Request(0, SamplingParams(temperature=5.0, top_k=1))] * 2)
        assert sampler.sample(logits, batch).token_ids.tolist() == [0, 0]


def test_penalty_tracks_prompt_and_output_across_steps_and_slot_reuse():
    """The seen-token table: filled from prompt and output when a request first samples, then
    by the sampler with each drawn token; a released slot serves a new request clean. More
    penalized requests than the table's first 8 rows, so it grows."""
    generator = torch.Generator().manual_seed(6)
    vocab = 40
    requests = [
        Request(
            i,
            SamplingParams(temperature=0.0 if i % 2 else 0.9, repetition_penalty=1.9, seed=i),
            prompt=torch.randint(vocab, (6,), generator=generator).tolist(),
            output=[3] if i == 0 else [],
        )
        for i in range(11)
    ]
    sampler = Sampler(vocab)
    for _ in range(4):
        logits = torch.randn(len(requests), vocab, generator=generator)
        batch = sampler.prepare(requests)
        actual = sampler.sampling_logits(logits, batch)
        for row, request in enumerate(requests):
            seen = request.prompt + request.output
            expected = sampling_logits_reference(logits[row], request.params, seen)
            torch.testing.assert_close(actual[row], expected)
        tokens = sampler.sample(logits, batch).token_ids.tolist()
        for request, token in zip(requests, tokens, strict=True):
            request.output.append(token)
    sampler.release(requests[0].id)
    fresh = Request(100, SamplingParams(repetition_penalty=2.0), prompt=[1, 2])
    logits = torch.randn(2, vocab, generator=generator)
    batch = sampler.prepare([fresh, requests[1]])
    actual = sampler.sampling_logits(logits, batch)
    torch.testing.assert_close(
        actual[0], sampling_logits_reference(logits[0], fresh.params, fresh.prompt)
    )
    torch.testing.assert_close(
        actual[1],
        sampling_logits_reference(
            logits[1], requests[1].params, requests[1].prompt + requests[1].output
        ),
    )


# -- seeds --------------------------------------------------------------------------------------


def test_seeded_rows_repeat_in_any_batch_and_order():
    """The same seeded request, with the same logits row, among different neighbours (greedy,
    penalized, seeded, unseeded), at different positions and with differently seeded samplers:
    the same tokens, step after step."""
    generator = torch.Generator().manual_seed(7)
    vocab, steps = 1000, 12
    logits_rows = torch.randn(steps, vocab, generator=generator)
    chosen = SamplingParams(temperature=1.1, top_p=0.97, min_p=0.01, seed=1234)

    def run(neighbours: int, position: int, sampler_seed: int) -> list[int]:
        sampler = Sampler(vocab, seed=sampler_seed)
        local = torch.Generator().manual_seed(100 + neighbours)
        others = [Request(i + 1, random_params(local), prompt=[1, 2]) for i in range(neighbours)]
        target = Request(0, chosen, prompt=[5])
        for step in range(steps):
            rows = others[:position] + [target] + others[position:]
            logits = torch.randn(len(rows), vocab, generator=local)
            logits[position] = logits_rows[step]
            out = sampler.sample(logits, sampler.prepare(rows)).token_ids.tolist()
            for request, token in zip(rows, out, strict=True):
                request.output.append(token)
        return target.output

    alone = run(0, 0, sampler_seed=0)
    assert run(5, 2, sampler_seed=1) == alone
    assert run(30, 30, sampler_seed=2) == alone
    assert run(3, 0, sampler_seed=3) == alone
    assert len(set(alone)) > 1  # the counter moves the noise on


def test_seed_and_counter_change_the_draw():
    vocab = 64
    logits = torch.zeros(1, vocab)  # uniform: every draw is the noise's argmin
    sampler = Sampler(vocab)

    def draw(seed: int, output_len: int) -> int:
        params = SamplingParams(temperature=1.0, seed=seed)
        request = Request(0, params, output=[0] * output_len)
        return sampler.sample(logits, sampler.prepare([request])).token_ids.item()

    by_seed = {draw(seed, 0) for seed in range(40)}
    by_counter = {draw(5, n) for n in range(40)}
    assert len(by_seed) > 15 and len(by_counter) > 15
    assert draw(-1, 3) == draw(2**64 - 1, 3)  # seeds are taken modulo 2**64, as torch does


# -- distribution ------------------------------------------------------------------------------


CASES = {
    "temperature": SamplingParams(temperature=1.0),
    "cold": SamplingParams(temperature=0.6),
    "top-k with a tie at k": SamplingParams(temperature=1.0, top_k=2),
    "top-p": SamplingParams(temperature=1.3, top_p=0.8),
    "min-p": SamplingParams(temperature=0.9, min_p=0.15),
    "all": SamplingParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.05),
    "penalty": SamplingParams(temperature=1.0, repetition_penalty=1.8),
}


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_exact_distribution(case, seeded):
    """40k draws over a vocabulary of 8 against the exact probabilities: chi-square below its
    1e-6 quantile, every cut token never drawn. Seeded rows each have their own seed; unseeded
    rows take their keys from the sampler's generator."""
    draws, prompt = 40_000, [0, 4, 5]
    logits = torch.tensor([2.0, 1.5, 1.5, 0.3, 0.0, -0.7, -1.2, -3.0])
    params = CASES[case]
    exact = sampling_logits_reference(logits, params, prompt).double().softmax(0)
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    requests = [
        Request(i, SamplingParams(**{**fields, "seed": i}) if seeded else params, prompt=prompt)
        for i in range(draws)
    ]
    sampler = Sampler(8, seed=11)
    tokens = sampler.sample(logits.expand(draws, 8), sampler.prepare(requests)).token_ids
    assert_draws_follow(tokens, exact, case)


def test_hash_is_uniform_and_uncorrelated():
    """Uniforms of 256 rows (16 seeds x 16 consecutive counters, the low-entropy inputs a real
    run has) x 4096 vocabulary indices: 256-bin chi-square, mean, and the correlation between
    neighbours in the vocabulary and between consecutive counters; the exponentials' mean and
    variance. 2**20 values: each moment within 5 standard errors."""
    seeds, counters = np.meshgrid(np.arange(16, dtype=np.uint64), np.arange(16, dtype=np.uint64))
    keys = seeded_row_keys(seeds.ravel(), counters.ravel())
    key_lo = torch.from_numpy((keys & np.uint64(0xFFFFFFFF)).astype(np.int64))
    key_hi = torch.from_numpy((keys >> np.uint64(32)).astype(np.int64))
    uniform = hash_uniform(key_lo, key_hi, 4096).double()  # (256, 4096)
    n = uniform.numel()
    assert 0 < uniform.min() and uniform.max() < 1
    counts = torch.histc(uniform, bins=256, min=0, max=1)
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum().item()
    assert chi2 < CHI2_BOUND[255]
    assert abs(uniform.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    centred = uniform - 0.5
    along_vocab = (centred[:, 1:] * centred[:, :-1]).mean().item() * 12
    # rows are (counter, seed) in meshgrid order: rows 16 apart are consecutive counters
    along_counter = (centred[16:] * centred[:-16]).mean().item() * 12
    assert abs(along_vocab) < 5 / math.sqrt(n) and abs(along_counter) < 5 / math.sqrt(n)
    noise = exponential_noise(key_lo, key_hi, 4096).double()
    assert abs(noise.mean().item() - 1) < 5 / math.sqrt(n)
    # the sample variance's own variance is (mu4 - sigma**4) / n = (9 - 1) / n for Exp(1)
    assert abs(noise.var().item() - 1) < 5 * math.sqrt(8 / n)


# -- stop strings -------------------------------------------------------------------------------


def test_find_stop_string():
    assert find_stop_string("Hello, world", [","]) == 5
    assert find_stop_string("Hello, world", ["?", "!"]) is None
    assert find_stop_string("stop", ["stop"]) == 0
    # what was checked is not searched again, except for a stop string that began in it
    assert find_stop_string("a,b,c", [","], checked=2) == 3
    assert find_stop_string("abXYcd", ["XY"], checked=3) == 2
    assert find_stop_string("abXYcd", ["XY"], checked=4) is None
    # the first to be completed wins; of those completed together, the longest
    assert find_stop_string("abcd", ["abcd", "bc"]) == 1
    assert find_stop_string("abcd", ["bcd", "abcd"]) == 0


def char_tokens(text: str) -> tuple[list[int], object]:
    vocab = sorted(set(text))
    return [vocab.index(c) for c in text], lambda ids: "".join(vocab[i] for i in ids)


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_stop_checker_cuts_the_same_whatever_the_token_boundaries(chunk):
    ids, decode = char_tokens("The answer: 42.\nQ: next")
    checker = StopStringChecker(["\nQ:", "answer: 4"], decode)
    steps = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    stopped_at = next(n for n, step in enumerate(steps) if checker.append(step))
    assert checker.stopped and checker.text == "The "
    assert stopped_at == (len("The answer: 4") - 1) // chunk
    assert checker.append([0]) and checker.text == "The "


def test_stop_checker_waits_for_whole_characters():
    """Byte tokens: a stop string made of a two-byte character split over two tokens is found,
    and the text never holds a half character."""
    ids = list("naïve café".encode())
    checker = StopStringChecker(["é"], lambda t: bytes(t).decode("utf-8", errors="replace"))
    for token in ids:
        if checker.append([token]):
            break
        assert "\ufffd" not in checker.text
    assert checker.stopped and checker.text == "naïve caf"
    unfinished = StopStringChecker(["x"], lambda t: bytes(t).decode("utf-8", errors="replace"))
    assert not unfinished.append([0x61, 0xC3])
    assert unfinished.text == "" and unfinished.finish() == "a\ufffd"


def test_stop_checker_decodes_in_context():
    """A SentencePiece-like decode drops the leading space of the first piece; given the last
    prompt token as context, the output's first piece keeps its space."""
    pieces = ["▁Hello", "▁world", "!", "▁again"]

    def decode(ids):
        return "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")

    checker = StopStringChecker(["! a"], decode, context=[0])
    assert not checker.append([1])
    assert checker.text == " world"
    assert checker.append([2, 3]) and checker.text == " world"
    assert StopStringChecker(["zzz"], decode).append([1]) is False


# -- SamplingParams --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", "0.7"),
        ("top_k", -1),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("seed", 2**64),
        ("seed", 1.5),
        ("stop_token_ids", (3, -1)),
        ("stop", ("ok", "")),
        ("stop", (3,)),
        ("logprobs", 1),
    ],
)
def test_invalid_params_name_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_unknown_params_name_themselves_and_the_known_ones():
    with pytest.raises(ValueError, match=r"'top_q'.*known: max_tokens, temperature, top_k"):
        SamplingParams(top_q=0.9)
    with pytest.raises(TypeError):  # what a wrong keyword raises in Python, for older callers
        SamplingParams(nucleus=0.9)
    with pytest.raises(ValueError, match="'nucleus'"):
        SamplingParams.from_dict({"max_tokens": 4, "nucleus": 0.9})


def test_from_dict_and_defaults():
    params = SamplingParams.from_dict(
        {"max_tokens": 8, "temperature": 1, "stop_token_ids": [2, 3], "stop": ["\n\n"]}
    )
    assert params == SamplingParams(
        max_tokens=8, temperature=1.0, stop_token_ids=(2, 3), stop=("\n\n",)
    )
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    assert dataclasses.replace(params, top_k=5).top_k == 5
    with pytest.raises(ValueError, match="JSON object"):
        SamplingParams.from_dict([("max_tokens", 4)])


def test_bad_logits_shape_says_what_was_prepared():
    sampler = Sampler(10)
    batch = sampler.prepare([Request(0, SamplingParams())])
    with pytest.raises(ValueError, match=r"\(1, 10\) as prepared, got \(2, 10\)"):
        sampler.sample(torch.zeros(2, 10), batch)


# -- on a GPU -------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
def test_gpu_step_never_syncs_and_compiled_race_matches_eager():
    """A mixed batch at a real shape: prepare and sample under CUDA's sync debug mode (an error
    on any host sync), and the compiled race against the eager one."""
    generator = torch.Generator().manual_seed(8)
    rows, vocab = 96, 32_000
    params = [random_params(generator) for _ in range(rows)]
    params = [dataclasses.replace(p, logprobs=i % 2 == 0) for i, p in enumerate(params)]
    requests = [Request(i, p, prompt=[i, i + 1]) for i, p in enumerate(params)]
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to("cuda", torch.bfloat16)
    compiled = Sampler(vocab, device="cuda", seed=0)
    eager = Sampler(vocab, device="cuda", seed=0, compile=False)
    for sampler in (compiled, eager):  # warm up: compilation syncs
        sampler.sample(logits, sampler.prepare(requests))
    torch.cuda.synchronize()
    # new ids: their penalized rows are admitted into the seen-token table (which grows)
    requests = [dataclasses.replace(r, id=r.id + rows) for r in requests]
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = compiled.sample(logits, compiled.prepare(requests))
        reference = eager.sample(logits, eager.prepare(requests))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.token_ids, reference.token_ids)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("case", ["top-p", "all", "penalty"])
def test_gpu_draws_follow_the_exact_distribution(case):
    draws, prompt = 200_000, [0, 4, 5]
    # bf16 on the device: the exact distribution is that of the bf16-rounded logits
    logits = torch.tensor([2.0, 1.5, 1.5, 0.3, 0.0, -0.7, -1.2, -3.0]).bfloat16().float()
    params = CASES[case]
    exact = sampling_logits_reference(logits, params, prompt).double().softmax(0)
    requests = [
        Request(i, dataclasses.replace(params, seed=i), prompt=prompt) for i in range(draws)
    ]
    sampler = Sampler(8, device="cuda")
    logits = logits.to("cuda", torch.bfloat16).expand(draws, 8)
    tokens = sampler.sample(logits, sampler.prepare(requests)).token_ids.cpu()
    assert_draws_follow(tokens, exact, case)
