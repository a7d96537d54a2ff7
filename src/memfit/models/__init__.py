"""The reference decoder, its presets and Hugging Face config interop."""

from memfit.models.config import (
    PRESETS,
    ModelConfig,
    format_params,
    from_hf_config,
    load_model_config,
)
from memfit.models.llama import Llama, build_model, load_hf_state_dict, to_hf_state_dict

__all__ = [
    "PRESETS",
    "Llama",
    "ModelConfig",
    "build_model",
    "format_params",
    "from_hf_config",
    "load_hf_state_dict",
    "load_model_config",
    "to_hf_state_dict",
]
