"""Activation-aware scaling before int4 (memfit.nn.awq): the scaled model computes what it did
before quantization (the inputs' 1/s folded into the norms, v and up); no layer's output error on
the calibration inputs is above plain round to nearest's; the quantized model's outputs are
closer to the full-precision ones than round to nearest's."""

import copy

import torch

from memfit.models import Llama
from memfit.models.config import ModelConfig
from memfit.nn.awq import awq_scale
from memfit.nn.quant import quantize_model


def tiny_model() -> Llama:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=96, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=256, qkv_bias=True,
    )  # fmt: skip
    model = Llama(config).eval()
    with torch.no_grad():  # a few loud input channels, as trained models have
        for block in model.layers:
            block.attention_norm.weight[:4] *= 8.0
            block.mlp_norm.weight[5:9] *= 8.0
            block.attention.qkv.bias.normal_(0, 0.1)
    return model


@torch.no_grad()
def test_awq_keeps_the_model_and_lowers_the_int4_error():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    calibration = torch.randint(0, 96, (2, 48), generator=g)
    held_out = torch.randint(0, 96, (2, 40), generator=g)
    reference = model(held_out)
    plain = copy.deepcopy(model)
    report = awq_scale(model, calibration, "int4", group=32, clip=False)
    torch.testing.assert_close(model(held_out), reference, rtol=1e-4, atol=1e-4)
    assert len(report) == 2 * 4
    assert all(layer.error <= layer.error_rtn for layer in report)
    assert any(layer.alpha > 0 and layer.error < 0.9 * layer.error_rtn for layer in report)
    quantize_model(model, "int4", dtype=torch.float32, group=32)
    quantize_model(plain, "int4", dtype=torch.float32, group=32)
    awq_error = (model(held_out) - reference).pow(2).mean()
    rtn_error = (plain(held_out) - reference).pow(2).mean()
    assert awq_error < rtn_error


@torch.no_grad()
def test_clipping_each_groups_range_lowers_the_int4_error_further():
    g = torch.Generator().manual_seed(2)
    calibration = torch.randint(0, 96, (2, 48), generator=g)
    held_out = torch.randint(0, 96, (4, 40), generator=g)
    scaled, clipped = tiny_model(), tiny_model()
    reference = scaled(held_out)
    awq_scale(scaled, calibration, "int4", group=32, clip=False)
    before = [p.clone() for p in scaled.parameters()]
    awq_scale(clipped, calibration, "int4", group=32)
    for kept, changed in zip(before, clipped.parameters(), strict=True):
        assert changed.abs().max() <= kept.abs().max() + 1e-6  # ranges only shrink
    for model in (scaled, clipped):
        quantize_model(model, "int4", dtype=torch.float32, group=32)
    assert (clipped(held_out) - reference).pow(2).mean() < (scaled(held_out) - reference).pow(
        2
    ).mean()
