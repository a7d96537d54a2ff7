"""The time model: a roofline of one optimizer step, its constants measured (BENCHMARKS.md).

    compute       = the products' FLOPs / (peak dense rate x efficiency(hidden size) x
                    product_occupancy(tokens a micro-batch))
                    + attention's FLOPs / (peak dense rate x attention_efficiency(head dim))
                    + the blocks' elementwise passes, the loss's passes over its logits, and
                    the weights' and gradients' traffic outside the matmuls / HBM bandwidth
                    (fp16: the fused loss's gradient products at the fp32 rate)
                    + floor^2 / (floor + the passes' time): each kernel takes the GPU at least
                    KERNEL_SECONDS (floor = the step's kernels x that), which short steps show
    recompute     = what activation checkpointing runs again of the blocks' forward (full: all
                    of it; selective: all but attention)
    host          = what the host's kernel launches take beyond that: eager blocks cost the host
                    milliseconds each (HOST_SECONDS_PER_BLOCK), so small models wait for Python;
                    a step captured in a CUDA graph, GRAPHED_HOST_SECONDS_PER_STEP while the GPU
                    waits
    optimizer     = bytes the update reads and writes / (HBM bandwidth x 0.8) (AdamW: parameter,
                    gradient and two moments read, three written: 28 B/param), or with offload
                    the CPU step at the node's rate and the PCIe copies
    communication = bytes each GPU's links carry per step / (NVLink rate x the bus efficiency
                    NCCL reaches) x the part that shows in the step

Products: 6 FLOPs per parameter a token (an input embedding of its own is a lookup, not one),
attention 3x its forward (ModelConfig.flops_per_token). The compute and host constants are
fitted (benchmarks/fit_time_model.py, least squares on log(predicted / measured)) to a designed
set of H100 steps (benchmarks/time_model.py, results/time_model.json: hidden sizes 576 to 8192,
head dims 64 and 128, GQA 1 to 8, SwiGLU 2x to 6x the hidden size, sequences 1k to 16k,
vocabularies 32k to 152k, none / selective / full checkpointing, bf16 and fp16, optimizer
offload, and steps of 256 tokens where the host sets the pace), eager blocks (compiled ones
change GPU-bound steps by 1-4%, train_step.json). Held out, never fitted: ten Hugging Face
models from 135M to 7.6B parameters and `--recommend`'s first three strategies of five models
from 0.5B to 8B, all within 10% where the GPU sets the pace (BENCHMARKS.md, "The time model").
- efficiency 0.749 x h / (h + 239): 0.53 of the dense rate at h 576, 0.61 at 1024, 0.71 at
  4096; attention 0.42 (head dim 64) and 0.40 (128) of it, forward and backward (torch's SDPA).
- elementwise passes 147 bytes a token per unit of hidden width per block (the SwiGLU width
  adds nothing the fit can tell apart), the loss 22 bytes a logit; fp32 products 1/21 of the
  dense rate (fitted to fp16's loss gradients).
- kernels 2.8 us each at least, products at 1 - exp(-rows / 550) of their rate, a captured
  step's host 1.2 ms: fitted (those three alone, the rest kept) to 32 captured steps of 256 to
  4096 tokens a micro-batch of four designed shapes on an H200 (part graph_floor); five Hugging
  Face models' held out: worst -9.8%, rms 4.4% (without these terms -69%, 35%).
- the host: 2.6 ms a block and micro-batch without checkpointing, 5.2 with full, 7.9 with
  selective (torch's selective-checkpoint policy sees every operation of the forward and of
  its rerun), and 14 ms a step. The host's speed moved host-bound steps by up to 2x between
  machines of the same kind, and by up to 2x between repeats of one step on one machine, so
  for the smallest models the model is good to about 35%. A host calibration timed before each
  measurement (an eager block's forward and backward: 2.7-5.1 ms within one machine) followed
  it only in part (host steps on two machines: rms 17% -> 12%; the host-bound held-out
  models: 16% -> 26%), so the model keeps one host.
Measured apart and fitted earlier (train_step.json, zero.json on H100 and H200 at 1 and 2 GPUs,
llama-1b to llama-2-13b, and bandwidth.json):
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

fp32 parts (`--fp32-parts`, memfit.train.precision): their blocks' and head's products at the
fp32 rate (`fp32_flops_per_s`: the dense bf16 rate / FP32_SLOWDOWN, or / TF32_SLOWDOWN with
`--fp32-matmul tf32`), their weights not cast; an fp32 run's products at the same rate (not
measured whole: every block of it in fp32 is the fp32 parts' case). 30 runs on an H100
(llama-1b and Llama-3.2-1B, the head to two blocks at each end, none and full checkpointing,
bf16 and fp16, fp32 and tf32 products): within -5% to +12% of the step, peaks within 1.7%.

LoRA, QLoRA and distillation follow the engine's dataflow at the same rates (no constant fitted
to their steps; the dequantizing kernels' rates measured on their own):
- LoRA: the frozen base's products run forward and for the input's gradient only (no weight
  gradient: 4 FLOPs per parameter, not 6; the input embedding none), the adapters 6 per adapter
  parameter; the base is not cast (no weight traffic), the adapters are. The adapters' update
  moves (T x width) tensors outside the matmuls' FLOPs (`lora_traffic_bytes_per_token`), at the
  HBM rate.
- QLoRA: above memfit.nn.quant.FUSED_MAX_ROWS rows (every training product) each product
  dequantizes its weight into the compute dtype and runs cuBLAS at the bf16 rate: the
  dequantization's bytes (read the stored weight, write the copy) at the rate the dequantize
  kernel reaches (DEQUANTIZE_HBM_EFFICIENCY, measured), per forward, recompute and input
  gradient. Below it the fused kernel runs at the bf16 rate divided by QUANT_MATMUL_SLOWDOWN.
- The teacher: one forward per micro-batch, 2 FLOPs per teacher parameter plus its attention, at
  the efficiency of its own width; the distillation loss's elementwise passes over the (T x V)
  logits at the HBM rate (DISTILL_LOSS_BYTES_PER_LOGIT), and a trainable head's gradient in fp32
  (memfit.ops.distill accumulates it with an fp32 addmm_).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memfit.models.config import ModelConfig
from memfit.optim.registry import get_optimizer
from memfit.planner import memory
from memfit.planner.hardware import GPU
from memfit.planner.memory import (
    Strategy,
    adapted_parts,
    adapter_params,
    block_linears,
    dequantized_copy_bytes,
    offloaded_bytes_per_layer,
    offloaded_weight_copies_per_layer,
    quantized_weight_bytes,
)

PEAK_EFFICIENCY = 0.749
HALF_EFFICIENCY_WIDTH = 239
FP32_SLOWDOWN = 21.2
TF32_SLOWDOWN = 4.6
"""fp32 products run at the dense bf16 rate / FP32_SLOWDOWN on the CUDA cores (fitted to fp16's
loss gradients; the fp32 parts' blocks and head measured 49 TF/s on an H100, 1/20), or with
`--fp32-matmul tf32` on the tensor cores at / TF32_SLOWDOWN (two fp32-parts runs on an H100:
199 and 231 TF/s, time_model.json part fp32_parts)."""
HBM_EFFICIENCY = 0.8
NCCL_BUS_EFFICIENCY = 0.53
COMMUNICATION_EXPOSED = 0.8
GPUS_PER_NODE = 8
PCIE_BYTES_PER_S = 53e9  # host <-> GPU, pinned memory, one direction (H100/H200 hosts, Gen5)
CPU_ADAM_PARAMS_PER_S = 4.4e9  # torch's fused AdamW with unscaling, a node of HOST_CPUS cores
HOST_CPUS = 16
ATTENTION_EFFICIENCY = {64: 0.424, 128: 0.403}
"""The fraction of the peak dense rate SDPA's fused attention reaches at head dims 64 and 128,
forward and backward (`attention_efficiency`)."""
ELEMENTWISE_BYTES = 147.0
"""HBM bytes a token moves per block and unit of hidden width outside the products, forward and
backward: norms, RoPE, SwiGLU, residual adds, casts (`elementwise_bytes_per_token`; a term in the
SwiGLU width fitted to 0 beside it, over SwiGLU widths of 2x to 6x the hidden size)."""
FORWARD_ELEMENTWISE_SHARE = 1 / 3
"""The forward's part of those passes, which a checkpointed block runs again."""
LOSS_BYTES_PER_LOGIT = 22.3
"""HBM bytes the fused cross-entropy moves per token and vocabulary entry."""
HOST_SECONDS_PER_BLOCK = {"none": 2.58e-3, "full": 5.15e-3, "selective": 7.91e-3}
"""The host's time to launch one block's forward and backward (and rerun) for one micro-batch,
eager, by checkpointing (`host_seconds`)."""
HOST_SECONDS_PER_STEP = 13.7e-3
"""The host's time a step spends outside the blocks (the loss, the update, clipping, metrics)."""
GRAPHED_HOST_SECONDS_PER_STEP = 1.2e-3
"""The host's time a step captured in a CUDA graph takes (`--cuda-graphs`): the batch's copies,
the replay's one launch, the schedule and the metrics, while the GPU waits (the engine reads the
loss after each step); the blocks' launches are in the graph."""
KERNELS_PER_BLOCK = {"none": 41, "full": 55, "selective": 55}
"""The kernels one block's forward and backward (and rerun) runs for one micro-batch, by
checkpointing: products, attention, norms, RoPE, SwiGLU, residual adds, casts (counted with
torch.profiler in captured steps of nine models, time_model.json part graph_floor: 41-50 without
checkpointing, Qwen2's biases the most)."""
KERNELS_PER_MICRO_BATCH = 90
"""The kernels a micro-batch runs outside the blocks: the embedding, the loss's chunks (a 128k
vocabulary's about 100 more than a 32k one's), the gradients' accumulation, the update's
share."""
KERNEL_SECONDS = 2.8e-6
"""The least time a kernel takes the GPU however little it does: its launch within a graph,
its ramp-up and drain (`kernel_floor_seconds`)."""
PRODUCT_ROWS = 550.0
"""The rows (tokens a micro-batch) that set how far short steps' products fall below their rate:
a product of few rows has too few tiles to fill the GPU's SMs (`product_occupancy`)."""
QUANT_MATMUL_SLOWDOWN = 2.5
"""How much slower memfit's fused dequantizing matmul (memfit.ops.quant.matmul) runs than the
bf16 cuBLAS product it replaces, where memfit.nn.quant runs it: products of at most
FUSED_MAX_ROWS rows (int8, 16). benchmarks/results/quant_matmul.json (H200, 005dd84): int8 at 16
rows, 2.0x (llama-3-8b's gate_up) to 3.1x (out). Training products are larger: they take the
dequantize-then-cuBLAS path (DEQUANTIZE_HBM_EFFICIENCY)."""
DEQUANTIZE_HBM_EFFICIENCY = 0.57
"""The fraction of the HBM bandwidth memfit.ops.quant.matmul.dequantize reaches, reading NF4 and
writing bf16 (2.52 bytes a weight): llama-3-8b's gate_up (117M weights) in 108 us on an H200
(benchmarks/results/quant_matmul.json, 005dd84): 2.7 of 4.8 TB/s. int8's reaches about as much;
the smaller weights' less (qkv 25M weights, 54 us)."""
# memfit.ops.distill's elementwise passes over each (C x V) chunk under bf16 autocast, bytes read
# and written per logit: casts, two log-softmax, the exponentials, the KL terms and gradients
# (KL: 168; JSD's mean distribution and its terms add 92; a temperature other than 1 adds the
# scaled student logits and their log-softmax, 22)
DISTILL_LOSS_BYTES_PER_LOGIT = {"kl": 168, "jsd": 260}
DISTILL_TEMPERATURE_BYTES_PER_LOGIT = 22


@dataclass
class StepTime:
    compute_s: float
    recompute_s: float
    optimizer_s: float
    communication_s: float
    tokens: int
    """Tokens per optimizer step on one GPU."""
    teacher_s: float = 0.0
    """Distillation: the teacher's forwards and the distillation loss beyond a cross-entropy's."""
    host_s: float = 0.0
    """What the host's kernel launches take beyond the GPU's work on the blocks (small models:
    the GPU waits for Python)."""

    @property
    def total_s(self) -> float:
        return (
            self.compute_s
            + self.recompute_s
            + self.optimizer_s
            + self.communication_s
            + self.teacher_s
            + self.host_s
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s


def efficiency(model: ModelConfig) -> float:
    """The fraction of the peak dense rate the matmuls and attention reach: higher for wider
    models (larger GEMMs)."""
    return PEAK_EFFICIENCY * model.hidden_size / (model.hidden_size + HALF_EFFICIENCY_WIDTH)


def product_occupancy(strategy: Strategy) -> float:
    """The part of `efficiency` a micro-batch's products keep at its rows (micro_batch x
    seq_len): 1 - exp(-rows / PRODUCT_ROWS), 1 at the thousands of rows of training steps,
    lower for short steps, whose products have too few tiles for the GPU's SMs."""
    return -math.expm1(-strategy.micro_batch * strategy.seq_len / PRODUCT_ROWS)


def attention_efficiency(head_dim: int) -> float:
    """The fraction of the peak dense rate SDPA's fused attention reaches, forward and backward:
    measured at head dims 64 and 128, between them interpolated, outside them the nearer."""
    low, high = ATTENTION_EFFICIENCY[64], ATTENTION_EFFICIENCY[128]
    share = min(1.0, max(0.0, (head_dim - 64) / 64))
    return low + (high - low) * share


def elementwise_bytes_per_token(model: ModelConfig) -> float:
    """HBM bytes per token of the blocks' passes outside the matmuls and attention (norms, RoPE,
    SwiGLU, residual adds, casts), forward and backward: ELEMENTWISE_BYTES per unit of the
    hidden width per block."""
    return ELEMENTWISE_BYTES * model.num_layers * model.hidden_size


def loss_bytes_per_token(model: ModelConfig) -> float:
    """HBM bytes per token of the fused cross-entropy's passes over its logits (written, read
    for the log-sum-exp, the gradient written over them and read by its products)."""
    return LOSS_BYTES_PER_LOGIT * model.vocab_size


def host_seconds(model: ModelConfig, strategy: Strategy) -> float:
    """The host's time to launch a step's blocks, forward and backward, eager: per block and
    micro-batch HOST_SECONDS_PER_BLOCK of its checkpointing (selective's policy sees every
    operation of the forward and of its rerun); a step captured in a CUDA graph, only
    GRAPHED_HOST_SECONDS_PER_STEP."""
    if strategy.cuda_graphs:  # the launches are the graph's, replayed at the GPU's pace
        return GRAPHED_HOST_SECONDS_PER_STEP
    checked = memory.checkpointed_blocks(model, strategy)
    per_micro_batch = (
        checked * HOST_SECONDS_PER_BLOCK[strategy.checkpointing]
        + (model.num_layers - checked) * HOST_SECONDS_PER_BLOCK["none"]
    )
    return HOST_SECONDS_PER_STEP + strategy.grad_accum * per_micro_batch


def kernel_floor_seconds(model: ModelConfig, strategy: Strategy) -> float:
    """The least time the GPU takes for a step's kernels: KERNEL_SECONDS for each of
    KERNELS_PER_BLOCK (by the block's checkpointing) and KERNELS_PER_MICRO_BATCH. A short step's
    passes outside the products take this rather than their bytes' time (`step_time`); where
    the host launches every kernel (eager) it hides behind the host's time, and steps captured
    in a CUDA graph show it."""
    checked = memory.checkpointed_blocks(model, strategy)
    kernels = (
        KERNELS_PER_MICRO_BATCH
        + checked * KERNELS_PER_BLOCK[strategy.checkpointing]
        + (model.num_layers - checked) * KERNELS_PER_BLOCK["none"]
    )
    return strategy.grad_accum * kernels * KERNEL_SECONDS


def host_share(model: ModelConfig, strategy: Strategy, gpu: GPU) -> float:
    """The host's launches (`host_seconds`) as a share of the GPU's time on the step's forward
    and backward: 1 and over where the host sets the pace; a step captured in a CUDA graph has
    only its replay's."""
    time = step_time(model, strategy, gpu)
    return host_seconds(model, strategy) / (time.compute_s + time.recompute_s)


def host_sets_pace(model: ModelConfig, strategy: Strategy, gpu: GPU) -> bool:
    """Whether the host's launches take at least 90% of the GPU's time (`host_share`): a step
    whose pace the host sets, or nearly, and so moves with the host's speed (up to 2x between
    machines of one kind, BENCHMARKS.md)."""
    return host_share(model, strategy, gpu) >= 0.9


def _training_flops_parts(model: ModelConfig, strategy: Strategy) -> tuple[float, float]:
    """Per token, (the products' FLOPs, attention's) of a forward and backward: attention's
    forward and backward 3x its forward; the products those of `training_flops_per_token` less
    attention, and less the input embedding's 6 per parameter where it is a table of its own
    (a lookup, not a product; tied, it is the output head's weight, which is one)."""
    attention = 3 * model.spec.attention_forward_flops(strategy.seq_len)
    matmuls = training_flops_per_token(model, strategy) - attention
    if not strategy.lora_rank and not model.tie_embeddings:
        matmuls -= 6 * model.vocab_size * model.hidden_size
    return matmuls, attention


def fp32_flops_per_s(gpu: GPU, strategy: Strategy) -> float:
    """The rate of fp32 products: cuBLAS on the CUDA cores, or in TF32 on the tensor cores with
    `fp32_matmul` tf32 (both near their peak at training sizes, whatever the model's width)."""
    slowdown = TF32_SLOWDOWN if strategy.fp32_matmul == "tf32" else FP32_SLOWDOWN
    return gpu.bf16_flops / slowdown


def fp32_parts_seconds(model: ModelConfig, strategy: Strategy, gpu: GPU) -> float:
    """What `--fp32-parts` adds to a step (memfit.train.precision): each fp32 block's products,
    its recompute's too, at the fp32 rate (`fp32_flops_per_s`) and its attention at the CUDA
    cores' (SDPA's fp32 kernel), where the step priced them at the bf16 rates; its elementwise
    passes in 4-byte elements; the fp32 head's products (forward and both gradients) at the
    fp32 rate. Less the weights the fp32 blocks do not cast (6 B per parameter and forward,
    and their gradients come in fp32: 8 B where bf16 ones take 14)."""
    if not strategy.fp32_parts:
        return 0.0
    fp32 = memory.fp32_blocks(model, strategy)
    k, L = len(fp32), model.num_layers
    checked = memory.checkpointed_blocks(model, strategy)
    rechecked = sum(i < checked for i in fp32)
    reruns = 0 if strategy.checkpointing == "none" else rechecked
    tokens = strategy.micro_batch * strategy.seq_len * strategy.grad_accum
    rate = gpu.bf16_flops * efficiency(model)
    attention_rate = gpu.bf16_flops * attention_efficiency(model.head_dim)
    fp32_rate = fp32_flops_per_s(gpu, strategy)
    hbm = gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    attention_forward = model.spec.attention_forward_flops(strategy.seq_len)
    block_matmul = model.spec.block_forward_flops(strategy.seq_len) - attention_forward
    # per fp32 block and token: forward + backward (3 forwards), the rerun's forward
    matmul = block_matmul * (3 * k + reruns) / L
    rerun_attention = reruns if strategy.checkpointing == "full" else 0
    attention = attention_forward * (3 * k + rerun_attention) / L
    seconds = tokens * matmul * (1 / fp32_rate - 1 / rate)
    seconds += tokens * attention * (FP32_SLOWDOWN / gpu.bf16_flops - 1 / attention_rate)
    elementwise = elementwise_bytes_per_token(model) / L
    seconds += tokens * elementwise * (k + reruns * FORWARD_ELEMENTWISE_SHARE) / hbm
    if memory.fp32_head(strategy):
        head = 6 * model.vocab_size * model.hidden_size
        # (fp16 already runs the two gradient products in fp32: `step_time`)
        bf16_share = 1 / 3 if strategy.precision == "fp16" else 1
        seconds += tokens * head * bf16_share * (1 / fp32_rate - 1 / rate)
    recast = rechecked if strategy.checkpointing == "full" else 0  # (`weight_traffic_bytes`)
    saved = (6 + 14 - 8) * k + 6 * recast
    seconds -= strategy.grad_accum * saved * model.spec.sizes["P_layer"] / hbm
    return seconds


def weight_traffic_bytes(strategy: Strategy, checked: float = 1.0) -> float:
    """HBM bytes per parameter per micro-batch that the model's weights and gradients move
    outside the matmuls. Stages 0-2 keep fp32 weights: autocast reads each (4 B) and writes a
    bf16 copy (2 B) in every forward, the recompute included, and the bf16 weight gradient is
    cast to fp32 and added into the gradient buffer (about 14 B). Stage 3 gathers bf16 weights
    (the all-gather writes them) and gives bf16 gradients that are copied into the reduce
    buffer (about 10 B). `checked`: the part of the blocks that checkpointing reruns."""
    if strategy.precision == "fp32":
        return 8  # the gradient accumulated into its buffer
    if strategy.zero == 3:
        return 10
    forwards = 1 + checked if strategy.checkpointing == "full" else 1
    return 6 * forwards + 14


def training_flops_per_token(model: ModelConfig, strategy: Strategy) -> float:
    """FLOPs per token of a forward and backward. Full fine-tuning: the family's 6 per parameter
    plus attention (ModelConfig.flops_per_token). LoRA: the base's forward (2 per parameter) and
    its input gradient (2 per parameter, none for the input embedding, whose output needs no
    gradient), the adapters' 6, attention's forward and backward."""
    flops = model.flops_per_token(strategy.seq_len)
    if not strategy.lora_rank:
        return flops
    P = model.num_params
    embedding = 0 if model.tie_embeddings else model.vocab_size * model.hidden_size
    attention = 3 * model.spec.attention_forward_flops(strategy.seq_len)
    return 4 * P - 2 * embedding + 6 * adapter_params(model, strategy) + attention


def model_flops_per_token(model: ModelConfig, strategy: Strategy) -> float:
    """The FLOPs per token a step does for the model (MFU's numerator): the training FLOPs
    (`training_flops_per_token`; recompute not counted) and the teacher's forward."""
    flops = training_flops_per_token(model, strategy)
    if strategy.teacher is not None:
        teacher = strategy.teacher
        flops += 2 * teacher.num_params + teacher.spec.attention_forward_flops(strategy.seq_len)
    return flops


def lora_traffic_bytes_per_token(model: ModelConfig, strategy: Strategy) -> float:
    """HBM bytes per token that the adapters' update moves outside the matmuls' FLOPs, over a
    forward, its recompute (checkpointing) and the backward, per adapted layer of input width n
    and output width w, in the compute dtype (memory.LORA_UPDATE's dataflow):
    - forward: A reads x (n); "addmm" reads the base output and writes y (2w); "concat" writes
      the parts' products, concatenates and scales them and adds the base (8w; 6w for one part);
    - backward: the update's gradient read by B's two products (2w; "concat" scales it first,
      4w), A's input gradient written and its weight gradient reading x (2n), the two input
      gradients summed (3n)."""
    if not strategy.lora_rank:
        return 0.0
    c = 4 if strategy.precision == "fp32" else 2
    forwards = 1 + memory.checkpointed_blocks(model, strategy) / model.num_layers
    total = 0
    for linear in block_linears(model):
        if not adapted_parts(linear, strategy):
            continue
        n, w = linear.in_features, linear.out_features
        if memory.LORA_UPDATE == "addmm":
            forward, backward = n + 2 * w, 2 * w + 5 * n
        else:
            forward = n + (8 if len(linear.parts) > 1 else 6) * w
            backward = 4 * w + 5 * n
        total += forwards * forward + backward
    return c * total * model.num_layers


def dequantization_bytes(model: ModelConfig, strategy: Strategy, kind: str) -> int:
    """HBM bytes one pass over a quantized model's block products moves to dequantize its
    weights for cuBLAS (memfit.nn.quant above FUSED_MAX_ROWS rows): each weight read as stored
    and written in the compute dtype; 0 where the fused kernel runs instead."""
    total = 0
    for linear in block_linears(model):
        copy = dequantized_copy_bytes(linear, strategy, kind)
        if copy:
            stored = quantized_weight_bytes(linear.out_features, linear.in_features, kind)
            total += copy + stored
    return total * model.num_layers


def _base_matmul_flops_per_token(model: ModelConfig) -> float:
    """2 FLOPs per block matrix parameter: one pass of a token through the blocks' products."""
    return 2 * model.num_layers * model.spec.sizes["P_matmul_layer"]


def communication_bytes(model: ModelConfig, strategy: Strategy) -> float:
    """Bytes each GPU's links carry per optimizer step (the bus bytes of nccl-tests), with
    share = (N-1)/N: the fp32 gradients reduced, 4P x share by reduce-scatter, twice that by
    all-reduce (stage 0), and the parameters gathered, 4P x share in fp32 after the step
    (stages 1-2), 2P x share in bf16 per forward and again per backward (stage 3, whose recompute
    reuses the backward's gather). Stages 0-1 reduce once per step (accumulation runs without
    sync), stages 2-3 once per micro-batch."""
    P, N = model.num_params, strategy.world_size
    if strategy.lora_rank:  # only the adapters have gradients
        P = adapter_params(model, strategy)
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
    rate = gpu.bf16_flops * efficiency(model) * product_occupancy(strategy)
    attention_rate = gpu.bf16_flops * attention_efficiency(model.head_dim)
    if strategy.precision == "fp32":
        rate = fp32_flops_per_s(gpu, strategy)
        attention_rate = gpu.bf16_flops / FP32_SLOWDOWN
    matmul_flops, attention_flops = _training_flops_parts(model, strategy)
    # the parameters whose weights and gradients the step casts, accumulates and updates
    P = adapter_params(model, strategy) if strategy.lora_rank else model.num_params
    hbm = gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    # the part of the blocks whose forward checkpointing runs again
    checked = memory.checkpointed_blocks(model, strategy) / model.num_layers
    weights = strategy.grad_accum * P * weight_traffic_bytes(strategy, checked) / hbm
    compute = tokens * (matmul_flops / rate + attention_flops / attention_rate) + weights
    compute += tokens * lora_traffic_bytes_per_token(model, strategy) / hbm
    passes = tokens * (elementwise_bytes_per_token(model) + loss_bytes_per_token(model)) / hbm
    compute += passes
    if strategy.precision == "fp16" and strategy.fused_cross_entropy:
        # the fused loss's gradient products run in fp32 (fp16 cannot hold small softmax
        # values: memfit.ops.cross_entropy): the head's input and weight gradients
        head = 2 * model.vocab_size * model.hidden_size * (1 if strategy.lora_rank else 2)
        compute += tokens * head / fp32_flops_per_s(gpu, strategy)
    compute += fp32_parts_seconds(model, strategy, gpu)

    # the blocks' forward is recomputed (not the embedding or the loss): 2 FLOPs per block
    # parameter plus attention's score and value products, which selective keeps instead
    # (LoRA: and the adapters' forward), and the forward's share of the elementwise passes
    attention_forward = model.spec.attention_forward_flops(strategy.seq_len)
    forward_matmul = model.spec.block_forward_flops(strategy.seq_len) - attention_forward
    forward_matmul += 2 * adapter_params(model, strategy)
    forward_elementwise = elementwise_bytes_per_token(model) * FORWARD_ELEMENTWISE_SHARE / hbm
    recompute = 0.0
    if strategy.checkpointing in ("full", "selective"):
        recompute = forward_matmul / rate + forward_elementwise
        if strategy.checkpointing == "full":
            recompute += attention_forward / attention_rate
        recompute *= checked * tokens
    # each kernel takes the GPU KERNEL_SECONDS however little it does: a short step's kernels
    # take about that floor, a long step's passes hide it (floor^2 / (floor + passes) is the
    # floor where the passes take no time and fades as they grow)
    passes += checked * tokens * forward_elementwise
    floor = kernel_floor_seconds(model, strategy)
    compute += floor * floor / (floor + passes)
    # QLoRA: each pass of the base's products (forward, recompute, input gradient) dequantizes
    # its weights for cuBLAS, or runs the fused kernel (QUANT_MATMUL_SLOWDOWN)
    if strategy.quantize_base != "none":
        passes = 2 + checked
        copies = dequantization_bytes(model, strategy, strategy.quantize_base)
        dequantize = gpu.hbm_bytes_per_s * DEQUANTIZE_HBM_EFFICIENCY
        compute += strategy.grad_accum * passes * copies / dequantize
        if not copies:
            compute += (
                (QUANT_MATMUL_SLOWDOWN - 1)
                * passes
                * tokens
                * _base_matmul_flops_per_token(model)
                / rate
            )

    if strategy.cuda_graphs:  # the GPU waits for the host between replays
        host = host_seconds(model, strategy)
    else:  # the host launches while the GPU works: the longer of the two sets the pace
        host = host_seconds(model, strategy) - (compute + recompute)

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
        teacher_s=teacher_time(model, strategy, gpu),
        host_s=max(0.0, host),
    )


def teacher_time(model: ModelConfig, strategy: Strategy, gpu: GPU) -> float:
    """Seconds per optimizer step that distillation adds to a step with a cross-entropy: the
    teacher's forward of every micro-batch (2 FLOPs per teacher parameter, its output head's
    product in the loss included, plus its attention) at the efficiency of its width, its
    dequantization passes if quantized; the distillation loss's elementwise passes over the
    logits; and a trainable head's gradient, which memfit.ops.distill accumulates in fp32."""
    teacher = strategy.teacher
    if teacher is None:
        return 0.0
    tokens = strategy.micro_batch * strategy.seq_len * strategy.grad_accum
    rate = gpu.bf16_flops * efficiency(teacher)
    if strategy.precision == "fp32":
        rate = fp32_flops_per_s(gpu, strategy)
    hbm = gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    flops = 2 * teacher.num_params + teacher.spec.attention_forward_flops(strategy.seq_len)
    seconds = tokens * flops / rate
    if strategy.teacher_quantize != "none":
        copies = dequantization_bytes(teacher, strategy, strategy.teacher_quantize)
        seconds += strategy.grad_accum * copies / (gpu.hbm_bytes_per_s * DEQUANTIZE_HBM_EFFICIENCY)
        if not copies:
            seconds += (
                (QUANT_MATMUL_SLOWDOWN - 1) * tokens * _base_matmul_flops_per_token(teacher) / rate
            )
    per_logit = DISTILL_LOSS_BYTES_PER_LOGIT[strategy.distill_kind]
    if strategy.distill_temperature != 1:
        per_logit += DISTILL_TEMPERATURE_BYTES_PER_LOGIT
    seconds += tokens * model.vocab_size * per_logit / hbm
    if not strategy.lora_rank and strategy.precision != "fp32":
        # the head's gradient: an fp32 product where a cross-entropy's is bf16 (in the 6 FLOPs)
        student_rate = gpu.bf16_flops * efficiency(model)
        head = 2 * model.vocab_size * model.hidden_size
        seconds += tokens * head * (1 / fp32_flops_per_s(gpu, strategy) - 1 / student_rate)
    return seconds
