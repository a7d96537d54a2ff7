"""Programmatic dependent launch (memfit.ops._triton.programmatic_launch): off outside the
engine's scope, on CPU and under the interpreter; on a Hopper GPU the kernels of a decode layer
are launched with it, and a CUDA graph of them replays the values of their eager run bit for
bit, replay after replay (a kernel that read before its wait would read stale activations)."""

import contextlib

import pytest
import torch

import memfit.functional as MF
from memfit.inference import LLM, SamplingParams
from memfit.ops import _triton, gemv, paged_write, rms_norm, swiglu
from memfit.ops._triton import interpreter_enabled, pdl_enabled, programmatic_launch, tl, triton
from memfit.ops.attention import paged
from tests.ops.paged_cases import make_paged

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_off_outside_the_scope_and_on_cpu():
    assert not pdl_enabled(torch.device("cpu"))
    with programmatic_launch():
        assert not pdl_enabled(torch.device("cpu"))  # the interpreter has no grid dependencies
        with programmatic_launch():
            pass
        assert _triton._pdl_scope.on  # a nested scope leaves the outer one on
    assert not _triton._pdl_scope.on
    if torch.cuda.is_available():
        assert not pdl_enabled(torch.device("cuda"))


KERNEL_MODULES = (gemv, rms_norm, paged_write, swiglu, paged)


@triton.jit
def no_op():
    """Stands in for gdc_wait and gdc_launch_dependents, which the interpreter cannot run."""
    tl.static_assert(True)


@pytest.mark.skipif(
    torch.cuda.is_available() or not interpreter_enabled(), reason="the interpreter's twin"
)
def test_pdl_variants_compute_what_plain_launches_do(monkeypatch):
    """Under the interpreter, with the grid-dependency instructions as no-ops, every kernel's
    PDL variant (its first tile read before the wait, its own tile sizes) gives the values of
    its plain launch."""

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 96, generator=generator)
    w_up = torch.randn(2 * 80, 96, generator=generator) / 10
    w_down = torch.randn(96, 80, generator=generator) / 9
    norm = torch.rand(96, generator=generator) + 0.5
    decode = make_paged([1, 1], [40, 70], 4, 2, 16, 8, torch.float32, "cpu")
    chunk = make_paged([5, 3], [20, 9], 4, 2, 16, 8, torch.float32, "cpu", seed=1)
    qkv = torch.randn(3, (4 + 2 * 2) * 16, generator=generator)
    angles = torch.rand(3, 8, generator=generator) * 6
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    slots = torch.tensor([5, 17, 2])

    def layer():
        h, s = MF.add_rms_norm(x, MF.rms_norm(x, norm, 1e-6), norm, 1e-6)
        y = MF.linear(MF.linear(h, w_up, swiglu=True), w_down, residual=s)
        pools = torch.zeros(2, 3, 8, 2, 16)
        q = paged_write.rotary_paged_write(qkv, cos, sin, pools[0], pools[1], slots, heads_q=4)
        q_d, k_d, v_d, meta_d = decode
        q_c, k_c, v_c, meta_c = chunk
        return (
            y, MF.swiglu(w_up[None, :3]), q, pools,
            paged.paged_attention(q_d, k_d, v_d, **meta_d, num_splits=3),
            paged.paged_attention(q_c, k_c, v_c, **meta_c),
        )  # fmt: skip

    with triton_on_cpu_or_none(), torch.no_grad():
        plain = layer()
        for module in KERNEL_MODULES:
            monkeypatch.setattr(module, "pdl_enabled", lambda device: True)
            monkeypatch.setattr(module, "gdc_wait", no_op)
            monkeypatch.setattr(module, "gdc_launch_dependents", no_op)
        early = layer()
    for a, b in zip(plain, early, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def triton_on_cpu_or_none():
    from memfit.ops._triton import triton_on_cpu

    return triton_on_cpu() if not torch.cuda.is_available() else contextlib.nullcontext()


def _spy(monkeypatch) -> list[bool]:
    seen = []
    for module in (gemv, rms_norm):

        def recording(kernel, grid, device, *args, _launch=_triton.launch, **meta):
            seen.append(bool(meta.get("PDL")))
            return _launch(kernel, grid, device, *args, **meta)

        monkeypatch.setattr(module, "launch", recording)
    return seen


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9.0 or later")
def test_graph_replays_of_a_pdl_chain_equal_the_eager_run(monkeypatch):
    seen = _spy(monkeypatch)
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden, ffn, layers = 1024, 2816, 6

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, device="cuda").mul_(scale).bfloat16()

    weights = [
        (randn(hidden, scale=0.1).add_(1), randn(3 * hidden, hidden, scale=hidden**-0.5),
         randn(hidden, 3 * hidden, scale=hidden**-0.5), randn(2 * ffn, hidden, scale=hidden**-0.5),
         randn(hidden, ffn, scale=ffn**-0.5))
        for _ in range(layers)
    ]  # fmt: skip
    x0 = randn(1, 1, hidden)

    def chain():
        x = x0
        for norm, w_in, w_out, w_up, w_down in weights:
            h = MF.rms_norm(x, norm, 1e-5)
            branch = MF.linear(MF.linear(h, w_in), w_out)
            h, x = MF.add_rms_norm(x, branch, norm, 1e-5)
            x = MF.linear(MF.linear(h, w_up, swiglu=True), w_down, residual=x)
        return x

    with torch.inference_mode(), programmatic_launch():
        eager = chain().clone()
        assert seen and all(seen)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    for _ in range(50):
        graph.replay()
        assert torch.equal(out, eager)
    seen.clear()
    with torch.inference_mode():
        plain = chain()  # outside the scope: plain launches, the same values to rounding
    assert seen and not any(seen)
    # plain launches take other tile sizes: the same values up to the order of the sums
    assert (plain.float() - eager.float()).norm() < 1e-2 * eager.float().norm()


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9.0 or later")
def test_engine_with_pdl_gives_the_tokens_of_its_eager_steps(monkeypatch):
    """A batch-1 request decoded by captured steps (PDL) and by eager steps (PDL too, the same
    kernels): the same greedy tokens."""
    seen = _spy(monkeypatch)
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    tokens = {}
    for graphs in (True, False):
        llm = LLM("tiny", dtype="bf16", memory_fraction=0.1, cuda_graphs=graphs, seed=0)
        tokens[graphs] = llm.generate([prompt], params, progress=False)[0].token_ids
        del llm
    assert any(seen)
    assert tokens[True] == tokens[False]
