"""memfit profile: the measured breakdown against exact tensor accounting on CPU (tiny preset),
the timeline's trace arithmetic, the table, and a GPU twin (skipped without CUDA)."""

import importlib.util
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from memfit.cli.profile import run_profile
from memfit.config import build_config
from memfit.optim import model_state_bytes
from memfit.profile import (
    CATEGORIES,
    MatplotlibMissing,
    measure_memory,
    plot_timeline,
    timeline_from_trace,
)
from memfit.train.engine import Trainer

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SEQ_LEN = 64


def tiny_config(tmp_path, name="run", **train):
    return build_config(
        flags={
            "data": {"seq_len": SEQ_LEN},
            "train": {"micro_batch": 2, "device": "cpu", "precision": "fp32", **train},
            "checkpoint": {"out": str(tmp_path / name)},
        }
    )


def measure(tmp_path, name="run", **train):
    trainer = Trainer(tiny_config(tmp_path, name, **train))
    return trainer, measure_memory(trainer, steps=1)


def matmul_weight_numel(trainer) -> int:
    """Elements of the weights autocast casts: every nn.Linear inside the blocks (the lm_head
    is cast by the loss itself, which frees its copy before returning)."""
    return sum(
        module.weight.numel()
        for module in trainer.model.layers.modules()
        if isinstance(module, torch.nn.Linear)
    )


def test_fp32_breakdown_matches_tensor_accounting(tmp_path):
    trainer, m = measure(tmp_path)
    config = trainer.model_config
    assert list(m.breakdown) == list(CATEGORIES)
    assert len(CATEGORIES) == 8
    params = 4 * config.num_params
    assert m.breakdown["params"] == params
    assert m.breakdown["grads"] == params
    assert m.breakdown["optimizer_states"] == 2 * params  # AdamW: exp_avg, exp_avg_sq
    assert m.breakdown["master_weights"] == 0
    tokens = 2 * SEQ_LEN
    hidden, vocab = config.hidden_size, config.vocab_size
    # the fused loss keeps grad_hidden (tokens x hidden) and grad_weight (vocab x hidden), fp32
    assert m.breakdown["logits_loss"] == tokens * hidden * 4 + vocab * hidden * 4
    assert m.breakdown["temporaries"] == 0  # no autocast, no weight copies
    assert m.breakdown["activations"] > 0
    # CPU: no allocator statistics
    assert m.breakdown["runtime_overhead"] == 0
    assert m.peak_allocated_bytes is None and m.peak_reserved_bytes is None
    assert m.phase_peaks == {} and m.timeline is None
    assert m.phase_reserved == {} and m.fragmentation == {}
    assert m.device == "cpu" and m.steps == 1
    assert m.total_bytes == sum(m.breakdown.values())
    # the measurement's steps trained and freed their gradients, as train_step does
    assert trainer.step == 2
    assert all(p.grad is None for p in trainer.model.parameters())


def test_activations_grow_linearly_with_micro_batch(tmp_path):
    _, small = measure(tmp_path, "mb2", micro_batch=2)
    _, large = measure(tmp_path, "mb4", micro_batch=4)
    ratio = large.breakdown["activations"] / small.breakdown["activations"]
    assert ratio == pytest.approx(2.0, rel=0.1)


def test_activations_match_the_layer_accounting(tmp_path):
    """Without checkpointing each block keeps (fp32, T tokens) 4h + 2q + 2kv + 3f elements per
    token and 1/rms of its two norms plus the attention log-sum-exp (the planner's formula); around
    the blocks the final norm's input and 1/rms and the RoPE tables. Checkpointing keeps less."""
    trainer, m = measure(tmp_path, "none")
    c = trainer.model_config
    tokens = 2 * SEQ_LEN
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = 4 * tokens * (4 * c.hidden_size + 2 * q + 2 * kv + 3 * c.intermediate_size)
    per_layer += 4 * tokens * (2 + c.num_heads)
    outside = 4 * tokens * c.hidden_size + 4 * tokens + 2 * 4 * SEQ_LEN * c.head_dim
    expected = c.num_layers * per_layer + outside
    assert m.breakdown["activations"] == pytest.approx(expected, rel=0.05)
    _, full = measure(tmp_path, "full", checkpointing="full")
    assert full.breakdown["activations"] < m.breakdown["activations"] / 5


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_bf16_temporaries_are_the_autocast_weight_copies(tmp_path, checkpointing):
    """Under bf16 autocast every block matmul's weight is cast once and cached until autocast
    exits (so checkpointing does not change it at the end of the forward); grad_hidden is bf16."""
    trainer, m = measure(tmp_path, checkpointing, precision="bf16", checkpointing=checkpointing)
    c = trainer.model_config
    assert m.breakdown["temporaries"] == 2 * matmul_weight_numel(trainer)
    tokens = 2 * SEQ_LEN
    assert (
        m.breakdown["logits_loss"] == tokens * c.hidden_size * 2 + c.vocab_size * c.hidden_size * 4
    )
    assert m.breakdown["params"] == 4 * c.num_params  # fp32 master weights, counted once
    assert m.breakdown["master_weights"] == 0
    assert m.breakdown["activations"] > 0


def test_gradient_accumulation_and_sgd(tmp_path):
    """grad_accum 2 of micro-batch 2 keeps one micro-batch's activations; SGD keeps one momentum."""
    _, single = measure(tmp_path, "single")
    trainer, m = measure(tmp_path, "accum", grad_accum=2, optimizer="sgd")
    params = 4 * trainer.model_config.num_params
    assert m.breakdown["grads"] == params
    assert m.breakdown["optimizer_states"] == params
    assert m.breakdown["activations"] == single.breakdown["activations"]
    assert m.breakdown["logits_loss"] == single.breakdown["logits_loss"]


def test_measure_memory_rejects_zero_steps(tmp_path):
    trainer = Trainer(tiny_config(tmp_path))
    with pytest.raises(ValueError, match="steps=0"):
        measure_memory(trainer, steps=0)


def test_timeline_from_trace_follows_alloc_and_free():
    trace = [
        {"action": "segment_alloc", "size": 2048},
        {"action": "alloc", "size": 512},  # forward
        {"action": "alloc", "size": 1024},
        {"action": "free_requested", "size": 512},
        {"action": "free_completed", "size": 512},  # backward
        {"action": "alloc", "size": 512},
        {"action": "free_completed", "size": 1024},  # optimizer
        {"action": "segment_free", "size": 2048},
    ]
    marks = [
        ("forward:begin", 0),
        ("forward:end", 3),
        ("backward:begin", 3),
        ("backward:end", 6),
        ("optimizer:begin", 6),
        ("optimizer:end", 8),
    ]
    tl = timeline_from_trace(trace, start_allocated=100, start_reserved=4096, marks=marks)
    assert tl.points == [(0, 100), (1, 612), (2, 1636), (3, 1124), (4, 1636), (5, 612)]
    assert tl.peak_bytes == 1636
    assert tl.reserved == [(0, 4096), (0, 6144), (5, 4096), (5, 4096)]
    assert tl.phases == [("forward", 0, 2), ("backward", 2, 4), ("optimizer", 4, 5)]
    assert not tl.truncated


def test_plot_timeline_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MatplotlibMissing, match="pip install matplotlib"):
        plot_timeline([(0, 1), (1, 2)], [], tmp_path / "t.png", "t")
    assert not (tmp_path / "t.png").exists()


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_timeline_writes_a_png(tmp_path):
    points = [(i, (i % 7) * 2**28) for i in range(50)]
    phases = [("forward", 0, 20), ("backward", 20, 45), ("optimizer", 45, 49)]
    path = plot_timeline(
        points, phases, tmp_path / "sub" / "t.png", "test", reserved=[(0, 2**31), (49, 2**31)]
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_profile_prints_the_table_beside_the_plan(tmp_path):
    console = Console(record=True, width=140)
    plans = []

    def plan_fn(trainer):
        params = 4 * trainer.model_config.num_params
        plan = SimpleNamespace(
            breakdown={category: 0 for category in CATEGORIES} | {"params": params},
            peak_bytes=10 * params,
            phases={"forward": 5 * params, "backward": 10 * params, "optimizer": 4 * params},
        )
        plans.append(plan)
        return plan

    assert run_profile(tiny_config(tmp_path), console, steps=1, plan_fn=plan_fn) == 0
    text = console.export_text()
    assert len(plans) == 1
    for label in (*CATEGORIES, "measured", "planned", "error", "peak allocated", "forward peak"):
        assert label in text
    assert "+0.0%" in text  # params: planned exactly
    assert "cpu" in text
    assert not (tmp_path / "run" / "memory_timeline.png").exists()  # CPU: no timeline


def test_run_profile_without_plan(tmp_path):
    console = Console(record=True, width=140)
    assert run_profile(tiny_config(tmp_path), console, steps=1, png=str(tmp_path / "t.png")) == 0
    text = console.export_text()
    assert "optimizer_states" in text and "planned" not in text
    assert "not written" in text


def cuda_config(tmp_path, name, checkpointing):
    return build_config(
        flags={
            "data": {"seq_len": 256},
            "train": {
                "micro_batch": 8,
                "device": "cuda",
                "precision": "bf16",
                "checkpointing": checkpointing,
            },
            "checkpoint": {"out": str(tmp_path / name)},
        }
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_profile_on_cuda(tmp_path, checkpointing):
    """On CUDA the categories add up to the peak (runtime_overhead is the remainder, so their sum
    must not overshoot it by much), the phase peaks bound the peak, the timeline reaches it, and
    `memfit profile` writes the timeline plot. checkpointing none: compiled blocks (compile auto)."""
    trainer = Trainer(cuda_config(tmp_path, "measure", checkpointing))
    m = measure_memory(trainer, steps=2)
    params = 4 * trainer.model_config.num_params
    assert m.breakdown["params"] == params
    assert m.breakdown["grads"] == params
    assert m.breakdown["optimizer_states"] == 2 * params
    assert m.breakdown["temporaries"] == 2 * matmul_weight_numel(trainer)
    assert m.breakdown["activations"] > 0
    peak = m.peak_allocated_bytes
    assert peak is not None and m.peak_reserved_bytes >= peak
    assert m.total_bytes == pytest.approx(peak, rel=0.1)
    assert set(m.phase_peaks) == {"forward", "backward", "optimizer"}
    assert max(m.phase_peaks.values()) <= peak
    # what the caching allocator holds per phase: at least what is allocated, at most its peak
    assert set(m.phase_reserved) == set(m.phase_peaks)
    for phase, reserved in m.phase_reserved.items():
        assert m.phase_peaks[phase] <= reserved <= m.peak_reserved_bytes
        assert m.fragmentation[phase] == (reserved - m.phase_peaks[phase]) / peak
    assert m.timeline is not None and not m.timeline.truncated
    assert [name for name, _, _ in m.timeline.phases] == ["forward", "backward", "optimizer"]
    # the timeline covers the last step, whose phases cover all of it but the inputs' copy
    assert m.timeline.peak_bytes == pytest.approx(max(m.phase_peaks.values()), rel=0.02)

    console = Console(record=True, width=140)
    png = tmp_path / "timeline.png"
    config = cuda_config(tmp_path, "cli", checkpointing)
    assert run_profile(config, console, steps=1, png=str(png)) == 0
    assert "backward: reserved - allocated" in console.export_text(clear=False)
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "pip install matplotlib" in console.export_text()


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_offload_runs_are_measured_against_the_registry(tmp_path, offload):
    """One process with ZeRO-Offload: the same train step the engine runs; on the device the
    parameters (stage 3 + params: none), gradients, no optimizer states; in host memory the fp32
    master copies, their gradients and AdamW's moments, as `model_state_bytes` says."""
    zero = 3 if offload == "params" else 0
    config = build_config(
        flags={
            "data": {"seq_len": SEQ_LEN},
            "train": {"micro_batch": 2, "device": "cpu", "precision": "fp32"},
            "distributed": {"zero": zero, "offload": offload},
            "checkpoint": {"out": str(tmp_path / "run")},
        }
    )
    trainer = Trainer(config)
    m = measure_memory(trainer, steps=1)
    P = trainer.model_config.num_params
    expected = model_state_bytes(P, optimizer="adamw", zero=zero, world_size=1, offload=offload)
    assert m.breakdown["optimizer_states"] == 0
    assert m.breakdown["params"] == expected["params"]
    assert m.breakdown["grads"] == expected["grads"]
    assert m.host_bytes == expected["host"] > 0
    assert m.breakdown["activations"] > 0 and trainer.step == 2
    console = Console(record=True, width=160)
    assert run_profile(replace_out(config, tmp_path / "cli"), console, steps=1) == 0
    assert "host memory (offload)" in console.export_text()


def replace_out(config, out):
    config.checkpoint.out = str(out)
    return config


def test_zero3_under_torchrun_prints_every_rank_beside_the_plan(tmp_path):
    """`memfit profile --zero 3` under `torchrun --nproc_per_node 2` (gloo on CPU): each rank
    measures its own shard of the model states; rank 0 prints its table beside the plan and a
    line per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), "-m", "memfit", "profile", "--zero", "3",
        "--device", "cpu", "--precision", "fp32", "--seq-len", "64", "--micro-batch", "2",
        "--profile-steps", "1", "--out", str(tmp_path / "run"),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    assert "rank 0 of 2" in text and "rank 1:" in text and "ZeRO 3 x 2 ranks" in text
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
        for line in text.splitlines()
        if line.count("│") >= 4
    }
    measured, planned = rows["params"]
    assert measured == planned  # this rank's fp32 shard: 4P/2 (MiB, one decimal)
    assert rows["grads"][0] == rows["grads"][1]
    assert rows["optimizer_states"][0] == rows["optimizer_states"][1]
