"""The time model: a roofline of one optimizer step, its constants measured (BENCHMARKS.md).

    compute       = training FLOPs / (peak dense rate x efficiency(hidden size))
                    + the weights' and gradients' traffic outside the matmuls / HBM bandwidth
    recompute     = the forward FLOPs that activation checkpointing runs again (full: the blocks'
                    forward; selective: all of it but attention's)
    optimizer     = bytes the update reads and writes / (HBM bandwidth x 0.8) (AdamW: parameter,
                    gradient and two moments read, three written: 28 B/param), or with offload
                    the CPU step at the node's rate and the PCIe copies
    communication = bytes each GPU's links carry per step / (NVLink rate x the bus efficiency
                    NCCL reaches) x the part that shows in the step

Training FLOPs per token are 6 per parameter plus causal attention (ModelConfig.flops_per_token).
Fitted to memfit's own runs (benchmarks/results: train_step.json on an H100, zero.json on H100
and H200 at 1 and 2 GPUs, llama-1b to llama-2-13b, the runs up to commit 56557b1, plus ab6e1a6
and e1aeb55 for the CPU rate; later runs, a207e91's accumulation and c920c3d's parameter
offload, are held out and tested against it), and measured apart where a rate can be
(bandwidth.json):
- efficiency 0.76 x h / (h + 600): 0.59 of the dense rate for llama-1b (h 2048), 0.66 for
  llama-2-7b (4096), 0.68 for llama-2-13b (5120). fp32 runs on the non-tensor-core rate, about
  1/15 of bf16 on Hopper.
- NCCL's bus bandwidth on two H200s (NVLink 4, multicast off) was 243 GB/s for a 64 MiB
  all-reduce, 53% of the links' 450 GB/s; reduce-scatter and all-gather reach a little less.
- Collectives run beside backward on their own stream, yet 80% of their time shows in the step
  (fitted to the 2-GPU runs against the 1-GPU ones): they take SMs and HBM bandwidth from the
  compute (a GEMM loop ran 8% slower beside all-reduces, which ran 27% slower beside it) and the
  last buckets are waited for after backward.
- Offload: pinned copies at 53 GB/s each way; torch's fused CPU AdamW (with unscaling) stepped
  4.4e9 parameters/s on a 16-core host and 6.8e9 on a 32-core one (two ranks), and the ranks of
  a node share it.
On 4 and 8 GPUs the model assumes the bus bandwidth and the exposed part measured at 2: true of
ring collectives on a switched NVLink node to first order (each GPU drives the same links), not
yet measured here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memfit.models.config import ModelConfig
from memfit.optim.registry import get_optimizer
from memfit.planner.hardware import GPU
from memfit.planner.memory import (
    Strategy,
    offloaded_bytes_per_layer,
    offloaded_weight_copies_per_layer,
)

PEAK_EFFICIENCY = 0.76
HALF_EFFICIENCY_WIDTH = 600
FP32_SLOWDOWN = 15.0
HBM_EFFICIENCY = 0.8
NCCL_BUS_EFFICIENCY = 0.53
COMMUNICATION_EXPOSED = 0.8
GPUS_PER_NODE = 8
PCIE_BYTES_PER_S = 53e9  # host <-> GPU, pinned memory, one direction (H100/H200 hosts, Gen5)
CPU_ADAM_PARAMS_PER_S = 4.4e9  # torch's fused AdamW with unscaling, a node of HOST_CPUS cores
HOST_CPUS = 16


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


def efficiency(model: ModelConfig) -> float:
    """The fraction of the peak dense rate the matmuls and attention reach: higher for wider
    models (larger GEMMs)."""
    return PEAK_EFFICIENCY * model.hidden_size / (model.hidden_size + HALF_EFFICIENCY_WIDTH)


def weight_traffic_bytes(strategy: Strategy) -> int:
    """HBM bytes per parameter per micro-batch that the model's weights and gradients move
    outside the matmuls. Stages 0-2 keep fp32 weights: autocast reads each (4 B) and writes a
    bf16 copy (2 B) in every forward, the recompute included, and the bf16 weight gradient is
    cast to fp32 and added into the gradient buffer (about 14 B). Stage 3 gathers bf16 weights
    (the all-gather writes them) and gives bf16 gradients that are copied into the reduce
    buffer (about 10 B)."""
    if strategy.precision == "fp32":
        return 8  # the gradient accumulated into its buffer
    if strategy.zero == 3:
        return 10
    forwards = 2 if strategy.checkpointing == "full" else 1
    return 6 * forwards + 14


def communication_bytes(model: ModelConfig, strategy: Strategy) -> float:
    """Bytes each GPU's links carry per optimizer step (the bus bytes of nccl-tests), with
    share = (N-1)/N: the fp32 gradients reduced, 4P x share by reduce-scatter, twice that by
    all-reduce (stage 0), and the parameters gathered, 4P x share in fp32 after the step
    (stages 1-2), 2P x share in bf16 per forward and again per backward (stage 3, whose recompute
    reuses the backward's gather). Stages 0-1 reduce once per step (accumulation runs without
    sync), stages 2-3 once per micro-batch."""
    P, N = model.num_params, strategy.world_size
    if N == 1:
        return 0.0
    share = (N - 1) / N
    if strategy.zero == 3:
        return (4 + 2 * 2) * P * share * strategy.grad_accum
    reductions = strategy.grad_accum if strategy.zero == 2 else 1
    return (4 * reductions + 4) * P * share


def cpu_adam_rate(host_cpus: int = HOST_CPUS) -> float:
    """Parameters per second a node's CPU steps AdamW at: memory-bound, so it grows slower than
    the cores (measured 4.4e9 on 16 cores, 6.8e9 on 32 with two ranks: as their square root)."""
    return CPU_ADAM_PARAMS_PER_S * math.sqrt(host_cpus / HOST_CPUS)


def step_time(
    model: ModelConfig, strategy: Strategy, gpu: GPU, *, host_cpus: int = HOST_CPUS
) -> StepTime:
    """The time model's optimizer step; `host_cpus`: the training node's CPU cores (offload)."""
    tokens = strategy.micro_batch * strategy.seq_len * strategy.grad_accum
    rate = gpu.bf16_flops * efficiency(model)
    if strategy.precision == "fp32":
        rate /= FP32_SLOWDOWN
    flops_per_token = model.flops_per_token(strategy.seq_len)
    P = model.num_params
    hbm = gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    weights = strategy.grad_accum * P * weight_traffic_bytes(strategy) / hbm
    compute = tokens * flops_per_token / rate + weights

    # the blocks' forward is recomputed (not the embedding or the loss): 2 FLOPs per block
    # parameter plus attention's score and value products, which selective keeps instead
    attention_forward = model.spec.attention_forward_flops(strategy.seq_len)
    forward_per_token = model.spec.block_forward_flops(strategy.seq_len)
    if strategy.checkpointing == "full":
        recompute = tokens * forward_per_token / rate
    elif strategy.checkpointing == "selective":
        recompute = tokens * max(0.0, forward_per_token - attention_forward) / rate
    else:
        recompute = 0.0

    N = strategy.world_size
    bytes_per_param = get_optimizer(strategy.optimizer).update_bytes_per_param
    if strategy.master_weights == "none":
        # bf16 parameters and gradients: 2 bytes instead of 4 for the parameter read and written
        # and the gradient read (the registry counts fp32 ones)
        bytes_per_param -= 3 * 2
    shard = P / N if strategy.zero >= 1 else P
    if strategy.offload == "none":
        optimizer = shard * bytes_per_param / hbm
    else:
        # The ranks of one node share its CPU: the step over all their shards takes the node's
        # rate. Each GPU has its own PCIe link. Measured (benchmarks/results/bandwidth.json and
        # the offload runs of zero.json): the copies do not overlap compute today.
        cpu = shard * min(N, GPUS_PER_NODE) / cpu_adam_rate(host_cpus)
        pcie = 4 * shard / PCIE_BYTES_PER_S  # one fp32 copy of this rank's shard
        if strategy.offload == "params":
            # every gather (forward and backward) brings the block's shard up and the gradients
            # go down during backward, all on one copy stream: the step's forward and backward
            # take the longer of their compute and these copies
            copies = (2 * pcie + pcie) * strategy.grad_accum
            optimizer = cpu + max(0.0, copies - compute - recompute)
        else:
            # the gradients go down after backward, the updated parameters come back up after
            # the step
            optimizer = cpu + 2 * pcie

    # collectives run beside backward on their own stream but slow it down (they take SMs and
    # HBM bandwidth) and are waited for at its end: part of their time shows in the step
    bus = gpu.interconnect_bytes_per_s * NCCL_BUS_EFFICIENCY
    communication = communication_bytes(model, strategy) / bus * COMMUNICATION_EXPOSED
    if strategy.offload_activations:
        # each block's share out in the forward and back in the backward, on a stream of their
        # own beside the blocks' compute: only what the compute cannot hide shows (none for
        # block inputs at llama-1b and llama-3.2-3b, seq 8192: activation_offload.json)
        moved = model.num_layers * (
            offloaded_bytes_per_layer(model, strategy)
            + offloaded_weight_copies_per_layer(model, strategy)
        )
        copies = 2 * moved * strategy.grad_accum / PCIE_BYTES_PER_S
        communication += max(0.0, copies - compute - recompute)
    return StepTime(
        compute_s=compute,
        recompute_s=recompute,
        optimizer_s=optimizer,
        communication_s=communication,
        tokens=tokens,
    )
