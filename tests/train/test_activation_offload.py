"""Activation offload (memfit.train.offload): checkpointed blocks whose inputs go to CPU memory
give the gradients of checkpointing alone, bit for bit, and the pinned buffers are pooled. On a
CPU the copies are plain ones; test_gpu.py's twin checks the streams and the lower peak."""

import pytest
import torch

from memfit.models.config import ModelConfig
from memfit.models.llama import build_model
from memfit.train.checkpointing import apply_activation_checkpointing
from memfit.train.offload import ActivationOffload

CONFIG = ModelConfig(
    vocab_size=96, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
    intermediate_size=160, max_seq_len=64,
)  # fmt: skip


def gradients(mode: str, offload: ActivationOffload | None, steps: int = 2) -> dict:
    model = build_model(CONFIG, attention="sdpa", seed=0)
    apply_activation_checkpointing(model, mode, offload=offload)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):  # (accumulated: each micro-batch's forward, then its backward)
        tokens = torch.randint(0, CONFIG.vocab_size, (2, 33), generator=generator)
        model(tokens, tokens).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_offloaded_gradients_are_bitwise_those_of_checkpointing(mode):
    offload = ActivationOffload("cpu")
    expected, got = gradients(mode, None), gradients(mode, offload, steps=2)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    block_input = 2 * 33 * CONFIG.hidden_size * 4  # (fp32 on a CPU)
    assert offload.bytes_offloaded == 2 * CONFIG.num_layers * block_input
    # one buffer a layer, made in the first micro-batch and reused by the second
    assert offload.buffers_allocated == CONFIG.num_layers


def test_input_gradient_flows_through_offloaded_blocks():
    # the embedding's gradient needs the gradient of the first block's input
    grads = gradients("full", ActivationOffload("cpu"), steps=1)
    embedding = next(g for name, g in grads.items() if "embed" in name)
    assert embedding.abs().sum() > 0


def test_without_checkpointing_the_saved_activations_move_and_parameters_stay():
    offload = ActivationOffload("cpu", min_bytes=1024)
    expected, got = gradients("none", None), gradients("none", offload, steps=2)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    moved = {tuple(b.host.shape) for group in offload._groups for b in group}
    model = build_model(CONFIG, attention="sdpa", seed=0)
    shapes = {tuple(p.shape) for p in model.parameters()} | {
        tuple(p.t().shape) for p in model.parameters() if p.dim() == 2
    }
    assert moved and not moved & shapes  # activations, no parameter (nor its transpose)
    assert all(len(group) > 0 for group in offload._groups)  # every block moved some
    # and the pool is reused by the second micro-batch: no more buffers than one forward's
    assert offload.buffers_allocated == sum(len(group) for group in offload._groups)


def test_small_saved_tensors_stay():
    offload = ActivationOffload("cpu")  # 1 MiB: more than any tensor of this model
    gradients("none", offload, steps=1)
    assert offload.bytes_offloaded == 0


def test_no_offload_without_grad():
    offload = ActivationOffload("cpu")
    model = build_model(CONFIG, attention="sdpa", seed=0)
    apply_activation_checkpointing(model, "full", offload=offload)
    with torch.no_grad():
        model(torch.zeros(1, 5, dtype=torch.long))
    assert offload.bytes_offloaded == 0


def test_planner_counts_two_block_inputs_on_the_gpu():
    from memfit.models import PRESETS
    from memfit.planner import Strategy, plan

    model = PRESETS["llama-1b"]
    base = Strategy(micro_batch=8, seq_len=8192, checkpointing="full")
    kept, offloaded = (
        plan(model, base),
        plan(model, Strategy(**{**vars(base), "offload_activations": True})),
    )
    block_input = 2 * 8 * 8192 * model.hidden_size
    assert offloaded.host_bytes == model.num_layers * block_input
    assert (
        kept.forward_kept_bytes - offloaded.forward_kept_bytes
        == (model.num_layers - 2) * block_input
    )
    assert offloaded.peak_bytes < kept.peak_bytes


def test_planner_without_checkpointing_moves_every_layer_but_two():
    from memfit.models import PRESETS
    from memfit.planner import Strategy, plan, step_time
    from memfit.planner.hardware import get_gpu
    from memfit.planner.memory import layer_activation_bytes

    model, gpu = PRESETS["llama-1b"], get_gpu("h100-sxm")
    base = Strategy(micro_batch=1, seq_len=8192)
    kept, offloaded = (
        plan(model, base),
        plan(model, Strategy(**{**vars(base), "offload_activations": True})),
    )
    per_layer = layer_activation_bytes(model, base)
    assert offloaded.host_bytes == model.num_layers * per_layer
    assert (
        kept.forward_kept_bytes - offloaded.forward_kept_bytes == (model.num_layers - 2) * per_layer
    )
    # every activation over PCIe twice a step: more than the step's compute hides
    assert (
        step_time(model, Strategy(**{**vars(base), "offload_activations": True}), gpu).total_s
        > step_time(model, base, gpu).total_s
    )
