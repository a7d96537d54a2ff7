"""GPU twins of the RMSNorm and SwiGLU tests: the compiled Triton kernels at llama-1b sizes.

The same house rule as on CPU (error vs an fp64 reference within 2x the error of the PyTorch
reference in the same precision), here with the GPU's own round-to-nearest-even bf16 casts;
bitwise determinism of the persistent dweight reduction; and a speed check against the
plain-PyTorch path in the same process, printing achieved bandwidth (run with -s to see it).
Skipped without CUDA.
"""

import types

import pytest
import torch

import memfit.ops.rms_norm as rms_norm_module
import memfit.ops.swiglu as swiglu_module
from memfit.ops.rms_norm import add_rms_norm, rms_norm
from memfit.ops.swiglu import swiglu
from tests.reference import assert_error_within, rms_norm_reference, swiglu_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EPS = 1e-5


def forward_backward(function, inputs, grad_out, **kwargs):
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = function(*inputs, **kwargs)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    return (out, *grads)


@pytest.mark.parametrize(("rows", "hidden"), [(8192, 2048), (1023, 5000), (64, 16384), (7, 32768)])
def test_rms_norm_bf16_matches_fp64_reference(rows: int, hidden: int):
    torch.manual_seed(0)
    x = (torch.randn(rows, hidden, device="cuda") * 3 + 0.5).bfloat16()
    weight = 1 + 0.1 * torch.randn(hidden, device="cuda")  # fp32 master weight
    grad_out = torch.randn(rows, hidden, device="cuda").bfloat16()

    ours = forward_backward(rms_norm, (x, weight), grad_out, eps=EPS)
    baseline = forward_backward(rms_norm_reference, (x, weight), grad_out, eps=EPS)
    exact = forward_backward(rms_norm_reference, (x.double(), weight.double()), grad_out, eps=EPS)
    assert [t.dtype for t in ours] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for name, a, b, e in zip(("y", "grad_x", "grad_weight"), ours, baseline, exact, strict=True):
        assert_error_within(a, b, e, name=name)


@pytest.mark.parametrize(("rows", "ffn"), [(8192, 5632), (777, 1000)])
def test_swiglu_bf16_matches_fp64_reference(rows: int, ffn: int):
    torch.manual_seed(0)
    gate_up = (torch.randn(rows, 2 * ffn, device="cuda") * 3).bfloat16()
    grad_out = torch.randn(rows, ffn, device="cuda").bfloat16()

    ours = forward_backward(swiglu, (gate_up,), grad_out)
    baseline = forward_backward(swiglu_reference, (gate_up,), grad_out)
    exact = forward_backward(swiglu_reference, (gate_up.double(),), grad_out)
    for name, a, b, e in zip(("out", "grad_gate_up"), ours, baseline, exact, strict=True):
        assert_error_within(a, b, e, name=name)


def test_swiglu_on_a_slice_of_a_wider_projection():
    torch.manual_seed(0)
    fused = torch.randn(4, 300, 3 * 5632, device="cuda").bfloat16().requires_grad_()
    gate_up = fused[..., 5632:]  # rows strided by 3 * 5632
    out = swiglu(gate_up)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected = forward_backward(swiglu, (gate_up.contiguous(),), grad_out)
    assert torch.equal(out, expected[0])
    assert torch.equal(fused.grad[..., 5632:], expected[1])
    assert torch.count_nonzero(fused.grad[..., :5632]) == 0


def test_two_runs_are_bitwise_equal():
    torch.manual_seed(0)
    x = torch.randn(8192, 2048, device="cuda").bfloat16()
    weight = torch.randn(2048, device="cuda")
    grad_out = torch.randn_like(x)
    gate_up = torch.randn(8192, 2 * 5632, device="cuda").bfloat16()
    grad_gate_out = torch.randn(8192, 5632, device="cuda").bfloat16()
    for function, inputs, grad, kwargs in [
        (rms_norm, (x, weight), grad_out, {"eps": EPS}),
        (swiglu, (gate_up,), grad_gate_out, {}),
    ]:
        first = forward_backward(function, inputs, grad, **kwargs)
        second = forward_backward(function, inputs, grad, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_torch_compile_traces_the_pytorch_path(monkeypatch):
    launched = []
    for module in (rms_norm_module, swiglu_module):
        launch = module.launch
        monkeypatch.setattr(
            module, "launch", lambda *a, launch=launch, **k: (launched.append(a), launch(*a, **k))
        )

    def block(x, weight):
        return swiglu(torch.cat([rms_norm(x, weight, EPS)] * 2, dim=-1))

    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    weight = torch.randn(256, device="cuda", requires_grad=True)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    compiled(x, weight).sum().backward()
    assert launched == []  # traced: Inductor would fuse the plain ops
    block(x, weight).sum().backward()
    assert len(launched) == 4  # eager: two forward and two backward kernels


def time_forward_backward(function_class, inputs, grad_out, *args) -> dict[str, float]:
    """Median ms of the Function's forward and backward, as (eager, graph) pairs.

    eager: triton.testing.do_bench through autograd (what a training step sees, CPU launch
    overhead included where the GPU work is shorter than it). graph: do_bench_cudagraph on the
    Function's own forward and backward with a stand-in ctx: GPU time only.
    """
    from triton.testing import do_bench, do_bench_cudagraph

    def new_ctx():
        ctx = types.SimpleNamespace(needs_input_grad=(True,) * len(inputs) + (False,) * len(args))
        ctx.save_for_backward = lambda *tensors: setattr(ctx, "saved_tensors", tensors)
        return ctx

    inputs = [t.detach().requires_grad_() for t in inputs]
    out = function_class.apply(*inputs, *args)
    ctx = new_ctx()
    function_class.forward(ctx, *inputs, *args)  # saves what backward needs, outside the graph
    forward_ctx = new_ctx()
    return {
        "forward": do_bench(lambda: function_class.apply(*inputs, *args), return_mode="median"),
        "backward": do_bench(
            lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True),
            return_mode="median",
        ),
        "forward graph": do_bench_cudagraph(
            lambda: function_class.forward(forward_ctx, *inputs, *args), return_mode="median"
        ),
        "backward graph": do_bench_cudagraph(
            lambda: function_class.backward(ctx, grad_out), return_mode="median"
        ),
    }


@pytest.mark.parametrize("op", ["rms_norm", "swiglu"])
def test_faster_than_the_pytorch_path(monkeypatch, op: str):
    torch.manual_seed(0)
    rows = 16384
    if op == "rms_norm":
        hidden = 2048
        module, function_class, args = rms_norm_module, rms_norm_module.RMSNormFunction, (EPS,)
        x = torch.randn(rows, hidden, device="cuda").bfloat16()
        inputs = (x, torch.ones(hidden, device="cuda"))
        grad_out = torch.randn_like(x)
        # Compulsory traffic: x -> y forward, (x, dy) -> dx backward, 2 bytes an element.
        moved = {"forward": 2 * 2 * rows * hidden, "backward": 3 * 2 * rows * hidden}
    else:
        ffn = 5632
        module, function_class, args = swiglu_module, swiglu_module.SwiGLUFunction, ()
        inputs = (torch.randn(rows, 2 * ffn, device="cuda").bfloat16(),)
        grad_out = torch.randn(rows, ffn, device="cuda").bfloat16()
        # (gate, up) -> out forward, (gate, up, d_out) -> (d_gate, d_up) backward.
        moved = {"forward": 3 * 2 * rows * ffn, "backward": 5 * 2 * rows * ffn}

    triton_ms = time_forward_backward(function_class, inputs, grad_out, *args)
    with monkeypatch.context() as patch:
        patch.setattr(module, "_use_triton", lambda *tensors: False)
        pytorch_ms = time_forward_backward(function_class, inputs, grad_out, *args)

    print(f"\n{op} {tuple(inputs[0].shape)} bf16, {torch.cuda.get_device_name()}:")
    for key, triton_time in triton_ms.items():
        nbytes = moved[key.split()[0]]
        print(
            f"  {key:15s} triton {triton_time * 1e3:7.1f} us {nbytes / triton_time / 1e6:5.0f} GB/s"
            f" | pytorch {pytorch_ms[key] * 1e3:7.1f} us "
            f"{nbytes / pytorch_ms[key] / 1e6:5.0f} GB/s | {pytorch_ms[key] / triton_time:4.1f}x"
        )
    assert triton_ms["forward graph"] < pytorch_ms["forward graph"]
    assert triton_ms["backward graph"] < pytorch_ms["backward graph"]


@pytest.mark.parametrize(("rows", "hidden"), [(1, 2048), (64, 4096), (1023, 5000)])
def test_add_rms_norm_equals_the_add_then_the_norm(rows: int, hidden: int):
    """The fused residual add + norm of a decode step: bit for bit the add, then rms_norm."""
    torch.manual_seed(0)
    x, branch = (torch.randn(rows, hidden, device="cuda").bfloat16() for _ in "xb")
    weight = 1 + 0.1 * torch.randn(hidden, device="cuda")
    with torch.no_grad():
        normed, total = add_rms_norm(x, branch, weight, EPS)
        torch.testing.assert_close(total, x + branch, rtol=0, atol=0)
        torch.testing.assert_close(normed, rms_norm(x + branch, weight, EPS), rtol=0, atol=0)
