"""Model families, their presets and Hugging Face config interop.

A family is a folder (`models/llama/`) with its plain-PyTorch model, its spec (parameters, FLOPs,
activation bytes: what the planner reads) and its Hugging Face state-dict adapter, registered in
`FAMILIES` under the name `ModelConfig.family` gives. A new family (MoE) is a new folder and one
entry here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfit.models.config import (
    PRESETS,
    ModelConfig,
    format_params,
    from_hf_config,
    load_model_config,
)


@dataclass(frozen=True)
class Family:
    build: Callable[..., Any]
    """build(config, *, device, attention, seed) -> the model."""
    spec: Callable[[ModelConfig], Any]
    to_hf_state_dict: Callable[[Any], dict]
    load_hf_state_dict: Callable[[Any, dict], None]
    hf_layout: Callable[[Any], dict]
    """hf_layout(model) -> {memfit name: [(Hugging Face name, shape), ...]}, the parts each
    tensor concatenates along dim 0; shapes only, so a meta-device model answers."""
    check_hf_shapes: Callable[..., None]
    """check_hf_shapes(model, {Hugging Face name: shape}, source=...) raises ValueError naming
    missing, unexpected and mis-shaped tensors."""


FAMILIES: dict[str, Callable[[], Family]] = {}


def _llama() -> Family:
    from memfit.models import llama

    return Family(
        build=lambda *args, **kwargs: llama.build_model(*args, **kwargs),
        spec=llama.LlamaSpec,
        to_hf_state_dict=lambda *args: llama.to_hf_state_dict(*args),
        load_hf_state_dict=lambda *args: llama.load_hf_state_dict(*args),
        hf_layout=lambda model: _llama_adapter().hf_layout(model),
        check_hf_shapes=lambda *args, **kwargs: _llama_adapter().check_hf_shapes(*args, **kwargs),
    )


def _llama_adapter():
    from memfit.models.llama import state_dict

    return state_dict


FAMILIES["llama"] = _llama  # imported on first use: `memfit plan` needs no torch model code


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]()


def build_model(config: ModelConfig, **kwargs: Any):
    """The model of `config`'s family (see the family's build_model for the options)."""
    return get_family(config.family).build(config, **kwargs)


def __getattr__(name: str):
    if name in ("Llama", "load_hf_state_dict", "to_hf_state_dict"):
        from memfit.models import llama

        return getattr(llama, name)
    if name in ("GenerationDefaults", "PretrainedInfo", "PretrainedTokenizer", "load_pretrained"):
        from memfit.models import loading  # torch and safetensors: imported on first use

        return getattr(loading, name)
    raise AttributeError(f"module 'memfit.models' has no attribute {name!r}")


def _check_presets() -> None:
    # llama-1b is the anchor shape: its count is a contract (DESIGN.md).
    assert abs(PRESETS["llama-1b"].num_params / 1e6 - 953.2) <= 0.05


_check_presets()

__all__ = [
    "FAMILIES",
    "PRESETS",
    "Family",
    "GenerationDefaults",
    "ModelConfig",
    "PretrainedInfo",
    "PretrainedTokenizer",
    "build_model",
    "format_params",
    "from_hf_config",
    "get_family",
    "load_model_config",
    "load_pretrained",
]
