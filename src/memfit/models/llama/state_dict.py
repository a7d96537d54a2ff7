"""The Hugging Face state-dict adapter of the Llama family (LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM): one name map, read both ways.

memfit fuses q, k and v into one `qkv` projection (rows q | k | v) and gate and up into one
`gate_up` (rows gate | up); a memfit tensor maps to the Hugging Face tensors it concatenates
along dim 0, in order. A tied model (no lm_head) ignores a checkpoint's lm_head.weight.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.models.config import ModelConfig

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


def to_hf_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """This model's weights under Hugging Face's names, with qkv and gate_up split back."""
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        parts = tensor.split(_split_sizes(model.config, name, tensor.shape[0]), dim=0)
        out.update(zip(hf_names(name), parts, strict=True))
    return out


def load_hf_state_dict(model: torch.nn.Module, hf_state: dict[str, Tensor]) -> None:
    """Load Hugging Face weights (names as in `to_hf_state_dict`) into `model`, fusing qkv and
    gate_up. Raises ValueError listing missing or unexpected keys, or mismatched shapes."""
    expected = to_hf_state_dict(model)
    missing = sorted(set(expected) - set(hf_state))
    ignored = {"lm_head.weight"} if model.lm_head is None else set()
    unexpected = sorted(set(hf_state) - set(expected) - ignored)
    if missing or unexpected:
        raise ValueError(
            f"Hugging Face weights do not match model {model.config.name!r}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in expected.items():
        if tuple(hf_state[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{name}: expected shape {tuple(tensor.shape)}, got {tuple(hf_state[name].shape)}"
            )
    model.load_state_dict(
        {name: torch.cat([hf_state[hf] for hf in hf_names(name)]) for name in model.state_dict()}
    )
