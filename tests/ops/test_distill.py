"""The fused linear distillation loss (memfit.ops.distill): loss and gradients equal an unfused
reference (KL and JSD, temperatures, alpha, ignored rows, odd shapes, chunks that do not divide
the rows), on the plain path and the Triton row kernel (under the interpreter here, on the GPU
in the CUDA twin); no (N, vocab) tensor is ever made; bad arguments are refused."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.functional import linear_distillation_loss
from memfit.ops import distill
from memfit.ops._triton import HAS_TRITON, triton_on_cpu

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def row_kernel(on: bool):
    """The row kernel on CPU tensors (Triton's interpreter), or the plain path."""
    return triton_on_cpu() if on else contextlib.nullcontext()


def reference(hidden, weight, teacher_hidden, teacher_weight, targets, alpha, temperature, kind):
    s, t = hidden @ weight.T, teacher_hidden @ teacher_weight.T
    keep = targets != -100
    ce = F.cross_entropy(s, targets, ignore_index=-100, reduction="sum")
    log_q, log_p = F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1)
    if kind == "kl":
        soft = (log_p.exp() * (log_p - log_q)).sum(-1)
    else:
        m = (log_p.exp() + log_q.exp()) / 2
        soft = 0.5 * (F.kl_div(m.log(), log_p, log_target=True, reduction="none").sum(-1)
                      + F.kl_div(m.log(), log_q, log_target=True, reduction="none").sum(-1))  # fmt: skip
    return (1 - alpha) * ce + alpha * temperature**2 * (soft * keep).sum()


def case(dtype, n=37, d=24, d_t=40, vocab=103, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, d, generator=g, dtype=dtype) / d**0.5).requires_grad_()
    teacher_hidden = torch.randn(n, d_t, generator=g, dtype=dtype)
    teacher_weight = torch.randn(vocab, d_t, generator=g, dtype=dtype) / d_t**0.5
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[::5] = -100
    return hidden, weight, teacher_hidden, teacher_weight, targets


@pytest.mark.parametrize("kind", ["kl", "jsd"])
@pytest.mark.parametrize("alpha, temperature", [(0.5, 1.0), (1.0, 2.5), (0.0, 1.0), (0.3, 0.7)])
def test_loss_and_gradients_equal_the_unfused_reference(kind, alpha, temperature):
    inputs = case(torch.float64)
    expected = reference(*inputs, alpha, temperature, kind)
    expected_grads = torch.autograd.grad(expected, inputs[:2])
    loss = linear_distillation_loss(*inputs, alpha=alpha, temperature=temperature, kind=kind,
                                    chunk_size=8)  # fmt: skip
    grads = torch.autograd.grad(loss * 0.5, inputs[:2])
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, 0.5 * want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize("kind", ["kl", "jsd"])
def test_fp32_error_within_twice_pytorchs_own(kind, kernel):
    exact = case(torch.float64, n=64, vocab=257)
    want = reference(*exact, 0.5, 2.0, kind)
    want_grads = torch.autograd.grad(want, exact[:2])
    single = [t.detach().float().requires_grad_(t.requires_grad) for t in exact[:4]] + [exact[4]]
    with row_kernel(kernel):
        ours = linear_distillation_loss(*single, alpha=0.5, temperature=2.0, kind=kind,
                                        chunk_size=16)  # fmt: skip
        ours_grads = torch.autograd.grad(ours, single[:2])
    torch_loss = reference(*single, 0.5, 2.0, kind)
    torch_grads = torch.autograd.grad(torch_loss, single[:2])
    assert abs(ours.double() - want) <= 2 * abs(torch_loss.double() - want) + 1e-6 * abs(want)
    for mine, theirs, truth in zip(ours_grads, torch_grads, want_grads, strict=True):
        error = (mine.double() - truth).abs().max()
        assert error <= 2 * (theirs.double() - truth).abs().max() + 1e-7


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize("kind", ["kl", "jsd"])
def test_bf16_autocast_error_within_twice_pytorchs_own(kind, kernel):
    """Under bf16 autocast (the model's bf16 hidden states, an fp32 student head, a bf16
    teacher) against the same unfused loss under autocast, both measured against fp64."""
    exact = case(torch.float64, n=64, vocab=257)
    hidden = exact[0].detach().bfloat16().requires_grad_()
    weight = exact[1].detach().float().requires_grad_()
    teacher = [exact[2].bfloat16(), exact[3].bfloat16()]
    exact_bf16 = [hidden.detach().double().requires_grad_(), exact[1]]  # (hidden as rounded)
    want = reference(*exact_bf16, *[t.double() for t in teacher], exact[4], 0.5, 2.0, kind)
    want_grads = torch.autograd.grad(want, exact_bf16)
    with row_kernel(kernel), torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_distillation_loss(hidden, weight, *teacher, exact[4], alpha=0.5,
                                        temperature=2.0, kind=kind, chunk_size=16)  # fmt: skip
        ours_grads = torch.autograd.grad(ours, [hidden, weight])
        theirs = reference(hidden, weight, *teacher, exact[4], 0.5, 2.0, kind)
        theirs_grads = torch.autograd.grad(theirs, [hidden, weight])
    assert ours.dtype == torch.float32
    assert abs(ours.double() - want) <= 2 * abs(theirs.double() - want) + 1e-4 * abs(want)
    for mine, pytorchs, truth in zip(ours_grads, theirs_grads, want_grads, strict=True):
        assert mine.dtype == pytorchs.dtype
        error = (mine.double() - truth).abs().max()
        assert error <= 2 * (pytorchs.double() - truth).abs().max() + 1e-6


@needs_triton
@pytest.mark.parametrize("kind", ["kl", "jsd"])
@pytest.mark.parametrize(
    "alpha, temperature, vocab",
    [(0.5, 1.0, 103), (1.0, 2.5, 4099), (0.0, 1.0, 5000), (0.3, 0.7, 7)],
)
def test_the_row_kernel_equals_the_plain_path(kind, alpha, temperature, vocab):
    """fp32, odd vocabularies (one block, a block and a bit), ignored rows, a chunk that does
    not divide the rows: the kernel's loss and gradients are the plain path's to fp32
    rounding."""
    inputs = case(torch.float32, vocab=vocab, seed=1)
    options = {"alpha": alpha, "temperature": temperature, "kind": kind, "chunk_size": 16}
    plain = linear_distillation_loss(*inputs, **options)
    plain_grads = torch.autograd.grad(plain, inputs[:2])
    with triton_on_cpu():
        assert distill._use_kernel(torch.device("cpu"), torch.float32)
        fused = linear_distillation_loss(*inputs, **options)
        fused_grads = torch.autograd.grad(fused, inputs[:2])
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    for got, want in zip(fused_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@needs_triton
def test_strided_targets_are_read_as_their_values():
    """Targets as a strided view (every other element of a longer tensor): the kernel reads the
    values, not the memory after them."""
    hidden, weight, teacher_hidden, teacher_weight, targets = case(torch.float32)
    strided = torch.stack([targets, torch.zeros_like(targets)], 1)[:, 0]
    assert not strided.is_contiguous()
    plain = linear_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, targets)
    with triton_on_cpu():
        fused = linear_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, strided)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["kl", "jsd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_row_kernel_on_cuda(monkeypatch, kind, dtype):
    """The GPU twin: the kernel (KERNEL_ON_CUDA) at a llama vocabulary, within 2x of PyTorch's
    own error in the same precision against fp64, for the loss and both gradients."""
    monkeypatch.setattr(distill, "KERNEL_ON_CUDA", True)
    exact = [t.cuda() for t in case(torch.float64, n=300, d=64, d_t=96, vocab=32003)]
    want = reference(*exact, 0.5, 2.0, kind)
    want_grads = torch.autograd.grad(want, exact[:2])
    low = [exact[0].detach().to(dtype).requires_grad_(), exact[1].detach().float().requires_grad_()]
    teacher = [exact[2].to(dtype), exact[3].to(dtype)]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        assert distill._use_kernel(low[0].device, dtype)
        ours = linear_distillation_loss(*low, *teacher, exact[4], alpha=0.5, temperature=2.0,
                                         kind=kind, chunk_size=128)  # fmt: skip
        ours_grads = torch.autograd.grad(ours, low)
        theirs = reference(*low, *teacher, exact[4], 0.5, 2.0, kind)
        theirs_grads = torch.autograd.grad(theirs, low)
    assert abs(ours.double() - want) <= 2 * abs(theirs.double() - want) + 1e-5 * abs(want)
    for mine, pytorchs, truth in zip(ours_grads, theirs_grads, want_grads, strict=True):
        error = (mine.double() - truth).abs().max()
        assert error <= 2 * (pytorchs.double() - truth).abs().max() + 1e-7


def test_a_head_in_the_compute_dtype_is_not_copied_to_fp32():
    """A LoRA student's frozen bf16 head (and the bf16 teacher's) stay bf16: no (V, d) fp32."""
    n, d, vocab = 64, 64, 4099  # (a chunk's logits, 16 x V, are a quarter of V x d)
    hidden, weight, teacher_hidden, teacher_weight, targets = case(torch.float32, n, d, d, vocab)
    weight, teacher_weight = weight.detach().bfloat16(), teacher_weight.bfloat16()
    hidden = hidden.detach().bfloat16().requires_grad_()
    made = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    with Watch(), torch.autocast("cpu", dtype=torch.bfloat16):
        linear_distillation_loss(hidden, weight, teacher_hidden.bfloat16(), teacher_weight,
                                 targets, chunk_size=16).backward()  # fmt: skip
    assert not [t for t in made if t.numel() >= vocab * d and t.dtype == torch.float32]
    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_rows_by_vocabulary_tensor_is_made():
    n, d, vocab, chunk = 256, 16, 101, 8
    inputs = case(torch.float32, n=n, d=d, d_t=d, vocab=vocab)
    with LargestTensor() as mode:
        loss = linear_distillation_loss(*inputs, chunk_size=chunk)
        loss.backward()
    assert mode.largest <= max(chunk * vocab, vocab * d, n * d)  # not n * vocab = 25,856
    assert mode.largest < n * vocab // 4


def test_bad_arguments_are_refused():
    inputs = case(torch.float32)
    with pytest.raises(ValueError, match="alpha must be in"):
        linear_distillation_loss(*inputs, alpha=1.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        linear_distillation_loss(*inputs, temperature=0)
    with pytest.raises(ValueError, match="kind must be"):
        linear_distillation_loss(*inputs, kind="mse")
    hidden, weight, teacher_hidden, teacher_weight, targets = inputs
    with pytest.raises(ValueError, match=r"targets must be in \[0, 103\) or ignore_index=-100"):
        linear_distillation_loss(
            hidden, weight, teacher_hidden, teacher_weight, torch.full_like(targets, 103)
        )
    hidden, weight, teacher_hidden, teacher_weight, targets = inputs
    with pytest.raises(ValueError, match="same 37 rows over the same vocabulary of 103"):
        linear_distillation_loss(hidden, weight, teacher_hidden, teacher_weight[:50], targets)
