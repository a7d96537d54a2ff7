import pytest
import torch

import memfit.ops.cross_entropy as cross_entropy_module
from memfit.ops.cross_entropy import linear_cross_entropy
from tests.ops.paths import import_without_triton, kernels_on_cpu, on_path
from tests.reference import assert_error_within, linear_cross_entropy_reference

IGNORE = -100

# (rows N, hidden h, vocab V, chunk_size): chunk sizes that do not divide N, a chunk of 1 row,
# one larger than N, and the default.
CASES = [(1, 8, 1, None), (17, 48, 37, 5), (17, 130, 37, 1), (97, 130, 1000, 16), (97, 8, 1000, 40), (97, 48, 1000, 200), (97, 48, 37, None)]  # fmt: skip
# Fewer, smaller cases for the kernel: the interpreter runs each row's program in Python.
KERNEL_CASES = [(1, 8, 1, None), (7, 16, 37, 3), (7, 130, 300, 1), (17, 48, 37, 5), (33, 24, 300, 8), (33, 8, 37, None)]  # fmt: skip


@pytest.fixture(params=["torch", "triton"])
def path(request, monkeypatch):
    yield from on_path(request, monkeypatch, cross_entropy_module, "_launch_cross_entropy_rows")


def make_inputs(
    rows: int, hidden: int, vocab: int, dtype: torch.dtype, ignore_fraction: float = 0.2
):
    """hidden (N, h), weight (V, h) scaled so that logits are O(1-3), targets (N,) int64."""
    hidden_states = torch.randn(rows, hidden, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, hidden, dtype=torch.float64) * 2 / hidden**0.5).to(dtype)
    targets = torch.randint(0, vocab, (rows,))
    targets[torch.rand(rows) < ignore_fraction] = IGNORE
    return hidden_states, weight, targets


def loss_and_grads(function, hidden, weight, targets, grad_scale: float = 1.0, **kwargs):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    loss = function(hidden, weight, targets, **kwargs)
    (loss * grad_scale).backward()
    return loss, hidden.grad, weight.grad


def assert_all_within(ours, baseline, exact):
    for name, a, b, e in zip(
        ("loss", "grad_hidden", "grad_weight"), ours, baseline, exact, strict=True
    ):
        assert_error_within(a, b, e, name=name)


@pytest.mark.parametrize(
    ("path", "rows", "hidden", "vocab", "chunk_size"),
    [("torch", *case) for case in CASES] + [("triton", *case) for case in KERNEL_CASES],
    indirect=["path"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_fp64_reference(path, rows, hidden, vocab, chunk_size, dtype):
    torch.manual_seed(0)
    hidden_states, weight, targets = make_inputs(rows, hidden, vocab, dtype)
    ours = loss_and_grads(
        linear_cross_entropy, hidden_states, weight, targets, chunk_size=chunk_size
    )
    baseline = loss_and_grads(linear_cross_entropy_reference, hidden_states, weight, targets)
    exact = loss_and_grads(
        linear_cross_entropy_reference, hidden_states.double(), weight.double(), targets
    )
    loss, grad_hidden, grad_weight = ours
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert grad_hidden.dtype == dtype and grad_weight.dtype == dtype
    assert_all_within(ours, baseline, exact)


@pytest.mark.parametrize(
    ("path", "rows", "hidden", "vocab", "chunk_size"),
    [("torch", *case) for case in CASES[1:5]] + [("triton", *case) for case in KERNEL_CASES[1:4]],
    indirect=["path"],
)
def test_under_cpu_autocast_with_fp32_master_weight(path, rows, hidden, vocab, chunk_size):
    torch.manual_seed(0)
    hidden_states, weight, targets = make_inputs(rows, hidden, vocab, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inputs = (hidden_states, weight, targets)
        ours = loss_and_grads(linear_cross_entropy, *inputs, grad_scale=0.37, chunk_size=chunk_size)
        baseline = loss_and_grads(
            linear_cross_entropy_reference, hidden_states, weight, targets, grad_scale=0.37
        )
    exact = loss_and_grads(
        linear_cross_entropy_reference, hidden_states.double(), weight.double(), targets, 0.37
    )
    assert all(tensor.dtype == torch.float32 for tensor in ours)
    assert_all_within(ours, baseline, exact)

    # Outside autocast, compute_dtype=bf16 gives the same as autocast's default.
    bf16 = torch.bfloat16
    explicit = loss_and_grads(
        linear_cross_entropy, *inputs, grad_scale=0.37, chunk_size=chunk_size, compute_dtype=bf16
    )
    assert all(torch.equal(a, b) for a, b in zip(ours, explicit, strict=True))


def test_fp16_compute_keeps_gradients_below_fp16_range(path):
    """Softmax values far below fp16's range must still reach the fp32 gradients."""
    torch.manual_seed(0)
    hidden_states, weight, _ = make_inputs(1, 16, 50, torch.float32)
    targets = torch.zeros(1, dtype=torch.int64)
    # Class 0 wins by a margin of ~23 logits: every other class gets p ~ 1e-10 < 6e-8.
    weight[0] = hidden_states[0] * 23 / hidden_states[0].square().sum()
    loss, grad_hidden, grad_weight = loss_and_grads(
        linear_cross_entropy, hidden_states, weight, targets, compute_dtype=torch.float16
    )
    exact = loss_and_grads(
        linear_cross_entropy_reference, hidden_states.double(), weight.double(), targets
    )
    fp16 = loss_and_grads(
        linear_cross_entropy_reference, hidden_states.half(), weight.half(), targets
    )
    assert grad_hidden.dtype == grad_weight.dtype == torch.float32
    assert torch.count_nonzero(fp16[2][1:]) == 0  # plain fp16 loses them all
    assert torch.count_nonzero(exact[2][1:]) == exact[2][1:].numel()
    # Relative error from fp16-rounded logits (~23 * 2**-11): a few percent of p. (Row 0,
    # (p_0 - 1) * h with 1 - p_0 ~ 5e-9, cancels to 0 in fp32 in any implementation.)
    torch.testing.assert_close(grad_weight[1:].double(), exact[2][1:], rtol=5e-2, atol=0)
    torch.testing.assert_close(grad_hidden.double(), exact[1], rtol=5e-2, atol=1e-6)
    torch.testing.assert_close(loss.double(), exact[0], rtol=0, atol=5e-2)


def test_chunk_size_does_not_change_the_result():
    torch.manual_seed(0)
    hidden_states, weight, targets = make_inputs(23, 24, 61, torch.float64)
    results = [
        loss_and_grads(linear_cross_entropy, hidden_states, weight, targets, chunk_size=chunk)
        for chunk in (None, 1, 4, 7, 23, 1000)
    ]
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_kernel_chunk_size_does_not_change_the_result(monkeypatch):
    """Every chunk reuses the logits and gradient buffers: no chunk may see another's data."""
    torch.manual_seed(0)
    kernels_on_cpu(monkeypatch)
    hidden_states, weight, targets = make_inputs(13, 24, 61, torch.float32)
    results = [
        loss_and_grads(linear_cross_entropy, hidden_states, weight, targets, chunk_size=chunk)
        for chunk in (None, 1, 5)
    ]
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_deterministic(monkeypatch, dtype):
    torch.manual_seed(0)
    kernels_on_cpu(monkeypatch)
    hidden_states, weight, targets = make_inputs(11, 16, 300, dtype)
    first = loss_and_grads(linear_cross_entropy, hidden_states, weight, targets, chunk_size=4)
    second = loss_and_grads(linear_cross_entropy, hidden_states, weight, targets, chunk_size=4)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_plain_path_while_torch_compile_traces(monkeypatch):
    """Under torch.compile the plain path is traced, for Inductor to fuse its elementwise ops."""
    kernels_on_cpu(monkeypatch)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(cross_entropy_module, "_launch_cross_entropy_rows", None)  # would raise
    hidden_states, weight, targets = make_inputs(5, 8, 11, torch.float32)
    loss_and_grads(linear_cross_entropy, hidden_states, weight, targets, chunk_size=2)


def test_works_without_triton(monkeypatch):
    """Where triton is missing, the module imports and serves every call on the plain path."""
    module = import_without_triton(
        monkeypatch, cross_entropy_module, "cross_entropy_without_triton"
    )
    kernels_on_cpu(monkeypatch)
    assert not module.HAS_TRITON
    hidden_states, weight, targets = make_inputs(5, 8, 11, torch.float64)
    ours = loss_and_grads(module.linear_cross_entropy, hidden_states, weight, targets)
    exact = loss_and_grads(linear_cross_entropy_reference, hidden_states, weight, targets)
    for a, b in zip(ours, exact, strict=True):
        torch.testing.assert_close(a, b)


def test_default_chunk_size_targets_the_logits_budget(monkeypatch):
    torch.manual_seed(0)
    rows, vocab = 50, 37
    # A budget of 3 rows of fp32 logits: the default must chunk, and stay correct.
    monkeypatch.setattr(cross_entropy_module, "_CHUNK_LOGITS_BYTES", 3 * vocab * 4 + 5)
    calls = []
    original = cross_entropy_module._matmul_wide
    monkeypatch.setattr(
        cross_entropy_module,
        "_matmul_wide",
        lambda a, b, out_dtype: calls.append(a.shape[0]) or original(a, b, out_dtype),
    )
    hidden_states, weight, targets = make_inputs(rows, 16, vocab, torch.float64)
    ours = loss_and_grads(linear_cross_entropy, hidden_states, weight, targets)
    exact = loss_and_grads(linear_cross_entropy_reference, hidden_states, weight, targets)
    assert calls == [3] * 16 + [2]
    for a, b in zip(ours, exact, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_default_chunk_size_rounds_to_whole_matmul_tiles(monkeypatch):
    monkeypatch.setattr(cross_entropy_module, "_CHUNK_LOGITS_BYTES", 1000 * 37 * 4)
    assert cross_entropy_module._default_chunk_size(5000, 37) == 768
    assert cross_entropy_module._default_chunk_size(500, 37) == 500
    monkeypatch.setattr(cross_entropy_module, "_CHUNK_LOGITS_BYTES", 200 * 37 * 4)
    assert cross_entropy_module._default_chunk_size(5000, 37) == 200


def test_ignored_rows_and_all_ignored_chunks(path):
    torch.manual_seed(0)
    hidden_states, weight, targets = make_inputs(20, 16, 30, torch.float32, ignore_fraction=0.0)
    targets[:8] = IGNORE  # chunks 0 and 1 (chunk_size 4) are entirely ignored
    targets[13] = IGNORE
    loss, grad_hidden, grad_weight = loss_and_grads(
        linear_cross_entropy, hidden_states, weight, targets, chunk_size=4
    )
    assert torch.count_nonzero(grad_hidden[:8]) == 0 and torch.count_nonzero(grad_hidden[13]) == 0
    exact = loss_and_grads(linear_cross_entropy_reference, hidden_states, weight, targets)
    for a, b in zip((loss, grad_hidden, grad_weight), exact, strict=True):
        torch.testing.assert_close(a, b)

    targets[:] = IGNORE
    loss, grad_hidden, grad_weight = loss_and_grads(
        linear_cross_entropy, hidden_states, weight, targets, chunk_size=4
    )
    assert loss.item() == 0.0
    assert torch.count_nonzero(grad_hidden) == 0 and torch.count_nonzero(grad_weight) == 0


def test_strided_targets_are_read_as_their_values(path):
    """Targets as a strided view (every other element of a longer tensor), on either path."""
    torch.manual_seed(0)
    hidden_states, weight, targets = make_inputs(20, 16, 30, torch.float32)
    strided = torch.stack([targets, torch.zeros_like(targets)], 1)[:, 0]
    assert not strided.is_contiguous()
    got = loss_and_grads(linear_cross_entropy, hidden_states, weight, strided, chunk_size=8)
    want = loss_and_grads(linear_cross_entropy, hidden_states, weight, targets, chunk_size=8)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_custom_ignore_index_inside_the_vocabulary(path):
    torch.manual_seed(0)
    hidden_states, weight, targets = make_inputs(15, 8, 12, torch.float32, ignore_fraction=0.0)
    targets[::3] = 0  # e.g. a pad token id
    ours = loss_and_grads(linear_cross_entropy, hidden_states, weight, targets, ignore_index=0)
    exact = loss_and_grads(
        linear_cross_entropy_reference, hidden_states, weight, targets, ignore_index=0
    )
    for a, b in zip(ours, exact, strict=True):
        torch.testing.assert_close(a, b)


def test_gradients_accumulate_over_two_calls(path):
    torch.manual_seed(0)
    hidden_a, weight, targets_a = make_inputs(13, 16, 40, torch.float32)
    hidden_b, _, targets_b = make_inputs(11, 16, 40, torch.float32)
    weight.requires_grad_()
    for hidden_states, targets in ((hidden_a, targets_a), (hidden_b, targets_b)):
        linear_cross_entropy(hidden_states, weight, targets, chunk_size=3).backward()
    ours = weight.grad.clone()

    weight.grad = None
    for hidden_states, targets in ((hidden_a, targets_a), (hidden_b, targets_b)):
        linear_cross_entropy_reference(hidden_states, weight, targets).backward()
    torch.testing.assert_close(ours, weight.grad)


def test_grads_only_where_required_and_none_without_grad_mode(path):
    torch.manual_seed(0)
    hidden_states, weight, targets = make_inputs(10, 8, 20, torch.float32)
    hidden_states.requires_grad_()
    loss = linear_cross_entropy(hidden_states, weight, targets, chunk_size=3)
    loss.backward()
    assert hidden_states.grad is not None and weight.grad is None

    weight.requires_grad_()
    with torch.no_grad():
        loss_no_grad = linear_cross_entropy(hidden_states, weight, targets, chunk_size=3)
    assert loss_no_grad.grad_fn is None
    torch.testing.assert_close(loss_no_grad, loss.detach())


def test_second_backward_through_the_same_graph_raises(path):
    torch.manual_seed(0)
    hidden_states, weight, targets = make_inputs(6, 8, 10, torch.float32)
    hidden_states.requires_grad_()
    loss = linear_cross_entropy(hidden_states, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


@pytest.mark.parametrize(
    ("hidden_shape", "weight_shape", "targets", "kwargs", "message"),
    [
        ((8,), (5, 8), torch.zeros(8, dtype=torch.int64), {}, r"hidden.shape=\(8,\)"),
        ((4, 8), (5, 7), torch.zeros(4, dtype=torch.int64), {}, r"weight.shape=\(5, 7\)"),
        ((4, 8), (5, 8), torch.zeros(3, dtype=torch.int64), {}, r"targets.shape=\(3,\)"),
        ((4, 8), (5, 8), torch.zeros(4, 1, dtype=torch.int64), {}, r"targets.shape=\(4, 1\)"),
        ((4, 8), (5, 8), torch.zeros(4), {}, "targets.dtype=torch.float32"),
        ((4, 8), (5, 8), torch.tensor([0, 1, 5, IGNORE]), {}, "got target 5"),
        ((4, 8), (5, 8), torch.tensor([0, -3, 1, 2]), {}, "got target -3"),
        ((4, 8), (5, 8), torch.zeros(4, dtype=torch.int64), {"chunk_size": 0}, "got 0"),
        (
            (4, 8),
            (5, 8),
            torch.zeros(4, dtype=torch.int64),
            {"compute_dtype": torch.int32},
            "got torch.int32",
        ),
    ],
)
def test_bad_inputs_raise_value_error(hidden_shape, weight_shape, targets, kwargs, message):
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(
            torch.randn(hidden_shape), torch.randn(weight_shape), targets, **kwargs
        )
