"""The int8 output head of an inference model (memfit.nn.quant.quantize_head): logits within
int8's error of the float head's, tied and untied; the loss path reads the dequantized head;
products of many rows never dequantize the head whole."""

import pytest
import torch

import memfit.nn.quant as quant_module
from memfit.models import build_model
from memfit.models.config import PRESETS
from memfit.nn.quant import QuantLinear, quantize_head
from tests.ops.paths import kernels_on_cpu

pytest.importorskip("triton")


@pytest.mark.parametrize("tied", [False, True])
def test_an_int8_head_gives_the_float_heads_logits(monkeypatch, tied):
    kernels_on_cpu(monkeypatch)
    config = PRESETS["tiny"].replace(num_layers=1, tie_embeddings=tied)
    model = build_model(config, dtype=torch.float32).eval()
    tokens = torch.randint(0, config.vocab_size, (1, 5))
    with torch.no_grad():
        reference = model(tokens)
        embed, head = model.embed.weight.clone(), model.output_weight.clone()
        nbytes = quantize_head(model, dtype=torch.float32)
        assert isinstance(model.lm_head, QuantLinear) and model.lm_head.quant.kind == "int8"
        assert nbytes == config.vocab_size * (config.hidden_size + 4)
        assert torch.equal(model.embed.weight, embed)  # a tied model's embedding stays
        logits = model(tokens)
        assert logits.shape == reference.shape
        torch.testing.assert_close(logits, reference, atol=0.05, rtol=0.05)
        # the loss path multiplies by the dequantized head: each weight within half an int8
        # step of its row (max |w| / 127 / 2) of the float head's
        weight = model.output_weight
        assert torch.equal(weight, model.lm_head.quant.dequantize())
        step = head.abs().amax(dim=1, keepdim=True) / 127
        assert ((weight - head).abs() <= step / 2 * (1 + 1e-5)).all()
        assert quantize_head(model, dtype=torch.float32) == nbytes  # once


def test_the_heads_products_never_dequantize_it_whole(monkeypatch):
    kernels_on_cpu(monkeypatch)
    model = build_model(PRESETS["tiny"].replace(num_layers=1), dtype=torch.bfloat16).eval()
    quantize_head(model, dtype=torch.bfloat16)
    monkeypatch.setattr(
        quant_module.QuantizedWeight, "dequantize", lambda *a, **k: pytest.fail("dequantized")
    )
    x = torch.randn(1, 40, PRESETS["tiny"].hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        assert model.lm_head(x).shape == (1, 40, PRESETS["tiny"].vocab_size)
