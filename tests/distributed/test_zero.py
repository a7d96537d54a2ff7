"""ZeRO stages 0-3 with gloo, 2 and 3 processes: losses and final parameters equal a single-process
run on the whole batch (fp32 tolerance) over 10 steps, with and without accumulation, with
clipping, with offload, on a model whose parameter counts do not divide by the world size."""

import contextlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from memfit.distributed import ZeroOptimizer, zero_state_bytes
from memfit.train.optim import parameter_groups

STEPS, MICRO_BATCH, LR = 10, 4, 1e-2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.LayerNorm(5), nn.Linear(5, 3)
    )


def batches(world_size: int, accum: int):
    """Step s: world_size * accum micro-batches; rank r takes micro-batches r*accum ..."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(world_size * accum, MICRO_BATCH, 7, generator=generator)
        yield x, torch.randn(world_size * accum, MICRO_BATCH, 3, generator=generator)


def optimizer_factory(groups):
    return torch.optim.AdamW(groups, lr=LR, foreach=True)


def reference(world_size: int, accum: int):
    model = make_model()
    optimizer = optimizer_factory(parameter_groups(model, 0.1))
    losses = []
    for x, y in batches(world_size, accum):
        loss = sum(nn.functional.mse_loss(model(xi), yi) for xi, yi in zip(x, y, strict=True))
        loss = loss / len(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def train(zero, model, rank, world_size, accum):
    losses = []
    for x, y in batches(world_size, accum):
        total = torch.zeros(())
        for micro in range(accum):
            index = rank * accum + micro
            last = micro == accum - 1
            with contextlib.nullcontext() if last else zero.no_sync():
                loss = nn.functional.mse_loss(model(x[index]), y[index]) / accum
                loss.backward()
            total += loss.detach()
        zero.clip_grad_norm_(0.5)
        zero.step()
        zero.zero_grad()
        if world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
    return losses


def build(model: nn.Module, stage: int | str) -> ZeroOptimizer:
    """stage: 0-3, or "1+offload" (optimizer offload), "3+offload" (parameter offload)."""
    stage, _, offload = str(stage).partition("+")
    stage = int(stage)
    units = [model[0], model[2]] if stage == 3 else ()  # root: the LayerNorm and last Linear
    return ZeroOptimizer(
        parameter_groups(model, 0.1),
        optimizer_factory,
        stage=stage,
        bucket_numel=50,
        offload={"": "none", "offload": "optimizer" if stage < 3 else "params"}[offload],
        units=units,
        root=model if stage == 3 else None,
    )


def worker(rank, world_size, port, accum, stages, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    for stage in stages:
        model = make_model()
        zero = build(model, stage)
        losses = train(zero, model, rank, world_size, accum)
        with zero.summon_full_params():
            results[stage] = (losses, [p.detach().clone() for p in model.parameters()])
        results[f"bytes{stage}"] = zero.state_bytes()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("world_size", "accum"), [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_stages_match_the_single_process_run(tmp_path, world_size, accum):
    out = tmp_path / "results.pt"
    stages = (0, 1, 2, 3, "3+offload")
    mp.spawn(worker, args=(world_size, free_port(), accum, stages, str(out)), nprocs=world_size)
    results = torch.load(out)
    ref_losses, ref_params = reference(world_size, accum)
    for stage in stages:
        losses, params = results[stage]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        for got, expected in zip(params, ref_params, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    num_params = sum(p.numel() for p in ref_params)
    for stage in (0, 1, 2, 3):
        measured = results[f"bytes{stage}"]
        expected = zero_state_bytes(num_params, stage, world_size)
        for key, value in expected.items():
            # each bucket pads to a multiple of world_size elements (fewer than world_size each)
            assert value <= measured[key] <= value + 16 * world_size * 8, (stage, key)


def test_needs_a_process_group():
    with pytest.raises(ValueError, match="torchrun --nproc_per_node"):
        ZeroOptimizer(parameter_groups(make_model(), 0.1), optimizer_factory, stage=1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_formulas_agree_with_the_planner(stage, world_size):
    from memfit.models.config import PRESETS
    from memfit.planner import Strategy, plan

    model = PRESETS["llama-2-7b"]
    planned = plan(model, Strategy(zero=stage, world_size=world_size)).category_peaks
    formulas = zero_state_bytes(model.num_params, stage, world_size)
    for key in ("params", "grads", "optimizer_states"):
        assert abs(planned[key] - formulas[key]) <= 16, (key, planned[key], formulas[key])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_single_process_offload_matches_plain_training(stage):
    """One GPU's ZeRO-Offload (here on CPU): no process group, optimizer on the CPU copies
    (stage 3: the parameter shards too)."""
    model = make_model()
    zero = build(model, f"{stage}+offload")
    losses = train(zero, model, 0, 1, accum=2)
    ref_losses, ref_params = reference(1, 2)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    with zero.summon_full_params():
        for got, expected in zip(model.parameters(), ref_params, strict=True):
            torch.testing.assert_close(got.detach(), expected, rtol=1e-5, atol=1e-6)
    assert zero.state_bytes()["optimizer_states"] == 0


def test_model_zero_grad_to_none_does_not_lose_gradients():
    """model.zero_grad() sets .grad to None; the next backward's gradients still reach the
    flat buffers the collectives and the optimizer read."""
    model, reference_model = make_model(), make_model()
    zero = ZeroOptimizer(parameter_groups(model, 0.1), optimizer_factory, stage=1, offload=True)
    optimizer = optimizer_factory(parameter_groups(reference_model, 0.1))
    x, y = torch.randn(4, 7), torch.randn(4, 3)
    for _ in range(2):
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        zero.step()
        zero.zero_grad()
        nn.functional.mse_loss(reference_model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for got, expected in zip(model.parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("fused", [True, False])
def test_offloaded_step_sees_what_the_gradients_were_multiplied_by(stage, fused):
    """Offload copies each gradient to the host as soon as it is final, before the loss
    scaler's unscaling and the clipping multiply the device gradients: the CPU step applies the
    same factor (fused AdamW: through its grad_scale; otherwise: a multiply). eps=1 makes AdamW
    sensitive to the gradients' scale."""
    options = {"fused": True} if fused else {"foreach": True}

    def factory(groups):
        return torch.optim.AdamW(groups, lr=LR, eps=1.0, **options)

    model, reference_model = make_model(), make_model()
    zero = ZeroOptimizer(
        parameter_groups(model, 0.1), factory, stage=stage, bucket_numel=50, offload=True
    )
    optimizer = factory(parameter_groups(reference_model, 0.1))
    x, y = torch.randn(4, 7), torch.randn(4, 3)
    for _ in range(2):
        nn.functional.mse_loss(model(x), y).backward()
        torch._foreach_mul_(zero.gradients(), 0.25)  # what DynamicLossScaler does, then tells
        zero.note_gradients_scaled(0.25)
        zero.clip_grad_norm_(0.05)
        zero.step()
        zero.zero_grad()
        nn.functional.mse_loss(reference_model(x), y).backward()
        for param in reference_model.parameters():
            param.grad.mul_(0.25)
        torch.nn.utils.clip_grad_norm_(reference_model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
    for got, expected in zip(model.parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
