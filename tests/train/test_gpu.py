"""GPU twins of the CPU engine tests: the same properties on CUDA, where memory comes from the
caching allocator's statistics and attention runs in SDPA's fused kernels. Skipped without CUDA."""

import gc

import pytest
import torch

from memfit.config import build_config
from memfit.models.config import ModelConfig
from memfit.models.llama import build_model
from memfit.train.checkpointing import apply_activation_checkpointing
from memfit.train.engine import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def cuda_trainer(tmp_path, **train):
    return Trainer(
        build_config(
            flags={
                "data": {"seq_len": train.pop("seq_len", 256)},
                "train": {"steps": 40, "device": "cuda", **train},
                "checkpoint": {"out": str(tmp_path)},
            }
        )
    )


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_tiny_learns_on_cuda(tmp_path, precision):
    trainer = cuda_trainer(tmp_path, precision=precision)
    assert trainer.precision == precision
    history = [trainer.train_step() for _ in range(40)]
    assert history[-1].loss < history[0].loss - 1.5
    assert 0 < history[-1].mem_allocated_bytes <= history[-1].mem_peak_bytes
    param_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert history[-1].mem_allocated_bytes >= 3 * param_bytes  # weights + AdamW's two moments


def test_auto_precision_is_bf16_on_cuda(tmp_path):
    assert cuda_trainer(tmp_path).precision == "bf16"


def _activation_memory(mode: str) -> tuple[int, dict[str, torch.Tensor]]:
    config = ModelConfig(
        vocab_size=1000,
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=8,
        intermediate_size=1376,
    )
    model = build_model(config, device="cuda", seed=0)
    apply_activation_checkpointing(model, mode)
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, 1000, (4, 512), device="cuda", generator=generator)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens, tokens)
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    return held, {n: p.grad.float().clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_on_cuda():
    """bf16 autocast, SDPA flash kernel: full < selective < none in memory held after forward,
    selective holds exactly the attention outputs more than full, gradients equal."""
    held = {}
    grads = {}
    for mode in ("none", "selective", "full"):
        held[mode], grads[mode] = _activation_memory(mode)
    tokens, hidden, layers = 4 * 512, 512, 4
    bf16 = 2
    block_input = tokens * hidden * bf16
    assert held["full"] < held["selective"] < held["none"] / 3
    # attention output (bf16) + log-sum-exp (fp32 per head and token) per layer
    extra = layers * (tokens * hidden * bf16 + tokens * 8 * 4)
    assert held["selective"] - held["full"] == pytest.approx(extra, rel=0.15)
    assert held["full"] >= layers * block_input
    for mode in ("selective", "full"):
        for name, grad in grads[mode].items():
            torch.testing.assert_close(
                grad, grads["none"][name], rtol=1e-2, atol=1e-4, msg=f"{mode}: {name}"
            )


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_compiled_blocks_match_eager(tmp_path, checkpointing):
    """compile=auto (on for CUDA) must train like eager, with every checkpointing mode."""
    losses = {}
    for compile in ("on", "off"):
        trainer = Trainer(
            build_config(
                flags={
                    "model": {"compile": compile},
                    "data": {"seq_len": 256},
                    "train": {
                        "steps": 6,
                        "device": "cuda",
                        "checkpointing": checkpointing,
                        "precision": "bf16",
                    },
                    "checkpoint": {"out": str(tmp_path / compile)},
                }
            )
        )
        assert trainer.compiled == (compile == "on")
        losses[compile] = [trainer.train_step().loss for _ in range(6)]
    for compiled, eager in zip(losses["on"], losses["off"], strict=True):
        assert compiled == pytest.approx(eager, rel=2e-2)


@pytest.mark.parametrize("mode,compiled", [("full", False), ("none", False), ("none", True)])
def test_activation_offload_on_cuda(mode, compiled):
    """Activation offload against the same checkpointing mode without it: the gradients bit for
    bit, and less memory held after the forward (full: all but two block inputs; none: the
    blocks' saved activations, also what the fused kernels and compiled blocks save)."""
    from memfit.distributed.parallelize import parallelize
    from memfit.train.offload import ActivationOffload

    config = ModelConfig(
        vocab_size=1000, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=8,
        intermediate_size=1376,
    )  # fmt: skip
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, 1000, (4, 512), device="cuda", generator=generator)
    held, grads, pools = {}, {}, {}
    for name, offload in (("kept", None), ("offloaded", ActivationOffload("cuda"))):
        model = build_model(config, device="cuda", seed=0)
        parallelize(
            model, checkpointing=mode, compile=compiled, zero=0, param_groups=[],
            param_dtype=torch.float32, offload_activations=offload,
        )  # fmt: skip
        for _ in range(2):  # (the second forward reuses the pinned buffers)
            gc.collect()  # (an earlier test's cycles freed during the forward would count)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(tokens, tokens)
            torch.cuda.synchronize()
            held[name] = torch.cuda.memory_allocated() - before
            loss.backward()
            if offload is not None:
                pools.setdefault(name, []).append(offload.buffers_allocated)
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert pools["offloaded"][0] == pools["offloaded"][1] > 0
    if mode == "full":
        block_input = 4 * 512 * 512 * 2
        assert held["kept"] - held["offloaded"] >= (config.num_layers - 2) * block_input
    else:
        assert held["offloaded"] < held["kept"] / 2
    for n, grad in grads["kept"].items():
        assert torch.equal(grads["offloaded"][n], grad), n


@pytest.mark.parametrize("checkpointing, quantize", [("none", "none"), ("full", "none"),
                                                    ("full", "nf4"), ("none", "int8")])  # fmt: skip
def test_lora_learns_on_cuda_with_a_frozen_bf16_base(tmp_path, checkpointing, quantize):
    """LoRA on CUDA in bf16, compiled blocks (checkpointing none) or checkpointed ones, the base
    in bf16 or quantized (QLoRA): the loss falls, the base stays as it was, and only the
    adapters hold optimizer state."""
    trainer = Trainer(
        build_config(
            flags={
                "data": {"seq_len": 256},
                "train": {"steps": 30, "device": "cuda", "precision": "bf16", "lr": 1e-2,
                          "checkpointing": checkpointing},
                "checkpoint": {"out": str(tmp_path)},
                "lora": {"rank": 8, "alpha": 16.0, "quantize": quantize},
            }
        )
    )  # fmt: skip
    assert trainer.compiled == (checkpointing == "none")
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" not in n}
    base |= {n: b.detach().clone() for n, b in trainer.model.named_buffers() if ".quant." in n}
    assert all(p.dtype == torch.bfloat16 for n, p in base.items() if ".quant." not in n)
    assert all(b.is_cuda for b in base.values())
    assert any(".quant." in n for n in base) == (quantize != "none")
    history = [trainer.train_step() for _ in range(30)]
    assert history[-1].loss < history[0].loss - 0.5
    for name, param in trainer.model.named_parameters():
        if ".lora_" in name:
            assert param.dtype == torch.float32, name
        else:
            assert torch.equal(param, base[name]), name
    for name, buffer in trainer.model.named_buffers():
        if ".quant." in name:
            assert torch.equal(buffer, base[name]), name
    stateful = {id(p) for p, s in trainer.optimizer.state.items() if s}
    adapters = {id(p) for n, p in trainer.model.named_parameters() if ".lora_" in n}
    assert stateful == adapters


def test_checkpointing_auto_fits_a_budget_between_none_and_full(tmp_path, monkeypatch):
    """--checkpointing auto on a GPU whose memory (as the planner is told) lies between what the
    run needs without checkpointing and with full: it checkpoints some of the blocks, and the
    run's measured peak is below the same run's without checkpointing."""
    import dataclasses

    import memfit.planner
    from memfit.planner import detect_gpu, plan
    from memfit.planner.search import SAFETY_MARGIN

    gpu = detect_gpu()
    if gpu is None:
        pytest.skip("a GPU outside the planner's catalog")
    shape = {"seq_len": 512, "micro_batch": 32, "precision": "bf16"}
    plain = cuda_trainer(tmp_path / "none", **shape)
    model, strategy = plain.model_config, plain.strategy()
    none = plan(model, strategy, gpu).required_bytes
    full = plan(model, dataclasses.replace(strategy, checkpointing="full"), gpu).required_bytes
    budget = (none + full) / 2 / (1 - SAFETY_MARGIN)
    peaks = {"none": _peak_of_steps(plain)}
    del plain
    monkeypatch.setattr(
        memfit.planner, "detect_gpu", lambda: dataclasses.replace(gpu, memory_bytes=int(budget))
    )
    auto = cuda_trainer(tmp_path / "auto", checkpointing="auto", **shape)
    train = auto.config.train
    assert train.checkpointing in ("selective", "full"), train
    assert train.checkpoint_blocks is not None, train
    assert 0 < train.checkpoint_blocks < model.num_layers
    peaks["auto"] = _peak_of_steps(auto)
    assert peaks["auto"] < peaks["none"], peaks


def _peak_of_steps(trainer, steps: int = 3) -> int:
    """torch.cuda.max_memory_allocated over `steps` steps of `trainer` (after its first, which
    makes the optimizer's states)."""
    import gc

    trainer.train_step()
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        trainer.train_step()
    return torch.cuda.max_memory_allocated()


@pytest.mark.parametrize("attention", ["sdpa", "flash"])
@pytest.mark.parametrize("compiled", [False, True])
def test_fp32_parts_on_cuda(attention, compiled):
    """The GPU twin of tests/train/test_fp32_parts.py: every part in fp32 under bf16 autocast
    computes what the fp32 model does (cuBLAS, SDPA and memfit's Triton kernels in fp32; a
    flash model's fp32 blocks take SDPA), compiled blocks too, their backward included (the
    precision wrapper goes around the compiled forward: memfit.distributed.parallelize); the
    ends and the head alone lie between bf16's error and none."""
    from memfit.config import parse_fp32_parts
    from memfit.distributed.parallelize import parallelize

    config = ModelConfig(
        vocab_size=1000, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=704, max_seq_len=512,
    )  # fmt: skip
    torch.manual_seed(0)
    tokens = torch.randint(0, 1000, (2, 301), device="cuda")

    def run(parts):
        model = build_model(config, device="cuda", attention=attention, seed=0)
        parallelize(
            model, checkpointing="none", compile=compiled, zero=0, param_groups=[],
            param_dtype=torch.bfloat16, fp32_parts=parse_fp32_parts(parts or ""),
        )  # fmt: skip
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=parts is not None):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        return loss.detach(), grads

    torch.backends.cuda.matmul.allow_tf32 = False
    exact = run(None)
    everything = run("first:4,head")
    torch.testing.assert_close(everything[0], exact[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(everything[1], exact[1], rtol=1e-4, atol=1e-5)
    errors = []
    for parts in ("", "first:1,last:1,head"):
        loss, grads = run(parts)
        errors.append(((loss - exact[0]).abs().item(), ((grads - exact[1]).norm()).item()))
    # (the losses are bf16-rounded: the ends in fp32 may land on bf16's very error)
    assert errors[1][0] <= errors[0][0] and errors[1][1] < errors[0][1], errors
