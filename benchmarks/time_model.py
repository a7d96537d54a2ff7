"""The time model against measured training steps (issue 20): a designed set of model shapes and
strategies the model is fitted on, Hugging Face models it is not (held out), adaptive
checkpointing against full, and `--recommend`'s top three on models from 0.5B to 8B.

    python benchmarks/time_model.py --parts fit held_out      # the time model's measurements
    python benchmarks/time_model.py --parts adaptive          # --checkpointing auto vs full
    python benchmarks/time_model.py --parts recommend         # --auto's choice vs its runners-up
    python benchmarks/time_model.py --parts fp32_parts        # what --fp32-parts costs

Every configuration runs through memfit's Trainer as `memfit train --model CONFIG.json` would
(random weights, the model given as a Hugging Face config.json), with random tokens, compile
off (blocks compiled change a step by 1-4%: train_step.json), `--attention auto`. Step time:
the median of `--repeat` optimizer steps after `--warmup` (wall clock, synchronized). Peak:
torch.cuda.max_memory_allocated over the timed steps. Host speed: `host_block_s`
(`measure_host_block_seconds` below) just before the timed steps. Each record keeps the
model's config and the Strategy the trainer ran (`Trainer.strategy()`), so that the time model can be refitted and
rescored offline (benchmarks/fit_time_model.py), and what the planner predicted when it ran.
A configuration that runs out of memory, or that memfit refuses, is recorded as such.

Parts:
- fit: shapes with hidden sizes 576 to 8192 (few layers where wide: the time model is per
  layer), head dims 64 and 128, GQA ratios 1 to 8, sequences 1k to 16k, vocabularies 32k to
  152k, checkpointing none / selective / full, bf16 and fp16, optimizer offload.
- host: 256 tokens a step, where the host's kernel launches set the step time: its cost per
  block by checkpointing mode.
- held_out: the configs of ten Hugging Face models (SmolLM2, Qwen2.5, Llama-3.2, TinyLlama,
  Mistral), full size, 135M to 7.6B parameters, five with 128k+ vocabularies.
- adaptive: on llama-1b and llama-3.2-3b shapes where no checkpointing does not fit an H100,
  `--checkpointing auto` against full and selective checkpointing of every block.
- fp32_parts: `--fp32-parts` on llama-1b (32k vocabulary) and Llama-3.2-1B (128k): the head,
  the last block, the first and the last, two of each, by checkpointing, against bf16 alone;
  in fp16; and with the fp32 products in TF32 (`--fp32-matmul tf32`).
- capacity: configurations planned at 95-102% of an H100's memory, under the allocator
  PYTORCH_CUDA_ALLOC_CONF names (default: expandable segments, as `memfit train` asks): what
  it reserves beyond the allocated peak there, and which run out of memory.
- recommend: `memfit plan --recommend`'s first three strategies (tokens per step 2^16) for five
  models from 0.5B to 8B, each run: is the first the fastest measured, within 10%?
- graphs: the step captured in a CUDA graph (`--cuda-graphs`) against the eager one on the
  held-out models whose host sets the pace, Llama-3.2-1B, and steps of 256 tokens.
- graph_floor: captured steps of 256 to 4096 tokens a micro-batch on the designed shapes, by
  checkpointing, with accumulation, and their kernels: what a captured step costs the GPU
  beyond its work (fitted); graph_floor_held_out: the same on Hugging Face models (scored).
- held_out_graphs: the held-out configurations eager and captured, one after the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import append_results, environment, time_calls
from rich.console import Console
from rich.table import Table
from train_step import free_memory, random_batches

from memfit.config import build_config
from memfit.functional import rotary_cos_sin
from memfit.models.config import ModelConfig, from_hf_config
from memfit.models.llama import build_model
from memfit.nn import AttentionMetadata
from memfit.planner import detect_gpu, plan, step_time
from memfit.train.engine import ConfigError, Trainer, use_expandable_segments


def llama(hidden, layers, heads, kv_heads, intermediate, vocab, *, head_dim=None, tied=False,
          model_type="llama", max_seq=32768, theta=500000.0):  # fmt: skip
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "max_position_embeddings": max_seq,
        "rope_theta": theta,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    return config


# designed shapes: (name, config)
SHAPES = {
    "h576-hd64-v49k": llama(576, 12, 9, 3, 1536, 49152, tied=True),
    "h768-hd64-v50k": llama(768, 12, 12, 12, 3072, 50257),
    "h1024-hd64-v32k": llama(1024, 12, 16, 4, 2816, 32000),
    "h1024-hd128-v50k": llama(1024, 12, 8, 8, 4096, 50257),
    "h1536-hd128-v152k": llama(1536, 10, 12, 2, 4096, 151936, tied=True),
    "h2048-hd64-v32k": llama(2048, 8, 32, 32, 5632, 32000),
    "h2048-hd128-v128k": llama(2048, 8, 16, 8, 5632, 128256),
    "h2048-hd64-v65k": llama(2048, 8, 32, 4, 8192, 65536),
    "h3072-hd128-v128k": llama(3072, 6, 24, 8, 8192, 128256),
    "h4096-hd128-v128k": llama(4096, 4, 32, 8, 14336, 128256),
    "h4096-hd128-v32k": llama(4096, 4, 32, 32, 11008, 32000),
    "h5120-hd128-v32k": llama(5120, 4, 40, 8, 13824, 32000),
    "h8192-hd128-v32k": llama(8192, 2, 64, 8, 28672, 32000),
    # SwiGLU widths of 2x and 6x the hidden size, and a Qwen2-type block (q, k, v biases)
    "h1024-hd128-f6x-v32k": llama(1024, 8, 8, 2, 6144, 32000),
    "h2048-hd128-f6x-v152k": llama(2048, 6, 16, 2, 12288, 151936, tied=True),
    "h2048-hd64-f2x-v32k": llama(2048, 6, 32, 8, 4096, 32000),
    "h3072-hd128-f6x-v128k": llama(3072, 4, 24, 8, 18432, 128256),
    "qwen2-h1280-hd128-v152k": llama(1280, 8, 10, 2, 7168, 151936, tied=True, model_type="qwen2"),
}

# Hugging Face models (their config.json's shapes), never fitted on
HF_MODELS = {
    "SmolLM2-135M": llama(576, 30, 9, 3, 1536, 49152, tied=True, max_seq=8192, theta=100000.0),
    "SmolLM2-360M": llama(960, 32, 15, 5, 2560, 49152, tied=True, max_seq=8192, theta=100000.0),
    "Qwen2.5-0.5B": llama(896, 24, 14, 2, 4864, 151936, tied=True, model_type="qwen2"),
    "Llama-3.2-1B": llama(2048, 16, 32, 8, 8192, 128256, tied=True),
    "TinyLlama-1.1B": llama(2048, 22, 32, 4, 5632, 32000, max_seq=2048, theta=10000.0),
    "Qwen2.5-1.5B": llama(1536, 28, 12, 2, 8960, 151936, tied=True, model_type="qwen2"),
    "Llama-3.2-3B": llama(3072, 28, 24, 8, 8192, 128256, tied=True),
    "Qwen2.5-3B": llama(2048, 36, 16, 2, 11008, 151936, tied=True, model_type="qwen2"),
    "Mistral-7B-v0.3": llama(4096, 32, 32, 8, 14336, 32768, model_type="mistral"),
    "Qwen2.5-7B": llama(3584, 28, 28, 4, 18944, 152064, model_type="qwen2"),
    "Llama-3.1-8B": llama(4096, 32, 32, 8, 14336, 128256),
}

# (model, seq_len, micro_batch, checkpointing, precision, other train/distributed settings)
FIT = [
    ("h576-hd64-v49k", 2048, 8, "none", "bf16", {}),
    ("h576-hd64-v49k", 4096, 8, "full", "bf16", {}),
    ("h768-hd64-v50k", 1024, 16, "none", "fp16", {}),
    ("h768-hd64-v50k", 2048, 8, "selective", "bf16", {}),
    ("h1024-hd64-v32k", 4096, 4, "none", "bf16", {}),
    ("h1024-hd64-v32k", 4096, 4, "selective", "bf16", {}),
    ("h1024-hd64-v32k", 4096, 4, "full", "bf16", {}),
    ("h1024-hd128-v50k", 16384, 1, "selective", "bf16", {}),
    ("h1024-hd128-v50k", 2048, 8, "none", "fp16", {}),
    ("h1536-hd128-v152k", 2048, 4, "none", "bf16", {}),
    ("h1536-hd128-v152k", 8192, 1, "full", "bf16", {}),
    ("h2048-hd64-v32k", 2048, 8, "none", "fp16", {}),
    ("h2048-hd64-v32k", 2048, 8, "full", "bf16", {}),
    ("h2048-hd128-v128k", 8192, 1, "none", "bf16", {}),
    ("h2048-hd128-v128k", 8192, 2, "full", "bf16", {}),
    ("h2048-hd128-v128k", 2048, 4, "none", "bf16", {"offload": "optimizer"}),
    ("h2048-hd64-v65k", 16384, 1, "full", "bf16", {}),
    ("h3072-hd128-v128k", 4096, 2, "selective", "bf16", {}),
    ("h3072-hd128-v128k", 1024, 8, "none", "bf16", {}),
    ("h4096-hd128-v128k", 2048, 4, "full", "bf16", {}),
    ("h4096-hd128-v128k", 4096, 2, "none", "bf16", {}),
    ("h4096-hd128-v32k", 1024, 8, "none", "bf16", {}),
    ("h4096-hd128-v32k", 4096, 4, "selective", "fp16", {}),
    ("h5120-hd128-v32k", 2048, 2, "none", "bf16", {}),
    ("h5120-hd128-v32k", 8192, 1, "full", "bf16", {}),
    ("h8192-hd128-v32k", 2048, 2, "full", "bf16", {}),
    ("h8192-hd128-v32k", 1024, 4, "none", "bf16", {}),
    ("h1024-hd128-f6x-v32k", 2048, 8, "none", "bf16", {}),
    ("h1024-hd128-f6x-v32k", 8192, 2, "full", "bf16", {}),
    ("h2048-hd128-f6x-v152k", 4096, 2, "full", "bf16", {}),
    ("h2048-hd128-f6x-v152k", 2048, 4, "none", "bf16", {}),
    ("h2048-hd64-f2x-v32k", 4096, 2, "none", "bf16", {}),
    ("h2048-hd64-f2x-v32k", 4096, 2, "selective", "bf16", {}),
    ("h3072-hd128-f6x-v128k", 2048, 4, "full", "bf16", {}),
    ("qwen2-h1280-hd128-v152k", 4096, 2, "none", "bf16", {}),
    ("qwen2-h1280-hd128-v152k", 8192, 1, "full", "bf16", {}),
    # the same tokens a micro-batch at sequences 1k and 16k: attention's share apart
    ("h1024-hd64-v32k", 1024, 16, "none", "bf16", {}),
    ("h1024-hd64-v32k", 16384, 1, "none", "bf16", {}),
    ("h2048-hd128-v128k", 1024, 16, "none", "bf16", {}),
    ("h2048-hd128-v128k", 16384, 1, "none", "bf16", {}),
]

HELD_OUT = [
    ("SmolLM2-135M", 2048, 8, "none", "bf16", {}),
    ("SmolLM2-360M", 2048, 8, "selective", "bf16", {}),
    ("Qwen2.5-0.5B", 4096, 2, "none", "bf16", {}),
    ("Llama-3.2-1B", 2048, 4, "none", "bf16", {}),
    ("TinyLlama-1.1B", 2048, 8, "selective", "fp16", {}),
    ("Qwen2.5-1.5B", 4096, 2, "full", "bf16", {}),
    ("Llama-3.2-3B", 2048, 2, "full", "bf16", {}),
    ("Qwen2.5-3B", 8192, 1, "full", "bf16", {}),
    ("Mistral-7B-v0.3", 4096, 1, "full", "bf16", {"optimizer": "adamw8bit", "master_weights": "none"}),
    ("Qwen2.5-7B", 4096, 1, "full", "bf16", {"optimizer": "adamw8bit", "master_weights": "none"}),
]  # fmt: skip

# few tokens a step: the host's launches, not the GPU, set the step time
HOST = [
    (name, 256, 1, mode, "bf16", {})
    for name in ("h576-hd64-v49k", "SmolLM2-135M", "h2048-hd64-v32k", "Llama-3.2-1B")
    for mode in ("none", "full", "selective")
]

ADAPTIVE = [
    ("llama-1b", 4096, 16, mode, "bf16", {}) for mode in ("auto", "full", "selective", "none")
] + [("llama-3.2-3b", 4096, 4, mode, "bf16", {}) for mode in ("auto", "full", "selective")]

RECOMMEND_MODELS = [
    "Qwen2.5-0.5B",
    "Llama-3.2-1B",
    "Llama-3.2-3B",
    "Mistral-7B-v0.3",
    "Llama-3.1-8B",
]
RECOMMEND_TOKENS_PER_STEP = 2**16

# `--fp32-parts` (issue 20, item 4): what keeping the ends of a model in fp32 costs, against the
# plan's price, with its products in fp32 and in tf32 (`--fp32-matmul`)
FP32_PARTS = [
    (name, 2048, 4, mode, "bf16", {"fp32_parts": parts})
    for name in ("llama-1b", "Llama-3.2-1B")
    for mode in ("none", "full")
    for parts in ("", "head", "last:1,head", "first:1,last:1,head", "first:2,last:2,head")
] + [
    ("llama-1b", 2048, 4, "none", "fp16", {"fp32_parts": parts})
    for parts in ("", "first:1,last:1,head")
] + [
    (name, 2048, 4, mode, "bf16", {"fp32_parts": parts, "fp32_matmul": "tf32"})
    for name in ("llama-1b", "Llama-3.2-1B")
    for mode in ("none", "full")
    for parts in ("head", "first:1,last:1,head")
]  # fmt: skip

# the caching allocator at the GPU's capacity (issue 20, item 5): configurations whose planned
# allocated peak is 95% to 102% of an H100's memory, each run (or out of memory), under the
# allocator the run's PYTORCH_CUDA_ALLOC_CONF names: how much it reserves beyond the allocated
# peak there, which the planner's slack must cover
CAPACITY = (
    [("llama-3.2-3b", seq, 4, "none", "bf16", {}) for seq in (3392, 3520, 3648, 3776, 3904)]
    + [("llama-3.2-3b", seq, 8, "selective", "bf16", {}) for seq in (10752, 11264, 11648, 11904)]
    + [("llama-1b", seq, 100, "full", "bf16", {}) for seq in (4248, 4408, 4504, 4568)]
)

# compiled blocks (what `memfit train` runs on CUDA without checkpointing): the host's launches
# per block, and the smallest held-out models as `memfit train` runs them
COMPILED = [
    (name, 256, 1, "none", "bf16", {"compile": "on"})
    for name in ("h576-hd64-v49k", "SmolLM2-135M", "h2048-hd64-v32k", "Llama-3.2-1B")
] + [
    ("SmolLM2-135M", 2048, 8, "none", "bf16", {"compile": "on"}),
    ("Qwen2.5-0.5B", 4096, 2, "none", "bf16", {"compile": "on"}),
    ("Llama-3.2-1B", 2048, 4, "none", "bf16", {"compile": "on"}),
]

# the step captured in a CUDA graph (`--cuda-graphs`, memfit.train.graphs) against the eager
# step, each configuration eager then captured on the same machine: the held-out models whose
# host sets the pace, one whose GPU does, and steps of 256 tokens
GRAPHS = [
    (name, seq_len, micro_batch, mode, "bf16", settings)
    for name, seq_len, micro_batch, mode in [
        ("SmolLM2-135M", 2048, 8, "none"),
        ("SmolLM2-360M", 2048, 8, "selective"),
        ("Qwen2.5-0.5B", 4096, 2, "none"),
        ("Llama-3.2-1B", 2048, 4, "none"),
        ("SmolLM2-135M", 256, 1, "none"),
        ("Llama-3.2-1B", 256, 1, "full"),
    ]
    for settings in ({}, {"cuda_graphs": True})
]

# captured steps from 256 to 4096 tokens a micro-batch (`--cuda-graphs`), where the GPU's own
# per-kernel costs, not the host, set the pace of small steps: fitted on the designed shapes,
# scored on Hugging Face models (graph_floor_held_out)
GRAPH_FLOOR = [
    (name, seq_len, micro_batch, mode, "bf16", {"cuda_graphs": True, **accum})
    for name in ("h576-hd64-v49k", "h1024-hd64-v32k", "h2048-hd64-v32k", "h3072-hd128-v128k")
    for seq_len, micro_batch, mode, accum in [
        (256, 1, "none", {}),
        (256, 1, "full", {}),
        (256, 1, "selective", {}),
        (256, 1, "none", {"grad_accum": 4}),
        (1024, 1, "none", {}),
        (1024, 1, "full", {}),
        (1024, 1, "selective", {}),
        (2048, 2, "none", {}),
    ]
]
GRAPH_FLOOR_HELD_OUT = [
    (name, seq_len, micro_batch, mode, "bf16", {"cuda_graphs": True})
    for name in ("SmolLM2-135M", "SmolLM2-360M", "Qwen2.5-0.5B", "TinyLlama-1.1B", "Llama-3.2-1B")
    for seq_len, micro_batch, mode in [(256, 1, "none"), (1024, 1, "full"), (2048, 2, "selective")]
]
# the held-out configurations eager and, where the engine can capture them, captured: the time
# model on the step `--auto` would run (it captures where that is 5% faster)
HELD_OUT_GRAPHS = [
    (name, seq_len, micro_batch, mode, precision, {**settings, **graphed})
    for name, seq_len, micro_batch, mode, precision, settings in HELD_OUT
    for graphed in ({}, {"cuda_graphs": True})
]

DISTRIBUTED_KEYS = ("zero", "offload")


def measure_host_block_seconds(device: str = "cuda", rounds: int = 9, repeat: int = 8) -> float:
    """This machine's host speed: the seconds one eager forward and backward of a small memfit
    block (width 256, 64 tokens, bf16 autocast) takes, wall clock: the median over `rounds` of
    the mean of `repeat` calls, after a warm-up. Its GPU work is a few microseconds a kernel,
    so the host's Python, dispatch and launches set it: the same work, per operation, as a
    training step's eager blocks. The measurement takes about 0.4 s. (Recorded beside each
    configuration; not a predictor: on the lent H100s it moved 2.7-5.1 ms within one machine,
    as the host-bound steps themselves moved up to 2x between repeats.)"""

    config = ModelConfig(
        vocab_size=256, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2,
        intermediate_size=704, max_seq_len=64,
    )  # fmt: skip
    block = build_model(config, device=device, seed=0).layers[0]
    x = torch.randn(1, 64, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    metadata = AttentionMetadata.causal(64, device)
    cos, sin = rotary_cos_sin(metadata.positions, 64, config.rope_theta, device=device)

    def once() -> None:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            y = block(x, cos, sin, metadata, None)
        y.float().sum().backward()

    def synchronize() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(5):
        once()
    synchronize()
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            once()
        synchronize()
        means.append((time.perf_counter() - start) / repeat)
    return sorted(means)[rounds // 2]


def count_kernels(step) -> int | None:
    """The CUDA kernels one call of `step` runs (torch.profiler; a replayed graph's kernels are
    reported one by one), or None where the profiler cannot tell."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    except Exception:  # (a profiler that cannot trace the replay: no count, not a failed run)
        return None
    kernels = [n for n in names if not n.startswith(("Memcpy", "Memset"))]
    return len(kernels) or None


def model_spec(name: str, folder: Path) -> tuple[str, dict | None]:
    """The --model argument for `name` (a preset, or a config.json written to `folder`) and the
    Hugging Face config it stands for."""
    config = SHAPES.get(name) or HF_MODELS.get(name)
    if config is None:
        return name, None
    path = folder / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**config, "_name_or_path": name}))
    return str(path), config


def measure(name, seq_len, micro_batch, checkpointing, precision, settings, *, folder, warmup,
            repeat, grad_accum=1, checkpoint_blocks=None, kernels=False) -> dict:  # fmt: skip
    """One configuration's record: what it is, what the planner predicted, what it measured
    (kernels: and the CUDA kernels of one more step, `count_kernels`)."""
    free_memory()
    spec, hf = model_spec(name, folder)
    train = {
        "micro_batch": micro_batch, "grad_accum": grad_accum, "checkpointing": checkpointing,
        "checkpoint_blocks": checkpoint_blocks, "precision": precision, "lr": 1e-5,
        "steps": warmup + repeat + 1,
        **{k: v for k, v in settings.items() if k not in (*DISTRIBUTED_KEYS, "compile")},
    }  # fmt: skip
    distributed = {k: v for k, v in settings.items() if k in DISTRIBUTED_KEYS}
    record = {
        "model": name,
        "hf_config": hf,
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "grad_accum": grad_accum,
        "checkpointing": checkpointing,
        "precision": precision,
        "settings": settings,
    }
    trainer = None
    with tempfile.TemporaryDirectory() as out:
        try:
            config = build_config(
                flags={
                    "model": {"name": spec, "compile": settings.get("compile", "off")},
                    "data": {"seq_len": seq_len},
                    "train": train,
                    "distributed": distributed,
                    "checkpoint": {"out": out},
                }
            )
            trainer = Trainer(config)
            strategy = trainer.strategy()
            model = trainer.model_config
            gpu = detect_gpu()
            predicted = step_time(model, strategy, gpu)
            planned = plan(model, strategy, gpu)
            record.update(
                strategy=_strategy_json(strategy),
                params=model.num_params,
                predicted_step_s=predicted.total_s,
                predicted_parts={
                    k: v for k, v in dataclasses.asdict(predicted).items() if k.endswith("_s")
                },
                predicted_peak_bytes=planned.peak_bytes,
                predicted_fits=planned.fits,
            )
            trainer.batches = random_batches(model.vocab_size, micro_batch, 0, seq_len)
            trainer.train_step()  # (the optimizer's states are made in the first step)
            record["host_block_s"] = measure_host_block_seconds()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = time_calls(trainer.train_step, warmup=warmup, repeat=repeat, clock="wall")
            step_s = statistics.median(times)
            tokens = micro_batch * seq_len * grad_accum
            record.update(
                times_s=times,
                step_s=step_s,
                tokens_per_s=tokens / step_s,
                peak_bytes=torch.cuda.max_memory_allocated(),
                # what the caching allocator held at most: the peak and what it cannot hand out
                peak_reserved_bytes=torch.cuda.max_memory_reserved(),
                time_error=predicted.total_s / step_s - 1,
                peak_error=planned.peak_bytes / torch.cuda.max_memory_allocated() - 1,
            )
            if kernels:
                record["kernels"] = count_kernels(trainer.train_step)
        except torch.OutOfMemoryError as error:
            record["error"] = "out of memory: " + str(error).strip().splitlines()[0][:200]
        except (ConfigError, ValueError) as error:
            record["error"] = f"refused: {str(error)[:300]}"
        finally:
            trainer = None  # noqa: F841 - free the model before the next configuration
            free_memory()
            # (what the configuration left allocated: 0 unless something outlives its trainer)
            record["allocated_after_bytes"] = torch.cuda.memory_allocated()
    return record


def _strategy_json(strategy) -> dict:
    out = dataclasses.asdict(strategy)
    out["teacher"] = None
    out["lora_targets"] = list(strategy.lora_targets)
    return out


def run_part(part: str, configs: list, args, folder: Path, console: Console) -> list[dict]:
    records = []
    for name, seq_len, micro_batch, checkpointing, precision, settings in configs:
        described = f"{name} seq {seq_len} mb {micro_batch} {checkpointing} {precision} {settings}"
        if args.match and not any(m in described for m in args.match):
            continue
        record = measure(
            name, seq_len, micro_batch, checkpointing, precision, settings, folder=folder,
            warmup=args.warmup, repeat=args.repeat, grad_accum=settings.get("grad_accum", 1),
            kernels=part in ("graphs", "graph_floor", "graph_floor_held_out"),
        )  # fmt: skip
        record["part"] = part
        records.append(record)
        _print(console, record)
        _save_partial(args, records)
    return records


def recommend_part(args, folder: Path, console: Console) -> list[dict]:
    """For each model: rank_strategies' first three at RECOMMEND_TOKENS_PER_STEP, each run."""
    from memfit.planner.search import rank_strategies

    gpu = detect_gpu()
    records = []
    for name in RECOMMEND_MODELS:
        if args.match and not any(m in name for m in args.match):
            continue
        spec, _ = model_spec(name, folder)
        model = from_hf_config(spec) if name in HF_MODELS else None
        ranked = rank_strategies(
            model, gpu, seq_len=2048, tokens_per_step=RECOMMEND_TOKENS_PER_STEP, limit=3
        )
        for place, r in enumerate(ranked):
            s = r.strategy
            settings = {"optimizer": s.optimizer, "master_weights": s.master_weights}
            settings.update(zero=s.zero, offload=s.offload)
            if s.offload_activations:
                settings["offload_activations"] = True
            record = measure(
                name, s.seq_len, s.micro_batch, s.checkpointing, s.precision, settings,
                folder=folder, warmup=0, repeat=2, grad_accum=s.grad_accum,
                checkpoint_blocks=s.checkpoint_blocks,
            )  # fmt: skip
            record.update(part="recommend", place=place + 1, listed=s.describe())
            record["listed_tokens_per_s"] = r.time.tokens_per_s
            records.append(record)
            _print(console, record)
            _save_partial(args, records)
    return records


def _print(console: Console, r: dict) -> None:
    what = (
        f"{r['part'] if 'part' in r else ''} {r['model']} seq {r['seq_len']} mb {r['micro_batch']}"
        f" x{r['grad_accum']} {r['checkpointing']} {r['precision']} {r['settings']}"
    )
    if "error" in r:
        console.print(f"{what}: {r['error']}", highlight=False, markup=False)
        return
    console.print(
        f"{what}: step {r['step_s'] * 1e3:.1f} ms (predicted {r['predicted_step_s'] * 1e3:.1f}, "
        f"{r['time_error']:+.1%}), {r['tokens_per_s']:,.0f} tok/s, peak "
        f"{r['peak_bytes'] / 2**30:.2f} GiB (predicted {r['predicted_peak_bytes'] / 2**30:.2f}, "
        f"{r['peak_error']:+.1%})",
        highlight=False,
        markup=False,
    )


def _save_partial(args, records: list[dict]) -> None:
    """What has been measured so far, in case the run is cut off."""
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "time_model.partial.json").write_text(json.dumps(records, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--parts", nargs="+", default=["fit", "held_out"],
        choices=[
            "fit", "host", "held_out", "adaptive", "recommend", "fp32_parts", "capacity",
            "compiled", "graphs", "graph_floor", "graph_floor_held_out", "held_out_graphs",
        ],
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--match", nargs="*", help="only configurations naming one of these")
    parser.add_argument("--out", help="a folder for the results (default benchmarks/results)")
    args = parser.parse_args()
    use_expandable_segments()  # (as `memfit train` asks, before anything starts CUDA)
    if detect_gpu() is None:
        raise SystemExit("benchmarks/time_model.py needs a CUDA GPU of the planner's catalog")
    console = Console(width=200)
    records: list[dict] = []
    # the host's speed (measure_host_block_seconds) before and after each part
    host_block_s = [measure_host_block_seconds()]
    console.print(f"host: {host_block_s[0] * 1e3:.2f} ms an eager block's forward and backward")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        parts = {
            "fit": FIT, "host": HOST, "held_out": HELD_OUT, "adaptive": ADAPTIVE,
            "fp32_parts": FP32_PARTS, "capacity": CAPACITY, "compiled": COMPILED,
            "graphs": GRAPHS, "graph_floor": GRAPH_FLOOR,
            "graph_floor_held_out": GRAPH_FLOOR_HELD_OUT, "held_out_graphs": HELD_OUT_GRAPHS,
        }  # fmt: skip
        for part in args.parts:
            if part == "recommend":
                records += recommend_part(args, folder, console)
            else:
                records += run_part(part, parts[part], args, folder, console)
            host_block_s.append(measure_host_block_seconds())
            _save_partial(args, records)
    run = {
        "benchmark": "time_model",
        "env": {
            **environment(),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "host_block_s": host_block_s,
        },
        "gpu_capacity_bytes": torch.cuda.get_device_properties(0).total_memory,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "records": records,
    }
    print("wrote", append_results("time_model", run, args.out))
    table = Table(title=f"time model on {run['env'].get('gpu')}")
    for column in ("part", "model", "strategy", "step ms", "predicted", "error", "peak error"):
        table.add_column(column)
    for r in records:
        if "error" in r:
            table.add_row(r["part"], r["model"], "", r["error"][:40], "", "", "")
            continue
        table.add_row(
            r["part"], r["model"],
            f"seq {r['seq_len']} mb {r['micro_batch']} x{r['grad_accum']} {r['checkpointing']}",
            f"{r['step_s'] * 1e3:.1f}", f"{r['predicted_step_s'] * 1e3:.1f}",
            f"{r['time_error']:+.1%}", f"{r['peak_error']:+.1%}",
        )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
