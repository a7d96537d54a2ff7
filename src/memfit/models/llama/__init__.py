"""The Llama family (Llama 2/3, Mistral, Qwen2 shapes): the model (`model.py`), its spec, what the
planner reads (`spec.py`), and its Hugging Face state-dict adapter (`state_dict.py`). The model
and the adapter are imported on first use, so that the planner's import of the spec loads no
torch."""

from memfit.models.llama.spec import LlamaSpec

_LAZY = {
    "Block": "model",
    "Llama": "model",
    "build_model": "model",
    "load_hf_state_dict": "state_dict",
    "to_hf_state_dict": "state_dict",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"memfit.models.llama.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'memfit.models.llama' has no attribute {name!r}")


__all__ = ["Block", "Llama", "LlamaSpec", "build_model", "load_hf_state_dict", "to_hf_state_dict"]
