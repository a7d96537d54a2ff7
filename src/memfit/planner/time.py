"""The time model: a roofline of one optimizer step, with efficiencies fitted to measurements.

    compute     = training FLOPs / (peak dense rate x efficiency(tokens per micro-batch))
    recompute   = the forward FLOPs that activation checkpointing runs again (full: the blocks'
                  forward; selective: all of it but attention's)
    optimizer   = bytes the update reads and writes / (HBM bandwidth x 0.8)
                  (AdamW: parameter, gradient and two moments read, three written: 28 B/param)
    communication (several GPUs) = bytes each GPU sends per step / interconnect bandwidth, 70%
                  of it hidden behind backward (ZeRO paper section 7: DDP and stages 1-2 move
                  2 x 4P(N-1)/N bytes of gradients, stage 3 adds 2 all-gathers of 2P(N-1)/N
                  bf16 parameters)

Training FLOPs per token are 6 per parameter plus causal attention (ModelConfig.flops_per_token).
The efficiency is fitted to memfit's own H100 measurements (BENCHMARKS.md, llama-1b, sequence
2048): 0.48 of 989 TFLOP/s at 8192 tokens per micro-batch and 0.53 at 16384 are matched by
0.60 * T / (T + 1000) (with the optimizer's time counted apart); fp32 runs on the non-tensor-core rate, about 1/15 of bf16 on Hopper.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.models.config import ModelConfig
from memfit.planner.hardware import GPU
from memfit.planner.memory import Strategy

PEAK_EFFICIENCY = 0.60
HALF_EFFICIENCY_TOKENS = 1000
FP32_SLOWDOWN = 15.0
HBM_EFFICIENCY = 0.8
COMMUNICATION_HIDDEN = 0.7
PCIE_BYTES_PER_S = 25e9  # host <-> GPU, pinned memory, one direction
CPU_ADAM_PARAMS_PER_S = 1.0e9  # vectorized AdamW over a flat fp32 shard on a server CPU


@dataclass
class StepTime:
    compute_s: float
    recompute_s: float
    optimizer_s: float
    communication_s: float
    tokens: int
    """Tokens per optimizer step on one GPU."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.recompute_s + self.optimizer_s + self.communication_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s


def efficiency(strategy: Strategy) -> float:
    tokens = strategy.micro_batch * strategy.seq_len
    return PEAK_EFFICIENCY * tokens / (tokens + HALF_EFFICIENCY_TOKENS)


def step_time(model: ModelConfig, strategy: Strategy, gpu: GPU) -> StepTime:
    tokens = strategy.micro_batch * strategy.seq_len * strategy.grad_accum
    rate = gpu.bf16_flops * efficiency(strategy)
    if strategy.precision == "fp32":
        rate /= FP32_SLOWDOWN
    flops_per_token = model.flops_per_token(strategy.seq_len)
    compute = tokens * flops_per_token / rate

    # the blocks' forward is recomputed (not the embedding or the loss): 2 FLOPs per block
    # parameter plus attention's score and value products, which selective keeps instead
    embeddings = model.vocab_size * model.hidden_size * (1 if model.tie_embeddings else 2)
    attention_forward = 2 * model.num_layers * model.num_heads * model.head_dim * strategy.seq_len
    forward_per_token = 2 * (model.num_params - embeddings) + attention_forward
    if strategy.checkpointing == "full":
        recompute = tokens * forward_per_token / rate
    elif strategy.checkpointing == "selective":
        recompute = tokens * max(0.0, forward_per_token - attention_forward) / rate
    else:
        recompute = 0.0

    P = model.num_params
    N = strategy.world_size
    bytes_per_param = 28 if strategy.optimizer == "adamw" else 16
    shard = P / N if strategy.zero >= 1 else P
    if strategy.offload == "none":
        optimizer = shard * bytes_per_param / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    else:  # gradients down, parameters up over PCIe, the update on the CPU
        optimizer = shard * 4 * 2 / PCIE_BYTES_PER_S + shard / CPU_ADAM_PARAMS_PER_S

    communication = 0.0
    if N > 1:
        moved = 2 * 4 * P * (N - 1) / N
        if strategy.zero == 3:
            moved += 2 * 2 * P * (N - 1) / N
        communication = moved / gpu.interconnect_bytes_per_s * (1 - COMMUNICATION_HIDDEN)
    return StepTime(
        compute_s=compute,
        recompute_s=recompute,
        optimizer_s=optimizer,
        communication_s=communication,
        tokens=tokens,
    )
