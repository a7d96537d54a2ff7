"""Adafactor (memfit.optim.adafactor, memfit.ops.optim_factored): the Triton kernels against the
PyTorch path (under the interpreter on CPU; compiled at llama shapes on a GPU), the PyTorch path
against a float64 transcription of the paper's Algorithms 4 and 5, state bytes, exact resume,
convergence next to AdamW, and bad input."""

import contextlib
import io
import math

import pytest
import torch

import memfit.ops.optim_factored as ops
import memfit.optim.adafactor as adafactor_module
from memfit.ops._triton import interpreter_enabled, triton_on_cpu
from memfit.optim.adafactor import Adafactor, state_bytes
from tests.reference import assert_error_within

SHAPES = [(37, 50), (5, 256), (129, 96), (33,), (3, 7, 20)]
OPTIONS = {
    "defaults": dict(lr=0.05),  # scale_parameter, clipping at 1, no momentum
    "momentum, weight decay": dict(lr=0.1, scale_parameter=False, beta1=0.9, weight_decay=0.1),
    "relative step, no clipping": dict(
        lr=None, relative_step=True, clip_threshold=math.inf, decay_rate=-0.5
    ),
}
needs_interpreter = pytest.mark.skipif(
    not interpreter_enabled(), reason="the kernels on CPU need TRITON_INTERPRET=1"
)


def fresh_inputs(shape, steps, *, dtype=torch.float32, device="cpu", seed=0):
    """A parameter and `steps` gradients of `shape`; the gradients' scale changes over the
    steps so that the second-moment statistics matter."""
    generator = torch.Generator().manual_seed(seed + sum(shape))
    param = torch.randn(shape, generator=generator)
    grads = [torch.randn(shape, generator=generator) * 3.0**-k for k in range(steps)]
    return param.to(device, dtype), [g.to(device, dtype) for g in grads]


def run(param, grads, options, *, kernels=False, optimizer=None):
    """Steps of Adafactor(**options) on a copy of `param`: (parameter, optimizer)."""
    param = torch.nn.Parameter(param.clone())
    optimizer = optimizer or Adafactor([param], **options)
    with triton_on_cpu() if kernels and param.device.type == "cpu" else contextlib.nullcontext():
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
    return param.detach(), optimizer


def assert_same(got, want, dtype, name):
    """Equal to fp32 rounding (rtol 1e-5), or within one rounding of a 16-bit dtype."""
    scale = want.float().abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale, msg=name)
    else:
        one_rounding = torch.finfo(dtype).eps * (want.float().abs() + 1e-3 * scale)
        assert bool(((got.float() - want.float()).abs() <= one_rounding).all()), name


def assert_within_torch_error(kernel_run, torch_run, fp32_run):
    """A 16-bit run of the kernels against the torch path's in the same dtype, both measured
    against the torch path in fp32 from the same start: the parameter's and the momentum's
    errors within twice the torch path's (rounding to 16 bits differs where the last fp32 bits
    do: sqrt, rsqrt and division compiled, and the momentum amplifies a flipped rounding where
    it cancels)."""
    (got, got_optimizer), (want, want_optimizer), (exact, exact_optimizer) = (
        kernel_run,
        torch_run,
        fp32_run,
    )
    assert_error_within(got.float(), want.float(), exact, name="parameter")
    (got_state,) = got_optimizer.state.values()
    (want_state,) = want_optimizer.state.values()
    (exact_state,) = exact_optimizer.state.values()
    if "momentum" in want_state:
        assert got_state["momentum"].dtype == want_state["momentum"].dtype
        assert_error_within(
            got_state["momentum"].float(), want_state["momentum"].float(),
            exact_state["momentum"], name="momentum",
        )  # fmt: skip


def assert_same_states(got_optimizer, want_optimizer, dtype):
    (got,) = got_optimizer.state.values()
    (want,) = want_optimizer.state.values()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].device == value.device
        if key == "step":
            assert got[key].device.type == "cpu" and torch.equal(got[key], value)
        else:
            assert_same(got[key], value, dtype if key == "momentum" else torch.float32, key)


# ---------------------------------------------------------------------------------------------
# The kernels against the PyTorch path.
# ---------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernels_match_the_torch_path(shape, options):
    param, grads = fresh_inputs(shape, 3)
    want, want_optimizer = run(param, grads, options)
    got, got_optimizer = run(param, grads, options, kernels=True)
    assert_same(got, want, torch.float32, "parameter")
    assert_same_states(got_optimizer, want_optimizer, torch.float32)
    assert not torch.equal(want, param)


@needs_interpreter
@pytest.mark.parametrize("shape", [(37, 50), (33,)], ids=str)
def test_kernels_match_the_torch_path_in_bf16(shape):
    options = OPTIONS["momentum, weight decay"]
    param, grads = fresh_inputs(shape, 3, dtype=torch.bfloat16)
    want, want_optimizer = run(param, grads, options)
    got, got_optimizer = run(param, grads, options, kernels=True)
    assert got.dtype == torch.bfloat16
    assert_same(got, want, torch.bfloat16, "parameter")
    assert_same_states(got_optimizer, want_optimizer, torch.bfloat16)


@needs_interpreter
def test_a_matrix_step_is_four_launches_and_a_vector_two(monkeypatch):
    """Pass 1 (sums of g**2), the EMA of R and C, the sum of u**2, the update; no loop of
    small ops. Without clipping, the third launch goes."""
    kernels = []
    real_launch = ops.launch
    monkeypatch.setattr(
        ops, "launch", lambda k, *a, **kw: kernels.append(k) or real_launch(k, *a, **kw)
    )
    for shape, clip, count in [((37, 50), 1.0, 4), ((37, 50), math.inf, 3), ((33,), 1.0, 2)]:
        kernels.clear()
        param, grads = fresh_inputs(shape, 1)
        run(param, grads, dict(lr=0.1, clip_threshold=clip, beta1=0.9), kernels=True)
        assert len(kernels) == count, (shape, clip, kernels)


def step_in_kernels(monkeypatch, optimizer_class, inputs, options):
    """Step fresh parameters of `inputs` ((start, grads) pairs) through the interpreted kernels,
    one step per gradient; returns the parameters, the optimizer and the kernels the last step
    launched."""
    kernels = []
    real_launch = ops.launch
    monkeypatch.setattr(
        ops, "launch", lambda k, *a, **kw: kernels.append(k) or real_launch(k, *a, **kw)
    )
    params = [torch.nn.Parameter(p.clone()) for p, _ in inputs]
    optimizer = optimizer_class(params, **options)
    with triton_on_cpu():
        for step in range(len(inputs[0][1])):
            kernels.clear()
            for param, (_, grads) in zip(params, inputs, strict=True):
                param.grad = grads[step].clone()
            optimizer.step()
    return params, optimizer, kernels


@needs_interpreter
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_matrices_of_one_shape_step_together_as_each_alone(monkeypatch, options):
    """Matrices of one (rows, cols) and dtype, a batch of them in one tensor among them,
    share each pass's launch (four for all, beside two per vector), and each gets the step
    it gets alone in the torch path: its own statistics and its own tensor's RMS(u), RMS(p)."""
    shapes = [(37, 50), (2, 37, 50), (37, 50), (33,), (20, 50)]
    inputs = [fresh_inputs(shape, 3, seed=i) for i, shape in enumerate(shapes)]
    params, optimizer, kernels = step_in_kernels(monkeypatch, Adafactor, inputs, options)
    clip = math.isfinite(options.get("clip_threshold", 1.0))
    assert len(kernels) == 2 * (3 + clip) + 2  # two sets of matrices, one vector
    for param, (start, grads) in zip(params, inputs, strict=True):
        want, want_optimizer = run(start, grads, options)
        assert_same(param.detach(), want, torch.float32, "parameter")
        got_state, (want_state,) = optimizer.state[param], want_optimizer.state.values()
        for key, value in want_state.items():
            assert_same(got_state[key], value, torch.float32, key)


@needs_interpreter
def test_zero_rows_and_columns_of_gradient_give_a_zero_update():
    """eps1 keeps R and C positive: a zero row or column moves nothing (no 0/0)."""
    param, (grad,) = fresh_inputs((37, 50), 1)
    grad[3] = 0.0
    grad[:, 7] = 0.0
    options = dict(lr=0.1, scale_parameter=False)
    for kernels in (False, True):
        got, _ = run(param, [grad], options, kernels=kernels)
        assert bool(got.isfinite().all())
        assert torch.equal(got[3], param[3]) and torch.equal(got[:, 7], param[:, 7])


# ---------------------------------------------------------------------------------------------
# The PyTorch path against the paper's algorithm, in float64.
# ---------------------------------------------------------------------------------------------


def adafactor_paper(
    param,
    grads,
    *,
    lr=None,
    eps=(1e-30, 1e-3),
    clip_threshold=1.0,
    decay_rate=-0.8,
    beta1=None,
    weight_decay=0.0,
    scale_parameter=True,
    relative_step=False,
    warmup_init=False,
):
    """Shazeer and Stern 2018, Algorithms 4 (>= 2 dims, here with the paper's row and column
    sums) and 5 (vectors), with update clipping, relative step sizes, the first moment of the
    clipped update and decoupled weight decay, in the dtype of `param` (run it in float64 for
    the exact answer)."""
    eps1, eps2 = eps
    x = param.clone()
    row_sums = col_sums = second_moment = momentum = None
    rms = lambda t: t.square().mean().sqrt()
    for t, grad in enumerate(grads, start=1):
        grad = grad.to(x.dtype)
        if relative_step:
            rho = min(1e-6 * t if warmup_init else 1e-2, 1 / math.sqrt(t))
        else:
            rho = lr
        alpha = torch.clamp(rms(x), min=eps2) * rho if scale_parameter else rho
        beta2 = 1 - t**decay_rate
        square = grad**2 + eps1
        if x.dim() >= 2:
            # R_t = beta2 R + (1 - beta2) (G**2 + eps1) 1_m; C_t = ... 1_n^T (G**2 + eps1)
            new_rows, new_cols = square.sum(-1), square.sum(-2)
            row_sums = new_rows * (1 - beta2) + (row_sums * beta2 if t > 1 else 0)
            col_sums = new_cols * (1 - beta2) + (col_sums * beta2 if t > 1 else 0)
            # V = R C / (1_n^T R)
            v = row_sums[..., :, None] * col_sums[..., None, :] / row_sums.sum(-1)[..., None, None]
        else:
            second_moment = square * (1 - beta2) + (second_moment * beta2 if t > 1 else 0)
            v = second_moment
        u = grad / v.sqrt()
        u = u / torch.clamp(rms(u) / clip_threshold, min=1.0)
        if beta1 is not None:
            momentum = u * (1 - beta1) + (momentum * beta1 if t > 1 else 0)
            u = momentum
        x = x - alpha * u - alpha * weight_decay * x
    return x


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_path_follows_the_paper_in_float64(shape, options):
    """10 steps: the error against the float64 algorithm at most 2x that of the same algorithm
    run in fp32."""
    param, grads = fresh_inputs(shape, 10)
    got, _ = run(param, grads, options)
    exact = adafactor_paper(param.double(), [g.double() for g in grads], **options)
    baseline = adafactor_paper(param, grads, **options)
    assert_error_within(got, baseline, exact, name=f"Adafactor {shape}", floor=1e-6)
    assert (exact - param.double()).abs().max() > 1e-3  # the parameter moved


# ---------------------------------------------------------------------------------------------
# State bytes, resume, convergence.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta1", [None, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 50), (3, 7, 20), (33,), (), (2048, 2048)], ids=str)
def test_state_bytes_are_what_it_keeps(shape, dtype, beta1):
    """Every tensor state but the CPU step counter, after one step."""
    param = torch.nn.Parameter(torch.randn(shape).to(dtype))
    optimizer = Adafactor([param], lr=0.1, beta1=beta1)
    param.grad = torch.randn(shape).to(dtype)
    optimizer.step()
    state = optimizer.state[param]
    kept = sum(t.nbytes for key, t in state.items() if key != "step")
    assert (
        kept
        == state_bytes(shape, dtype, beta1=beta1)
        == Adafactor.state_bytes(shape, dtype, beta1=beta1)
    )
    assert state["step"].device.type == "cpu" and state["step"].dtype == torch.float32
    if len(shape) >= 2:
        assert state["row"].dtype == state["col"].dtype == torch.float32
    if shape == (2048, 2048):  # 0.1 bytes per parameter is the target
        assert state_bytes(shape, dtype) / param.numel() < 0.01


@pytest.mark.parametrize(
    ("dtype", "kernels"),
    [
        (torch.float32, False),
        (torch.bfloat16, False),
        (torch.float32, True),
        (torch.bfloat16, True),
    ],
)
def test_resume_is_exact(dtype, kernels):
    """5 steps, save (through torch.save), 5 more; a fresh optimizer loads the checkpoint and
    takes the same 5 steps: bitwise the same parameters and states. A bf16 parameter keeps its
    statistics in fp32 through load_state_dict (torch's would cast them to bf16)."""
    if kernels and not interpreter_enabled():
        pytest.skip("the kernels on CPU need TRITON_INTERPRET=1")
    shapes = [(37, 50), (33,), (3, 7, 20)] if not kernels else [(13, 40), (9,)]
    options = dict(lr=0.05, beta1=0.9, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in shapes]
    grads = [[torch.randn(s, generator=generator).to(dtype) for s in shapes] for _ in range(10)]
    optimizer = Adafactor(params, **options)

    def steps(optimizer, params, grads):
        with triton_on_cpu() if kernels else contextlib.nullcontext():
            for step_grads in grads:
                for param, grad in zip(params, step_grads, strict=True):
                    param.grad = grad.clone()
                optimizer.step()

    steps(optimizer, params, grads[:5])
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    saved_params = [p.detach().clone() for p in params]
    steps(optimizer, params, grads[5:])

    buffer.seek(0)
    resumed_params = [torch.nn.Parameter(p.clone()) for p in saved_params]
    resumed = Adafactor(resumed_params, **options)
    resumed.load_state_dict(torch.load(buffer))
    steps(resumed, resumed_params, grads[5:])
    for param, resumed_param in zip(params, resumed_params, strict=True):
        assert torch.equal(param, resumed_param)
        state, resumed_state = optimizer.state[param], resumed.state[resumed_param]
        for key, value in state.items():
            assert resumed_state[key].dtype == value.dtype, key
            assert torch.equal(resumed_state[key], value), key
    assert resumed.state[resumed_params[0]]["step"].item() == 10


def mlp_regression(make_optimizer, steps=200, seed=0):
    """A 16-64-4 tanh MLP fit to a random teacher of the same kind, full batch: the losses
    before and after `steps` steps."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 16, generator=generator)
    teacher_hidden = torch.randn(16, 32, generator=generator) / 4
    teacher_out = torch.randn(32, 4, generator=generator) / 32**0.5
    y = torch.tanh(x @ teacher_hidden) @ teacher_out
    torch.manual_seed(seed + 1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    optimizer = make_optimizer(model.parameters())
    loss = first = torch.nn.functional.mse_loss(model(x), y)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y)
    return first.item(), loss.item()


@pytest.fixture
def one_thread():
    """The problem is tiny: one thread (several spin against each other on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_converges_like_adamw(one_thread):
    """200 full-batch steps: the loss falls more than 10x, and ends within 4x of AdamW's at
    the same lr (1e-2; absolute steps: scale_parameter=False) and within 5x of it with the
    paper's relative step sizes (no lr at all)."""
    _, adamw = mlp_regression(lambda p: torch.optim.AdamW(p, lr=1e-2))
    for options, factor in [
        (dict(lr=1e-2, scale_parameter=False, beta1=0.9), 4),
        (dict(lr=1e-2, scale_parameter=False), 4),
        (dict(lr=None, relative_step=True), 5),
    ]:
        first, last = mlp_regression(lambda p, options=options: Adafactor(p, **options))
        assert last < first / 10, (options, first, last)
        assert last < factor * adamw, (options, last, adamw)


# ---------------------------------------------------------------------------------------------
# Bad input, gradients that are None or sparse.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(), "Adafactor: lr is None; pass a float lr, or relative_step=True"),
        (dict(lr=1e-2, relative_step=True), "Adafactor: lr must be None with relative_step=True"),
        (dict(lr=-1.0), "Adafactor: lr must be a float >= 0, got -1.0"),
        (dict(lr=1e-2, clip_threshold=-1), r"Adafactor: clip_threshold must be > 0 .*got -1"),
        (dict(lr=1e-2, eps=(0.0, 1e-3)), r"Adafactor: eps\[0\] .* must be > 0, got 0.0"),
        (dict(lr=1e-2, eps=(1e-30, -1.0)), r"Adafactor: eps\[1\] .* must be >= 0, got -1.0"),
        (dict(lr=1e-2, eps=1e-30), r"Adafactor: eps must be a pair \(eps1, eps2\), got 1e-30"),
        (dict(lr=1e-2, decay_rate=0.5), "Adafactor: decay_rate must be <= 0 .*got 0.5"),
        (dict(lr=1e-2, beta1=1.0), r"Adafactor: beta1 must be None .* or in \[0, 1\), got 1.0"),
        (dict(lr=1e-2, weight_decay=-0.1), "Adafactor: weight_decay must be >= 0, got -0.1"),
        (dict(lr=1e-2, scale_parameter=1), "Adafactor: scale_parameter must be True or False"),
        (dict(lr=1e-2, warmup_init=True), "Adafactor: warmup_init=True needs relative_step=True"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        Adafactor([torch.nn.Parameter(torch.ones(3, 4))], **options)


def test_bad_input_is_refused_and_missing_gradients_skipped():
    param = torch.nn.Parameter(torch.ones(3, 4))
    with pytest.raises(ValueError, match="Adafactor: clip_threshold must be > 0"):
        Adafactor([{"params": [param], "clip_threshold": 0.0}], lr=1e-2)
    optimizer = Adafactor([param], lr=1e-2)
    param.grad = torch.ones(3, 4).to_sparse()
    with pytest.raises(RuntimeError, match="Adafactor does not take sparse gradients"):
        optimizer.step()
    wide = torch.nn.Parameter(torch.ones(3, 4, dtype=torch.float64))
    wide.grad = torch.ones_like(wide)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16, got torch.float64"):
        Adafactor([wide], lr=1e-2).step()

    frozen, moving = torch.nn.Parameter(torch.ones(5, 6)), torch.nn.Parameter(torch.ones(6))
    optimizer = Adafactor([frozen, moving], lr=1e-2)
    moving.grad = torch.randn(6)
    optimizer.step()
    assert torch.equal(frozen, torch.ones(5, 6)) and not optimizer.state[frozen]
    assert not torch.equal(moving, torch.ones(6)) and optimizer.state[moving]["step"] == 1


# ---------------------------------------------------------------------------------------------
# GPU twin: the compiled kernels at llama shapes.
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2048, 2048), (8192, 2048), (2048,)], ids=str)
def test_kernels_on_the_gpu_match_the_torch_path_at_llama_shapes(shape, dtype, options):
    """fp32: the torch path's values to rounding; 16-bit: see `assert_within_torch_error`."""
    param, grads = fresh_inputs(shape, 3, dtype=dtype, device="cuda")
    got, got_optimizer = run(param, grads, options)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(adafactor_module, "use_triton", lambda tensor: False)
        want, want_optimizer = run(param, grads, options)
        fp32 = run(param.float(), [g.float() for g in grads], options)
    if dtype == torch.float32:
        assert_same(got, want, dtype, "parameter")
        assert_same_states(got_optimizer, want_optimizer, dtype)
    else:
        assert_within_torch_error((got, got_optimizer), (want, want_optimizer), fp32)
    rerun, _ = run(param, grads, options)  # no atomics: a rerun is bitwise the same
    assert torch.equal(rerun, got)
