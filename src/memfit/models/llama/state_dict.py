"""The Hugging Face state-dict adapter of the Llama family (LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM): one name map, read both ways.

memfit fuses q, k and v into one `qkv` projection (rows q | k | v) and gate and up into one
`gate_up` (rows gate | up); a memfit tensor maps to the Hugging Face tensors it concatenates
along dim 0, in order. A tied model (no lm_head) ignores a checkpoint's lm_head.weight, and
every model the rotary inv_freq buffers older checkpoints hold (`unused_hf_name`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from memfit.models.config import ModelConfig
from memfit.models.loading import check_tensor_shapes

# memfit name -> the Hugging Face names it concatenates (dim 0), in order
_TOP = {
    "embed.weight": ("model.embed_tokens.weight",),
    "norm.weight": ("model.norm.weight",),
    "lm_head.weight": ("lm_head.weight",),
}
_LAYER = {  # below layers.{i}. / model.layers.{i}.
    "attention.qkv.weight": tuple(f"self_attn.{x}_proj.weight" for x in "qkv"),
    "attention.qkv.bias": tuple(f"self_attn.{x}_proj.bias" for x in "qkv"),
    "attention.out.weight": ("self_attn.o_proj.weight",),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.down.weight": ("mlp.down_proj.weight",),
    "attention_norm.weight": ("input_layernorm.weight",),
    "mlp_norm.weight": ("post_attention_layernorm.weight",),
}


def hf_names(name: str) -> tuple[str, ...]:
    """The Hugging Face names memfit parameter `name` is made of."""
    if name in _TOP:
        return _TOP[name]
    _, index, rest = name.split(".", 2)  # layers.{i}.rest
    if rest not in _LAYER:
        raise KeyError(f"no Hugging Face name for memfit parameter {name!r}")
    return tuple(f"model.layers.{index}.{hf}" for hf in _LAYER[rest])


def _split_sizes(config: ModelConfig, name: str, rows: int) -> list[int]:
    if ".qkv." in name:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [q, kv, kv]
    if name.endswith("gate_up.weight"):
        return [rows // 2, rows // 2]
    return [rows]


def _base_tensors(model: torch.nn.Module):
    """The model's state dict without LoRA adapters (memfit.nn.lora: saved in peft's format)."""
    return [(n, t) for n, t in model.state_dict().items() if ".lora_" not in n]


def hf_layout(model: torch.nn.Module) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """memfit name -> the (Hugging Face name, shape) of each tensor it concatenates along dim 0,
    in order. Reads shapes only, so a model on the meta device answers without memory: the
    loader checks a checkpoint against it before it reads any weights."""
    layout = {}
    for name, tensor in _base_tensors(model):
        rows = _split_sizes(model.config, name, tensor.shape[0])
        layout[name] = [
            (hf, (size, *tensor.shape[1:])) for hf, size in zip(hf_names(name), rows, strict=True)
        ]
    return layout


def unused_hf_name(model: torch.nn.Module, name: str) -> bool:
    """Whether checkpoint tensor `name` is one the model does without: the lm_head.weight of a
    tied model (some checkpoints keep a copy of the embedding there) and the rotary inv_freq
    buffers older transformers versions saved (memfit computes RoPE from the config)."""
    return (model.lm_head is None and name == "lm_head.weight") or name.endswith(
        "rotary_emb.inv_freq"
    )


def check_hf_shapes(
    model: torch.nn.Module,
    found: Mapping[str, Sequence[int]],
    *,
    source: str = "Hugging Face weights",
) -> None:
    """Raise ValueError naming the tensors `found` (Hugging Face name -> shape) lacks or has
    beyond what `model` takes, and the shapes that differ."""
    expected = {hf: shape for parts in hf_layout(model).values() for hf, shape in parts}
    check_tensor_shapes(
        expected,
        found,
        source=source,
        target=f"model {model.config.name!r}",
        ignore=lambda name: unused_hf_name(model, name),
    )


def to_hf_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """This model's weights under Hugging Face's names, with qkv and gate_up split back."""
    out: dict[str, Tensor] = {}
    for name, tensor in _base_tensors(model):
        parts = tensor.split(_split_sizes(model.config, name, tensor.shape[0]), dim=0)
        out.update(zip(hf_names(name), parts, strict=True))
    return out


def load_hf_state_dict(model: torch.nn.Module, hf_state: dict[str, Tensor]) -> None:
    """Load Hugging Face weights (names as in `to_hf_state_dict`) into `model`, fusing qkv and
    gate_up. Raises ValueError listing missing or unexpected keys, or mismatched shapes.
    (`memfit.models.loading.load_pretrained` reads a checkpoint directory tensor by tensor.)"""
    check_hf_shapes(model, {name: tuple(tensor.shape) for name, tensor in hf_state.items()})
    model.load_state_dict(
        {
            name: torch.cat([hf_state[hf] for hf, _ in parts])
            for name, parts in hf_layout(model).items()
        }
    )
