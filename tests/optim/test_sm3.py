"""SM3 (memfit.optim.sm3, memfit.ops.optim_factored): the Triton kernels against the PyTorch path
(under the interpreter on CPU; compiled at llama shapes on a GPU), the PyTorch path against a
float64 transcription of SM3-II with explicit cover sets, state bytes, exact resume, convergence
next to AdamW, and bad input."""

import contextlib
import io

import pytest
import torch

import memfit.ops.optim_factored as ops
import memfit.optim.sm3 as sm3_module
from memfit.ops._triton import interpreter_enabled, triton_on_cpu
from memfit.optim.sm3 import SM3, state_bytes
from tests.optim.test_adafactor import (
    assert_same,
    assert_same_states,
    assert_within_torch_error,
    fresh_inputs,
    mlp_regression,
    step_in_kernels,
)
from tests.reference import assert_error_within

SHAPES = [(37, 50), (5, 256), (129, 96), (33,), (3, 7, 20)]
OPTIONS = {
    "defaults": dict(lr=0.1),  # momentum 0.9
    "no momentum, weight decay": dict(lr=0.1, beta1=0.0, weight_decay=0.1),
    "eps": dict(lr=0.05, beta1=0.5, eps=1e-3),
}
needs_interpreter = pytest.mark.skipif(
    not interpreter_enabled(), reason="the kernels on CPU need TRITON_INTERPRET=1"
)


def run(param, grads, options, *, kernels=False):
    """Steps of SM3(**options) on a copy of `param`: (parameter, optimizer)."""
    param = torch.nn.Parameter(param.clone())
    optimizer = SM3([param], **options)
    with triton_on_cpu() if kernels and param.device.type == "cpu" else contextlib.nullcontext():
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
    return param.detach(), optimizer


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
    options = OPTIONS["defaults"] | dict(weight_decay=0.1)
    param, grads = fresh_inputs(shape, 3, dtype=torch.bfloat16)
    want, want_optimizer = run(param, grads, options)
    got, got_optimizer = run(param, grads, options, kernels=True)
    assert got.dtype == torch.bfloat16
    assert_same(got, want, torch.bfloat16, "parameter")
    assert_same_states(got_optimizer, want_optimizer, torch.bfloat16)


@needs_interpreter
def test_a_matrix_step_is_two_launches_and_a_vector_one(monkeypatch):
    """One pass over the matrix (nu, the update, the partial maxima), then the tiny kernel
    that reduces the maxima into the accumulators."""
    kernels = []
    real_launch = ops.launch
    monkeypatch.setattr(
        ops, "launch", lambda k, *a, **kw: kernels.append(k) or real_launch(k, *a, **kw)
    )
    for shape, count in [((37, 50), 2), ((3, 7, 20), 2), ((33,), 1)]:
        kernels.clear()
        param, grads = fresh_inputs(shape, 1)
        run(param, grads, dict(lr=0.1), kernels=True)
        assert len(kernels) == count, (shape, kernels)


@needs_interpreter
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_matrices_of_one_shape_step_together_as_each_alone(monkeypatch, options):
    """Matrices whose (rows, cols) views agree (a (3, 7, 20) tensor is a (21, 20) matrix)
    share the two launches, beside one per vector, and each gets the step it gets alone in
    the torch path: its own accumulators."""
    shapes = [(21, 20), (3, 7, 20), (21, 20), (33,), (5, 20)]
    inputs = [fresh_inputs(shape, 3, seed=i) for i, shape in enumerate(shapes)]
    params, optimizer, kernels = step_in_kernels(monkeypatch, SM3, inputs, options)
    assert len(kernels) == 2 * 2 + 1  # two sets of matrices, one vector
    for param, (start, grads) in zip(params, inputs, strict=True):
        want, want_optimizer = run(start, grads, options)
        assert_same(param.detach(), want, torch.float32, "parameter")
        got_state, (want_state,) = optimizer.state[param], want_optimizer.state.values()
        for key, value in want_state.items():
            assert_same(got_state[key], value, torch.float32, key)


@needs_interpreter
def test_zero_gradients_give_a_zero_update_not_nan():
    """eps = 0: nu is 0 where a row and a column have seen only zeros; the safe divide makes
    the update 0 there."""
    param, (grad, later) = fresh_inputs((37, 50), 2)
    grad[3] = 0.0
    grad[:, 7] = 0.0
    later[3, 7] = 0.0
    options = dict(lr=0.1, beta1=0.0)
    for kernels in (False, True):
        got, optimizer = run(param, [grad], options, kernels=kernels)
        assert bool(got.isfinite().all())
        assert torch.equal(got[3], param[3]) and torch.equal(got[:, 7], param[:, 7])
        state = optimizer.state[next(iter(optimizer.state))]
        assert state["row_acc"][3] == 0 and state["col_acc"][7] == 0
        got, _ = run(param, [grad, later], options, kernels=kernels)
        assert bool(got.isfinite().all()) and got[3, 7] == param[3, 7]


# ---------------------------------------------------------------------------------------------
# The PyTorch path against the paper's algorithm, in float64.
# ---------------------------------------------------------------------------------------------


def sm3_paper(param, grads, *, lr=0.1, beta1=0.9, eps=0.0, weight_decay=0.0):
    """Anil et al. 2019, SM3-II, with explicit cover sets S_r and one mu_r each:
    the rows and the columns of the (prod(shape[:-1]), shape[-1]) matrix, or one set per
    element for fewer than 2 dims; then momentum of the preconditioned gradient (the authors'
    implementation) and decoupled weight decay. In the dtype of `param`."""
    x = param.clone()
    matrix_shape = (-1, x.shape[-1]) if x.dim() >= 2 else (1, -1)
    rows, cols = x.reshape(matrix_shape).shape
    covers = []  # (rows, cols) boolean masks
    if x.dim() >= 2:
        for i in range(rows):
            covers.append(torch.zeros(rows, cols, dtype=torch.bool))
            covers[-1][i] = True
        for j in range(cols):
            covers.append(torch.zeros(rows, cols, dtype=torch.bool))
            covers[-1][:, j] = True
    else:
        for j in range(cols):
            covers.append(torch.zeros(rows, cols, dtype=torch.bool))
            covers[-1][0, j] = True
    mu = torch.zeros(len(covers), dtype=x.dtype)
    momentum = torch.zeros_like(x)
    for grad in grads:
        g = grad.to(x.dtype).reshape(rows, cols)
        # nu_ij = min over the sets that hold (i, j) of mu_r, + g_ij**2
        nu = torch.full((rows, cols), torch.inf, dtype=x.dtype)
        for r, cover in enumerate(covers):
            nu[cover] = torch.minimum(nu[cover], mu[r])
        nu = nu + g * g
        for r, cover in enumerate(covers):
            mu[r] = nu[cover].max()
        u = torch.where(nu + eps > 0, g / (nu + eps).sqrt(), 0.0).reshape(x.shape)
        if beta1 > 0:
            momentum = beta1 * momentum + (1 - beta1) * u
            u = momentum
        x = x - lr * u - lr * weight_decay * x
    return x


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_path_follows_the_paper_in_float64(shape, options):
    """10 steps: the error against the float64 algorithm at most 2x that of the same algorithm
    run in fp32."""
    param, grads = fresh_inputs(shape, 10)
    got, _ = run(param, grads, options)
    exact = sm3_paper(param.double(), [g.double() for g in grads], **options)
    baseline = sm3_paper(param, grads, **options)
    assert_error_within(got, baseline, exact, name=f"SM3 {shape}", floor=1e-6)
    assert (exact - param.double()).abs().max() > 1e-3  # the parameter moved


# ---------------------------------------------------------------------------------------------
# State bytes, resume, convergence.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta1", [0.0, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 50), (3, 7, 20), (33,), (), (2048, 2048)], ids=str)
def test_state_bytes_are_what_it_keeps(shape, dtype, beta1):
    """Every tensor state but the CPU step counter, after one step."""
    param = torch.nn.Parameter(torch.randn(shape).to(dtype))
    optimizer = SM3([param], lr=0.1, beta1=beta1)
    param.grad = torch.randn(shape).to(dtype)
    optimizer.step()
    state = optimizer.state[param]
    kept = sum(t.nbytes for key, t in state.items() if key != "step")
    assert kept == state_bytes(shape, dtype, beta1=beta1)
    assert kept == SM3.state_bytes(shape, dtype, beta1=beta1)
    assert state["step"].device.type == "cpu" and state["step"].dtype == torch.float32
    assert ("momentum" in state) == (beta1 > 0)
    if shape == (2048, 2048) and beta1 == 0:  # 0.1 bytes per parameter is the target
        assert state_bytes(shape, dtype, beta1=0) / param.numel() < 0.01


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
    accumulators in fp32 through load_state_dict (torch's would cast them to bf16)."""
    if kernels and not interpreter_enabled():
        pytest.skip("the kernels on CPU need TRITON_INTERPRET=1")
    shapes = [(37, 50), (33,), (3, 7, 20)] if not kernels else [(13, 40), (9,)]
    options = dict(lr=0.05, beta1=0.9, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in shapes]
    grads = [[torch.randn(s, generator=generator).to(dtype) for s in shapes] for _ in range(10)]
    optimizer = SM3(params, **options)

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
    resumed = SM3(resumed_params, **options)
    resumed.load_state_dict(torch.load(buffer))
    steps(resumed, resumed_params, grads[5:])
    for param, resumed_param in zip(params, resumed_params, strict=True):
        assert torch.equal(param, resumed_param)
        state, resumed_state = optimizer.state[param], resumed.state[resumed_param]
        for key, value in state.items():
            assert resumed_state[key].dtype == value.dtype, key
            assert torch.equal(resumed_state[key], value), key
    assert resumed.state[resumed_params[0]]["step"].item() == 10


@pytest.fixture
def one_thread():
    """The problem is tiny: one thread (several spin against each other on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_converges_like_adamw(one_thread):
    """200 full-batch steps: the loss falls more than 10x and ends within 4x of AdamW's at
    lr 1e-2 (SM3's lr is Adagrad's scale: 0.1)."""
    _, adamw = mlp_regression(lambda p: torch.optim.AdamW(p, lr=1e-2))
    for options in [dict(lr=0.1), dict(lr=0.1, beta1=0.0)]:
        first, last = mlp_regression(lambda p, options=options: SM3(p, **options))
        assert last < first / 10, (options, first, last)
        assert last < 4 * adamw, (options, last, adamw)


# ---------------------------------------------------------------------------------------------
# Bad input, gradients that are None or sparse.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(lr=-1), "SM3: lr must be a float >= 0, got -1"),
        (dict(lr=None), "SM3: lr must be a float >= 0, got None"),
        (dict(beta1=1.0), r"SM3: beta1 must be in \[0, 1\) \(0: no momentum\), got 1.0"),
        (dict(beta1=-0.1), r"SM3: beta1 must be in \[0, 1\)"),
        (dict(eps=-1e-8), "SM3: eps must be >= 0, got -1e-08"),
        (dict(weight_decay=float("nan")), "SM3: weight_decay must be >= 0, got nan"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        SM3([torch.nn.Parameter(torch.ones(3, 4))], **options)


def test_bad_input_is_refused_and_missing_gradients_skipped():
    param = torch.nn.Parameter(torch.ones(3, 4))
    with pytest.raises(ValueError, match="SM3: beta1 must be in"):
        SM3([{"params": [param], "beta1": 2.0}])
    optimizer = SM3([param])
    param.grad = torch.ones(3, 4).to_sparse()
    with pytest.raises(RuntimeError, match="SM3 does not take sparse gradients"):
        optimizer.step()
    wide = torch.nn.Parameter(torch.ones(3, 4, dtype=torch.float64))
    wide.grad = torch.ones_like(wide)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16, got torch.float64"):
        SM3([wide]).step()

    frozen, moving = torch.nn.Parameter(torch.ones(5, 6)), torch.nn.Parameter(torch.ones(6))
    optimizer = SM3([frozen, moving])
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
        patch.setattr(sm3_module, "use_triton", lambda tensor: False)
        want, want_optimizer = run(param, grads, options)
        fp32 = run(param.float(), [g.float() for g in grads], options)
    if dtype == torch.float32:
        assert_same(got, want, dtype, "parameter")
        assert_same_states(got_optimizer, want_optimizer, dtype)
    else:
        assert_within_torch_error((got, got_optimizer), (want, want_optimizer), fp32)
    rerun, _ = run(param, grads, options)  # no atomics: a rerun is bitwise the same
    assert torch.equal(rerun, got)
