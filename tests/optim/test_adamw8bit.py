"""8-bit AdamW (memfit.optim.AdamW8bit, memfit.ops.adamw8bit): the code and its round trip, the
fused Triton step against the torch path (under the interpreter on CPU), the update against
torch's fp32 AdamW, state bytes, exact resume, stochastic rounding, bad input (training the
tiny preset: tests/optim/test_training.py)."""

import contextlib
import io

import pytest
import torch

from memfit.ops import adamw8bit as ops
from memfit.ops._triton import interpreter_enabled, triton_on_cpu
from memfit.optim import get_optimizer
from memfit.optim.adamw8bit import AdamW8bit, state_bytes

SHAPES = [(37, 50), (5, 256), (129, 96), (4099,), (33,)]


def wide_values(n: int, signed: bool, seed: int = 0) -> torch.Tensor:
    """Values spread over nine decades, shuffled so that each block mixes them."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.logspace(-9, 0, n)[torch.randperm(n, generator=generator)]
    values = torch.rand(n, generator=generator) * magnitude
    if signed:
        values *= torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    return values


@pytest.mark.parametrize("signed", [True, False])
def test_the_code_is_ordered_and_exact_at_the_top(signed):
    code = ops.dynamic_code(signed)
    assert code.shape == (256,) and code.dtype == torch.float32
    magnitudes = code[:128] if signed else code
    assert magnitudes[0] == 0 and magnitudes[-1] == 1
    assert bool((magnitudes[1:] > magnitudes[:-1]).all())
    assert magnitudes[1] == pytest.approx(10.0 ** -(6 if signed else 7))
    if signed:
        assert torch.equal(code[128:], -code[:128])


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_picks_the_nearest_value_of_the_code(signed):
    x = wide_values(3 * 256 + 77, signed)
    codes, absmax = ops.quantize(x, signed)
    assert codes.dtype == torch.uint8 and absmax.shape == (4,)
    scale = absmax.repeat_interleave(256)[: x.numel()]
    code = ops.dynamic_code(signed)
    nearest = code[(x[:, None] / scale[:, None] - code[None, :]).abs().argmin(1)] * scale
    got = ops.dequantize(codes, absmax, signed)
    assert bool(((got - x).abs() <= (nearest - x).abs() * (1 + 1e-6) + 1e-30).all())
    # the round trip's error, per block: at most half the code's widest step (of the absmax)
    widest = 0.9 / 2 ** (6 if signed else 7)
    assert bool(((got - x).abs() <= scale * widest / 2 * (1 + 1e-5)).all())
    # the largest element of each block is stored exactly
    for b in range(4):
        block = x[b * 256 : (b + 1) * 256]
        top = block.abs().argmax()
        assert got[b * 256 + top] == block[top]


def _states(params, quantized):
    states = []
    for p in params:
        if quantized:
            blocks = -(-p.numel() // 256)
            states.append({
                "exp_avg_codes": torch.zeros_like(p, dtype=torch.uint8),
                "exp_avg_absmax": torch.zeros(blocks),
                "exp_avg_sq_root_codes": torch.zeros_like(p, dtype=torch.uint8),
                "exp_avg_sq_root_absmax": torch.zeros(blocks),
            })  # fmt: skip
        else:
            states.append({"exp_avg": torch.zeros_like(p, dtype=torch.float32),
                           "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)})  # fmt: skip
    return states


@pytest.mark.skipif(not interpreter_enabled(), reason="the kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantized", [True, False])
def test_fused_step_matches_the_torch_path(quantized, dtype):
    generator = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=generator).to(dtype) for s in SHAPES]
    copies = [p.clone() for p in params]
    states, copy_states = _states(params, quantized), _states(params, quantized)
    table = ops.ChunkTable([p.numel() for p in params], torch.device("cpu"))
    options = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    for step in range(1, 4):
        grads = [torch.randn(s, generator=generator).to(dtype) for s in SHAPES]
        for p, g, s in zip(copies, grads, copy_states, strict=True):
            ops.adamw_step_reference(p, g, s, step=step, **options)
        with triton_on_cpu():
            ops.fused_adamw_step(params, grads, states, table, step=step, **options)
    for p, q in zip(params, copies, strict=True):
        # fp32: the same arithmetic up to the order of rounding (fused multiply-adds); bf16:
        # one rounding of the parameter apart at most
        tolerance = 1e-6 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(p.float(), q.float(), rtol=tolerance, atol=tolerance)
    for s, t in zip(states, copy_states, strict=True):
        for key in s:
            if s[key].dtype == torch.uint8:  # a rounding apart flips a code, rarely
                assert (s[key] != t[key]).float().mean() < 2e-3, key
            else:
                torch.testing.assert_close(s[key], t[key], rtol=1e-5, atol=1e-7)


class _Model(torch.nn.Module):
    """Odd sizes: tensors that straddle blocks, one under the 8-bit threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(67, 129)
        self.b = torch.nn.Linear(129, 45)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _train(optimizer_class, steps, seed=0, **options):
    torch.manual_seed(seed)
    model = _Model()
    optimizer = optimizer_class(model.parameters(), **options)
    generator = torch.Generator().manual_seed(seed + 1)
    target = torch.nn.Linear(67, 45)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 67, generator=generator)
        loss = (model(x) - target(x).detach()).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def test_the_update_follows_fp32_adamw_over_100_steps():
    """Against torch.optim.AdamW from the same start: after 100 steps the parameters have moved
    alike (the 8-bit run's distance from the fp32 run under 5% of how far the fp32 run moved),
    and so has the loss."""
    options = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    start, _ = _train(AdamW8bit, 0)
    exact, exact_losses = _train(torch.optim.AdamW, 100, **options)
    quantized, losses = _train(AdamW8bit, 100, **options)
    for (name, p0), p32, p8 in zip(
        start.named_parameters(), exact.parameters(), quantized.parameters(), strict=True
    ):
        moved = (p32 - p0).norm()
        assert (p8 - p32).norm() < 0.05 * moved, name
    assert losses[-1] == pytest.approx(exact_losses[-1], rel=0.03)


def test_state_bytes_are_what_it_keeps():
    model = _Model()
    optimizer = AdamW8bit(model.parameters(), min_8bit_size=100)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    for param in model.parameters():
        kept = sum(t.nbytes for key, t in optimizer.state[param].items() if key != "step")
        assert kept == state_bytes(param.numel(), quantized=param.numel() >= 100)
    spec = get_optimizer("adamw8bit")
    assert spec.state_bytes_per_param == 2 + 8 / 256
    assert state_bytes(256 * 1000) == 256 * 1000 * spec.state_bytes_per_param


@pytest.mark.parametrize("triton", [False, True])
def test_resume_is_exact(triton):
    if triton and not interpreter_enabled():
        pytest.skip("the kernel on CPU needs TRITON_INTERPRET=1")
    with triton_on_cpu() if triton else contextlib.nullcontext():
        torch.manual_seed(0)
        model = _Model()
        optimizer = AdamW8bit(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(3)
        grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(10)]

        def run(model, optimizer, steps):
            for step_grads in steps:
                for p, g in zip(model.parameters(), step_grads, strict=True):
                    p.grad = g.clone()
                optimizer.step()

        run(model, optimizer, grads[:5])
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, buffer)
        run(model, optimizer, grads[5:])
        buffer.seek(0)
        saved = torch.load(buffer)
        resumed = _Model()
        resumed.load_state_dict(saved["model"])
        again = AdamW8bit(resumed.parameters(), lr=1e-2)
        again.load_state_dict(saved["optim"])
        assert again.state[next(resumed.parameters())]["exp_avg_codes"].dtype == torch.uint8
        run(resumed, again, grads[5:])
        for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
            assert torch.equal(p, q)
        del generator


def test_bad_input_is_named():
    w = torch.nn.Parameter(torch.ones(4, 4))
    with pytest.raises(ValueError, match="AdamW8bit: lr must be >= 0"):
        AdamW8bit([w], lr=-1)
    with pytest.raises(ValueError, match=r"AdamW8bit: betas must be in \[0, 1\)"):
        AdamW8bit([w], betas=(0.9, 1.0))
    half = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.float16))
    half.grad = torch.ones_like(half)
    with pytest.raises(ValueError, match="AdamW8bit: parameters must be fp32 or bf16"):
        AdamW8bit([half]).step()
    sparse = torch.nn.Parameter(torch.ones(4, 4))
    sparse.grad = torch.ones(4, 4).to_sparse()
    with pytest.raises(ValueError, match="sparse gradients"):
        AdamW8bit([sparse]).step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_on_the_gpu_matches_the_torch_path(dtype):
    """The compiled kernel at llama shapes (and odd ones) against the torch path on the GPU."""
    shapes = [(2048, 2048), (8192, 2048), (128256 // 64, 2048), (37, 50), (4099,)]
    generator = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=generator).to(dtype) for s in shapes]
    copies = [p.clone() for p in params]
    for quantized in (True, False):
        states = [{k: v.cuda() for k, v in s.items()} for s in _states(params, quantized)]
        copy_states = [{k: v.clone() for k, v in s.items()} for s in states]
        table = ops.ChunkTable([p.numel() for p in params], torch.device("cuda"))
        options = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
        for step in range(1, 4):
            grads = [torch.randn(s, device="cuda", generator=generator).to(dtype) for s in shapes]
            ops.fused_adamw_step(params, grads, states, table, step=step, **options)
            for p, g, s in zip(copies, grads, copy_states, strict=True):
                ops.adamw_step_reference(p, g, s, step=step, **options)
        # fp32: equal to rounding, except where an fp32 difference in the last bits moved a
        # state across a code boundary: one code step of a moment moves the update by at most
        # about lr (rare: the codes below agree to 2e-3)
        tolerance = 1e-6 if dtype == torch.float32 else 2**-8
        for p, q in zip(params, copies, strict=True):
            close = torch.isclose(p.float(), q.float(), rtol=tolerance, atol=tolerance)
            assert (~close).float().mean() < 1e-4
            assert (p.float() - q.float()).abs().max() <= 2 * options["lr"] + tolerance
        for s, t in zip(states, copy_states, strict=True):
            for key in s:
                if s[key].dtype == torch.uint8:
                    assert (s[key] != t[key]).float().mean() < 2e-3, key


@pytest.mark.parametrize("triton", [False, True])
def test_stochastic_rounding_keeps_updates_below_the_bf16_step(triton):
    """Decay of 1e-4 a step on bf16 ones (a step of 2^-8 below 1): rounding to nearest never
    moves them; stochastic rounding follows the exact decay on average."""
    if triton and not interpreter_enabled():
        pytest.skip("the kernel on CPU needs TRITON_INTERPRET=1")
    with triton_on_cpu() if triton else contextlib.nullcontext():
        finals = {}
        for stochastic in (False, True):
            w = torch.nn.Parameter(torch.ones(64, 128, dtype=torch.bfloat16))
            optimizer = AdamW8bit([w], lr=1e-2, weight_decay=1e-2, stochastic_rounding=stochastic)
            for _ in range(100):
                w.grad = torch.zeros_like(w)
                optimizer.step()
            finals[stochastic] = w.detach().float()
        assert torch.equal(finals[False], torch.ones(64, 128))
        exact = (1 - 1e-4) ** 100
        assert finals[True].mean().item() == pytest.approx(exact, abs=2e-4)
        assert finals[True].std().item() > 0


def test_the_torch_path_in_chunks_equals_one_pass(monkeypatch):
    """The CPU step in chunks of a multiple of the block: bitwise the values of one pass."""
    import memfit.optim.adamw8bit as module

    generator = torch.Generator().manual_seed(5)
    weights = [torch.randn(3000, 7, generator=generator) for _ in range(2)]
    grads = [[torch.randn(3000, 7, generator=generator) for _ in range(2)] for _ in range(3)]
    results = []
    for chunk in (1 << 20, 512):
        monkeypatch.setattr(module, "CPU_CHUNK", chunk)
        w = torch.nn.Parameter(weights[0].clone())
        optimizer = AdamW8bit([w], lr=1e-2)
        for step_grads in grads:
            w.grad = step_grads[0].clone()
            optimizer.step()
        results.append((w.detach().clone(), dict(optimizer.state[w])))
    assert torch.equal(results[0][0], results[1][0])
    for key, value in results[0][1].items():
        assert torch.equal(value, results[1][1][key]), key
