"""memfit: train and serve transformer language models in the GPU memory you have."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real imports stay lazy: `import memfit` loads neither torch nor triton
    from memfit.models.config import ModelConfig
    from memfit.planner import GPU, MemoryPlan, Strategy

__version__ = "0.1.0"


def plan(
    model: str | ModelConfig,
    strategy: Strategy | None = None,
    gpu: str | GPU | None = None,
    **strategy_options: Any,
) -> MemoryPlan:
    """Predicted per-GPU memory of training `model` (a preset name, a HF config.json path or a
    ModelConfig) with `strategy` (a `memfit.planner.Strategy`, or its fields as keywords) on `gpu`
    (a catalog name such as "h100-sxm", a `GPU`, or None for no capacity check).
    Returns a `MemoryPlan` with `.peak_bytes`, `.breakdown`, `.phases` and `.fits`."""
    from memfit.models.config import ModelConfig, load_model_config
    from memfit.planner import Strategy, get_gpu
    from memfit.planner import plan as _plan

    model = model if isinstance(model, ModelConfig) else load_model_config(model)
    strategy = strategy or Strategy(**strategy_options)
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    return _plan(model, strategy, gpu)


def recommend(
    model: str | ModelConfig, gpu: str | GPU = "h100-sxm", **options: Any
) -> list[Strategy]:
    """Strategies (`memfit.planner.Strategy`) that fit `gpu`, fastest predicted first; options as
    for `memfit.planner.rank_strategies` (seq_len, tokens_per_step, optimizer, limit)."""
    from memfit.models.config import ModelConfig, load_model_config
    from memfit.planner import get_gpu
    from memfit.planner import recommend as _recommend

    model = model if isinstance(model, ModelConfig) else load_model_config(model)
    return _recommend(model, get_gpu(gpu) if isinstance(gpu, str) else gpu, **options)


def __getattr__(name: str) -> Any:
    # memfit.flash_attention / memfit.flash_attention_varlen, imported on first use (triton is
    # slow to import and `memfit plan` never needs it)
    if name in (
        "flash_attention",
        "flash_attention_varlen",
        "sparse_attention",
        "sparse_attention_varlen",
    ):
        from memfit.ops import attention as module

        return getattr(module, name)
    if name == "sparse":  # the sparse attention patterns (memfit.sparse.local(512), ...)
        from memfit.ops.attention import sparse

        return sparse
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
