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
from memfit.nn import Attention, AttentionMetadata, Linear, RMSNorm, SwiGLUMLP


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, backend: str) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            layer_index=layer_index,
            backend=backend,
            bias=config.qkv_bias,
            window=config.layer_window(layer_index),
            # (a plain local pattern runs as the sliding window above, decode included)
            pattern=config.attention_pattern
            if layer_index in config.sparse_layer_indices()
            and config.layer_window(layer_index) is None
            else None,
        )
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: Tensor, *attention_inputs) -> Tensor:
        """x: (batch, seqlen, hidden); attention_inputs: what `Attention.forward` takes after
        its input (cos, sin, metadata, kv_cache)."""
        branch = self.attention(self.attention_norm(x), *attention_inputs)
        # x + branch and its norm: one kernel when no gradient is needed (a decode step)
        normed, x = MF.add_rms_norm(x, branch, self.mlp_norm.weight, self.mlp_norm.eps)
        return self.mlp(normed, residual=x)  # x + mlp(normed)


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
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @property
    def output_weight(self) -> Tensor:
        """The output head's weight (a quantized head's dequantized: memfit.nn.quant.quantize_head)."""
        if self.lm_head is None:
            return self.embed.weight
        quant = getattr(self.lm_head, "quant", None)
        return self.lm_head.weight if quant is None else quant.dequantize()

    def forward(
        self,
        tokens: Tensor,
        targets: Tensor | None = None,
        *,
        metadata: AttentionMetadata | None = None,
        kv_cache=None,
        start_pos: int = 0,
        last_only: bool = False,
        logits_at: Tensor | None = None,
        return_hidden: bool = False,
    ) -> Tensor:
        """tokens: (batch, seqlen) ids. With `targets` (batch, seqlen; -100 where no loss): the
        summed cross-entropy. Without: logits (batch, seqlen, vocab), or (batch, 1, vocab) of the
        last position with `last_only` (a prefill needs no more), or (batch, len(logits_at), vocab)
        at the token indices `logits_at` (a paged step: each sequence's last token), or with
        `return_hidden` the final norm's output. `metadata` says where the tokens
        are (default: positions start_pos.., plain causal attention); `kv_cache` is written at its
        positions and, when it has a key_mask, read (memfit.inference)."""
        seqlen = tokens.shape[1]
        if metadata is None:
            if kv_cache is not None and start_pos + seqlen > kv_cache.max_seq_len:
                raise ValueError(
                    f"KV cache holds {kv_cache.max_seq_len} positions; asked to write up to "
                    f"{start_pos + seqlen}"
                )
            metadata = AttentionMetadata.causal(seqlen, tokens.device, start=start_pos)
            if kv_cache is not None and start_pos > 0:  # a later chunk reads the cache
                metadata = kv_cache.metadata(metadata.positions)
            # RoPE extrapolates past the trained length badly; allow it but never silently
            # beyond 2x. (Given metadata, the tokens may be several sequences flattened into one
            # row, a paged step: the engine checks each sequence's length when it is added.)
            longest = 2 * self.config.max_seq_len
            if start_pos + seqlen > longest and self.config.rope_scaling is None:
                raise ValueError(
                    f"sequence of {start_pos + seqlen} tokens exceeds twice the model's "
                    f"max_seq_len={self.config.max_seq_len}"
                )
        x = self.embed_tokens(tokens)  # (B, T, h)
        cos, sin = MF.rotary_cos_sin(
            metadata.positions,
            self.config.head_dim,
            self.config.rope_theta,
            self.config.rope_scaling,
            device=tokens.device,
        )
        for block in self.layers:
            x = block(x, cos, sin, metadata, kv_cache)
        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:
            x = x[:, logits_at]
        return self.output(x, targets, return_hidden=return_hidden)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """The residual stream's start: the tokens' embedding rows, in the compute dtype under
        autocast (the engine may run this, each block and `output` in a precision of their own:
        memfit.train.precision.apply_fp32_parts)."""
        x = self.embed(tokens)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return x

    def output(
        self, x: Tensor, targets: Tensor | None = None, *, return_hidden: bool = False
    ) -> Tensor:
        """The final norm and the output head over the last block's output x (batch, seqlen,
        hidden): logits, with `targets` the summed cross-entropy, with `return_hidden` the
        norm's output (the head's input, for a loss of the caller's: distillation)."""
        x = self.norm(x)
        if return_hidden:
            return x
        if targets is None:
            if hasattr(self.lm_head, "quant"):  # an inference model's int8 head
                return self.lm_head(x)
            return MF.linear(x, self.output_weight.to(x.dtype))  # (B, T, vocab)
        return MF.linear_cross_entropy(
            x.reshape(-1, x.shape[-1]), self.output_weight, targets.reshape(-1)
        )

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, part: str = "") -> None:
        """Normal(0, init_std) for matrices and embeddings, 1 for norms, zero biases; the output
        projections of each residual branch scaled by 1/sqrt(2 * num_layers) (GPT-2). part: only
        that submodule ("layers.3": a block made on its own), else the whole model. LoRA
        adapters are left to their layer (`LoRALinear.reset_adapters`)."""
        std = self.config.init_std
        module = self.get_submodule(part)
        for name, param in module.named_parameters(prefix=part):
            if ".lora_" in name:
                continue
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
    dtype: torch.dtype | None = None,
) -> Llama:
    """Construct on the meta device, then allocate on `device` and initialize (seeded); in
    `dtype` (default fp32) without an fp32 copy first."""
    with torch.device("meta"):
        model = Llama(config, attention=attention)
    if dtype is not None:
        model.to(dtype)  # (meta tensors: free)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    model.init_weights(generator)
    return model
