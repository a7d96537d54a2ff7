"""The serving memory model: what one GPU holds while the engine serves a model (weights, one
step's transient memory, CUDA graphs, the runtime) and the paged KV cache pool that fills the rest
(Kwon et al. 2023, "vLLM", section 4: vLLM sizes the pool after a profiling step, from
`gpu_memory_utilization`; memfit predicts that step instead of running it).

Notation as in planner/memory.py: L layers, h hidden, q = heads * head_dim, kv = kv_heads *
head_dim, f the SwiGLU width, V the vocabulary, d head_dim, c bytes per element of the model's
dtype (2 for bf16/fp16, 4 for fp32), T tokens of a step, R sequences of a step (logits rows).

Weights: c * P, every parameter in the dtype (tied embeddings count once).

KV cache (inference/paged_cache.py): keys and values of every layer, heads_kv heads each, in the
dtype:
    per token   2 * L * kv_heads * d * c        (llama-3-8b in bf16: 128 KiB)
    per block   block_size * per token          (PagedKVCache.bytes_per_block)
The cache allocates one block beyond those it hands out (its scratch block, where the padding
rows of captured decode steps write).

One step (inference/engine.py -> paged.py -> models/llama/model.py under inference_mode: nothing
is saved for backward, so a tensor lives only while Python holds it) runs at most
T = max(max_step_tokens, max_running) tokens (each running sequence decodes one token even when
the budget is spent) of at most R = max_running sequences. Through the forward its inputs are
alive: token ids, positions, slots and each token's sequence (4 x 8T), the logit indices (8R),
the block table (4 R W, W = blocks of the longest sequence), sequence lengths and starts
(4R + 4(R + 1)), and RoPE's fp32 cos and sin (2 x 4Td). On top of them, in the dtype:
  - attention, at the output projection: the block input and its norm (2Th), the fused qkv
    output (T(q + 2kv): `qkv` holds it until the attention returns), v's contiguous copy (T kv),
    q and k after RoPE (T(q + kv)), the attention output (Tq) and the projection's output (Th):
        c * T * (3h + 3q + 4kv)
  - MLP: the block input (held by the caller), x after attention and its norm (3Th), gate_up
    (2Tf) and the SwiGLU output (Tf) while swiglu runs; gate_up is freed before the down
    projection adds Th:
        c * T * max(3h + 3f, 4h + f)
  - the last hidden state and its rows at the logit indices: c * (T + R) * h;
  - the logits: the final norm's output and the logits, c * R * (h + V) (the norm itself, its
    input and output and fp32 1/rms, 2cRh + 4R, is smaller).
The forward's peak is the largest of these. Then only the logits stay, and the sampler adds its
own buffers: greedy rows take one argmax (8R); rows sampled with top-p (`generate.sample`) peak in
its sort, which holds the fp32 logits divided by the temperature, the sorted values with their
int64 order, and its own temporaries: 4 + 12 + 20 = 36 bytes per logit (measured; without top-p
12), so the sampler holds max(8R, 36 * S * V) beside the logits, S the rows sampled at once (by
default all R, a batched sampler; an engine drawing rows one by one through generate.sample has
S = 1).
Allocated at once, the step peaks at max(forward, c * R * V + sampler). The caching allocator
keeps, though, the segments of both phases: the sampler's (S, V) fp32 buffers do not fit in the
forward's freed blocks, so the memory the step holds is forward + sampler (measured below).

Attention kernels: the plan assumes memfit's Triton paged kernels (ops/attention/paged.py), which
allocate their output and, for a decode step split over the context, fp32 partials of under a
megabyte. The plain-PyTorch reference (`functional._paged_reference`, where Triton does not run)
gathers every token's whole context, 2 * c * T * (W * block_size) * kv bytes per layer: 32 GiB
for a step of 2048 tokens over 4096-token contexts of llama-3-8b. It is for tests.

CUDA graphs (inference/cuda_graphs.py): decode steps captured at the bucketed batch sizes B_1 >
B_2 > ... (default 1, 2, 4, 8, then the multiples of 16 below max_running, and max_running), in
one shared memory pool, largest first, each graph keeping its logits (c * B_j * V). Capturing
graph k needs the logits of the graphs before it and its own forward (the phases above at
T = R = B_k, without the host-built inputs), so
    pool = max_k (sum_{j < k} c * B_j * V + forward_k)
plus the static input buffers of the largest batch, one cuBLAS workspace for the warm-up stream
and one for the capture stream (PyTorch keys workspaces by handle and stream), and the driver's
memory for the captured graphs, outside the allocator (CUDA_GRAPHS_DRIVER_BYTES).

The runtime:
  - one cuBLAS workspace (32 MiB on Hopper) for the engine's thread (the training plan counts
    two: the forward's thread and the autograd engine's);
  - allocator slack: 5% (planner/memory.py's FRAGMENTATION) of the step's and the graphs'
    allocator memory, the caching allocator's segments around tensors that come and go; the
    weights and the KV pool are long-lived tensors allocated once and get none;
  - the CUDA context, CUDA_CONTEXT_BYTES of planner/memory.py (600 MiB), and the device code of
    the kernels a step loads, KERNEL_MODULES_BYTES.

The pool: budget = memory_fraction * GPU memory, available = budget - everything above, and
    pool = floor(available / per block) * per block
which hands out one block less (the scratch block): pool / per block - 1 blocks of block_size
tokens, floor(blocks / ceil(seq_len / block_size)) sequences of seq_len tokens at once. The plan
fits when one whole sequence of seq_len tokens does.

Checked on an H100 (torch 2.11, CUDA 13, driver 580): a step of 2048 tokens and 256 logit rows
(255 decodes and a prefill chunk) of llama-3-8b, llama-1b and qwen2.5-7b shapes allocated the
planned forward peak to within 512 bytes; a decode step of 256 to within 0.4 MB (the allocator
hands out a reused block whole when less than 1 MiB of it would remain); sampling 256 rows with
top-k and top-p 36.06 bytes per logit at V = 128256 and 36.00 at V = 32000; the 20 graphs of
llama-3-8b's buckets up to 256 allocated 1.0% and reserved 4.3% more than planned. Serving
llama-3-8b whole with the pool sized by this plan (seq_len 4096, graphs up to 256, a mixed step
of 2048 tokens, 256 rows sampled with top-p, decodes replayed), the GPU's memory in use peaked
19 MB (0.02%) over the budget: the allocator's reserved memory within 0.4 MB of the plan, the
memory outside it 20 MB over (the CUDA context took 649 MB, CUDA_CONTEXT_BYTES allows 629).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.models.config import ModelConfig
from memfit.planner.hardware import GPU, GPUS, GiB, get_gpu
from memfit.planner.memory import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION,
    block_linears,
    frozen_model_bytes,
)

__all__ = [
    "CUDA_GRAPHS_DRIVER_BYTES",
    "ELEMENT_BYTES",
    "KERNEL_MODULES_BYTES",
    "SAMPLING_BYTES_PER_LOGIT",
    "SCRATCH_BLOCKS",
    "ServePlan",
    "cuda_graph_pool_bytes",
    "default_cuda_graph_batch_sizes",
    "dtype_name",
    "kv_bytes_per_token",
    "kv_pool_bytes",
    "plan_serve",
    "serve_fixes",
    "step_inputs_bytes",
    "step_memory",
    "weight_bytes",
    "with_options",
]

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_DTYPE_NAMES = {
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
}

# One cuBLAS handle's workspace on Hopper (32 MiB); the training plan's figure is two handles.
CUBLAS_WORKSPACE_PER_HANDLE = CUBLAS_WORKSPACE_BYTES // 2
# PagedKVCache allocates one block beyond those it hands out: the scratch block, where the padding
# rows of a captured decode step write (inference/cuda_graphs.py).
SCRATCH_BLOCKS = 1
# The most bytes per logit the sampler holds at once: top-p's sort (measured on an H100).
SAMPLING_BYTES_PER_LOGIT = 36
# Device code of the kernels a step loads on first use (Triton's norm, RoPE, SwiGLU and paged
# attention, torch's sampling kernels): 73.4 MB for a llama-3-8b step on an H100 (torch 2.11,
# CUDA 13, driver 580), outside the caching allocator.
KERNEL_MODULES_BYTES = 70 * 2**20
# What capturing the decode graphs takes outside the allocator: 100.7 MB for llama-3-8b's 20
# graphs on that H100, and about as much for 8 or 20 graphs of a one-layer model.
CUDA_GRAPHS_DRIVER_BYTES = 96 * 2**20


def dtype_name(dtype: Any) -> str:
    """'bf16', 'fp16' or 'fp32' for such a name or a torch dtype (str(torch.bfloat16) is
    'torch.bfloat16'); ValueError naming the known ones otherwise."""
    name = str(dtype)
    name = _DTYPE_NAMES.get(name, name)
    if name not in ELEMENT_BYTES:
        raise ValueError(
            f"serving dtype {dtype!r} is not one memfit plans for; use one of "
            f"{', '.join(ELEMENT_BYTES)} (or the torch dtypes bfloat16, float16, float32)"
        )
    return name


def weight_bytes(config: ModelConfig, dtype: Any = "bf16") -> int:
    """Every parameter in the dtype: c * P (tied embeddings counted once)."""
    return ELEMENT_BYTES[dtype_name(dtype)] * config.spec.num_params


KV_CACHE_DTYPES = ("auto", "fp8", "int8")
INT8_TOKEN_SCALE_BYTES = 2  # (memfit.inference.paged_cache.TOKEN_SCALE_BYTES)
"""The KV cache in the model's dtype, or in one byte an element, fp8 e4m3 or int8
(PagedKVCache(kv_dtype=...))."""


def kv_bytes_per_token(
    config: ModelConfig, dtype: Any = "bf16", kv_cache_dtype: str = "auto"
) -> int:
    """Keys and values of every layer for one token: 2 * L * kv_heads * head_dim * c (c = 1 for
    an fp8 or int8 cache; int8 adds each token's fp16 scale per head, 2 * L * kv_heads * 2;
    the per-head scales and key offsets, L * kv_heads * (head_dim + 2) fp32, are
    not counted: a few KiB)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    element = 1 if kv_cache_dtype != "auto" else ELEMENT_BYTES[dtype_name(dtype)]
    per_head = config.head_dim * element + (
        INT8_TOKEN_SCALE_BYTES if kv_cache_dtype == "int8" else 0
    )
    return 2 * config.num_layers * config.num_kv_heads * per_head


def default_cuda_graph_batch_sizes(max_running: int) -> tuple[int, ...]:
    """The engine's buckets (inference/cuda_graphs.py): 1, 2, 4, 8, then the multiples of 16
    below max_running, and max_running itself."""
    sizes = {size for size in (1, 2, 4, 8) if size < max_running}
    sizes |= set(range(16, max_running, 16))
    return tuple(sorted(sizes | {max_running}))


def step_inputs_bytes(tokens: int, rows: int, table_width: int) -> int:
    """A step's inputs, built on the host and copied over: token ids, positions, cache slots and
    each token's sequence (4 x 8T), the logit indices (8R), the block table (4 R W), the
    sequence lengths (4R) and where each sequence starts (4(R + 1))."""
    return 4 * 8 * tokens + 8 * rows + 4 * rows * table_width + 4 * rows + 4 * (rows + 1)


def step_memory(
    config: ModelConfig,
    *,
    tokens: int,
    rows: int,
    dtype: Any = "bf16",
    table_width: int = 1,
    sampled_rows: int | None = None,
    sample: bool = True,
) -> dict[str, int]:
    """Bytes alive at the high point of each phase of one engine step (module docstring): T
    `tokens` of R `rows` sequences (rows <= tokens), the block table `table_width` blocks wide,
    `sampled_rows` rows through the sampler at once (None: all R; 0: greedy only).

    Keys: "inputs" (`step_inputs_bytes`), the forward's phases "attention", "mlp",
    "last_hidden", "logits" (each with the inputs and RoPE's fp32 cos and sin, 2 x 4Td), and
    "forward", their largest; with `sample`, "sampling" (the logits and the sampler's buffers);
    "peak", what the step allocates at most (torch.cuda.max_memory_allocated), and "held", what
    the caching allocator holds for it: the forward's peak plus the sampler's buffers."""
    if not 1 <= rows <= tokens:
        raise ValueError(f"a step needs 1 <= rows <= tokens, got rows={rows}, tokens={tokens}")
    s = config.spec.sizes
    c = ELEMENT_BYTES[dtype_name(dtype)]
    T, R = tokens, rows
    h, q, kv, f, V = s["h"], s["q"], s["kv"], s["f"], s["V"]
    inputs = step_inputs_bytes(T, R, table_width)
    alive = inputs + 2 * 4 * T * config.head_dim  # and RoPE's cos and sin
    phases = {
        "inputs": inputs,
        "attention": alive + c * T * (3 * h + 3 * q + 4 * kv),
        "mlp": alive + c * T * max(3 * h + 3 * f, 4 * h + f),
        "last_hidden": alive + c * (T + R) * h,
        "logits": alive + max(2 * c * R * h + 4 * R, c * R * (h + V)),
    }
    phases["forward"] = max(phases.values())
    if sample:
        S = R if sampled_rows is None else sampled_rows
        if not 0 <= S <= R:
            raise ValueError(f"sampled_rows must be within 0..rows={R}, got {sampled_rows}")
        sampler = max(8 * R, SAMPLING_BYTES_PER_LOGIT * S * V)
        phases["sampling"] = c * R * V + sampler
        phases["peak"] = max(phases["forward"], phases["sampling"])
        phases["held"] = phases["forward"] + sampler
    else:
        phases["peak"] = phases["held"] = phases["forward"]
    return phases


def cuda_graph_pool_bytes(
    config: ModelConfig, batch_sizes: Sequence[int], *, dtype: Any = "bf16", table_width: int = 1
) -> int:
    """Allocator memory of the decode steps captured at `batch_sizes` (inference/cuda_graphs.py):
    the static input buffers of the largest size B (`step_inputs_bytes` without logit indices),
    the cuBLAS workspaces of the warm-up and the capture stream, and the graphs' shared pool.
    Captured largest first, graph k's capture needs the logits the earlier graphs keep
    (c * B_j * V each) and its own forward (the step's forward without the host-built inputs):
        pool = max_k (sum_{j < k} c * B_j * V + forward_k).
    0 for no sizes. The driver's memory for the graphs (CUDA_GRAPHS_DRIVER_BYTES) is apart."""
    sizes = sorted(set(batch_sizes), reverse=True)
    if not sizes:
        return 0
    c = ELEMENT_BYTES[dtype_name(dtype)]
    largest = sizes[0]
    static = step_inputs_bytes(largest, largest, table_width) - 8 * largest
    pool = kept = 0
    for size in sizes:
        forward = step_memory(
            config, tokens=size, rows=size, dtype=dtype, table_width=table_width, sample=False
        )
        pool = max(pool, kept + forward["forward"] - forward["inputs"])
        kept += c * size * config.vocab_size
    return static + 2 * CUBLAS_WORKSPACE_PER_HANDLE + pool


@dataclass(frozen=True, kw_only=True)
class ServePlan:
    """Predicted memory of one GPU serving `model`, and the KV cache pool that fits (bytes)."""

    model: ModelConfig
    gpu: str | None
    """The catalog's name, None when only the memory was given."""
    gpu_memory_bytes: int
    dtype: str
    block_size: int
    memory_fraction: float
    max_step_tokens: int
    max_running: int
    seq_len: int
    cuda_graph_batch_sizes: tuple[int, ...]
    sampled_rows: int | None

    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    step_tokens: int
    """T of the largest step: max(max_step_tokens, max_running)."""
    step_rows: int
    step_phases: dict[str, int]
    """`step_memory` of the largest step: each phase's bytes at its high point."""
    step_peak_bytes: int
    """What the largest step allocates at most (torch.cuda.max_memory_allocated over it)."""
    step_held_bytes: int
    """What the caching allocator holds for steps: the forward's peak and the sampler's buffers."""
    workspace_bytes: int
    cuda_graph_pool_bytes: int
    """`cuda_graph_pool_bytes`: the graphs' allocator memory (0 without graphs)."""
    cuda_graph_driver_bytes: int
    allocator_slack_bytes: int
    cuda_context_bytes: int
    kernel_modules_bytes: int

    budget_bytes: int
    """memory_fraction * gpu_memory_bytes."""
    available_bytes: int
    """What the budget leaves for the KV cache (negative when it does not hold the rest)."""
    num_blocks: int
    """Blocks the pool hands out to sequences (the scratch block not counted)."""
    kv_pool_bytes: int
    """The pool's memory: num_blocks + SCRATCH_BLOCKS blocks (what the engine gives
    `PagedKVCache.from_budget`); 0 when not one block is left for sequences."""
    notes: list[str] = field(default_factory=list)
    kv_cache_dtype: str = "auto"
    quantize: str = "none"

    @property
    def cuda_graph_bytes(self) -> int:
        """The graphs' allocator memory and the driver's."""
        return self.cuda_graph_pool_bytes + self.cuda_graph_driver_bytes

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_sequence(self) -> int:
        return -(-self.seq_len // self.block_size)

    @property
    def max_sequences(self) -> int:
        """Sequences of seq_len tokens the pool holds at once."""
        return self.num_blocks // self.blocks_per_sequence

    @property
    def fits(self) -> bool:
        """One whole sequence of seq_len tokens fits in the pool."""
        return self.max_sequences >= 1

    @property
    def shortfall_bytes(self) -> int:
        """Memory the budget lacks for one sequence of seq_len tokens (0 when it fits)."""
        need = (self.blocks_per_sequence + SCRATCH_BLOCKS) * self.kv_bytes_per_block
        return max(0, need - self.available_bytes)

    @property
    def breakdown(self) -> dict[str, int]:
        """Where the budget goes; the values add up to budget_bytes."""
        parts = {
            "weights": self.weights_bytes,
            "kv_cache": self.kv_pool_bytes,
            "step_activations": self.step_held_bytes,
            "cublas_workspace": self.workspace_bytes,
            "cuda_graphs": self.cuda_graph_bytes,
            "allocator_slack": self.allocator_slack_bytes,
            "cuda_context": self.cuda_context_bytes,
            "kernel_modules": self.kernel_modules_bytes,
        }
        parts["unused"] = self.budget_bytes - sum(parts.values())
        return parts

    def describe(self) -> str:
        graphs = self.cuda_graph_batch_sizes
        return ", ".join(
            [
                self.dtype,
                f"{self.memory_fraction:.0%} of {self.gpu_memory_bytes / GiB:.2f} GiB",
                f"blocks of {self.block_size}",
                f"steps of {self.max_step_tokens} tokens",
                f"up to {self.max_running} sequences",
                f"CUDA graphs up to batch {max(graphs)}" if graphs else "no CUDA graphs",
            ]
        )

    def error_message(self) -> str:
        """Why the plan does not fit, with the numbers and the single changes that would."""
        gpu = self.gpu or f"a GPU of {gib(self.gpu_memory_bytes)}"
        need = (self.blocks_per_sequence + SCRATCH_BLOCKS) * self.kv_bytes_per_block
        runtime = (
            self.workspace_bytes
            + self.allocator_slack_bytes
            + self.cuda_context_bytes
            + self.kernel_modules_bytes
        )
        lines = [
            f"{self.model.name} ({self.dtype}) does not fit {gpu} for serving: "
            f"{self.memory_fraction:.2f} x {gib(self.gpu_memory_bytes)} = {gib(self.budget_bytes)} "
            f"holds the weights ({gib(self.weights_bytes)}), a step of {self.step_tokens} tokens "
            f"({gib(self.step_held_bytes)}), CUDA graphs ({gib(self.cuda_graph_bytes)}) and the "
            f"runtime ({gib(runtime)}: cuBLAS workspace, allocator slack, CUDA context, kernels), "
            f"leaving {gib(self.available_bytes)} for the KV cache; one sequence of "
            f"{self.seq_len} tokens needs {gib(need)} ({self.blocks_per_sequence} blocks of "
            f"{self.block_size} and the scratch block): {gib(self.shortfall_bytes)} short"
        ]
        fixes = serve_fixes(self)
        if fixes:
            lines.append(
                "single changes that fit: "
                + "; ".join(
                    f"{label} ({p.max_sequences} sequences of {p.seq_len})" for label, p in fixes
                )
            )
        elif self.weights_bytes > self.budget_bytes:
            lines.append(
                "the weights alone exceed the budget: a GPU with more memory, or the model split "
                "over several GPUs (tensor parallelism) or quantized weights"
            )
        return "\n".join(lines)

    def check_fits(self) -> ServePlan:
        """self when it fits; ValueError with the numbers and the fixes otherwise."""
        if not self.fits:
            raise ValueError(self.error_message())
        return self

    def to_json(self) -> dict:
        return {
            "model": self.model.name,
            "gpu": self.gpu,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "memory_fraction": self.memory_fraction,
            "max_step_tokens": self.max_step_tokens,
            "max_running": self.max_running,
            "seq_len": self.seq_len,
            "cuda_graph_batch_sizes": list(self.cuda_graph_batch_sizes),
            "sampled_rows": self.sampled_rows,
            "budget_bytes": self.budget_bytes,
            "breakdown": self.breakdown,
            "step": {
                "tokens": self.step_tokens,
                "rows": self.step_rows,
                "phases": self.step_phases,
                "peak_bytes": self.step_peak_bytes,
                "held_bytes": self.step_held_bytes,
            },
            "cuda_graphs": {
                "pool_bytes": self.cuda_graph_pool_bytes,
                "driver_bytes": self.cuda_graph_driver_bytes,
            },
            "kv": {
                "dtype": self.kv_cache_dtype,
                "bytes_per_token": self.kv_bytes_per_token,
                "bytes_per_block": self.kv_bytes_per_block,
                "pool_bytes": self.kv_pool_bytes,
                "num_blocks": self.num_blocks,
                "tokens": self.kv_tokens,
                "blocks_per_sequence": self.blocks_per_sequence,
                "max_sequences": self.max_sequences,
            },
            "available_bytes": self.available_bytes,
            "fits": self.fits,
            "shortfall_bytes": self.shortfall_bytes,
            "notes": self.notes,
        }


def _gpu_memory(gpu: GPU | str | int) -> tuple[str | None, int]:
    if isinstance(gpu, GPU):
        return gpu.name, gpu.memory_bytes
    if isinstance(gpu, str):
        found = get_gpu(gpu)
        return found.name, found.memory_bytes
    if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 1:
        raise ValueError(
            f"gpu must be a catalog GPU, its name ({', '.join(GPUS)}) or its total memory in "
            f"bytes (torch.cuda.mem_get_info()[1]), got {gpu!r}"
        )
    return None, gpu


def plan_serve(
    config: ModelConfig,
    gpu: GPU | str | int,
    *,
    dtype: Any = "bf16",
    block_size: int = 16,
    memory_fraction: float = 0.9,
    max_step_tokens: int = 2048,
    max_running: int = 256,
    seq_len: int | None = None,
    cuda_graph_batch_sizes: Sequence[int] | None = None,
    sampled_rows: int | None = None,
    quantize: str = "none",
    kv_cache_dtype: str = "auto",
) -> ServePlan:
    """Plan serving `config` on `gpu` (a catalog GPU, its name, or its total memory in bytes,
    e.g. torch.cuda.mem_get_info()[1]): the memory of everything but the KV cache, and the pool
    of whole blocks that fills the rest of memory_fraction of the GPU (module docstring).

    dtype: the weights' and the KV cache's ('bf16', 'fp16', 'fp32' or a torch dtype);
    max_step_tokens, max_running: the Engine's; seq_len: the sequence length to count sequences
    of (default: the model's max_seq_len; also the block table's width);
    cuda_graph_batch_sizes: the decode batch sizes captured in CUDA graphs (default
    `default_cuda_graph_batch_sizes(max_running)`; () for none, as the present Engine);
    sampled_rows: rows sampled at once (None: all of a step's rows; the present Engine: 1).
    quantize: the blocks' linear weights quantized ('int8', 'int4': memfit.nn.quant), counted as
    stored, plus the largest one dequantized in the dtype (a product of more than
    memfit.nn.quant.FUSED_MAX_ROWS rows makes that copy for cuBLAS, one layer at a time), and the
    output head in int8 (memfit.nn.quant.quantize_head, never dequantized whole).
    kv_cache_dtype: 'auto' (the KV cache in `dtype`), 'fp8' or 'int8' (one byte an element: the
    same memory holds twice the bf16 tokens).
    Never raises for a model that does not fit: see `.fits` and `.check_fits()`.
    """
    name, total = _gpu_memory(gpu)
    dtype = dtype_name(dtype)
    seq_len = config.max_seq_len if seq_len is None else seq_len
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    for key, value in (
        ("block_size", block_size),
        ("max_step_tokens", max_step_tokens),
        ("max_running", max_running),
        ("seq_len", seq_len),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if cuda_graph_batch_sizes is None:
        cuda_graph_batch_sizes = default_cuda_graph_batch_sizes(max_running)
    graph_sizes = tuple(sorted(set(cuda_graph_batch_sizes)))
    if graph_sizes and (graph_sizes[0] < 1 or graph_sizes[-1] > max_running):
        raise ValueError(
            f"cuda_graph_batch_sizes must be within 1..max_running={max_running}, got "
            f"{list(cuda_graph_batch_sizes)}"
        )

    table_width = -(-seq_len // block_size)
    step_tokens = max(max_step_tokens, max_running)
    step_rows = max_running
    phases = step_memory(
        config,
        tokens=step_tokens,
        rows=step_rows,
        dtype=dtype,
        table_width=table_width,
        sampled_rows=sampled_rows,
    )
    pool = cuda_graph_pool_bytes(config, graph_sizes, dtype=dtype, table_width=table_width)
    driver = CUDA_GRAPHS_DRIVER_BYTES if graph_sizes else 0
    slack = int(FRAGMENTATION * (phases["held"] + pool))
    weights = weight_bytes(config, dtype)
    if quantize != "none":
        largest = max(linear.in_features * linear.out_features for linear in block_linears(config))
        weights = frozen_model_bytes(config, dtype, quantize, int8_head=True)
        weights += ELEMENT_BYTES[dtype] * largest
    per_token = kv_bytes_per_token(config, dtype, kv_cache_dtype)
    per_block = per_token * block_size
    budget = int(memory_fraction * total)
    runtime = CUBLAS_WORKSPACE_PER_HANDLE + slack + CUDA_CONTEXT_BYTES + KERNEL_MODULES_BYTES
    available = budget - weights - phases["held"] - pool - driver - runtime
    num_blocks = max(0, available // per_block - SCRATCH_BLOCKS)

    c = ELEMENT_BYTES[dtype]
    gathered = (
        2 * c * step_tokens * table_width * block_size * config.num_kv_heads * config.head_dim
    )
    notes = [
        "assumes memfit's Triton paged attention (output only); the PyTorch reference backend "
        f"would gather {gib(gathered)} more per layer at this step"
    ]
    return ServePlan(
        model=config,
        gpu=name,
        gpu_memory_bytes=total,
        dtype=dtype,
        block_size=block_size,
        memory_fraction=memory_fraction,
        max_step_tokens=max_step_tokens,
        max_running=max_running,
        seq_len=seq_len,
        cuda_graph_batch_sizes=graph_sizes,
        sampled_rows=sampled_rows,
        weights_bytes=weights,
        kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_block,
        step_tokens=step_tokens,
        step_rows=step_rows,
        step_phases=phases,
        step_peak_bytes=phases["peak"],
        step_held_bytes=phases["held"],
        workspace_bytes=CUBLAS_WORKSPACE_PER_HANDLE,
        cuda_graph_pool_bytes=pool,
        cuda_graph_driver_bytes=driver,
        allocator_slack_bytes=slack,
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
        kernel_modules_bytes=KERNEL_MODULES_BYTES,
        budget_bytes=budget,
        available_bytes=available,
        num_blocks=num_blocks,
        kv_pool_bytes=(num_blocks + SCRATCH_BLOCKS) * per_block if num_blocks else 0,
        notes=notes,
        kv_cache_dtype=kv_cache_dtype,
        quantize=quantize,
    )


def kv_pool_bytes(config: ModelConfig, gpu: GPU | str | int, **options: Any) -> int:
    """The KV pool's bytes (whole blocks) that `plan_serve(config, gpu, **options)` leaves: what
    the engine gives `PagedKVCache.from_budget`. ValueError with the numbers when not one
    sequence of seq_len tokens fits."""
    return plan_serve(config, gpu, **options).check_fits().kv_pool_bytes


def serve_fixes(plan: ServePlan) -> list[tuple[str, ServePlan]]:
    """Single changes (CLI flags) that make a plan fit: a shorter --seq-len, a larger
    --memory-fraction, a smaller step, no CUDA graphs, an int8 or fp8 KV cache, or the smallest
    catalog GPU that fits."""
    candidates: list[tuple[str, dict]] = []
    if plan.num_blocks >= 1:
        candidates.append((f"--seq-len {plan.kv_tokens}", {"seq_len": plan.kv_tokens}))
    needed = plan.budget_bytes + plan.shortfall_bytes
    fraction = math.ceil(100 * needed / plan.gpu_memory_bytes) / 100
    if plan.memory_fraction < fraction <= 0.98:
        candidates.append((f"--memory-fraction {fraction:.2f}", {"memory_fraction": fraction}))
    if plan.max_step_tokens > 512:
        candidates.append(("--max-step-tokens 512", {"max_step_tokens": 512}))
    if plan.cuda_graph_batch_sizes:
        candidates.append(("--no-cuda-graphs", {"cuda_graph_batch_sizes": ()}))
    if plan.kv_cache_dtype == "auto":  # (int8 loses less quality; fp8 holds a few % more)
        candidates.append(("--kv-cache-dtype int8", {"kv_cache_dtype": "int8"}))
        candidates.append(("--kv-cache-dtype fp8", {"kv_cache_dtype": "fp8"}))
    found = []
    for label, change in candidates:
        candidate = with_options(plan, **change)
        if candidate.fits:
            found.append((label, candidate))
    for other in sorted(GPUS.values(), key=lambda g: g.memory_bytes):
        if other.memory_bytes > plan.gpu_memory_bytes:
            candidate = with_options(plan, gpu=other)
            if candidate.fits:
                found.append((f"--gpu {other.name}", candidate))
                break
    return found


def with_options(
    plan: ServePlan, *, gpu: GPU | str | int | None = None, **changes: Any
) -> ServePlan:
    """The plan redone on another `gpu` or with some of plan_serve's options changed."""
    options = {
        "dtype": plan.dtype,
        "block_size": plan.block_size,
        "memory_fraction": plan.memory_fraction,
        "max_step_tokens": plan.max_step_tokens,
        "max_running": plan.max_running,
        "seq_len": plan.seq_len,
        "cuda_graph_batch_sizes": plan.cuda_graph_batch_sizes,
        "sampled_rows": plan.sampled_rows,
        "quantize": plan.quantize,
        "kv_cache_dtype": plan.kv_cache_dtype,
    }
    gpu = gpu if gpu is not None else plan.gpu or plan.gpu_memory_bytes
    return plan_serve(plan.model, gpu, **{**options, **changes})


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
