"""The memory model: per-GPU bytes of a training step, by category and by phase, following the
engine's actual dataflow (train/step.py, models/llama/, ops/); the per-layer activation formula
is the model family's spec (models/llama/spec.py).

Notation: P parameters, L layers, h hidden, q = heads*head_dim, kv = kv_heads*head_dim,
f = intermediate (ffn) size, V vocabulary, H heads, T = micro_batch * seq_len tokens,
c = bytes per element of the compute dtype (2 for bf16/fp16, 4 for fp32), N data-parallel ranks.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3 and figure 1, for mixed-precision Adam):
memfit keeps the parameters themselves in fp32 (they are the master weights; autocast casts
them for each matmul), so per GPU
    params 4P (stage 3: 4P/N) + grads 4P (stage 1: + the 4P/N shard its reduce-scatter writes;
    stage >= 2: 4P/N) + AdamW 8P / SGD 4P (stage >= 1: /N),
and no separate master copy. `--offload optimizer` moves the optimizer states to CPU memory.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1, redone for this model's kernels): per layer the engine keeps, in the compute
dtype, the residual input of each norm (2 x Th), each norm's output (2 x Th, the matmuls' inputs),
q and k after RoPE and v (T(q+2kv)), the attention output (Tq), gate_up (2Tf) and the SwiGLU
output (Tf), plus fp32 1/rms per norm (2 x 4T) and the attention log-sum-exp (4TH):
    none:       c*T*(4h + 2q + 2kv + 3f) + 4T*(2 + H)
    full:       c*T*h              (the block input; one block's activations are rebuilt in backward)
    selective:  c*T*(h + q) + 4TH  (block input + attention output and log-sum-exp)
Flash/SDPA attention removes Korthikanti's 5as/h term (memfit's flash kernel keeps exactly what
SDPA's does: its output and fp32 log-sum-exp, and reads grouped k and v without repeating them);
eager attention keeps the probabilities.

Around the blocks: the final norm's input (c*Th + 4T), and the fused linear cross-entropy's saved
gradients, grad_hidden (Th x 2 bytes in bf16, 4 otherwise) and grad_weight (Vh x 4): the logits are
never kept. While it runs, one chunk of fp32 logits (and its bf16 gradient) is alive.

Temporaries: under autocast every matmul weight is cast to the compute dtype once per forward and
that copy is cached until the forward ends; without checkpointing the matmuls also save it for
backward, so 2 bytes per matmul parameter live from forward to backward.

Phases: the peak of a step is the largest of
  - end of forward (inside the loss): states + activations + weight copies + loss buffers;
  - backward: starts from the end-of-forward memory minus the loss's transient buffers, then each
    layer frees its activations and weight copies and adds its fp32 gradients; checked at both ends
    and with the largest layer-backward transient;
  - optimizer step: params + grads + optimizer states.
With gradient accumulation the gradients of earlier micro-batches are alive in every phase.

LoRA (Hu et al. 2021; memfit.nn.lora, train/engine.py `_apply_lora`): the frozen base is held in
the compute dtype (c bytes a parameter, never fp32) and only the adapters train, fp32 A (r x in)
and B (rows x r) per targeted part of a fused layer (q, k, v of qkv; gate, up of gate_up), with
fp32 gradients and optimizer states (the registry's bytes, for A = sum of r(in + rows)). Autocast
casts nothing of a base already in the compute dtype; the output head is frozen, so the fused
cross-entropy keeps no (V x h) fp32 grad_weight, and the embedding's output needs no gradient.
A frozen product saves nothing of its input (its weight needs no gradient); adapter A saves it
instead, and B the r-wide x A^T of each part (c*T*r a part): a block keeps what the full model's
keeps. While an adapted layer runs, its update holds tensors of the layer's output width beside
the base output (LORA_UPDATE: how LoRALinear.forward adds it), which a checkpointed block's rerun
and the SwiGLU backward (c*T*(h + 2f), no weight gradient after it) compete for the block's peak.
QLoRA (Dettmers et al. 2023; memfit.nn.quant): the blocks' linear weights stored as NF4 (per
(out, in) weight: ceil(out*in/64) x 32 packed bytes + one int8 absmax per 64 + one fp32 scale per
256 absmax + an fp32 mean, memfit.ops.quant.nf4) or int8 (one byte + an fp32 scale per row); the
embeddings, norms and output head stay in the compute dtype. A product of more rows than
memfit.nn.quant.FUSED_MAX_ROWS (QUANT_FUSED_MAX_ROWS: every NF4 training product) dequantizes its
weight into the compute dtype for cuBLAS, forward and for the input's gradient: one layer's copy
at a time; below, the fused kernel dequantizes inside the matmul and holds none.
Distillation (memfit.train.distill): the teacher's weights (compute dtype or quantized, as the
base) for the whole run; after the student's forward it runs in inference mode, one block's
tensors alive at a time (c*T*(4h + 3f) at its SwiGLU), and returns its hidden states (c*T*h_t,
alive through the loss). The fused distillation loss (memfit.ops.distill) replaces the
cross-entropy: see `_distillation_loss` for what its chunks keep.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from memfit.config import check_parallelism, parse_fp32_parts
from memfit.models.config import ModelConfig, load_model_config
from memfit.ops.quant.int4 import int4_group
from memfit.optim.registry import get_optimizer, model_state_bytes
from memfit.planner.hardware import GPU, GiB

if TYPE_CHECKING:
    from memfit.config import Config

CATEGORIES = (
    "params",
    "grads",
    "master_weights",
    "optimizer_states",
    "activations",
    "logits_loss",
    "temporaries",
    "runtime_overhead",
)

# Beyond what the allocator hands out (max_memory_allocated), a process holds its CUDA context and
# the caching allocator's unused blocks: the budget the planner keeps free on every GPU.
CUDA_CONTEXT_BYTES = 600 * 2**20
ALLOCATOR_SLACK = {"expandable_segments": 0.02, "default": 0.10}
"""What the caching allocator reserves beyond the allocated peak of a step at the GPU's capacity
(`allocator_slack`), by its configuration. Measured on an H100 (time_model.json, part capacity:
llama-3.2-3b without checkpointing and selective, llama-1b full, planned at 95-102% of its
memory): with expandable segments (what `memfit train` asks for) every run whose allocated peak
reached 77.5 GiB ran, reserving 0.6-2.0% beyond it; with the allocator's default, runs of
72.3-77.5 GiB ran out of memory and 76.4 GiB ran at +1.8%: llama-1b's full checkpointing at
72.3 GiB needed more than 9.4%, so 10% is a bound those runs set, not a ceiling measured. Far
from capacity the reserve is larger and harmless (up to 21%: the allocator frees its cache
before it fails)."""
# the inference engine's allocator slack (planner/serve.py), on the step's and the graphs' memory
FRAGMENTATION = 0.05
# cuBLAS workspaces come from the caching allocator (PyTorch >= 1.11), 32 MiB per handle on
# Hopper, and a handle is per thread: the forward's and the autograd engine's backward thread each
# hold one for the rest of the process (seen in allocator traces on an H100).
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2**20
# memfit's linear cross-entropy sizes a chunk of fp32 logits to this many bytes (ops/cross_entropy.py).
CE_CHUNK_BYTES = 512 * 2**20
# the rows of a chunk of memfit.ops.distill.linear_distillation_loss (its default chunk_size,
# which memfit.train.distill keeps)
DISTILL_CHUNK_ROWS = 1024
# the Hugging Face names of a Llama block's linear layers (memfit.nn.lora.LINEAR_NAMES): LoRA's
# targets; "all-linear" is all of them (the output head is never one)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# memfit.ops.quant.nf4: weights per absmax, absmax values per second-level scale
NF4_BLOCK = 64
NF4_SCALE_BLOCK = 256
# the CUDA caching allocator hands out blocks in multiples of 512 bytes
ALLOCATION_GRANULE = 512
Quantize = Literal["none", "nf4", "int8"]


def allocator_slack() -> float:
    """ALLOCATOR_SLACK for the allocator a run started here gets: expandable segments unless
    PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) says otherwise, as
    memfit.train.engine.use_expandable_segments decides."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF"))
    expandable = conf is None or "expandable_segments:True" in conf
    return ALLOCATOR_SLACK["expandable_segments" if expandable else "default"]


@dataclass(frozen=True, kw_only=True)
class Strategy:
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    micro_batch: int = 1
    seq_len: int = 2048
    grad_accum: int = 1
    checkpointing: Literal["none", "full", "selective"] = "none"
    # how many blocks, the first ones, `checkpointing` applies to (None: all of them)
    checkpoint_blocks: int | None = None
    optimizer: str = "adamw"  # a registered optimizer (memfit.optim.OPTIMIZERS)
    # fp32 master weights, or none: bf16 parameters and gradients (`--master-weights none`)
    master_weights: Literal["fp32", "none"] = "fp32"
    # auto: what `--attention auto` runs for a model without a sliding window (SDPA)
    attention: Literal["auto", "flash", "sdpa", "eager"] = "auto"
    fused_cross_entropy: bool = True
    zero: int = 0
    offload: Literal["none", "optimizer", "params"] = "none"
    # activations in pinned CPU memory (`--offload-activations`): the checkpointed blocks'
    # inputs, or without checkpointing what the blocks save
    offload_activations: bool = False
    world_size: int = 1
    # the step captured in a CUDA graph and replayed (`--cuda-graphs`, memfit.train.graphs): the
    # host's launches leave the step
    cuda_graphs: bool = False
    # parts computing in fp32 under bf16/fp16 (`--fp32-parts`, memfit.config.parse_fp32_parts):
    # "head", "first:N", "last:N", comma-separated; kept in their canonical spelling
    fp32_parts: str = ""
    # how fp32 products run (`--fp32-matmul`): fp32 on the CUDA cores, or tf32 on the tensor cores
    fp32_matmul: Literal["fp32", "tf32"] = "fp32"
    # LoRA (memfit.nn.lora): adapters of this rank on a frozen base; 0 trains every weight
    lora_rank: int = 0
    # Hugging Face layer names (LORA_TARGETS), or ("all-linear",); a comma-separated string too
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lora_dropout: float = 0.0
    # QLoRA: the frozen base's block linear weights stored as NF4 or int8 (memfit.nn.quant)
    quantize_base: Quantize = "none"
    # distillation (memfit.train.distill): the teacher's shapes (None: plain cross-entropy),
    # how its linear weights are stored, and the loss (memfit.ops.distill)
    teacher: ModelConfig | None = None
    teacher_quantize: Quantize = "none"
    distill_kind: Literal["kl", "jsd"] = "kl"
    distill_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.attention == "auto":
            object.__setattr__(self, "attention", "sdpa")
        self._check_fine_tuning()
        if self.micro_batch < 1 or self.seq_len < 1 or self.grad_accum < 1 or self.world_size < 1:
            raise ValueError(
                f"micro_batch, seq_len, grad_accum and world_size must be >= 1: {self}"
            )
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.checkpoint_blocks is not None and (
            self.checkpoint_blocks < 0 or self.checkpointing == "none" or self.offload_activations
        ):
            raise ValueError(
                f"checkpoint_blocks = {self.checkpoint_blocks}: a count >= 0 of blocks to "
                "checkpoint, with checkpointing full or selective and without activation offload"
            )
        check_parallelism(
            zero=self.zero,
            offload=self.offload,
            optimizer=self.optimizer,
            world_size=self.world_size,
        )
        object.__setattr__(self, "fp32_parts", str(parse_fp32_parts(self.fp32_parts)))
        if self.fp32_parts and (
            self.precision == "fp32"
            or self.master_weights == "none"
            or self.lora_rank
            or self.zero == 3
        ):
            raise ValueError(
                f"fp32_parts {self.fp32_parts!r} computes those parts from fp32 master weights "
                "in a bf16 or fp16 run: not with precision fp32, master_weights 'none', LoRA or "
                f"ZeRO-3 (which hold the weights in the compute dtype): {self}"
            )
        if self.master_weights == "none" and (
            self.precision != "bf16" or self.zero or self.offload != "none" or self.world_size > 1
        ):
            raise ValueError(
                "master_weights='none' (bf16 parameters) needs bf16 precision on one process "
                f"without ZeRO or offload: {self}"
            )

    def _check_fine_tuning(self) -> None:
        """LoRA, QLoRA and the teacher: the refusals of memfit.config ([lora], [distill])."""
        targets = self.lora_targets
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        targets = tuple(targets)
        if "all-linear" in targets:
            targets = LORA_TARGETS
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            raise ValueError(
                f"LoRA targets {', '.join(map(repr, unknown)) or 'none'}: choose among "
                f"{', '.join(LORA_TARGETS)}, or all-linear"
            )
        # (the layer order, as memfit.nn.lora.LoRASpec keeps them)
        object.__setattr__(self, "lora_targets", tuple(t for t in LORA_TARGETS if t in targets))
        for name in ("quantize_base", "teacher_quantize"):
            if getattr(self, name) not in ("none", "nf4", "int8"):
                raise ValueError(
                    f"{name} = {getattr(self, name)!r}: choose 'none', 'nf4' or 'int8'"
                )
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: no LoRA), got {self.lora_rank}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.quantize_base != "none" and not self.lora_rank:
            raise ValueError(
                f"quantize_base {self.quantize_base!r} quantizes the frozen base of a LoRA run: "
                "set lora_rank (--lora-rank) too"
            )
        if self.lora_rank and (self.zero == 3 or self.offload != "none"):
            raise ValueError(
                f"LoRA trains with ZeRO stage 0, 1 or 2, without offload (got --zero {self.zero} "
                f"--offload {self.offload}): its adapters and their states are a few MB and the "
                "frozen base is stored once in the compute dtype on each GPU"
            )
        if self.lora_rank and self.master_weights == "none":
            raise ValueError(
                "with LoRA the frozen base is already stored in the compute dtype and the "
                "adapters keep fp32 weights: drop --master-weights none"
            )
        if self.teacher is None and self.teacher_quantize != "none":
            raise ValueError(
                f"teacher_quantize {self.teacher_quantize!r} stores a teacher's weights: give "
                "the teacher (--teacher) too"
            )
        if self.distill_kind not in ("kl", "jsd") or not self.distill_temperature > 0:
            raise ValueError(
                f"distillation: kind 'kl' or 'jsd' and a temperature > 0, got "
                f"{self.distill_kind!r} and {self.distill_temperature!r}"
            )

    @property
    def goal(self) -> str:
        """What the run trains: "full", "LoRA r16" or "QLoRA nf4 r16"."""
        if not self.lora_rank:
            return "full"
        if self.quantize_base != "none":
            return f"QLoRA {self.quantize_base} r{self.lora_rank}"
        return f"LoRA r{self.lora_rank}"

    def describe(self) -> str:
        parts = [self.precision, f"mb {self.micro_batch}", f"seq {self.seq_len}"]
        if self.grad_accum > 1:
            parts.append(f"accum {self.grad_accum}")
        parts.append(f"ckpt {self.checkpointing}")
        if self.checkpoint_blocks is not None:
            parts[-1] += f" ({self.checkpoint_blocks} blocks)"
        if self.offload_activations:
            parts.append("offload activations")
        if self.cuda_graphs:
            parts.append("cuda graphs")
        if self.zero or self.world_size > 1:
            parts.append(f"zero {self.zero} x {self.world_size} GPUs")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.master_weights == "none":
            parts.append("bf16 weights, no masters")
        if self.fp32_parts:
            parts.append(f"fp32 {self.fp32_parts}")
        if self.fp32_matmul != "fp32":
            parts.append(f"fp32 products in {self.fp32_matmul}")
        if self.lora_rank:
            on = "" if self.lora_targets == LORA_TARGETS else f" on {','.join(self.lora_targets)}"
            parts.append(f"{self.goal}{on}")
        if self.teacher is not None:
            stored = f" {self.teacher_quantize}" if self.teacher_quantize != "none" else ""
            parts.append(f"teacher {self.teacher.name}{stored}")
        return ", ".join(parts)


@dataclass
class MemoryPlan:
    """Predicted per-GPU memory of one training step."""

    model: ModelConfig
    strategy: Strategy
    breakdown: dict[str, int]
    """Bytes per category at the peak phase."""
    phases: dict[str, int]
    """Peak allocated bytes in each phase: forward, backward, optimizer."""
    peak_bytes: int
    """Predicted torch.cuda.max_memory_allocated()."""
    category_peaks: dict[str, int] = field(default_factory=dict)
    """Each category's largest value over the phases (what `memfit profile` measures per category;
    their sum exceeds the peak, since categories peak in different phases)."""
    forward_kept_bytes: int = 0
    """What one micro-batch's forward leaves alive for backward: activations, the loss's saved
    gradients and (without checkpointing) the compute-dtype weight copies."""
    capacity_bytes: int | None = None
    gpu: str | None = None
    notes: list[str] = field(default_factory=list)
    host_bytes: int = 0
    """Pinned CPU memory per rank under offload: the fp32 shards of parameters (the master copy),
    gradients and optimizer states the CPU step works on. The ranks of one node add up."""
    trainable_params: int = 0
    """Parameters that train: all of the model's, or with LoRA its adapters'."""
    teacher_bytes: int = 0
    """The teacher's weights (counted in params)."""
    slack: float = field(default_factory=allocator_slack)
    """The allocator's slack over the peak (`allocator_slack`)."""

    @property
    def required_bytes(self) -> int:
        """What the GPU must hold: the peak plus allocator slack and the CUDA context."""
        return int(self.peak_bytes * (1 + self.slack)) + CUDA_CONTEXT_BYTES

    @property
    def fits(self) -> bool:
        return self.capacity_bytes is None or self.required_bytes <= self.capacity_bytes

    @property
    def shortfall_bytes(self) -> int:
        return (
            0 if self.capacity_bytes is None else max(0, self.required_bytes - self.capacity_bytes)
        )

    def to_json(self) -> dict:
        strategy = asdict(self.strategy)
        if self.strategy.teacher is not None:
            strategy["teacher"] = self.strategy.teacher.name
        return {
            "model": self.model.name,
            "gpu": self.gpu,
            "goal": self.strategy.goal,
            "strategy": strategy,
            "trainable_params": self.trainable_params,
            "teacher_bytes": self.teacher_bytes,
            "peak_bytes": self.peak_bytes,
            "required_bytes": self.required_bytes,
            "allocator_slack": self.slack,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "breakdown": self.breakdown,
            "phases": self.phases,
            "host_bytes": self.host_bytes,
        }


def teacher_model(spec: str) -> ModelConfig:
    """The shapes of a teacher named as `--teacher` or distill.teacher name it: a preset, a
    Hugging Face config.json or checkpoint directory, or a memfit training checkpoint or run
    directory (its meta.json's model)."""
    path = Path(spec)
    if path.is_dir() and not (path / "config.json").is_file():
        from memfit.train.checkpoint import find_checkpoint, read_meta

        checkpoint = find_checkpoint(path)
        if checkpoint is not None:
            return ModelConfig(**read_meta(checkpoint)["model"])
    return load_model_config(spec)


def fine_tuning_fields(config: Config) -> dict[str, Any]:
    """The Strategy fields of a run configuration's [lora] and [distill] sections (none when it
    trains every weight on cross-entropy alone): what the planner must plan that run with
    (`memfit plan --config`, `memfit train --auto`, the engine's preflight)."""
    fields: dict[str, Any] = {}
    lora, distill = config.lora, config.distill
    if lora.rank:
        fields.update(
            lora_rank=lora.rank,
            lora_targets=lora.targets,
            lora_dropout=lora.dropout,
            quantize_base=lora.quantize,
        )
    if distill.teacher:
        fields.update(
            teacher=teacher_model(distill.teacher),
            teacher_quantize=distill.teacher_quantize,
            distill_kind=distill.kind,
            distill_temperature=distill.temperature,
        )
    return fields


def _sizes(model: ModelConfig) -> dict[str, int]:
    """The model family's sizes (models/<family>/spec.py)."""
    return model.spec.sizes


@dataclass(frozen=True)
class BlockLinear:
    """One linear layer of a block as memfit builds it (fused qkv and gate_up), its output rows
    in parts under their Hugging Face names (what LoRA targets)."""

    name: str
    in_features: int
    parts: tuple[tuple[str, int], ...]

    @property
    def out_features(self) -> int:
        return sum(rows for _, rows in self.parts)


def block_linears(model: ModelConfig) -> tuple[BlockLinear, ...]:
    """The linear layers of one block, in forward order (memfit.models.llama: Attention.qkv,
    Attention.out, SwiGLUMLP.gate_up, SwiGLUMLP.down; their parts as the family's hf_layout
    names them)."""
    if model.family != "llama":
        raise ValueError(
            f"the planner knows the block layout of the llama family, not {model.family!r}"
        )
    s = _sizes(model)
    h, q, kv, f = s["h"], s["q"], s["kv"], s["f"]
    return (
        BlockLinear("qkv", h, (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
        BlockLinear("out", q, (("o_proj", h),)),
        BlockLinear("gate_up", h, (("gate_proj", f), ("up_proj", f))),
        BlockLinear("down", f, (("down_proj", h),)),
    )


def adapted_parts(linear: BlockLinear, strategy: Strategy) -> list[tuple[str, int]]:
    """The parts of `linear` that get an adapter under `strategy` (none without LoRA)."""
    if not strategy.lora_rank:
        return []
    return [(name, rows) for name, rows in linear.parts if name in strategy.lora_targets]


def adapter_params(model: ModelConfig, strategy: Strategy) -> int:
    """LoRA's trainable parameters: A (rank x in) and B (rows x rank) for each targeted part of
    each block's linear layers (memfit.nn.lora.apply_lora; 0 without LoRA)."""
    r = strategy.lora_rank
    per_layer = sum(
        r * (linear.in_features + rows)
        for linear in block_linears(model)
        for _, rows in adapted_parts(linear, strategy)
    )
    return model.num_layers * per_layer


def _allocated(nbytes: int) -> int:
    """What the caching allocator hands out for a tensor of `nbytes`."""
    return -(-nbytes // ALLOCATION_GRANULE) * ALLOCATION_GRANULE


def quantized_weight_bytes(out_features: int, in_features: int, kind: str) -> int:
    """Device bytes of one (out, in) weight stored by memfit.ops.quant: NF4 with double-quantized
    absmax (packed 4-bit indices, int8 absmax per 64, fp32 scale per 256 absmax, fp32 mean:
    4.127 bits a weight), int8 with an fp32 scale per row, or int4 in groups (128 features, or
    the largest power of two below that divides them: memfit.ops.quant.int4_group) with an fp32
    scale and a uint8 zero point per group (4.31 bits). Each buffer is one allocation."""
    numel = out_features * in_features
    if kind == "nf4":
        blocks = -(-numel // NF4_BLOCK)
        buffers = [blocks * NF4_BLOCK // 2, blocks, 4 * -(-blocks // NF4_SCALE_BLOCK), 4]
    elif kind == "int8":
        buffers = [numel, 4 * out_features]
    elif kind == "int4":
        groups = out_features * (in_features // int4_group(in_features))
        buffers = [numel // 2, 4 * groups, groups]
    else:
        raise ValueError(f"quantize to 'nf4', 'int8' or 'int4', got {kind!r}")
    return sum(_allocated(b) for b in buffers)


def frozen_model_bytes(
    model: ModelConfig, precision: str, quantize: str = "none", *, int8_head: bool = False
) -> int:
    """A model held for inference or as a frozen LoRA base: every parameter in the compute dtype
    (bf16/fp16: 2 bytes, fp32: 4), or with `quantize` the blocks' linear weights quantized
    (memfit.nn.quant.quantize_model) and the embeddings, norms, biases and head as they were;
    `int8_head`: the head quantized to int8 as an inference model's is (quantize_head: a tied
    model's a copy beside its embedding)."""
    c = 4 if precision == "fp32" else 2
    s = _sizes(model)
    if quantize == "none":
        return c * s["P"]
    linears = sum(
        quantized_weight_bytes(linear.out_features, linear.in_features, quantize)
        for linear in block_linears(model)
    )
    held = c * (s["P"] - s["L"] * s["P_matmul_layer"]) + s["L"] * linears
    if int8_head:
        head = model.vocab_size * model.hidden_size
        held += quantized_weight_bytes(model.vocab_size, model.hidden_size, "int8")
        held -= 0 if model.tie_embeddings else c * head
    return held


def layer_activation_bytes(model: ModelConfig, strategy: Strategy, mode: str | None = None) -> int:
    """Bytes one block keeps for backward after its forward (per micro-batch): the family's spec,
    and with LoRA what the adapters change of it (`_lora_saved_bytes`)."""
    mode = mode or strategy.checkpointing
    kept = model.spec.layer_activation_bytes(
        tokens=strategy.micro_batch * strategy.seq_len,
        seq_len=strategy.seq_len,
        precision=strategy.precision,
        checkpointing=mode,
        attention=strategy.attention,
    )
    if strategy.lora_rank and mode == "none":
        kept += _lora_saved_bytes(model, strategy)
    return kept


def checkpointed_blocks(model: ModelConfig, strategy: Strategy) -> int:
    """How many blocks `strategy` checkpoints: all with checkpointing full or selective, or
    the first `checkpoint_blocks` of them; none without checkpointing."""
    if strategy.checkpointing == "none":
        return 0
    blocks = strategy.checkpoint_blocks
    if blocks is None:
        return model.num_layers
    if blocks > model.num_layers:
        raise ValueError(
            f"checkpoint_blocks = {blocks}, but {model.name} has {model.num_layers} blocks"
        )
    return blocks


def fp32_blocks(model: ModelConfig, strategy: Strategy) -> set[int]:
    """The indices of the blocks that compute in fp32 under `strategy.fp32_parts`."""
    if not strategy.fp32_parts:
        return set()
    return set(parse_fp32_parts(strategy.fp32_parts).blocks(model.num_layers))


def fp32_head(strategy: Strategy) -> bool:
    """Whether the final norm, the output product and the loss compute in fp32."""
    return parse_fp32_parts(strategy.fp32_parts).head


def in_fp32(strategy: Strategy) -> Strategy:
    """`strategy` for a part that computes in fp32 (memfit.train.precision.apply_fp32_parts):
    its attention is SDPA's (memfit's flash kernel hands fp32 calls to it)."""
    attention = "sdpa" if strategy.attention == "flash" else strategy.attention
    return replace(strategy, precision="fp32", fp32_parts="", attention=attention)


def block_activation_bytes(model: ModelConfig, strategy: Strategy) -> list[int]:
    """What each block keeps for backward after its forward (per micro-batch), in order: the
    first `checkpointed_blocks` in the checkpointing mode, the others none; an fp32 block's in
    fp32 (`fp32_blocks`; the precision wrapper casts its input before the checkpoint keeps it,
    and a block in the compute dtype after it rounds its input before its checkpoint)."""
    checked = checkpointed_blocks(model, strategy)
    fp32 = fp32_blocks(model, strategy)
    return [
        layer_activation_bytes(
            model,
            in_fp32(strategy) if i in fp32 else strategy,
            strategy.checkpointing if i < checked else "none",
        )
        for i in range(model.num_layers)
    ]


def _lora_saved_bytes(model: ModelConfig, strategy: Strategy) -> int:
    """What adapters change of a block's saved tensors (LoRALinear.forward). A frozen product
    saves nothing of its input (its weight needs no gradient) and adapter A saves it instead, so a
    layer with an adapter keeps what the full model's layer kept, plus x A^T (T x rank a part,
    which the parts' B products save as slices of one tensor). A layer without one keeps its
    input no more: the norm outputs (qkv's and gate_up's inputs) and the SwiGLU output (down's);
    attention keeps its output (out's input) anyway. With dropout, A saves the dropped input in
    place of the input, and dropout its mask (a byte an element); out's dropped copy comes on
    top of the attention output."""
    c = 4 if strategy.precision == "fp32" else 2
    T = strategy.micro_batch * strategy.seq_len
    change = 0
    for linear in block_linears(model):
        parts = adapted_parts(linear, strategy)
        if not parts:
            change -= 0 if linear.name == "out" else c * T * linear.in_features
            continue
        change += c * T * strategy.lora_rank * len(parts)
        if strategy.lora_dropout:
            change += T * linear.in_features * (1 + (c if linear.name == "out" else 0))
    return change


def offloaded_bytes_per_layer(model: ModelConfig, strategy: Strategy) -> int:
    """What activation offload moves of each block per micro-batch: its input with
    checkpointing, else all it saves (the tensors of at least 1 MiB: nearly all of it at
    training sizes)."""
    if not strategy.offload_activations:
        return 0
    if strategy.checkpointing == "none":
        return layer_activation_bytes(model, strategy)
    c = 4 if strategy.precision == "fp32" else 2
    return c * strategy.micro_batch * strategy.seq_len * model.hidden_size


def offloaded_weight_copies_per_layer(model: ModelConfig, strategy: Strategy) -> int:
    """Without checkpointing, with fp32 masters under autocast: a compiled block (`--compile
    auto` compiles these on CUDA) saves its weights' low-precision copies inside its graph, and
    they move with its activations (eager blocks keep autocast's copies on the GPU). Measured
    on llama-1b, seq 8192: the 1.53 GiB a step of pinned memory beyond the activations, and
    with them the step time within 1% (activation_offload.json). (LoRA: the base is not cast,
    and the adapters' copies are a few MB: 0.)"""
    if not (
        strategy.offload_activations
        and strategy.checkpointing == "none"
        and strategy.master_weights == "fp32"
        and strategy.precision != "fp32"
        and not strategy.lora_rank
    ):
        return 0
    return 2 * _sizes(model)["P_matmul_layer"]


def _cross_entropy(model: ModelConfig, strategy: Strategy) -> tuple[int, int]:
    """(saved bytes, transient bytes while it runs) of the loss for one micro-batch."""
    s = _sizes(model)
    T = strategy.micro_batch * strategy.seq_len
    low = strategy.precision != "fp32"
    if not strategy.fused_cross_entropy:  # logits in compute dtype + fp32 log-softmax kept
        c = 2 if low else 4
        return T * s["V"] * (c + 4), T * s["V"] * 4
    grad_hidden = T * s["h"] * (2 if strategy.precision == "bf16" else 4)
    # (LoRA: the head is frozen, so no grad_weight is computed)
    grad_weight = 0 if strategy.lora_rank else s["V"] * s["h"] * 4
    rows = max(1, CE_CHUNK_BYTES // (s["V"] * 4))
    rows = min(T, max(256, rows // 256 * 256) if rows >= 256 else rows)
    logits = rows * s["V"] * 4
    grad_buffer = rows * s["V"] * 2 if strategy.precision == "bf16" else 0
    # autocast's bf16 copy of an fp32 output weight (bf16 parameters, and a LoRA base held in
    # the compute dtype, need none)
    fp32_head = strategy.master_weights == "fp32" and not strategy.lora_rank
    weight_copy = s["V"] * s["h"] * 2 if low and fp32_head else 0
    return grad_hidden + grad_weight, logits + grad_buffer + weight_copy


# memfit.ops.distill's chunk in (C x V) fp32 units: the student's logits s and the teacher's t
# (fp32 out of their products: 2), log_softmax(s) (1), the cross-entropy's gradient (1),
# log_softmax(t / T) (1), q and p (2), and the KL's gradient T(q - p) (1) with the two
# temporaries of alpha * it * mask (2): 10 when that last line runs. JSD adds log m and u (2) and
# peaks at 12; a temperature other than 1 adds log_softmax(s / T).
DISTILL_CHUNK_UNITS = {"kl": 10.0, "jsd": 12.0}


def _distillation_loss(model: ModelConfig, strategy: Strategy) -> tuple[int, int]:
    """(saved bytes, transient bytes while it runs) of memfit.ops.distill.linear_distillation_loss
    for one micro-batch, as its forward allocates (plain PyTorch, chunks of DISTILL_CHUNK_ROWS):
    saved, grad_hidden (T x h, the hidden states' dtype) and, for a trainable head, its fp32
    grad_weight (V x h); while it runs, DISTILL_CHUNK_UNITS of a chunk's (C x V) fp32 logits, the
    chunk's hidden states in the compute dtype (C x h), the teacher's hidden states it is given
    (T x h_t) and the head's copy: an fp32 head is cast to the compute dtype once (V x h x 2), a
    head stored in it (LoRA's frozen one, bf16 weights) is not copied."""
    s = _sizes(model)
    teacher = strategy.teacher
    assert teacher is not None
    T = strategy.micro_batch * strategy.seq_len
    c = 4 if strategy.precision == "fp32" else 2
    rows = min(T, DISTILL_CHUNK_ROWS)
    units = DISTILL_CHUNK_UNITS[strategy.distill_kind] + (strategy.distill_temperature != 1)
    head = s["V"] * s["h"]
    saved = c * T * s["h"] + (0 if strategy.lora_rank else 4 * head)
    stored_in_compute_dtype = (
        strategy.precision == "fp32" or strategy.lora_rank or strategy.master_weights == "none"
    )
    head_copies = 0 if stored_in_compute_dtype else 2 * head
    transient = (
        int(units * rows * s["V"] * 4)
        + c * rows * s["h"]
        + c * T * teacher.hidden_size
        + head_copies
    )
    return saved, transient


def _teacher_forward_bytes(strategy: Strategy) -> int:
    """What the teacher's forward (inference mode, one block at a time) holds at its peak beyond
    its weights, in the compute dtype: in its MLP the block's input, the attention branch, their
    sum and its norm (4 x T x h_t: Block.forward's locals) beside gate_up's output and the
    SwiGLU's (3 x T x f_t); a quantized teacher's products dequantize a layer's weight at a time
    (above memfit.nn.quant's fused rows): gate_up's beside its output being written, down's
    beside the SwiGLU output, its own and the residual sum (2 x T x h_t)."""
    teacher = strategy.teacher
    assert teacher is not None
    c = 4 if strategy.precision == "fp32" else 2
    T = strategy.micro_batch * strategy.seq_len
    h, f = teacher.hidden_size, teacher.intermediate_size
    peak = c * T * (4 * h + 3 * f)
    if strategy.teacher_quantize != "none":
        linears = {linear.name: linear for linear in block_linears(teacher)}
        copy = {
            name: dequantized_copy_bytes(linears[name], strategy, strategy.teacher_quantize)
            for name in ("gate_up", "down")
        }
        if copy["gate_up"]:
            peak = max(
                peak,
                c * T * (4 * h + 2 * f) + copy["gate_up"],
                c * T * (6 * h + f) + copy["down"],
            )
    return peak


def plan(model: ModelConfig, strategy: Strategy, gpu: GPU | None = None) -> MemoryPlan:
    """Predict the per-GPU memory of a training step of `model` under `strategy` on `gpu`."""
    checked = checkpointed_blocks(model, strategy)
    if strategy.checkpoint_blocks is not None and checked in (0, model.num_layers):
        # every block or none: the plain modes
        mode = strategy.checkpointing if checked else "none"
        whole = replace(strategy, checkpointing=mode, checkpoint_blocks=None)
        return replace(plan(model, whole, gpu), strategy=strategy)
    # the blocks that keep their activations (the last ones), planned as without checkpointing
    unchecked = model.num_layers - checked
    plain = replace(strategy, checkpointing="none", checkpoint_blocks=None)
    s = _sizes(model)
    N = strategy.world_size
    P, L = s["P"], s["L"]
    c_low = 2 if strategy.precision != "fp32" else 0  # bytes of autocast's weight copies
    T = strategy.micro_batch * strategy.seq_len

    lora = strategy.lora_rank > 0
    teacher = strategy.teacher
    if teacher is not None and teacher.vocab_size != model.vocab_size:
        raise ValueError(
            f"the teacher {teacher.name!r} has a vocabulary of {teacher.vocab_size} and the "
            f"student {model.name!r} {model.vocab_size}: distillation compares their "
            "distributions token by token, so they must share one tokenizer"
        )
    # model states (ZeRO sharding of the flat buffers): the registry's formula, which the tests
    # hold against ZeroOptimizer's real bytes; with LoRA, of the adapters (fp32, one process)
    # beside the frozen base
    trainable = adapter_params(model, strategy) if lora else P
    states = model_state_bytes(
        trainable,
        optimizer=strategy.optimizer,
        zero=strategy.zero,
        world_size=N,
        offload=strategy.offload,
        param_bytes=2 if strategy.master_weights == "none" else 4,
        embedding_params=0 if lora else model.vocab_size * model.hidden_size,
    )
    params, grads, optimizer = states["params"], states["grads"], states["optimizer_states"]
    if lora:
        params += frozen_model_bytes(model, strategy.precision, strategy.quantize_base)
    teacher_weights = 0
    if teacher is not None:
        teacher_weights = frozen_model_bytes(teacher, strategy.precision, strategy.teacher_quantize)
        params += teacher_weights
    # bytes of a gradient element: bf16 parameters (no masters) have bf16 gradients
    g = 2 if strategy.master_weights == "none" else 4

    # activations of one micro-batch at the end of its forward
    c = 4 if strategy.precision == "fp32" else 2
    fp32 = fp32_blocks(model, strategy)
    head_fp32 = fp32_head(strategy)
    c_out = 4 if head_fp32 or L - 1 in fp32 else c  # the final norm's input
    outside = c_out * T * s["h"] + 4 * T + 8 * T  # final norm input, its 1/rms, token ids
    kept = block_activation_bytes(model, strategy)
    checked_activations = sum(kept[:checked]) + outside
    activations = checked_activations + sum(kept[checked:])
    offloaded = offloaded_bytes_per_layer(model, strategy)
    # (each block's in its own precision: fp32 blocks move 4-byte tensors)
    offloaded_blocks = [
        offloaded_bytes_per_layer(model, in_fp32(strategy)) if i in fp32 else offloaded
        for i in range(L)
    ]
    if offloaded:
        # in pinned CPU memory; on the GPU two layers' at most: one being copied out (or, in
        # backward, the block's own) and the next one coming back
        activations -= sum(offloaded_blocks) - sum(sorted(offloaded_blocks)[-min(L, 2) :])
    if teacher is None:
        ce_saved, ce_transient = _cross_entropy(model, in_fp32(strategy) if head_fp32 else strategy)
    else:
        ce_saved, ce_transient = _distillation_loss(model, strategy)
    # (bf16 parameters: autocast has nothing to copy; fp32 blocks take their weights as they are)
    copied = [i for i in range(L) if i not in fp32] if strategy.master_weights == "fp32" else []
    weight_copies = c_low * len(copied) * s["P_matmul_layer"]
    if lora:
        # a base in the compute dtype is not cast; the fp32 adapters are (kept for backward
        # without checkpointing)
        weight_copies = _adapter_copy_bytes(model, strategy)
        if not checked:
            # the first block's input is the frozen embedding's output, which needs no gradient:
            # its attention norm saves nothing (checkpointing keeps the block input anyway)
            activations -= c * T * s["h"] + 4 * T
    # (what compiled blocks save of these copies moves too: counted in pinned memory and in
    # the copies' time, not taken off here, where no measured peak has shown it)
    copies_moved = offloaded_weight_copies_per_layer(model, strategy)
    output_grad = 0 if lora else g * s["V"] * s["h"]
    if strategy.zero == 3:
        # parameters are gathered in the compute dtype (autocast copies nothing): the root (the
        # embedding, final norm and output projection) and two blocks, the running one and the
        # next, prefetched; the output projection's gradient is in that dtype too
        c_param = 4 if strategy.precision == "fp32" else 2
        root = P - L * s["P_layer"]
        weight_copies = c_param * (root + 2 * s["P_layer"])
        output_grad = c_param * s["V"] * s["h"]
    # with accumulation, the gradients of earlier micro-batches (stage 1: the full buffer; its
    # shard is written by the reduce-scatter of the last micro-batch)
    grads_alive_in_forward = 0
    if strategy.grad_accum > 1:
        grads_alive_in_forward = 4 * trainable if strategy.zero == 1 else grads

    ws = CUBLAS_WORKSPACE_BYTES

    def phase(**parts: int) -> dict[str, int]:
        base = {"params": params, "optimizer_states": optimizer, "runtime_overhead": ws}
        return {key: int({**base, **parts}.get(key, 0)) for key in CATEGORIES}

    # end of forward: inside the loss, every activation, weight copy and loss buffer is alive
    forward = phase(
        grads=grads_alive_in_forward,
        activations=activations,
        logits_loss=ce_saved + ce_transient,
        temporaries=weight_copies,
    )
    # ... or before it: the teacher's forward, beside the student's hidden states (its final
    # norm's output), or without checkpointing the adapters of the last block's widest layer
    # (LORA_UPDATE), beyond what that block keeps
    before_loss = 0
    if teacher is not None:
        before_loss = c * T * s["h"] + _teacher_forward_bytes(strategy)
    if lora and unchecked:  # (the last block keeps its activations)
        # (a quantized gate_up's product: its weight dequantized, its output being written, the
        # block's gate_up and SwiGLU outputs not yet)
        gate_up = next(linear for linear in block_linears(model) if linear.name == "gate_up")
        dequantized = dequantized_copy_bytes(gate_up, strategy, strategy.quantize_base)
        before_loss = max(
            before_loss,
            _lora_forward_excess(model, strategy),
            dequantized - c * T * s["f"] if dequantized else 0,
        )
    if before_loss > ce_saved + ce_transient:
        forward = phase(
            grads=grads_alive_in_forward,
            activations=activations,
            temporaries=weight_copies + before_loss,
        )
    # backward starts with the loss's saved gradients: grad_weight becomes the output projection's
    # gradient, grad_hidden flows into the final norm. Checkpointed forwards dropped their weight
    # copies when autocast exited; unchecked ones keep them until each layer's backward.
    grad_hidden = ce_saved
    if strategy.fused_cross_entropy and not lora:
        grad_hidden = ce_saved - 4 * s["V"] * s["h"]
    kept_copies = weight_copies if strategy.zero == 3 else weight_copies * unchecked // L
    if fp32:  # (the unchecked blocks that are not fp32 ones)
        kept_copies = c_low * sum(i >= checked for i in copied) * s["P_matmul_layer"]

    def transient_of(block: int, mode: Strategy) -> int:
        """What block `block`'s backward adds, in its own precision (fp32 parts)."""
        return _layer_backward_transient(model, in_fp32(mode) if block in fp32 else mode)

    # the backward begins at the last block, ends at the first, and reruns the checkpointed ones
    # after the unchecked ones: each phase's block in its precision
    transient = transient_of(0, strategy)
    plain_transient = transient_of(L - 1, plain)
    last_transient = transient_of(L - 1, strategy)
    rerun_transient = transient_of(max(checked - 1, 0), strategy)
    backward_first = phase(
        grads=grads_alive_in_forward or output_grad,
        activations=activations,
        logits_loss=grad_hidden,
        temporaries=kept_copies + (plain_transient if unchecked else last_transient),
    )
    # ... and ends with every layer's activations and copies freed and its fp32 gradients made
    layer_grad = g * s["P_layer"] // (N if strategy.zero >= 2 else 1)
    if lora:
        layer_grad = grads // L
    # ZeRO-3 keeps the root gathered to the end (the embedding's gradient comes last) and one
    # block's fp32 gradients in the reduce-scatter in flight
    zero3_last = c_param * root + 4 * s["P_layer"] if strategy.zero == 3 else 0
    # (offloaded without checkpointing: two blocks' saved tensors are back on the GPU when the
    # last gradients are made, the first block's in use; measured on llama-1b, seq 8192, micro-
    # batches 1 and 2: activation_offload.json)
    in_use = 2 * offloaded if strategy.checkpointing == "none" else 0
    backward_last = phase(
        grads=grads if grads_alive_in_forward else min(grads, L * layer_grad + output_grad),
        activations=outside + in_use,
        temporaries=transient + zero3_last,
    )
    # some blocks checkpointed: the last of them reruns once the unchecked ones' backward has
    # freed their activations and copies
    backward_rerun = phase(
        grads=grads_alive_in_forward or min(grads, unchecked * layer_grad + output_grad),
        activations=checked_activations,
        temporaries=(rerun_transient + (weight_copies if strategy.zero == 3 else 0))
        if checked and unchecked
        else 0,
    )
    # what the optimizer allocates while it steps (torch's foreach SGD adds weight decay out of
    # place: one gradient-sized temporary)
    step_temporary = 0
    if strategy.offload == "none":
        per_param = get_optimizer(strategy.optimizer).step_temporary_bytes_per_param
        step_temporary = int(per_param * grads / g)  # sized like the gradients this rank holds
    optimizer_step = phase(grads=grads, temporaries=step_temporary)
    candidates = {
        "forward": forward,
        "backward": max(
            backward_first, backward_rerun, backward_last, key=lambda b: sum(b.values())
        ),
        "optimizer": optimizer_step,
    }
    category_peaks = {
        key: max(
            parts[key]
            for parts in (forward, backward_first, backward_rerun, backward_last, optimizer_step)
        )
        for key in CATEGORIES
    }
    phases = {name: sum(parts.values()) for name, parts in candidates.items()}
    peak_phase = max(phases, key=phases.get)
    breakdown = candidates[peak_phase]
    peak = phases[peak_phase]

    notes = []
    host = 0
    if teacher is not None:
        stored = (
            strategy.teacher_quantize if strategy.teacher_quantize != "none" else "compute dtype"
        )
        notes.append(
            f"params include the teacher {teacher.name}'s weights ({stored}): {gib(teacher_weights)}"
        )
    if offloaded:
        host += sum(offloaded_blocks) + (L - len(fp32)) * copies_moved
        what = "block inputs" if strategy.checkpointing != "none" else "activations"
        if copies_moved:
            what += " (and the weight copies that compiled blocks save)"
        notes.append(f"offloaded {what} take {gib(host)} of pinned CPU memory")
    if strategy.offload != "none":
        # stage 0 replicates the whole model's states on every rank, the others shard them
        host += states["host"]
        ranks = min(N, 8)  # the ranks that share a node's memory (8 GPUs per node)
        states_host = states["host"]
        node = f", {gib(states_host * ranks)} for the {ranks} ranks of a node" if ranks > 1 else ""
        notes.append(
            f"offloaded states take {gib(states_host)} of pinned CPU memory per rank{node}"
        )
    return MemoryPlan(
        model=model,
        strategy=strategy,
        breakdown=breakdown,
        phases=phases,
        category_peaks=category_peaks,
        forward_kept_bytes=int(activations + ce_saved + kept_copies),
        peak_bytes=int(peak),
        capacity_bytes=gpu.memory_bytes if gpu is not None else None,
        gpu=gpu.name if gpu is not None else None,
        notes=notes,
        host_bytes=host,
        trainable_params=trainable,
        teacher_bytes=teacher_weights,
    )


def _layer_backward_transient(model: ModelConfig, strategy: Strategy) -> int:
    """The largest memory a block's backward needs on top of what is already counted. It peaks in
    the SwiGLU backward: the gradient flowing in (Th), d swiglu-out (Tf) and d gate_up (2Tf) are
    alive while the SwiGLU output (Tf, counted in the activations) has been freed by the down
    projection's backward: c*T*(h + 2f), plus one weight gradient in the compute dtype before it is
    accumulated into fp32 (allocator traces of an H100 step). A checkpointed block first rebuilds
    its own activations and weight copies."""
    s = _sizes(model)
    c = 4 if strategy.precision == "fp32" else 2
    T = strategy.micro_batch * strategy.seq_len
    if strategy.lora_rank:
        return _lora_layer_backward_transient(model, strategy)
    transient = c * T * (s["h"] + 2 * s["f"]) + c * s["h"] * 2 * s["f"]
    transient = max(transient, _attention_backward_transient(model, strategy))
    if strategy.checkpointing in ("full", "selective"):
        rebuilt = layer_activation_bytes(model, strategy, mode="none") - layer_activation_bytes(
            model, strategy
        )
        transient += rebuilt + (2 * s["P_matmul_layer"] if strategy.precision != "fp32" else 0)
    return transient


def _lora_layer_backward_transient(model: ModelConfig, strategy: Strategy) -> int:
    """`_layer_backward_transient` with LoRA: the largest of
    - the SwiGLU backward, c*T*(h + 2f) as in the full model, but no weight gradient follows
      (the base is frozen; an adapter's is rows x rank);
    - a rerun block (checkpointing) at its widest adapted layer (`_lora_forward_excess`, with the
      gradient flowing in, Th);
    - a quantized base's products with a dequantized weight (`_dequantized_weight_peak`);
    - attention's backward;
    over the block's rebuilt activations (checkpointing) and one block's adapter copies."""
    s = _sizes(model)
    c = 4 if strategy.precision == "fp32" else 2
    T = strategy.micro_batch * strategy.seq_len
    transient = max(
        c * T * (s["h"] + 2 * s["f"]),
        _attention_backward_transient(model, strategy),
        _dequantized_weight_peak(model, strategy),
    )
    if strategy.checkpointing in ("full", "selective"):
        rebuilt = layer_activation_bytes(model, strategy, mode="none") - layer_activation_bytes(
            model, strategy
        )
        rerun = c * T * s["h"] + _lora_forward_excess(model, strategy)
        copies = _adapter_copy_bytes(model, strategy) // s["L"]
        transient = rebuilt + max(transient, rerun) + copies
    return transient


# How LoRALinear.forward adds the adapters' update to the base's product (memfit.nn.lora), which
# sets what one adapted layer of output width w holds while it runs:
# - "addmm": y = addmm(base, x A^T, B^T) with B block-diagonal over the parts: the base output
#   and y, 2w (`base` is referenced until forward returns, so at gate_up beside the SwiGLU
#   output too);
# - "concat" (6f05e43 to f140293, the commits of the runs in benchmarks/results/lora.json): each
#   part's B product, their concatenation and its scaled copy beside the base output, 4w (3w for
#   a single part, which is not concatenated).
LORA_UPDATE: Literal["addmm", "concat"] = "addmm"


def _lora_forward_excess(model: ModelConfig, strategy: Strategy) -> int:
    """The most a block's forward holds with LoRA beyond what it keeps once done: at the adapted
    layer where LORA_UPDATE's tensors peak, those (plus dropout's output and mask, in x (c + 1)
    bytes) less what the block saves from that layer on (models/llama/spec.py's terms: at
    gate_up its and the SwiGLU's outputs, 3Tf; after down nothing). "addmm": 2f at gate_up;
    "concat": 8Tf - 3Tf = 5Tf there. (At qkv and out the rest of the block keeps more than the
    update holds.)"""
    c = 4 if strategy.precision == "fp32" else 2
    T = strategy.micro_batch * strategy.seq_len
    s = _sizes(model)
    kept_after = {
        "qkv": 2 * s["q"] + 2 * s["kv"] + 2 * s["h"] + 3 * s["f"],
        "out": 2 * s["h"] + 3 * s["f"],
        "gate_up": 3 * s["f"],
        "down": 0,
    }
    excess = 0
    for linear in block_linears(model):
        if not adapted_parts(linear, strategy):
            continue
        width = linear.out_features
        if LORA_UPDATE == "addmm":
            held = 2 * width + (s["f"] if linear.name == "gate_up" else 0)
        else:
            held = (4 if len(linear.parts) > 1 else 3) * width
        dropped = linear.in_features * (c + 1) / c if strategy.lora_dropout else 0
        excess = max(excess, int(c * T * (held + dropped - kept_after[linear.name])))
    return excess


def _adapter_copy_bytes(model: ModelConfig, strategy: Strategy) -> int:
    """The adapters as the products take them, all blocks: the parts' A stacked (k r x in) and
    (LORA_UPDATE "addmm") B block-diagonal over the layer's parts (out x k r, its zero blocks
    included; "concat": each part's B), in the compute dtype (autocast's copies of the fp32
    adapters), or in fp32 only where stacking makes new tensors (a layer of several parts).
    Without checkpointing the products keep them for backward."""
    if not strategy.lora_rank:
        return 0
    r, elements = strategy.lora_rank, 0
    for linear in block_linears(model):
        parts = adapted_parts(linear, strategy)
        stacked = len(linear.parts) > 1
        if not parts or (strategy.precision == "fp32" and not stacked):
            continue
        elements += len(parts) * r * linear.in_features
        if LORA_UPDATE == "addmm" and stacked:
            elements += linear.out_features * len(parts) * r
        elif strategy.precision != "fp32":
            elements += sum(rows for _, rows in parts) * r
    c = 4 if strategy.precision == "fp32" else 2
    return c * model.num_layers * elements


# memfit.nn.quant.FUSED_MAX_ROWS: a quantized product of at most this many rows dequantizes
# inside the matmul kernel; above it the weight is dequantized whole (compute dtype, one layer's
# at a time) for cuBLAS, forward and backward.
QUANT_FUSED_MAX_ROWS = {"nf4": 0, "int8": 16, "int4": 0}


def dequantized_copy_bytes(linear: BlockLinear, strategy: Strategy, kind: str) -> int:
    """The compute-dtype copy a product with a quantized `linear` makes of its weight: none where
    the kernel dequantizes inside the matmul (at most QUANT_FUSED_MAX_ROWS[kind] rows, bf16 or
    fp16), else the whole weight."""
    rows = strategy.micro_batch * strategy.seq_len
    if kind == "none" or (strategy.precision != "fp32" and rows <= QUANT_FUSED_MAX_ROWS[kind]):
        return 0
    c = 4 if strategy.precision == "fp32" else 2
    return c * linear.in_features * linear.out_features


def _dequantized_weight_peak(model: ModelConfig, strategy: Strategy) -> int:
    """With a quantized base, beyond a block's saved tensors, its products' dequantized weights
    where they peak: gate_up's input gradient (the gradient flowing in Th, d gate_up 2Tf and dx
    Th alive, gate_up's and the SwiGLU's outputs 3Tf freed: c*T*(2h - f)) and down's (the
    gradient flowing in and dx Tf: c*T*(h + f)), each with its weight in the compute dtype.
    (The forward's products hold less: the gradient flowing in and the output being written.)"""
    if strategy.quantize_base == "none":
        return 0
    c = 4 if strategy.precision == "fp32" else 2
    T = strategy.micro_batch * strategy.seq_len
    s = _sizes(model)
    linears = {linear.name: linear for linear in block_linears(model)}
    kind = strategy.quantize_base
    gate_up = dequantized_copy_bytes(linears["gate_up"], strategy, kind)
    down = dequantized_copy_bytes(linears["down"], strategy, kind)
    if not gate_up:
        return 0
    return max(c * T * (2 * s["h"] - s["f"]) + gate_up, c * T * (s["h"] + s["f"]) + down)


def _attention_backward_transient(model: ModelConfig, strategy: Strategy) -> int:
    """What the attention kernel's backward allocates on top of its saved inputs: the gradient
    flowing in (Tq), dq, dk, dv (T(q + 2kv)) and two fp32 row vectors per query head.
    memfit's flash kernel writes dq, dk, dv directly (no fp32 accumulator; GQA's dk, dv are summed
    in registers) and its row vectors are delta and lse*log2(e); torch's FlashAttention-2 backend
    (sdpa) adds an fp32 dq accumulator (4Tq). Eager attention's probabilities are counted with the
    activations."""
    s = _sizes(model)
    c = 4 if strategy.precision == "fp32" else 2
    T = strategy.micro_batch * strategy.seq_len
    transient = c * T * (2 * s["q"] + 2 * s["kv"]) + 8 * T * s["H"]
    if strategy.attention == "sdpa":
        transient += 4 * T * s["q"]
    return transient


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def fewest_checkpointed_blocks(
    model: ModelConfig, strategy: Strategy, gpu: GPU | None = None, *, budget: float
) -> Strategy | None:
    """`strategy` (checkpointing full or selective) with the fewest blocks checkpointed whose
    MemoryPlan.required_bytes stays within `budget`, or None if only every block (or no
    checkpointing at all) fits. A bisection between the two: it finds where the plans cross the
    budget (memory falls block by block as blocks are checkpointed, except at the two ends,
    where the plain modes' own terms apply)."""
    if strategy.checkpointing == "none" or strategy.offload_activations:
        return None
    low, high = 0, model.num_layers  # (low does not fit, high does)
    if plan(model, replace(strategy, checkpoint_blocks=high), gpu).required_bytes > budget:
        return None
    if plan(model, replace(strategy, checkpoint_blocks=low), gpu).required_bytes <= budget:
        return None
    while high - low > 1:
        middle = (low + high) // 2
        fits = plan(model, replace(strategy, checkpoint_blocks=middle), gpu).required_bytes
        low, high = (low, middle) if fits <= budget else (middle, high)
    return replace(strategy, checkpoint_blocks=high) if high < model.num_layers else None


def what_would_fit(
    model: ModelConfig, strategy: Strategy, gpu: GPU
) -> list[tuple[str, MemoryPlan]]:
    """Single changes to `strategy` that make it fit `gpu`, cheapest first (in expected speed).
    A change that the strategy cannot take (offload or ZeRO with bf16 weights, say) is left out."""
    candidates: list[tuple[str, dict]] = []
    every = {"checkpoint_blocks": None}  # (every block)
    drop = " (every block: drop --checkpoint-blocks)" if strategy.checkpoint_blocks else ""
    for mode in ("selective", "full"):  # (only the blocks it takes to fit, first)
        fewest = fewest_checkpointed_blocks(
            model, replace(strategy, checkpointing=mode, checkpoint_blocks=None), gpu,
            budget=gpu.memory_bytes,
        )  # fmt: skip
        if fewest is not None and fewest.checkpoint_blocks != strategy.checkpoint_blocks:
            blocks = fewest.checkpoint_blocks
            label = f"--checkpointing {mode} --checkpoint-blocks {blocks}"
            candidates.append((label, {"checkpointing": mode, "checkpoint_blocks": blocks}))
    if strategy.checkpointing != "selective" or strategy.checkpoint_blocks is not None:
        candidates.append(
            (f"--checkpointing selective{drop}", {"checkpointing": "selective", **every})
        )
    if strategy.checkpointing != "full" or strategy.checkpoint_blocks is not None:
        candidates.append((f"--checkpointing full{drop}", {"checkpointing": "full", **every}))
    mb = strategy.micro_batch
    while mb > 1:
        mb //= 2
        accum = strategy.grad_accum * math.ceil(strategy.micro_batch / mb)
        candidates.append(
            (f"--micro-batch {mb} --grad-accum {accum}", {"micro_batch": mb, "grad_accum": accum})
        )
    if strategy.checkpointing != "full" and strategy.micro_batch > 1:
        accum = strategy.grad_accum * strategy.micro_batch
        candidates.append(
            (
                "--checkpointing full --micro-batch 1",
                {"checkpointing": "full", "micro_batch": 1, "grad_accum": accum, **every},
            )
        )
    if strategy.world_size > 1:  # shard more of the state over the same GPUs
        for zero in range(strategy.zero + 1, 4):
            candidates.append((f"--zero {zero}", {"zero": zero}))
    if strategy.offload == "none":
        candidates.append(("--offload optimizer", {"offload": "optimizer"}))
    if strategy.offload != "params":
        candidates.append(("--zero 3 --offload params", {"zero": 3, "offload": "params"}))
    for gpus in (2, 4, 8, 16, 32, 64):
        if gpus > strategy.world_size:
            candidates.append((f"--zero 3 on {gpus} GPUs", {"zero": 3, "world_size": gpus}))
    # then the leaner optimizers, which train differently (8-bit states; factored second moments)
    if strategy.optimizer == "adamw":
        for lean in ("adamw8bit", "adafactor", "sm3"):
            candidates.append((f"--optimizer {lean}", {"optimizer": lean}))
    # last, since they change what trains: adapters on a frozen base (in the compute dtype, or
    # NF4; the fp32 masters they need)
    lora = {"lora_rank": strategy.lora_rank or 16, "master_weights": "fp32"}
    single_process = strategy.zero == 0 and strategy.offload == "none"
    masters = " --master-weights fp32" if strategy.master_weights == "none" else ""
    if not strategy.lora_rank and single_process:
        candidates.append((f"--lora-rank 16{masters} (LoRA: adapters on a frozen base)", lora))
    if strategy.quantize_base == "none" and single_process:
        rank = "" if strategy.lora_rank else "--lora-rank 16 "
        label = f"{rank}--quantize-base nf4{masters} (QLoRA: adapters on an NF4 base)"
        candidates.append((label, {**lora, "quantize_base": "nf4"}))
    found = []
    for label, changes in candidates:
        try:
            result = plan(model, replace(strategy, **changes), gpu)
        except ValueError:
            continue
        if result.fits:
            found.append((label, result))
    return found
