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
        loss = model(tokens, tokens)  # (the last one's graph is alive meanwhile, as in training)
        loss.backward()
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


def moved_shapes(offload: ActivationOffload) -> list:
    """Record the shape of each tensor `offload` copies out, by block."""
    moved, copy_out = [], offload._copy_out

    def spy(x, group):
        moved.append((group, tuple(x.shape)))
        return copy_out(x, group)

    offload._copy_out = spy
    return moved


def test_without_checkpointing_the_saved_activations_move_and_parameters_stay():
    offload = ActivationOffload("cpu", min_bytes=1024)
    moved = moved_shapes(offload)
    expected, got = gradients("none", None), gradients("none", offload, steps=2)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    model = build_model(CONFIG, attention="sdpa", seed=0)
    shapes = {tuple(p.shape) for p in model.parameters()} | {
        tuple(p.t().shape) for p in model.parameters() if p.dim() == 2
    }
    assert moved and not {shape for _, shape in moved} & shapes  # activations, no parameter
    assert {group for group, _ in moved} == set(range(CONFIG.num_layers))  # every block's
    # the pool is reused by the second micro-batch: no more buffers than one forward's, and all
    # are back in it once the backward has used them
    assert offload.buffers_allocated == len(moved) // 2
    assert sum(len(free) for free in offload._free.values()) == offload.buffers_allocated


class _Square(torch.autograd.Function):
    """A fused op's shape: it saves what it makes inside (a leaf to autograd, no grad_fn)."""

    @staticmethod
    def forward(ctx, x):
        y = x * x
        ctx.save_for_backward(x, y)
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * 2 * x + 0 * y


def test_what_a_fused_op_saves_moves_and_the_blocks_shared_inputs_stay():
    from memfit.train.checkpointing import offload_saved_tensors

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(32, 32)

        def forward(self, x, table):
            return _Square.apply(self.linear(x)) * table

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(Block() for _ in range(2))
    offload = ActivationOffload("cpu", min_bytes=1)
    moved = moved_shapes(offload)
    offload_saved_tensors(model, offload)
    x = torch.randn(4, 32, requires_grad=True) * 1.0  # (as an embedding's output: no leaf)
    table = torch.randn(4, 32)
    for block in model.layers:
        x = block(x, table)
    x.sum().backward()
    # per block: the linear's input, the square's input and what it made inside; not the weight,
    # nor the table both blocks share (the product saves it for the square's gradient)
    assert [group for group, _ in moved] == [0, 0, 0, 1, 1, 1]
    assert offload.bytes_offloaded == 6 * 4 * 32 * 4


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
    # (and, with fp32 masters, the bf16 weight copies that the compiled blocks save)
    copies = 2 * model.spec.sizes["P_matmul_layer"]
    assert offloaded.host_bytes == model.num_layers * (per_layer + copies)
    assert (
        kept.forward_kept_bytes - offloaded.forward_kept_bytes == (model.num_layers - 2) * per_layer
    )
    # every activation over PCIe twice a step: more than the step's compute hides
    assert (
        step_time(model, Strategy(**{**vars(base), "offload_activations": True}), gpu).total_s
        > step_time(model, base, gpu).total_s
    )


class _SavesTransposed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.t() * 1)  # (a transposed tensor of its own, as compiled code has)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (xt,) = ctx.saved_tensors
        assert xt.stride() == (1, xt.shape[0])  # (a compiled backward checks its strides)
        return grad * 2


def test_a_saved_tensor_comes_back_with_its_strides():
    from memfit.train.checkpointing import offload_saved_tensors

    class Block(torch.nn.Module):
        def forward(self, x):
            return _SavesTransposed.apply(x)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block()])
    offload = ActivationOffload("cpu", min_bytes=1)
    offload_saved_tensors(model, offload)
    x = torch.randn(4, 32, requires_grad=True)
    model.layers[0](x).sum().backward()
    assert offload.bytes_offloaded == 4 * 32 * 4
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


class _SavesPadded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        rows, cols = x.shape
        padded = torch.empty_strided((rows, cols), (cols + 4, 1), dtype=x.dtype)  # (Inductor's)
        padded.copy_(x)
        ctx.save_for_backward(padded)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (padded,) = ctx.saved_tensors
        assert padded.stride() == (padded.shape[1] + 4, 1)  # (a compiled backward checks them)
        return grad * 2


def test_a_saved_tensor_with_padded_rows_comes_back_padded():
    """Compiled blocks pad rows (1376 columns in rows of 1408) and their backward checks the
    strides of what they saved: the buffer keeps them (a span 1/8 larger at most)."""
    from memfit.train.checkpointing import offload_saved_tensors

    class Block(torch.nn.Module):
        def forward(self, x):
            return _SavesPadded.apply(x)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block()])
    offload = ActivationOffload("cpu", min_bytes=1)
    offload_saved_tensors(model, offload)
    x = torch.randn(16, 36, requires_grad=True)
    model.layers[0](x).sum().backward()
    assert offload.bytes_offloaded == 16 * 36 * 4
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_expanded_and_sliced_saved_tensors_come_back_dense():
    from memfit.train.checkpointing import offload_saved_tensors

    class Block(torch.nn.Module):
        def forward(self, x):
            wide = (x * 1).sum(-1, keepdim=True).expand_as(x)  # (stride 0: elements overlap)
            return x * wide + (x * 1)[:, :8].sum(-1, keepdim=True)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block()])
    offload = ActivationOffload("cpu", min_bytes=1)
    offload_saved_tensors(model, offload)
    x = torch.randn(64, 64, requires_grad=True)
    reference = torch.randn(64, 64)
    model.layers[0](x).backward(reference)
    expected = x.detach().clone().requires_grad_()
    Block().forward(expected).backward(reference)
    torch.testing.assert_close(x.grad, expected.grad)
    assert offload.bytes_offloaded > 0
    assert offload.pinned_bytes <= offload.bytes_offloaded  # (no buffer over a view's span)
