"""How a request is sampled and when it stops, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0: greedy."""
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.stop_token_ids = tuple(self.stop_token_ids)
