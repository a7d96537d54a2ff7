"""memfit's FlashAttention on CPU: the Triton kernels under the interpreter at small shapes (16x16
blocks, so odd lengths cover partial blocks and every masked/unmasked run), the bad-input errors,
the torch.library registration and the model/planner wiring. GPU twins at real shapes:
test_flash_attention_gpu.py."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
import memfit.functional as MF
from memfit.ops._triton import interpreter_enabled, triton_on_cpu
from memfit.ops.attention import flash_attention, flash_attention_varlen
from memfit.planner import Strategy, plan
from memfit.train.checkpointing import _ATTENTION_OPS
from tests.ops.flash_cases import (
    check_against_reference,
    check_deterministic,
    check_varlen,
    make_qkv,
)

# bf16 under the interpreter: half a bf16 ulp of slack for the fp32 -> bf16 casts it truncates
FLOOR = {torch.float16: 1e-6, torch.bfloat16: 2.0**-8}


@pytest.fixture
def on_cpu():
    pytest.importorskip("triton")
    if not interpreter_enabled():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 at startup (tests/conftest.py)")
    with triton_on_cpu():
        yield


CASES = [
    # batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal, window
    (2, 17, 17, 2, 2, 32, True, None),
    (1, 97, 97, 4, 1, 32, True, None),  # GQA 4
    (1, 40, 40, 8, 1, 16, False, None),  # MQA (GQA 8), not causal
    (1, 1, 33, 2, 2, 32, True, None),  # one query (decode) sees the whole cache
    (1, 1, 1, 2, 1, 32, True, None),
    (1, 17, 50, 4, 2, 64, True, None),  # seqlen_q < seqlen_k: bottom-right diagonal
    (1, 50, 17, 2, 2, 32, True, None),  # seqlen_q > seqlen_k: the first rows see no key
    (1, 45, 45, 2, 1, 48, False, (5, 3)),  # window, head dim padded to 64
    (1, 70, 70, 2, 2, 32, True, (19, 0)),  # sliding window (Mistral W=20)
    (1, 33, 60, 2, 2, 32, False, (None, 4)),
    (1, 61, 61, 2, 2, 96, True, None),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference(on_cpu, case, dtype):
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal, window = case
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype, "cpu")
    check_against_reference(q, k, v, causal=causal, window=window, floor=FLOOR[dtype])


def test_softmax_scale(on_cpu):
    q, k, v = make_qkv(1, 30, 30, 2, 2, 32, torch.float16, "cpu")
    check_against_reference(q, k, v, causal=True, softmax_scale=0.3)


def test_non_contiguous_inputs(on_cpu):
    """q, k, v as views of one fused projection (rows strided), and a transposed layout."""
    batch, seqlen, heads, heads_kv, head_dim = 2, 37, 4, 2, 32
    qkv = torch.randn(batch, seqlen, (heads + 2 * heads_kv) * head_dim, dtype=torch.float16)
    q, k, v = qkv.split([heads * head_dim, heads_kv * head_dim, heads_kv * head_dim], dim=-1)
    q = q.view(batch, seqlen, heads, head_dim).detach().requires_grad_()
    k = k.view(batch, seqlen, heads_kv, head_dim).detach().requires_grad_()
    v = v.view(batch, seqlen, heads_kv, head_dim).detach().requires_grad_()
    assert not q.is_contiguous()
    check_against_reference(q, k, v, causal=True)
    # (batch, heads, seqlen, dim) storage seen as (batch, seqlen, heads, dim)
    q2, k2, v2 = (
        t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)
    )
    check_against_reference(q2, k2, v2, causal=False)
    # last dimension strided: copied to unit stride by the launcher
    wide = torch.randn(batch, seqlen, heads, 2 * head_dim, dtype=torch.float16)
    q3 = wide[..., ::2].detach().requires_grad_()
    assert q3.stride(-1) == 2
    check_against_reference(q3, k2, v2, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_documents_do_not_see_each_other(on_cpu, dtype):
    check_varlen(
        [1, 37, 5, 20], [1, 37, 5, 20], 4, 2, 32, dtype, "cpu", causal=True, floor=FLOOR[dtype]
    )


def test_varlen_different_q_and_k_lengths_and_window(on_cpu):
    check_varlen([3, 30, 1], [10, 30, 17], 2, 1, 32, torch.float16, "cpu", causal=True)
    check_varlen([25, 9], [25, 9], 2, 2, 32, torch.float16, "cpu", causal=False, window=(4, 2))


def test_backward_is_deterministic(on_cpu):
    # several blocks of 16 each way, GQA: every program kind and the group sum run. The
    # interpreter runs programs one after another, so a race can only show on a GPU: the twin
    # in test_flash_attention_gpu.py reruns 200 times at a real shape
    q, k, v = make_qkv(1, 37, 37, 2, 1, 16, torch.bfloat16, "cpu")
    check_deterministic(q, k, v, causal=True, reruns=5)


def test_empty_and_zero_length(on_cpu):
    q, k, v = make_qkv(2, 0, 5, 2, 2, 32, torch.float16, "cpu")
    out = flash_attention(q, k, v, causal=True)
    assert out.shape == q.shape
    q, k, v = make_qkv(1, 4, 0, 2, 2, 32, torch.float16, "cpu")
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    out.sum().backward()
    assert (q.grad == 0).all()


def test_package_level_entry_point():
    assert memfit.flash_attention is flash_attention
    assert memfit.flash_attention_varlen is flash_attention_varlen


def q16(*shape, dtype=torch.float16, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize(
    ("args", "options", "message"),
    [
        ((q16(1, 8, 2, 32), q16(1, 8, 2, 32), q16(1, 9, 2, 32)), {}, "k and v shapes differ"),
        ((q16(2, 8, 2, 32), q16(1, 8, 2, 32), q16(1, 8, 2, 32)), {}, "batch 2"),
        ((q16(1, 8, 2, 32), q16(1, 8, 2, 64), q16(1, 8, 2, 64)), {}, "head_dim 32"),
        ((q16(1, 8, 3, 32), q16(1, 8, 2, 32), q16(1, 8, 2, 32)), {}, "heads_q=3"),
        ((q16(1, 8, 2, 12), q16(1, 8, 2, 12), q16(1, 8, 2, 12)), {}, "head_dim=12"),
        ((q16(1, 8, 2, 100), q16(1, 8, 2, 100), q16(1, 8, 2, 100)), {}, "head_dim=100"),
        ((q16(1, 8, 2, 264), q16(1, 8, 2, 264), q16(1, 8, 2, 264)), {}, "head_dim=264"),
        (
            (q16(1, 8, 2, 32, dtype=torch.float32),) * 3,
            {},
            "float16 or bfloat16, got torch.float32",
        ),
        (
            (q16(1, 8, 2, 32), q16(1, 8, 2, 32, dtype=torch.bfloat16)) * 1 + (q16(1, 8, 2, 32),),
            {},
            "dtypes differ",
        ),
        ((q16(8, 2, 32), q16(8, 2, 32), q16(8, 2, 32)), {}, "must be a 4-D tensor"),
        ((q16(1, 8, 2, 32),) * 3, {"window": (3,)}, "window must be (left, right)"),
        ((q16(1, 8, 2, 32),) * 3, {"window": (-3, 0)}, "window left must be"),
        ((q16(1, 8, 2, 32),) * 3, {"softmax_scale": -1.0}, "softmax_scale must be a positive"),
    ],
)
def test_bad_inputs_raise_value_error(on_cpu, args, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        flash_attention(*args, **options)


def test_devices_differ_and_cpu_without_interpreter():
    q = q16(1, 8, 2, 32)
    with pytest.raises(ValueError, match="devices differ"):
        flash_attention(q, q.to("meta"), q)
    with pytest.raises(ValueError, match="runs on CUDA tensors, got cpu"):
        flash_attention(q, q, q)


def test_varlen_bad_cu_seqlens(on_cpu):
    q = q16(10, 2, 32)
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32"):
        flash_attention_varlen(q, q, q, torch.tensor([0, 10]), torch.tensor([0, 10]).int())
    with pytest.raises(ValueError, match="both need batch \\+ 1"):
        flash_attention_varlen(q, q, q, torch.tensor([0, 4, 10]).int(), torch.tensor([0, 10]).int())


def test_library_op_registration(on_cpu):
    """Schema, fake (meta) implementation and autograd registration agree with the kernels."""
    q, k, v = make_qkv(1, 20, 20, 2, 1, 32, torch.float16, "cpu")
    torch.library.opcheck(
        torch.ops.memfit.flash_attn_forward.default,
        (q, k, v, None, None, 20, 20, 1 << 30, 0, 32**-0.5),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


class _SeenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def test_eager_calls_and_the_op_agree(on_cpu):
    """Eager calls skip torch.library's wrappers (their host time); under a dispatch mode
    (selective checkpointing, fake tensors) the registered ops run. Same bits either way."""
    q, k, v = make_qkv(1, 37, 37, 4, 2, 32, torch.float16, "cpu")
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).half()
    results, names = [], []
    for mode in (contextlib.nullcontext(), _SeenOps()):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with mode:
            out = flash_attention(*leaves, causal=True)
            out.backward(grad)
        results.append([out.detach()] + [t.grad for t in leaves])
        names.append(type(out.grad_fn).__name__)
    assert names[0] == "_FlashAttentionBackward" and names[1] != names[0]
    assert torch.ops.memfit.flash_attn_forward.default in mode.ops
    assert torch.ops.memfit.flash_attn_backward.default in mode.ops
    for eager, op in zip(*results, strict=True):
        assert torch.equal(eager, op)


def test_selective_checkpointing_saves_the_flash_output():
    assert torch.ops.memfit.flash_attn_forward.default in _ATTENTION_OPS


def test_functional_attention_flash_matches_sdpa(on_cpu):
    q, k, v = make_qkv(2, 33, 33, 4, 2, 32, torch.float16, "cpu")
    with torch.no_grad():
        for window in (None, 8):
            flash = MF.attention(q, k, v, causal=True, window=window, backend="flash")
            sdpa = MF.attention(
                q.float(), k.float(), v.float(), causal=True, window=window, backend="sdpa"
            )
            torch.testing.assert_close(flash.float(), sdpa, atol=3e-3, rtol=3e-3)


def test_resolve_attention():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    flash = "flash" if memfit.ops._triton.HAS_TRITON else "sdpa"
    # auto: memfit's kernel for sliding windows (SDPA has no fused path for them), SDPA otherwise
    assert MF.resolve_attention("auto", cuda, precision="bf16", head_dim=128, window=4096) == flash
    assert MF.resolve_attention("auto", cuda, precision="bf16", head_dim=128) == "sdpa"
    assert MF.resolve_attention("auto", cuda, precision="fp32", head_dim=128, window=64) == "sdpa"
    assert MF.resolve_attention("auto", cuda, precision="bf16", head_dim=12, window=64) == "sdpa"
    assert MF.resolve_attention("auto", cpu, precision="bf16", window=64) == "sdpa"
    assert MF.resolve_attention("flash", cuda, precision="bf16", head_dim=128) == flash
    assert MF.resolve_attention("sdpa", cuda) == "sdpa"
    with pytest.raises(ValueError, match="not fp32"):
        MF.resolve_attention("flash", cuda, precision="fp32")
    with pytest.raises(ValueError, match="CUDA devices, not cpu"):
        MF.resolve_attention("flash", cpu)
    with pytest.raises(ValueError, match="unknown attention backend"):
        MF.resolve_attention("fast", cpu)


def test_planner_knows_flash_attention_memory():
    """flash's backward needs no fp32 dq accumulator, so where attention's backward sets a
    block's transient peak, flash plans less than SDPA."""
    model = memfit.models.config.load_model_config("llama-1b")
    assert Strategy(precision="bf16").attention == "sdpa"  # auto, for a model without a window
    from memfit.planner.memory import _attention_backward_transient

    strategy = Strategy(micro_batch=4, seq_len=2048, attention="flash")
    T, q = 4 * 2048, model.num_heads * model.head_dim
    flash = _attention_backward_transient(model, strategy)
    sdpa = _attention_backward_transient(model, Strategy(micro_batch=4, attention="sdpa"))
    assert sdpa - flash == 4 * T * q
    flash_plan = plan(model, strategy)
    sdpa_plan = plan(model, Strategy(micro_batch=4, seq_len=2048, attention="sdpa"))
    assert flash_plan.peak_bytes <= sdpa_plan.peak_bytes


def test_a_narrow_window_is_tuned_among_small_tiles():
    """The autotune key tells a sliding window narrower than the sequence from dense attention
    (TUNE_W), and a window of at most NARROW_BAND keys keeps only the 64-tile candidates."""
    triton = pytest.importorskip("triton")
    from memfit.ops.attention import launch
    from memfit.ops.attention.tiles import NO_LIMIT

    assert launch._tune_w(NO_LIMIT, 0, 4096) == 0  # causal, no window
    assert launch._tune_w(NO_LIMIT, NO_LIMIT, 4096) == 0
    assert launch._tune_w(5000, 0, 4096) == 0  # a window wider than the sequence
    assert launch._tune_w(511, 0, 16384) == 512
    assert launch._tune_w(256, 256, 16384) == 1024  # (513 keys, rounded up)
    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
        for m, n, w, st in launch._FWD_CONFIGS[128]
    ]
    narrow = launch._narrow_band_configs(configs, {"TUNE_W": 512})
    assert [c.kwargs for c in narrow] == [{"BLOCK_M": 64, "BLOCK_N": 64}]
    for band in (0, 1024, 16384):
        assert launch._narrow_band_configs(configs, {"TUNE_W": band}) == configs
    backward = [
        triton.Config(
            {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2},
            num_warps=w, num_stages=st,
        )
        for m1, n1, m2, n2, w, st in launch._BWD_CONFIGS[128] + launch._NARROW_ONLY[128]
    ]  # fmt: skip
    narrow = [launch._key(c) for c in launch._narrow_band_configs(backward, {"TUNE_W": 512})]
    assert narrow == [(64, 64, 64, 64, 4, 2), (32, 64, 64, 32, 4, 3)]
    wide = [launch._key(c) for c in launch._narrow_band_configs(backward, {"TUNE_W": 0})]
    assert wide == [tuple(c) for c in launch._BWD_CONFIGS[128]]
    assert launch._merge(512) and not launch._merge(0) and not launch._merge(1024)
