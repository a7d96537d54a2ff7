"""The reference decoder: a Llama-family transformer (Llama 2/3, Mistral, Qwen2 shapes).

    tokens -> embed -> [RMSNorm -> attention (RoPE, GQA) -> +residual
                        -> RMSNorm -> SwiGLU MLP -> +residual] x num_layers -> RMSNorm -> lm_head

Plain PyTorch: the model knows nothing of sharding, checkpointing or precision; the engine
applies those to it. Two layout choices differ from Hugging Face's LlamaForCausalLM and are
undone by `load_hf_state_dict` / `to_hf_state_dict`:
- q, k and v come from one fused projection `qkv` (rows q | k | v), gate and up from one fused
  `gate_up` (rows gate | up): one larger matrix product instead of three or two;
- under autocast the residual stream stays in the compute dtype (bf16/fp16) instead of being
  promoted to fp32 by the fp32 embedding; normalization still computes in fp32.
The loss is computed by `memfit.functional.linear_cross_entropy`, which never materializes the
(tokens, vocab) logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from memfit import functional as MF
from memfit.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return MF.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, backend: str) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.backend = backend
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.out = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache=None, start_pos: int = 0
    ) -> Tensor:
        batch, seqlen, _ = x.shape
        qkv = self.qkv(x)  # (B, T, (nh + 2 * nkv) * hs)
        q, k, v = qkv.split(
            [
                self.num_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
            ],
            dim=-1,
        )
        q = q.view(batch, seqlen, self.num_heads, self.head_dim)  # (B, T, nh, hs)
        k = k.view(batch, seqlen, self.num_kv_heads, self.head_dim)  # (B, T, nkv, hs)
        # v is a view into qkv: copying it lets the (T, q + 2kv) projection output be freed
        # after RoPE instead of being kept alive for backward by the attention kernel.
        v = v.reshape(batch, seqlen, self.num_kv_heads, self.head_dim).contiguous()
        q, k = MF.apply_rotary_qk(q, k, cos, sin)  # one kernel for both; no copy of qkv
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_index, start_pos, k, v)  # (B, start_pos + T, nkv, hs)
        y = MF.attention(q, k, v, causal=True, window=self.window, backend=self.backend)
        return self.out(y.reshape(batch, seqlen, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(MF.swiglu(self.gate_up(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, backend: str) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, layer_index, backend)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache=None, start_pos: int = 0
    ) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, kv_cache, start_pos)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A Llama-family decoder.

    `forward(tokens)` returns logits (batch, seqlen, vocab); `forward(tokens, targets)` returns
    the summed cross-entropy over targets != -100 (an fp32 scalar; divide by the token count).
    Build large shapes on the meta device (`with torch.device("meta"): Llama(config)`) to inspect
    them without memory; `materialize(model, device)` allocates and initializes.
    """

    def __init__(self, config: ModelConfig, *, attention: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i, attention) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @property
    def output_weight(self) -> Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, tokens: Tensor, targets: Tensor | None = None, *, kv_cache=None, start_pos: int = 0
    ) -> Tensor:
        batch, seqlen = tokens.shape
        if start_pos + seqlen > self.config.max_seq_len and self.config.rope_scaling is None:
            # RoPE extrapolates past the trained length badly; allow it but never silently beyond 2x.
            if start_pos + seqlen > 2 * self.config.max_seq_len:
                raise ValueError(
                    f"sequence of {start_pos + seqlen} tokens exceeds twice the model's "
                    f"max_seq_len={self.config.max_seq_len}"
                )
        x = self.embed(tokens)  # (B, T, h)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))  # residual stream in compute dtype
        cos, sin = MF.rotary_cos_sin(
            torch.arange(start_pos, start_pos + seqlen, device=tokens.device),
            self.config.head_dim,
            self.config.rope_theta,
            self.config.rope_scaling,
            device=tokens.device,
        )
        for block in self.layers:
            x = block(x, cos, sin, kv_cache, start_pos)
        x = self.norm(x)
        if targets is None:
            return x @ self.output_weight.to(x.dtype).T  # (B, T, vocab)
        return MF.linear_cross_entropy(
            x.reshape(batch * seqlen, -1), self.output_weight, targets.reshape(-1)
        )

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) for matrices and embeddings, 1 for norms, zero biases; the output
        projections of each residual branch scaled by 1/sqrt(2 * num_layers) (GPT-2)."""
        std = self.config.init_std
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif name.endswith(("attention.out.weight", "mlp.down.weight")):
                param.normal_(0.0, std / math.sqrt(2 * self.config.num_layers), generator=generator)
            else:
                param.normal_(0.0, std, generator=generator)


def build_model(
    config: ModelConfig,
    *,
    device: torch.device | str = "cpu",
    attention: str = "sdpa",
    seed: int | None = 0,
) -> Llama:
    """Construct on the meta device, then allocate on `device` and initialize (seeded)."""
    with torch.device("meta"):
        model = Llama(config, attention=attention)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    model.init_weights(generator)
    return model


# ---------------------------------------------------------------------------------------------
# Hugging Face interop: LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM state dicts.

_HF_RENAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def to_hf_state_dict(model: Llama) -> dict[str, Tensor]:
    """This model's weights under Hugging Face's names, with qkv and gate_up split back."""
    config = model.config
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name in _HF_RENAMES:
            out[_HF_RENAMES[name]] = tensor
            continue
        _, index, rest = name.split(".", 2)
        prefix = f"model.layers.{index}."
        if rest.startswith("attention.qkv."):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
            for short, part in (("q", q), ("k", k), ("v", v)):
                out[f"{prefix}self_attn.{short}_proj.{kind}"] = part
        elif rest == "attention.out.weight":
            out[f"{prefix}self_attn.o_proj.weight"] = tensor
        elif rest == "mlp.gate_up.weight":
            gate, up = tensor.chunk(2, dim=0)
            out[f"{prefix}mlp.gate_proj.weight"] = gate
            out[f"{prefix}mlp.up_proj.weight"] = up
        elif rest == "mlp.down.weight":
            out[f"{prefix}mlp.down_proj.weight"] = tensor
        elif rest == "attention_norm.weight":
            out[f"{prefix}input_layernorm.weight"] = tensor
        elif rest == "mlp_norm.weight":
            out[f"{prefix}post_attention_layernorm.weight"] = tensor
        else:  # pragma: no cover - every parameter is named above
            raise KeyError(name)
    return out


def load_hf_state_dict(model: Llama, hf_state: dict[str, Tensor]) -> None:
    """Load Hugging Face weights (names as in `to_hf_state_dict`) into `model`, fusing qkv and
    gate_up. Raises ValueError listing missing or unexpected keys, or mismatched shapes."""
    expected = to_hf_state_dict(model)
    missing = sorted(set(expected) - set(hf_state))
    if model.lm_head is None:
        unexpected = sorted(set(hf_state) - set(expected) - {"lm_head.weight"})
    else:
        unexpected = sorted(set(hf_state) - set(expected))
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
    own: dict[str, Tensor] = {}
    for name in model.state_dict():
        if name in _HF_RENAMES:
            own[name] = hf_state[_HF_RENAMES[name]]
            continue
        _, index, rest = name.split(".", 2)
        prefix = f"model.layers.{index}."
        if rest.startswith("attention.qkv."):
            kind = rest.rsplit(".", 1)[1]
            own[name] = torch.cat(
                [hf_state[f"{prefix}self_attn.{s}_proj.{kind}"] for s in ("q", "k", "v")]
            )
        elif rest == "attention.out.weight":
            own[name] = hf_state[f"{prefix}self_attn.o_proj.weight"]
        elif rest == "mlp.gate_up.weight":
            own[name] = torch.cat(
                [hf_state[f"{prefix}mlp.gate_proj.weight"], hf_state[f"{prefix}mlp.up_proj.weight"]]
            )
        elif rest == "mlp.down.weight":
            own[name] = hf_state[f"{prefix}mlp.down_proj.weight"]
        elif rest == "attention_norm.weight":
            own[name] = hf_state[f"{prefix}input_layernorm.weight"]
        elif rest == "mlp_norm.weight":
            own[name] = hf_state[f"{prefix}post_attention_layernorm.weight"]
    model.load_state_dict(own)
