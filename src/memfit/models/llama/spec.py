"""The Llama family's spec: what the planner reads about a model instead of re-deriving its
shapes. A family with another layout (MoE: only the routed experts' parameters are active per
token) writes its own spec with the same methods.

Notation: L layers, h hidden, q = heads x head_dim, kv = kv_heads x head_dim, f the SwiGLU width,
V the vocabulary, H query heads, T tokens of a micro-batch, s its sequence length, c bytes per
element of the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from memfit.models.config import ModelConfig


@dataclass(frozen=True)
class LlamaSpec:
    config: ModelConfig

    @cached_property
    def sizes(self) -> dict[str, int]:
        """h, q, kv, f, V, H, L; P (all parameters), P_layer (one block's), P_matmul_layer (one
        block's matrix parameters: the ones autocast casts and ZeRO-3 gathers per block)."""
        m = self.config
        h, d = m.hidden_size, m.head_dim
        q, kv = m.num_heads * d, m.num_kv_heads * d
        matmul = h * (q + 2 * kv) + q * h + 3 * h * m.intermediate_size
        layer = matmul + (q + 2 * kv if m.qkv_bias else 0) + 2 * h
        embeddings = m.vocab_size * h * (1 if m.tie_embeddings else 2)
        return {
            "h": h, "q": q, "kv": kv, "f": m.intermediate_size, "V": m.vocab_size,
            "H": m.num_heads, "L": m.num_layers, "P_layer": layer, "P_matmul_layer": matmul,
            "P_embeddings": embeddings, "P": m.num_layers * layer + embeddings + h,
        }  # fmt: skip

    @property
    def num_params(self) -> int:
        """Exact parameter count (embeddings included, tied ones counted once)."""
        return self.sizes["P"]

    @property
    def active_params(self) -> int:
        """Parameters each token is multiplied by: all of them in a dense model."""
        return self.sizes["P"]

    def attention_forward_flops(self, seq_len: int, *, causal: bool = True) -> float:
        """Per token, the score and value products: 4 * layers * heads * head_dim * seq_len
        (2 FLOPs per multiply-add, two products), halved when causal. A layer with a sparse
        pattern (config.attention_pattern) multiplies the keys its block layout lists instead
        (memfit.ops.attention.sparse.keys_per_query)."""
        m = self.config
        dense = 4 * m.num_heads * m.head_dim * seq_len * (0.5 if causal else 1.0)
        sparse = len(m.sparse_layer_indices())
        if not sparse:
            return m.num_layers * dense
        from memfit.ops.attention.sparse import keys_per_query, parse

        keys = keys_per_query(parse(m.attention_pattern), seq_len)
        return (m.num_layers - sparse) * dense + sparse * 4 * m.num_heads * m.head_dim * keys

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training FLOPs per token: 6 per active parameter (forward 2, backward 4) plus
        attention's forward and backward, 3x its forward (the convention of ANCHORS.md and PaLM,
        Chowdhery et al. 2022, appendix B)."""
        return 6 * self.active_params + 3 * self.attention_forward_flops(seq_len, causal=causal)

    def block_forward_flops(self, seq_len: int) -> float:
        """Per token, the forward of the blocks (what full activation checkpointing reruns):
        2 per block parameter plus attention."""
        s = self.sizes
        blocks = self.active_params - s["P_embeddings"]
        return 2 * blocks + self.attention_forward_flops(seq_len)

    def layer_activation_bytes(
        self, *, tokens: int, seq_len: int, precision: str, checkpointing: str, attention: str
    ) -> int:
        """Bytes one block keeps for backward after its forward (Korthikanti et al. 2022,
        section 4.1, redone for memfit's kernels): in the compute dtype the residual input of
        each norm (2 x Th), each norm's output (2 x Th), q and k after RoPE and v (T(q+2kv)), the
        attention output (Tq), gate_up (2Tf) and the SwiGLU output (Tf), plus fp32 1/rms per norm
        (2 x 4T) and the attention log-sum-exp (4TH):
            none:       c*T*(4h + 2q + 2kv + 3f) + 4T*(2 + H)
            full:       c*T*h              (the block input)
            selective:  c*T*(h + q) + 4TH  (block input + attention output and log-sum-exp)
        Flash/SDPA attention removes Korthikanti's 5as/h term; eager attention keeps the
        probabilities."""
        s = self.sizes
        c = 4 if precision == "fp32" else 2
        T = tokens
        if checkpointing == "full":
            return c * T * s["h"]
        if checkpointing == "selective" and attention != "eager":
            return c * T * (s["h"] + s["q"]) + 4 * T * s["H"]
        total = c * T * (4 * s["h"] + 2 * s["q"] + 2 * s["kv"] + 3 * s["f"]) + 4 * T * (2 + s["H"])
        if s["q"] != s["kv"] and precision == "fp32" and attention == "sdpa":
            # grouped k and v are repeated per query head before the fused fp32 kernel
            total += 2 * c * T * (s["q"] - s["kv"])
        if attention == "eager":
            # fp32 scores -> probabilities (kept by softmax) and their compute-dtype copy (kept
            # by the second matmul); k and v repeated per query head when grouped
            total += T * s["H"] * seq_len * (4 + c)
            if s["q"] != s["kv"]:
                total += 2 * c * T * s["q"]
        return total
