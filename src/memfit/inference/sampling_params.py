"""How a request is sampled and when it stops, checked when it is made.

Every field is validated in `__post_init__`, so a bad request fails when it is added, with the
value and the allowed range, instead of deep inside a batched step where one row's nonsense
would be hard to trace. An unknown keyword (`SamplingParams(top_q=0.9)`) is a `ValueError`
that names it and lists the known ones; it is also a `TypeError`, the exception Python raises
for a wrong keyword, so callers catching either see it. `from_dict` builds one from a decoded
JSON request under the same rules.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

# the range `torch.manual_seed` accepts: a seed is reduced to 64 bits (`seed % 2**64`)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

MIN_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily: dividing logits by a smaller one can overflow fp32
to inf, and the distribution is already a point mass on the argmax to fp32 precision."""


class UnknownSamplingParameterError(ValueError, TypeError):
    """A keyword that `SamplingParams` does not have. A ValueError, as every invalid request is,
    and a TypeError, what Python raises for an unexpected keyword argument."""


_Class = TypeVar("_Class", bound=type)


def _reject_unknown_keywords(cls: _Class) -> _Class:
    """Wrap the dataclass' `__init__` so that an unknown keyword names itself and the known
    ones, instead of the generated `__init__`'s bare TypeError."""
    generated: Callable[..., None] = cls.__init__  # type: ignore[misc]
    known = tuple(f.name for f in dataclasses.fields(cls))

    def __init__(self: Any, **kwargs: Any) -> None:
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            raise UnknownSamplingParameterError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(known)}"
            )
        generated(self, **kwargs)

    __init__.__doc__ = generated.__doc__
    __init__.__wrapped__ = generated  # type: ignore[attr-defined]  # inspect.signature shows fields
    cls.__init__ = __init__  # type: ignore[misc]
    return cls


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; `top_k=True` is a mistake, not 1
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return value


def _check_number(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _as_tuple(name: str, value: object, items: str) -> tuple:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a sequence of {items}, got {value!r}")
    return tuple(value)


@_reject_unknown_keywords
@dataclass(kw_only=True)
class SamplingParams:
    """Per-request sampling, applied in this order (the order of Hugging Face's logits
    processors): repetition penalty on the raw logits, temperature, top-k, top-p, min-p, then a
    draw from what is left (or the argmax when greedy).

    Ties at a cut are kept: top-k keeps every token whose logit equals the k-th largest, top-p
    every token equal to the last one it needs, so the kept set never depends on a sort order.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    """0 (or below MIN_TEMPERATURE): greedy, the argmax of the (penalized) logits; top_k, top_p
    and min_p are then ignored."""
    top_k: int = 0
    """Keep the k largest logits; 0: off."""
    top_p: float = 1.0
    """Keep the smallest set of largest probabilities whose mass reaches top_p (nucleus
    sampling, Holtzman et al. 2020), after top-k; 1: off."""
    min_p: float = 0.0
    """Keep tokens whose probability is at least min_p times the largest one (Nguyen et al.
    2024); 0: off. Tested in logit space: logit >= max logit + log(min_p)."""
    repetition_penalty: float = 1.0
    """Keskar et al. 2019 (CTRL), as Hugging Face applies it: the logit of every token already in
    the prompt or the output is divided by the penalty if positive, multiplied if negative;
    1: off. Applies to greedy requests too."""
    seed: int | None = None
    """Seeded requests draw the same tokens whatever else shares their batch (see `sampling`)."""
    stop_token_ids: tuple[int, ...] = ()
    """The request ends when it samples one of these; the token is not returned."""
    stop: tuple[str, ...] = ()
    """Stop strings: the output ends where the first of them appears in its text, which is cut
    before it (as OpenAI's API and vLLM do). A single string is taken as a 1-tuple."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence tokens (the LLM adds those to
    stop_token_ids otherwise): benchmarks of a fixed length."""
    logprobs: bool = False
    """Also return the log-probability of each chosen token under the raw model distribution,
    log_softmax of the unmodified logits (vLLM's convention): it does not see the penalty,
    temperature or truncation that chose the token, so it scores the text under the model."""

    def __post_init__(self) -> None:
        if _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if _check_number("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if _check_int("top_k", self.top_k) < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < _check_number("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p}")
        if not 0 <= _check_number("min_p", self.min_p) <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0: off), got {self.min_p}")
        if _check_number("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}"
            )
        if self.seed is not None and not SEED_MIN <= _check_int("seed", self.seed) <= SEED_MAX:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        self.stop_token_ids = _as_tuple("stop_token_ids", self.stop_token_ids, "token ids")
        for token in self.stop_token_ids:
            if _check_int("stop_token_ids", token) < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {token}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = _as_tuple("stop", self.stop, "strings")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(
                    f"stop must hold non-empty strings, got {text!r} (an empty one would stop "
                    "every request at once)"
                )
        for name in ("logprobs", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def with_stop_tokens(self, tokens: Sequence[int]) -> SamplingParams:
        """A copy that also stops at `tokens` (a model's end-of-sequence ids)."""
        extra = tuple(t for t in tokens if t not in self.stop_token_ids)
        return dataclasses.replace(self, stop_token_ids=self.stop_token_ids + extra)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @classmethod
    def from_dict(cls, request: Mapping[str, Any]) -> SamplingParams:
        """From a decoded JSON request: JSON arrays become tuples, a number for a float field
        may be an int; unknown keys raise like unknown keywords."""
        if not isinstance(request, Mapping):
            raise ValueError(
                f"sampling parameters must be a JSON object, got {type(request).__name__}"
            )
        values = {
            name: tuple(value)
            if isinstance(value, Sequence) and not isinstance(value, str)
            else value
            for name, value in request.items()
        }
        return cls(**values)
