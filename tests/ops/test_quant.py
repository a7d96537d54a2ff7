"""NF4, int8 and int4 weight quantization (memfit.ops.quant) and the frozen quantized linear layer
(memfit.nn.quant): the NF4 levels are QLoRA's published table; every weight takes its nearest
level; double quantization keeps the block scales within a fraction of a level; int4 rounds each
weight to its group's nearest level, keeps zeros exact and packs two a byte; a layer the group
does not divide takes a smaller one, saying so; the layer's output and input gradient equal the
dequantized weight's; QLoRA trains."""

import pytest
import torch

from memfit.config import build_config
from memfit.nn import Linear
from memfit.nn.quant import QuantLinear, quantize_model, quantized_linear
from memfit.ops.quant import (
    NF4_BLOCK,
    dequantize_int4,
    dequantize_int8,
    dequantize_nf4,
    int4_group,
    nf4_code,
    quantize_int4,
    quantize_int8,
    quantize_nf4,
    unpack_int4,
)
from memfit.ops.quant.nf4 import nf4_absmax
from memfit.train.engine import Trainer

# the NF4 data type as published with QLoRA (Dettmers et al. 2023, appendix E)
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]  # fmt: skip


def test_the_nf4_levels_are_the_published_ones():
    torch.testing.assert_close(nf4_code(), torch.tensor(PUBLISHED_NF4), rtol=0, atol=3e-7)


@pytest.mark.parametrize("shape", [(5, 100), (64, 64), (3, 7)])
def test_every_weight_takes_its_nearest_level(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    state = quantize_nf4(weight, double_quant=False)
    restored = dequantize_nf4(state, shape, torch.float32)
    absmax = nf4_absmax(state)
    flat = torch.nn.functional.pad(weight.reshape(-1), (0, -weight.numel() % NF4_BLOCK))
    normalized = (flat.reshape(-1, NF4_BLOCK) / absmax[:, None]).reshape(-1)[: weight.numel()]
    nearest = nf4_code()[(normalized[:, None] - nf4_code()[None, :]).abs().argmin(dim=1)]
    scale = absmax.repeat_interleave(NF4_BLOCK)[: weight.numel()]
    torch.testing.assert_close(restored.reshape(-1), nearest * scale, rtol=1e-6, atol=1e-7)
    assert state["packed"].dtype == torch.uint8
    assert state["packed"].numel() == -(-weight.numel() // NF4_BLOCK) * NF4_BLOCK // 2


def test_double_quantization_costs_little():
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 0.02
    plain = quantize_nf4(weight, double_quant=False)
    double = quantize_nf4(weight)
    assert double["absmax_q"].dtype == torch.int8 and "absmax" not in double
    # the scales within 1% (of their spread), the weights' error within 1% of plain NF4's
    scale_error = (nf4_absmax(double) - plain["absmax"]).abs().max()
    assert scale_error <= 0.01 * plain["absmax"].max()
    error_plain = (dequantize_nf4(plain, weight.shape, torch.float32) - weight).pow(2).mean()
    error_double = (dequantize_nf4(double, weight.shape, torch.float32) - weight).pow(2).mean()
    assert error_double <= 1.01 * error_plain
    bits = 8 * sum(t.numel() * t.element_size() for t in double.values()) / weight.numel()
    assert bits < 4.14  # 4 + 8 / 64 + 32 / (64 x 256), and the mean


def test_int8_rounds_each_row_to_its_scale():
    weight = torch.randn(6, 33, generator=torch.Generator().manual_seed(2))
    state = quantize_int8(weight)
    restored = dequantize_int8(state, torch.float32)
    assert (restored - weight).abs().max() <= state["scale"].max() / 2 + 1e-7


@pytest.mark.parametrize("group", [128, 32])
def test_int4_rounds_each_weight_to_its_groups_nearest_level(group):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(7, 256, generator=g) * torch.rand(7, 1, generator=g)
    weight[2, :group] = 0.0  # a group of zeros
    weight[3, group : 2 * group] = weight[3, group : 2 * group].abs() + 0.5  # all positive
    state = quantize_int4(weight, group)
    assert state["packed"].shape == (7, 32) and state["packed"].dtype == torch.int32
    assert state["scale"].shape == state["zero"].shape == (7, 256 // group)
    restored = dequantize_int4(state, torch.float32)
    step = state["scale"].repeat_interleave(group, dim=1)
    assert ((restored - weight).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(restored[2, :group], torch.zeros(group))  # zeros stay exact
    # each nibble the level of its feature: nibble j of a group's word c is feature j * G / 8 + c
    words = state["packed"].reshape(7, 256 // group, group // 8)
    q = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=2).reshape(7, 256)
    assert torch.equal(q, unpack_int4(state["packed"], 256 // group))
    levels = torch.round(weight / step.clamp_min(1e-12)) + state["zero"].repeat_interleave(
        group, dim=1
    )
    assert torch.equal(q[0].float(), levels[0].clamp(0, 15))
    bits = 8 * sum(t.numel() * t.element_size() for t in state.values()) / weight.numel()
    assert bits == 4 + 40 / group


def test_int4_takes_a_smaller_group_where_128_does_not_divide(caplog):
    assert int4_group(4096) == 128 and int4_group(576) == 64 and int4_group(48) == 16
    with pytest.raises(ValueError, match="divisible by a group of 16 to 128; this layer has 40"):
        int4_group(40)
    with pytest.raises(ValueError, match="does not divide the 576"):
        quantize_int4(torch.randn(4, 576), 128)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({
                "wide": Linear(256, 8), "odd": Linear(576, 8)})])  # fmt: skip

    model = Model()
    with caplog.at_level("WARNING"):
        quantize_model(model, "int4", dtype=torch.float32)
    wide, odd = model.layers[0]["wide"].quant, model.layers[0]["odd"].quant
    assert (wide.group, odd.group) == (128, 64)
    assert "layers of 576 input features" in caplog.text and "groups of 64" in caplog.text


@pytest.mark.parametrize("kind", ["nf4", "int8", "int4"])
def test_the_quantized_layer_equals_its_dequantized_weight_forward_and_backward(kind):
    base = Linear(128, 40, bias=True)
    layer = QuantLinear(base, kind, torch.float32)
    weight = layer.quant.dequantize(torch.float32)
    x = torch.randn(3, 5, 128, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, x @ weight.T + layer.bias)
    grad = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, grad)
    torch.testing.assert_close(dx, grad @ weight)
    assert not any(p.requires_grad for p in layer.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert quantized_linear(x, layer.quant).dtype == torch.bfloat16


def test_qlora_trains_and_resumes_exactly(tmp_path):
    def make(name, steps=6, resume=False):
        flags = {
            "data": {"seq_len": 64},
            "train": {"steps": steps, "micro_batch": 4, "warmup_steps": 2, "device": "cpu",
                      "precision": "fp32", "lr": 1e-2},
            "checkpoint": {"out": str(tmp_path / name), "resume": resume},
            "lora": {"rank": 4, "alpha": 8.0, "quantize": "nf4"},
        }  # fmt: skip
        return Trainer(build_config(flags=flags))

    straight = make("straight", steps=12)
    names = {n for n, _ in straight.model.named_buffers()}
    assert any(n.endswith("quant.packed") for n in names)
    linear = ("qkv.weight", "out.weight", "gate_up.weight", "down.weight")
    assert not any(n.endswith(linear) for n, _ in straight.model.named_parameters())
    history = straight.fit()
    assert history[-1].loss < history[0].loss - 0.1
    first = make("resumed")
    for _ in range(3):
        first.train_step()
    first.save()
    del first
    second = make("resumed", resume=True)
    again = make("again")
    expected = [again.train_step().loss for _ in range(6)]
    assert [m.loss for m in second.fit()] == expected[3:]
    # the run's checkpoint loads for inference: the base dequantized, the adapters merged
    from memfit.models import load_pretrained
    from memfit.nn.lora import lora_layers

    merged, info = load_pretrained(tmp_path / "resumed", device="cpu", dtype=torch.float32)
    assert info.lora is not None and not lora_layers(merged)
    assert not any(isinstance(m, QuantLinear) for m in merged.modules())
    tokens = torch.randint(0, 256, (2, 19))
    second.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), second.model(tokens), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="set lora.rank"):
        build_config(flags={"lora": {"quantize": "nf4"}})


def test_qlora_losses_follow_lora_losses(tmp_path):
    """The same run with the base in NF4 and in fp32: the losses stay within 2% of each other
    (NF4's error on the base is that small a change of the function)."""

    def losses(quantize):  # (each run in a directory of its own)
        trainer = Trainer(
            build_config(
                flags={
                    "data": {"seq_len": 64},
                    "train": {"steps": 10, "micro_batch": 4, "warmup_steps": 2, "device": "cpu",
                              "precision": "fp32", "lr": 3e-3},
                    "checkpoint": {"out": str(tmp_path / quantize)},
                    "lora": {"rank": 8, "alpha": 16.0, "quantize": quantize},
                }
            )
        )  # fmt: skip
        return [trainer.train_step().loss for _ in range(10)]

    full, quantized = losses("none"), losses("nf4")
    for a, b in zip(full, quantized, strict=True):
        assert abs(a - b) <= 0.02 * a


def test_qlora_from_random_weights_is_the_lora_run_quantized(tmp_path):
    """bf16: the QLoRA base, made block by block, holds the LoRA run's weights quantized; the
    embedding, norms and head are the LoRA run's, in bf16; the adapters and the global RNG after
    building are the same (dropout draws from it)."""
    from memfit.nn.quant import quantize_model

    def build(name, quantize):
        flags = {
            "data": {"seq_len": 32},
            "train": {"steps": 1, "micro_batch": 2, "device": "cpu", "precision": "bf16"},
            "checkpoint": {"out": str(tmp_path / name)},
            "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1, "quantize": quantize},
        }
        torch.manual_seed(7)
        trainer = Trainer(build_config(flags=flags))
        return trainer, torch.rand(3)

    lora, lora_next = build("lora", "none")
    qlora, qlora_next = build("qlora", "nf4")
    assert torch.equal(lora_next, qlora_next)
    quantize_model(lora.model, "nf4", dtype=torch.bfloat16)
    expected = dict(lora.model.named_parameters()) | dict(lora.model.named_buffers())
    got = dict(qlora.model.named_parameters()) | dict(qlora.model.named_buffers())
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, expected[name]), name
    assert qlora.model.embed.weight.dtype == torch.bfloat16
