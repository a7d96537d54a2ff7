"""Batched sampling for the inference engine: one step's logits (B, V) in, one token per row out,
each row under its own `SamplingParams`, with no Python loop over rows and no host sync on the
device side. Plus stop strings, checked on the host as the output text grows.

Basics
------
    sampler = Sampler(vocab_size, device=device)
    # each step, for the rows that sample (requests whose prompt is done), in logits' row order:
    batch = sampler.prepare(requests)        # host: per-row parameters, one copy to the device
    out = sampler.sample(logits, batch)      # device: token ids (B,), logprobs (B,) or None
    tokens, logprobs = out.to_lists()        # the step's one device -> host read
    sampler.release(request.id)              # when a request finishes (frees its penalty row)

`requests` are anything with `id`, `params`, `prompt` and `output` (the engine's `Request`).

Algorithm
---------
1. All rows greedy and none penalized (the common serving default): the argmax of the logits as
   they are (argmax of bf16 is exact), nothing else.
2. Any row penalized: every row's logits in fp32 with its seen tokens penalized (one fused pass;
   unpenalized rows have penalty 1, which changes nothing). The greedy rows take the argmax.
3. Truncation, as one threshold per row on the unscaled logits (keep the tokens whose logit is
   >= it). Dividing by a positive temperature keeps the order, so top-k and top-p can sort the
   logits as they are, bf16 included (half the bytes of fp32 scaled ones). Top-k: the k-th
   largest value; top-p: the value of the last token needed, from the values sorted once
   (`topk` to the deepest k when every top-p row also has a top-k, else a full sort), with
   softmax(values / T) and cumsum over what top-k kept; min-p: `max + T * log(min_p)`, the same
   test as p >= min_p * p_max. The threshold is the largest of the three.
4. The draw, by an exponential race, the Gumbel-max trick in multiplicative form (Gumbel 1954;
   Maddison, Tarlow and Minka 2014, "A* Sampling"): with E_v iid Exp(1), argmax_v p_v / E_v is
   distributed exactly as p, since P(p_v / E_v is the largest) = p_v / sum(p). In log space it is
   argmax_v (x_v / T - log E_v) over the kept tokens: no softmax, no sum, only an argmax, so a
   row's token does not depend on anything but its own row.
5. The noise is counter-based: E_v = -log(1 - W_v), W_v uniform from a hash of (row key, v). A
   seeded row's key is SplitMix64(SplitMix64(seed) + counter * golden) (Steele, Lea and Flood
   2014), with counter = tokens the request has output so far, computed on the host for the whole
   batch with numpy; an unseeded row's key is 64 fresh bits from the sampler's host generator.
   Per element, two rounds of a 32-bit xorshift-multiply mixer (constants from Wellons'
   hash-prospector search), keyed by the key's two halves, in plain torch int64 ops.

So a seeded request draws the same tokens whatever shares its batch, in whichever order, and
after a preemption (its counter is its output length): same seed, same logits row, same token.

Details
-------
* Repetition penalty needs each row's seen tokens (prompt and output). The sampler keeps them in
  a bool table (slots, V) on the device, one row per penalized request, filled when the request
  first samples (its prompt and output, part of the step's one copy) and then by the sampler
  itself with every token it draws: no per-step host work or copy proportional to the context,
  at V bytes per penalized request in flight (128 KiB at V = 128k; the table grows by doubling;
  its row 0 is scratch, read and written by the unpenalized rows of a penalized batch). The
  alternative, a padded (B, Lmax) id tensor every step, costs a B * Lmax copy per step.
* Integer hashing without overflow: every multiplier is < 2**31 and every operand < 2**32, so
  products stay below 2**63 (signed overflow is undefined behaviour in the C++ kernels).
* W = (h + 0.5) * 2**-32 in fp32, clamped to 1 - 2**-24, lies in (0, 1): E is in
  [1.2e-10, 16.6], never 0 (which would make a score +inf, and nan on a masked token) nor inf.
  E is quantized to about 2**-24 relative: a bias in the token probabilities far below what any
  test could measure.
* On CUDA the race (hash, noise, scaling, mask and argmax) is compiled by `torch.compile` into
  a single kernel that reads the logits once and writes B ids; eager, it is ~25 full (B, V)
  int64 passes (at B = 256, V = 128k on an H100: about 0.2 ms compiled, 5.7 ms eager). The
  penalty and the logprobs are compiled too. Compiled and eager agree up to ulps of `log`,
  `exp` and division, which can flip a token only at a near-exact tie of two scores; the keep
  mask is computed from the same values in both.
* The race scales by 1 / T rounded to fp32: an effective temperature off by at most 6e-8
  relative, which no measurement of the distribution could see.

Cautions
--------
* Logits are not batch-invariant themselves (a matmul's reduction order changes with the batch);
  the guarantee is per logits row.
* Top-p's cumulative sum is a reduction: a token exactly at the nucleus boundary could flip
  between kernels chosen for different batch shapes. Temperature, top-k, min-p, the penalty and
  the race are elementwise or exact.
* Full-vocabulary top-p (a top-p row without top-k) sorts every row of the batch: the costliest
  stage (about 1.1 ms of the 2.2 ms a B = 256, V = 128k step takes on an H100; with top-k it is
  a `topk` to the largest k, about 1 ms in all).
* `logprobs` is the raw model's log_softmax at the chosen token, as in vLLM: it scores the text
  under the model, not under the penalty, temperature and truncation that chose it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from memfit.inference.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# -- counter-based noise ----------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_GOLDEN64 = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function: a bijection of uint64 with full avalanche. numpy's uint64
    array arithmetic wraps, which is what it needs (the constants are numpy scalars so that no
    value is promoted to float64)."""
    x = x + _GOLDEN64
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seeded_row_keys(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """The 64-bit noise key of the draw number `counters` of the requests seeded `seeds`, both
    (B,) uint64. Mixing the seed before adding the counter keeps two seeds' streams from being
    shifts of each other (seed s at counter n+1 equal to seed s + golden at counter n)."""
    return _splitmix64(_splitmix64(seeds) + counters * _GOLDEN64)


def _mix32(x: Tensor) -> Tensor:
    # xorshift-multiply rounds on values < 2**32 held in int64; multipliers < 2**31
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def hash_uniform(key_lo: Tensor, key_hi: Tensor, vocab_size: int) -> Tensor:
    """(B,) and (B,) int64 key halves in [0, 2**32) -> (B, V) fp32 uniforms in (0, 1), a pure
    function of (key, vocab index): the same key gives the same row on any batch."""
    vocab = torch.arange(vocab_size, device=key_lo.device)  # (V,)
    bits = _mix32(vocab ^ key_lo[:, None])  # (B, V)
    bits = _mix32(bits ^ key_hi[:, None])
    return ((bits.float() + 0.5) * 2.0**-32).clamp_max(1 - 2.0**-24)


def exponential_noise(key_lo: Tensor, key_hi: Tensor, vocab_size: int) -> Tensor:
    """(B, V) fp32 Exp(1) variates: -log(1 - W), with log1p so that small E keep their
    precision (small E decide when an unlikely token wins)."""
    return -torch.log1p(-hash_uniform(key_lo, key_hi, vocab_size))


def exponential_race(
    scores: Tensor, threshold: Tensor, inverse_temperature: Tensor, key_lo: Tensor, key_hi: Tensor
) -> Tensor:
    """scores (B, V) logits (any float dtype), threshold (B,) fp32 (keep scores >= it),
    inverse_temperature (B,) fp32, keys (B,) -> token ids (B,) int64, each drawn from
    softmax(scores / T) over its row's kept tokens."""
    noise = exponential_noise(key_lo, key_hi, scores.shape[-1])
    scaled = scores.float() * inverse_temperature[:, None]
    raced = torch.where(scores >= threshold[:, None], scaled - noise.log(), -math.inf)  # (B, V)
    return raced.argmax(dim=-1)


def penalized_scores(logits: Tensor, seen: Tensor, slots: Tensor, penalties: Tensor) -> Tensor:
    """logits (B, V) -> (B, V) fp32 with the repetition penalty: the logit of each token marked
    in `seen` (slots, V) bool at the row's slot (B,) divided by its penalty (B,) if positive,
    multiplied if negative (Hugging Face's rule, which also divides a 0). A penalty of 1 leaves
    the row exactly as it was (x / 1 and x * 1 are exact)."""
    scores = logits.float()
    penalty = penalties[:, None]
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen.index_select(0, slots), penalized, scores)


def top_p_cut(
    scores: Tensor,
    ordered: Tensor,
    top_k_cut: Tensor,
    kth: Tensor,
    has_top_k: Tensor,
    top_p: Tensor,
    temperature: Tensor,
    *,
    any_top_k: bool = True,
) -> Tensor:
    """(B,) fp32: the logit of the last token top-p needs, over the distribution softmax(x / T)
    that top-k left (-inf on rows whose top_p is 1). scores (B, V) unscaled; `ordered`
    (B, depth) each row's largest scores, descending; `top_k_cut` (B,) fp32 top-k's threshold
    (-inf: off), equal to `kth` (B,), the k-th largest, where `has_top_k` (B,); `temperature`
    (B,) fp32. `any_top_k` False (no row has one) skips the passes that apply top-k.

    After a full sort each pass here is over (B, V): they are kept few (no softmax, no
    normalized cumsum, a binary search instead of a compare and a count)."""
    vocab, depth = scores.shape[-1], ordered.shape[-1]
    largest = ordered[:, :1].float()
    inverse_temperature = 1 / temperature[:, None]
    weights = ((ordered.float() - largest) * inverse_temperature).exp_()  # (B, depth), unnormalized
    if any_top_k:
        weights.masked_fill_(ordered < top_k_cut[:, None], 0)
    cumulative = weights.cumsum(dim=-1)  # (B, depth), monotone
    total = cumulative[:, -1]
    if depth < vocab:
        # top-k keeps every token tied with the k-th value, also those beyond `ordered` (topk
        # returned `depth` of them): their mass belongs to the distribution too
        beyond = (scores == kth[:, None]).sum(dim=-1) - (ordered == kth[:, None]).sum(dim=-1)
        beyond = torch.where(has_top_k, beyond, 0)
        tied = torch.exp((kth.float() - largest[:, 0]) * inverse_temperature[:, 0])
        total = total + beyond * tied
    # a token is needed while the mass before it is below top_p: the first j + 1 tokens, j the
    # first position whose cumulative mass reaches top_p * total. No further than the tokens
    # top-k kept, whatever fp32 rounding does to the total
    reach = (top_p * total)[:, None].contiguous()  # (B, 1)
    needed = torch.searchsorted(cumulative, reach).squeeze(1) + 1
    if any_top_k:
        needed = torch.minimum(needed, (ordered >= top_k_cut[:, None]).sum(dim=-1))
    else:
        needed = needed.clamp_max(depth)
    cut = ordered.gather(1, (needed - 1)[:, None]).squeeze(1).float()
    return torch.where(top_p < 1, cut, -math.inf)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log_softmax of logits (B, V) in fp32 at tokens (B,): (B,) fp32."""
    logits = logits.float()
    return logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


# -- a step's parameters ----------------------------------------------------------------------


class SamplingRequest(Protocol):
    """What the sampler reads from a request (the engine's `Request` has it)."""

    @property
    def id(self) -> int: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def prompt(self) -> Sequence[int]: ...
    @property
    def output(self) -> Sequence[int]: ...


# a top-k/top-p cut deeper than this sorts the whole row instead of running topk
_TOPK_MAX_DEPTH = 1024


@dataclass(frozen=True)
class SamplingBatch:
    """One step's per-row sampling parameters, made by `Sampler.prepare` and used by one
    `Sampler.sample`. The flags are decided on the host, so choosing the stages to run never
    reads the device."""

    size: int
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    logprobs: bool
    truncation_depth: int
    """How many of each row's largest values the top-k/top-p cut needs: the largest top_k, or
    the vocabulary when a top-p row has no top-k."""
    temperature: Tensor  # (B,) fp32, 1 on greedy rows
    inverse_temperature: Tensor  # (B,) fp32
    top_k: Tensor  # (B,) int64, 0: off, else <= V
    top_p: Tensor  # (B,) fp32, 1: off
    min_p_offset: Tensor  # (B,) fp32, T * log(min_p), -inf: off
    key_lo: Tensor  # (B,) int64 in [0, 2**32)
    key_hi: Tensor  # (B,) int64 in [0, 2**32)
    greedy_rows: Tensor  # (G,) int64
    penalties: Tensor  # (B,) fp32, 1: off
    penalty_slots: Tensor  # (B,) int64 rows of the sampler's seen-token table, 0: scratch


@dataclass(frozen=True)
class SampledTokens:
    token_ids: Tensor  # (B,) int64
    logprobs: Tensor | None  # (B,) fp32, when a row asked: every row's, the others ignore it

    def to_lists(self) -> tuple[list[int], list[float] | None]:
        """Both to the host in one read (ids < 2**53 are exact in float64)."""
        if self.logprobs is None:
            return self.token_ids.tolist(), None
        ids, logprobs = torch.stack([self.token_ids.double(), self.logprobs.double()]).tolist()
        return [int(token) for token in ids], logprobs


class Sampler:
    """Samples a step's rows on `device`, and keeps what sampling needs across steps: the
    seen-token table of penalized requests and the host generator of unseeded rows' keys.

    `seed` seeds that generator (unseeded requests then repeat for the same sequence of
    batches). `compile` compiles the race, the penalty and the logprobs with torch.compile;
    default: on CUDA. The first step that needs each takes seconds to compile (and again at
    B = 1, which Dynamo specializes): warm them up before timing."""

    def __init__(
        self,
        vocab_size: int,
        *,
        device: torch.device | str = "cpu",
        seed: int | None = None,
        compile: bool | None = None,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._rng = np.random.default_rng(seed)
        self._compile = self.device.type == "cuda" if compile is None else compile
        self._compiled: dict[Callable[..., Tensor], Callable[..., Tensor]] = {}
        self._seen: Tensor | None = None  # (slots, V) bool, made on first use
        # on the device: `table[i, j] = True` would copy the Python scalar over, a host sync
        self._true = torch.ones((), dtype=torch.bool, device=self.device)
        self._slots: dict[int, int] = {}
        self._free_slots: list[int] = []

    # -- host side --------------------------------------------------------------------------

    def prepare(self, requests: Sequence[SamplingRequest], *, ahead: int = 0) -> SamplingBatch:
        """The step's rows, in the order of the logits' rows. One pass over the requests on the
        host, one host -> device copy (pinned and asynchronous on CUDA). `ahead`: tokens each
        request has drawn that the host has not appended to its output yet (a pipelined step,
        queued before the last step's tokens came back; its seeded rows count them)."""
        rows = len(requests)
        if rows == 0:
            raise ValueError("prepare needs at least one request")
        vocab = self.vocab_size
        temperature = [1.0] * rows
        top_k, top_p, min_p_offset = [0] * rows, [1.0] * rows, [-math.inf] * rows
        seeds, counters, seeded = [0] * rows, [0] * rows, [False] * rows
        penalties, penalty_slots = [1.0] * rows, [0] * rows
        greedy_rows: list[int] = []
        new_slots: list[int] = []
        new_seen: list[Sequence[int]] = []
        logprobs = any_penalty = any_top_p = any_min_p = full_sort = False
        depth = 0
        for row, request in enumerate(requests):
            params = request.params
            logprobs |= params.logprobs
            if params.repetition_penalty != 1.0:
                any_penalty = True
                slot = self._slots.get(request.id)
                if slot is None:
                    slot = self._take_slot(request.id)
                    new_slots.append(slot)
                    new_seen.append([*request.prompt, *request.output])
                penalties[row], penalty_slots[row] = params.repetition_penalty, slot
            if params.greedy:
                greedy_rows.append(row)
                continue
            temperature[row] = params.temperature
            if params.top_k > 0:
                top_k[row] = min(params.top_k, vocab)
                depth = max(depth, top_k[row])
            if params.top_p < 1.0:
                top_p[row], any_top_p = params.top_p, True
                full_sort |= params.top_k == 0
            if params.min_p > 0:
                min_p_offset[row], any_min_p = params.temperature * math.log(params.min_p), True
            if params.seed is not None:
                seeds[row], counters[row] = params.seed % 2**64, len(request.output) + ahead
                seeded[row] = True
        sampled = rows - len(greedy_rows)

        keys = np.zeros(rows, dtype=np.uint64)
        if sampled:
            is_seeded = np.array(seeded)
            if is_seeded.any():
                seeded_keys = seeded_row_keys(
                    np.array(seeds, dtype=np.uint64), np.array(counters, dtype=np.uint64)
                )
                keys = np.where(is_seeded, seeded_keys, keys)
            if not is_seeded.all():
                fresh = self._rng.integers(0, 2**64, size=rows, dtype=np.uint64)
                keys = np.where(is_seeded, keys, fresh)
        seen_slots = [slot for slot, seen in zip(new_slots, new_seen, strict=True) for _ in seen]
        seen_tokens = [token for seen in new_seen for token in seen]

        ints = [
            np.array(top_k, dtype=np.int64),
            (keys & np.uint64(_MASK32)).astype(np.int64),
            (keys >> np.uint64(32)).astype(np.int64),
            np.array(greedy_rows, dtype=np.int64),
            np.array(penalty_slots, dtype=np.int64),
            np.array(new_slots, dtype=np.int64),
            np.array(seen_slots, dtype=np.int64),
            np.array(seen_tokens, dtype=np.int64),
        ]
        temperature_array = np.array(temperature)
        floats = [
            temperature_array.astype(np.float32),
            (1 / temperature_array).astype(np.float32),
            np.array(top_p, dtype=np.float32),
            np.array(min_p_offset, dtype=np.float32),
            np.array(penalties, dtype=np.float32),
        ]
        ints_on_device, floats_on_device = self._copy_in_one_go(ints, floats)
        (
            top_k_t,
            key_lo,
            key_hi,
            greedy_t,
            penalty_slots_t,
            new_slots_t,
            seen_slots_t,
            seen_tokens_t,
        ) = ints_on_device
        temperature_t, inverse_temperature_t, top_p_t, min_p_offset_t, penalties_t = (
            floats_on_device
        )
        if new_slots:
            # a reused slot still holds its last request's tokens: clear, then mark the new ones
            assert self._seen is not None
            self._seen.index_fill_(0, new_slots_t, False)
            self._seen.index_put_((seen_slots_t, seen_tokens_t), self._true)
        return SamplingBatch(
            size=rows,
            all_greedy=sampled == 0,
            any_greedy=bool(greedy_rows),
            any_top_k=depth > 0,
            any_top_p=any_top_p,
            any_min_p=any_min_p,
            any_penalty=any_penalty,
            logprobs=logprobs,
            truncation_depth=vocab if full_sort else depth,
            temperature=temperature_t,
            inverse_temperature=inverse_temperature_t,
            top_k=top_k_t,
            top_p=top_p_t,
            min_p_offset=min_p_offset_t,
            key_lo=key_lo,
            key_hi=key_hi,
            greedy_rows=greedy_t,
            penalties=penalties_t,
            penalty_slots=penalty_slots_t,
        )

    def _copy_in_one_go(
        self, ints: list[np.ndarray], floats: list[np.ndarray]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Pack int64 and fp32 arrays into one byte buffer, copy it once, and split it into
        views on the device (int64 first, so that every view is aligned). Pinned memory makes
        the copy asynchronous: a pageable copy would wait for the whole step's forward."""
        int_bytes = sum(a.nbytes for a in ints)
        buffer = np.concatenate([a.view(np.uint8) for a in ints + floats])
        host = torch.from_numpy(buffer)
        if self.device.type == "cuda":
            packed = host.pin_memory().to(self.device, non_blocking=True)
        else:
            packed = host.to(self.device)
        int_views = packed[:int_bytes].view(torch.int64).split([len(a) for a in ints])
        float_views = packed[int_bytes:].view(torch.float32).split([len(a) for a in floats])
        return list(int_views), list(float_views)

    def _take_slot(self, request_id: int) -> int:
        if not self._free_slots:
            # grow by doubling, the old rows keep their contents; row 0 is never handed out
            old = 0 if self._seen is None else self._seen.shape[0]
            grown = torch.zeros(
                max(2 * old, 8), self.vocab_size, dtype=torch.bool, device=self.device
            )
            if self._seen is not None:
                grown[:old] = self._seen
            self._seen = grown
            self._free_slots = list(range(grown.shape[0] - 1, max(old, 1) - 1, -1))
        slot = self._free_slots.pop()
        self._slots[request_id] = slot
        return slot

    def release(self, request_id: int) -> None:
        """Forget a finished request (frees its seen-token row; a no-op if it had none). A
        preempted request may keep its row: recomputing it does not change its tokens."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    # -- device side ------------------------------------------------------------------------

    def _scores(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """(B, V) unscaled: the logits as they are, or in fp32 with the penalty applied."""
        if not batch.any_penalty:
            return logits
        assert self._seen is not None
        return self._run(penalized_scores, logits, self._seen, batch.penalty_slots, batch.penalties)

    def _keep_threshold(self, scores: Tensor, batch: SamplingBatch) -> Tensor:
        """(B, V) unscaled scores -> (B,) fp32: keep the tokens whose score is >= it."""
        rows, vocab = scores.shape
        threshold = torch.full((rows,), -math.inf, device=scores.device)
        largest = None
        if batch.any_top_k or batch.any_top_p:
            depth = batch.truncation_depth
            if depth >= vocab or depth > _TOPK_MAX_DEPTH:
                ordered = scores.sort(dim=-1, descending=True).values[:, :depth]  # (B, depth)
            else:
                ordered = scores.topk(depth, dim=-1).values  # (B, depth), descending
            largest = ordered[:, 0]
            has_top_k = batch.top_k > 0
            k = torch.where(has_top_k, batch.top_k, depth)  # (B,), within 1..depth
            kth = ordered.gather(1, (k - 1)[:, None]).squeeze(1)
            threshold = torch.where(has_top_k, kth.float(), threshold)
            if batch.any_top_p:
                # eager: Inductor (torch 2.11) fails to generate the cumsum at dynamic shapes
                cut = top_p_cut(
                    scores,
                    ordered,
                    threshold,
                    kth,
                    has_top_k,
                    batch.top_p,
                    batch.temperature,
                    any_top_k=batch.any_top_k,
                )
                threshold = torch.maximum(threshold, cut)
        if batch.any_min_p:
            if largest is None:
                largest = scores.amax(dim=-1)
            threshold = torch.maximum(threshold, largest.float() + batch.min_p_offset)
        return threshold

    def sampling_logits(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """(B, V) fp32: the scaled logits the sampled rows draw from, -inf where truncated
        (greedy rows: the penalized logits). For tests and inspection; `sample` never
        materializes it."""
        scores = self._scores(logits, batch)
        kept = scores >= self._keep_threshold(scores, batch)[:, None]
        return torch.where(kept, scores.float() / batch.temperature[:, None], -math.inf)

    def sample(self, logits: Tensor, batch: SamplingBatch) -> SampledTokens:
        """logits (B, V) bf16/fp16/fp32 on the sampler's device -> token ids (B,) int64 and, if a
        row asked, logprobs (B,) fp32 (raw log_softmax at the chosen token). Launches device
        work only; marks the drawn tokens as seen for penalized rows, so call it once per
        `prepare`."""
        if logits.ndim != 2 or logits.shape != (batch.size, self.vocab_size):
            raise ValueError(
                f"logits must be (rows, vocab) = ({batch.size}, {self.vocab_size}) as prepared, "
                f"got {tuple(logits.shape)}"
            )
        scores = self._scores(logits, batch)
        if batch.all_greedy:
            tokens = scores.argmax(dim=-1)
        else:
            threshold = self._keep_threshold(scores, batch)
            tokens = self._run(
                exponential_race,
                scores,
                threshold,
                batch.inverse_temperature,
                batch.key_lo,
                batch.key_hi,
            )
            if batch.any_greedy:
                tokens[batch.greedy_rows] = scores.index_select(0, batch.greedy_rows).argmax(-1)
        if batch.any_penalty:
            assert self._seen is not None
            # every row: the unpenalized ones write into the scratch row 0
            self._seen.index_put_((batch.penalty_slots, tokens), self._true)
        logprobs = None
        if batch.logprobs:
            logprobs = self._run(token_logprobs, logits, tokens)
        return SampledTokens(token_ids=tokens, logprobs=logprobs)

    def _run(self, function: Callable[..., Tensor], *args: Tensor) -> Tensor:
        """`function(*args)`, compiled (once per function, shapes dynamic) when the sampler
        compiles: each is elementwise work, reductions and gathers over (B, V) that eager
        torch runs as many full passes and Inductor fuses into one or two kernels."""
        compiled = self._compiled.get(function)
        if compiled is None:
            compiled = torch.compile(function, dynamic=True) if self._compile else function
            self._compiled[function] = compiled
        if compiled is function:
            return function(*args)
        try:
            return compiled(*args)
        except Exception as error:  # a compiler failure must not take the engine down
            logger.warning("compiling %s failed (%s); running it eagerly", function.__name__, error)
            self._compiled[function] = function
            return function(*args)


# -- stop strings -----------------------------------------------------------------------------


def find_stop_string(text: str, stop: Sequence[str], *, checked: int = 0) -> int | None:
    """Where to cut `text` (keep text[:cut]) for the first stop string completed after its
    first `checked` characters (those were checked before and held none), or None.

    "First" is the occurrence that ends first, the longest one if several end together: where
    a character-by-character generation would have stopped, so the answer does not depend on
    how tokens split the text. An occurrence may begin in the checked part (a stop string that
    spans a token boundary). Cost: O(new characters + longest stop string) per stop string."""
    best_end, best_start = None, None
    for string in stop:
        start = text.find(string, max(0, checked - len(string) + 1))
        if start < 0:
            continue
        end = start + len(string)
        if best_end is None or (end, start) < (best_end, best_start):
            best_end, best_start = end, start
    return best_start


class StopStringChecker:
    """One request's stop strings, fed its new output tokens after every step.

        checker = StopStringChecker(params.stop, tokenizer.decode, context=request.prompt[-4:])
        if checker.append([token]):   # a stop string appeared: checker.text is cut before it
            finish the request

    The text grows by incremental decoding: each call decodes only the previous call's tokens
    (as context) and the new ones, and appends the difference, so a step costs O(tokens per
    step), not O(output). The context matters to tokenizers whose decode of a lone piece differs
    from its decode in a sequence (SentencePiece drops the leading space of a first piece): pass
    a few prompt tokens. A decode ending in U+FFFD (bytes of a character still to come) waits
    for the next tokens. Assumes decode(a + b) starts with decode(a), true of byte-level BPE and
    SentencePiece; `decode` takes a list of ids and returns text."""

    def __init__(
        self,
        stop: Sequence[str],
        decode: Callable[[list[int]], str],
        *,
        context: Sequence[int] = (),
    ) -> None:
        self.stop = (stop,) if isinstance(stop, str) else tuple(stop)
        self._decode = decode
        self._tokens = list(context)
        self._prefix = 0  # tokens[_prefix:_read] were decoded last time: the context of the next
        self._read = len(self._tokens)
        self.text = ""
        """The output's text so far; once stopped, cut before the stop string."""
        self.stopped = False

    def append(self, tokens: Iterable[int]) -> bool:
        """Add new output tokens; True once a stop string has appeared (then stays True)."""
        if self.stopped:
            return True
        self._tokens.extend(tokens)
        self._advance(final=False)
        return self.stopped

    def finish(self) -> str:
        """At the request's end: decode what was held back (an unfinished character) and
        return the final text."""
        if not self.stopped:
            self._advance(final=True)
        return self.text

    def _advance(self, *, final: bool) -> None:
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return
        checked = len(self.text)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self._tokens)
        cut = find_stop_string(self.text, self.stop, checked=checked)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
