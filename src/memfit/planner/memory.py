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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from memfit.config import check_parallelism
from memfit.models.config import ModelConfig
from memfit.optim.registry import get_optimizer, model_state_bytes
from memfit.planner.hardware import GPU, GiB

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
FRAGMENTATION = 0.05
# cuBLAS workspaces come from the caching allocator (PyTorch >= 1.11), 32 MiB per handle on
# Hopper, and a handle is per thread: the forward's and the autograd engine's backward thread each
# hold one for the rest of the process (seen in allocator traces on an H100).
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2**20
# memfit's linear cross-entropy sizes a chunk of fp32 logits to this many bytes (ops/cross_entropy.py).
CE_CHUNK_BYTES = 512 * 2**20


@dataclass(frozen=True, kw_only=True)
class Strategy:
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    micro_batch: int = 1
    seq_len: int = 2048
    grad_accum: int = 1
    checkpointing: Literal["none", "full", "selective"] = "none"
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

    def __post_init__(self) -> None:
        if self.attention == "auto":
            object.__setattr__(self, "attention", "sdpa")
        if self.micro_batch < 1 or self.seq_len < 1 or self.grad_accum < 1 or self.world_size < 1:
            raise ValueError(
                f"micro_batch, seq_len, grad_accum and world_size must be >= 1: {self}"
            )
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")
        check_parallelism(
            zero=self.zero,
            offload=self.offload,
            optimizer=self.optimizer,
            world_size=self.world_size,
        )
        if self.master_weights == "none" and (
            self.precision != "bf16" or self.zero or self.offload != "none" or self.world_size > 1
        ):
            raise ValueError(
                "master_weights='none' (bf16 parameters) needs bf16 precision on one process "
                f"without ZeRO or offload: {self}"
            )

    def describe(self) -> str:
        parts = [self.precision, f"mb {self.micro_batch}", f"seq {self.seq_len}"]
        if self.grad_accum > 1:
            parts.append(f"accum {self.grad_accum}")
        parts.append(f"ckpt {self.checkpointing}")
        if self.offload_activations:
            parts.append("offload activations")
        if self.zero or self.world_size > 1:
            parts.append(f"zero {self.zero} x {self.world_size} GPUs")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.master_weights == "none":
            parts.append("bf16 weights, no masters")
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

    @property
    def required_bytes(self) -> int:
        """What the GPU must hold: the peak plus allocator slack and the CUDA context."""
        return int(self.peak_bytes * (1 + FRAGMENTATION)) + CUDA_CONTEXT_BYTES

    @property
    def fits(self) -> bool:
        return self.capacity_bytes is None or self.required_bytes <= self.capacity_bytes

    @property
    def shortfall_bytes(self) -> int:
        return (
            0 if self.capacity_bytes is None else max(0, self.required_bytes - self.capacity_bytes)
        )

    def to_json(self) -> dict:
        return {
            "model": self.model.name,
            "gpu": self.gpu,
            "strategy": asdict(self.strategy),
            "peak_bytes": self.peak_bytes,
            "required_bytes": self.required_bytes,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "breakdown": self.breakdown,
            "phases": self.phases,
            "host_bytes": self.host_bytes,
        }


def _sizes(model: ModelConfig) -> dict[str, int]:
    """The model family's sizes (models/<family>/spec.py)."""
    return model.spec.sizes


def layer_activation_bytes(model: ModelConfig, strategy: Strategy, mode: str | None = None) -> int:
    """Bytes one block keeps for backward after its forward (per micro-batch): the family's spec."""
    return model.spec.layer_activation_bytes(
        tokens=strategy.micro_batch * strategy.seq_len,
        seq_len=strategy.seq_len,
        precision=strategy.precision,
        checkpointing=mode or strategy.checkpointing,
        attention=strategy.attention,
    )


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
    with them the step time within 1% (activation_offload.json)."""
    if not (
        strategy.offload_activations
        and strategy.checkpointing == "none"
        and strategy.master_weights == "fp32"
        and strategy.precision != "fp32"
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
    grad_weight = s["V"] * s["h"] * 4
    rows = max(1, CE_CHUNK_BYTES // (s["V"] * 4))
    rows = min(T, max(256, rows // 256 * 256) if rows >= 256 else rows)
    logits = rows * s["V"] * 4
    grad_buffer = rows * s["V"] * 2 if strategy.precision == "bf16" else 0
    # autocast's bf16 copy of an fp32 output weight (bf16 parameters need none)
    weight_copy = s["V"] * s["h"] * 2 if low and strategy.master_weights == "fp32" else 0
    return grad_hidden + grad_weight, logits + grad_buffer + weight_copy


def plan(model: ModelConfig, strategy: Strategy, gpu: GPU | None = None) -> MemoryPlan:
    """Predict the per-GPU memory of a training step of `model` under `strategy` on `gpu`."""
    s = _sizes(model)
    N = strategy.world_size
    P, L = s["P"], s["L"]
    c_low = 2 if strategy.precision != "fp32" else 0  # bytes of autocast's weight copies
    T = strategy.micro_batch * strategy.seq_len

    # model states (ZeRO sharding of the flat buffers): the registry's formula, which the tests
    # hold against ZeroOptimizer's real bytes
    states = model_state_bytes(
        P,
        optimizer=strategy.optimizer,
        zero=strategy.zero,
        world_size=N,
        offload=strategy.offload,
        param_bytes=2 if strategy.master_weights == "none" else 4,
        embedding_params=model.vocab_size * model.hidden_size,
    )
    params, grads, optimizer = states["params"], states["grads"], states["optimizer_states"]
    # bytes of a gradient element: bf16 parameters (no masters) have bf16 gradients
    g = 2 if strategy.master_weights == "none" else 4

    # activations of one micro-batch at the end of its forward
    per_layer = layer_activation_bytes(model, strategy)
    c = 4 if strategy.precision == "fp32" else 2
    outside = c * T * s["h"] + 4 * T + 8 * T  # final norm input, its 1/rms, token ids
    activations = L * per_layer + outside
    offloaded = offloaded_bytes_per_layer(model, strategy)
    if offloaded:
        # in pinned CPU memory; on the GPU two layers' at most: one being copied out (or, in
        # backward, the block's own) and the next one coming back
        activations -= (L - min(L, 2)) * offloaded
    ce_saved, ce_transient = _cross_entropy(model, strategy)
    # (bf16 parameters: autocast has nothing to copy)
    weight_copies = c_low * L * s["P_matmul_layer"] if strategy.master_weights == "fp32" else 0
    # (what compiled blocks save of these copies moves too: counted in pinned memory and in
    # the copies' time, not taken off here, where no measured peak has shown it)
    copies_moved = offloaded_weight_copies_per_layer(model, strategy)
    output_grad = g * s["V"] * s["h"]
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
        grads_alive_in_forward = 4 * P if strategy.zero == 1 else grads

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
    # backward starts with the loss's saved gradients: grad_weight becomes the output projection's
    # gradient, grad_hidden flows into the final norm. Checkpointed forwards dropped their weight
    # copies when autocast exited; unchecked ones keep them until each layer's backward.
    grad_hidden = ce_saved - 4 * s["V"] * s["h"] if strategy.fused_cross_entropy else ce_saved
    kept_copies = weight_copies if strategy.checkpointing == "none" or strategy.zero == 3 else 0
    transient = _layer_backward_transient(model, strategy)
    backward_first = phase(
        grads=grads_alive_in_forward or output_grad,
        activations=activations,
        logits_loss=grad_hidden,
        temporaries=kept_copies + transient,
    )
    # ... and ends with every layer's activations and copies freed and its fp32 gradients made
    layer_grad = g * s["P_layer"] // (N if strategy.zero >= 2 else 1)
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
    # what the optimizer allocates while it steps (torch's foreach SGD adds weight decay out of
    # place: one gradient-sized temporary)
    step_temporary = 0
    if strategy.offload == "none":
        per_param = get_optimizer(strategy.optimizer).step_temporary_bytes_per_param
        step_temporary = int(per_param * grads / g)  # sized like the gradients this rank holds
    optimizer_step = phase(grads=grads, temporaries=step_temporary)
    candidates = {
        "forward": forward,
        "backward": max(backward_first, backward_last, key=lambda b: sum(b.values())),
        "optimizer": optimizer_step,
    }
    category_peaks = {
        key: max(parts[key] for parts in (forward, backward_first, backward_last, optimizer_step))
        for key in CATEGORIES
    }
    phases = {name: sum(parts.values()) for name, parts in candidates.items()}
    peak_phase = max(phases, key=phases.get)
    breakdown = candidates[peak_phase]
    peak = phases[peak_phase]

    notes = []
    host = 0
    if offloaded:
        host += L * (offloaded + copies_moved)
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
    transient = c * T * (s["h"] + 2 * s["f"]) + c * s["h"] * 2 * s["f"]
    transient = max(transient, _attention_backward_transient(model, strategy))
    if strategy.checkpointing in ("full", "selective"):
        rebuilt = layer_activation_bytes(model, strategy, mode="none") - layer_activation_bytes(
            model, strategy
        )
        transient += rebuilt + (2 * s["P_matmul_layer"] if strategy.precision != "fp32" else 0)
    return transient


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


def what_would_fit(
    model: ModelConfig, strategy: Strategy, gpu: GPU
) -> list[tuple[str, MemoryPlan]]:
    """Single changes to `strategy` that make it fit `gpu`, cheapest first (in expected speed).
    A change that the strategy cannot take (offload or ZeRO with bf16 weights, say) is left out."""
    candidates: list[tuple[str, dict]] = []
    if strategy.checkpointing != "selective":
        candidates.append(("--checkpointing selective", {"checkpointing": "selective"}))
    if strategy.checkpointing != "full":
        candidates.append(("--checkpointing full", {"checkpointing": "full"}))
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
                {"checkpointing": "full", "micro_batch": 1, "grad_accum": accum},
            )
        )
    if strategy.offload == "none":
        candidates.append(("--offload optimizer", {"offload": "optimizer"}))
    for gpus in (2, 4, 8, 16, 32, 64):
        if gpus > strategy.world_size:
            candidates.append((f"--zero 3 on {gpus} GPUs", {"zero": 3, "world_size": gpus}))
    found = []
    for label, changes in candidates:
        try:
            result = plan(model, replace(strategy, **changes), gpu)
        except ValueError:
            continue
        if result.fits:
            found.append((label, result))
    return found
