"""Error-compensating quantization (memfit.nn.gptq): one layer's output error on its inputs is
below round to nearest's, with the same zero points (the format the kernels read) and the
scales refit to the levels by least squares (checked against a direct solve); a whole model's
states load through quantize_model and its outputs land closer to full precision than round to
nearest's; bad states and kinds are refused."""

import copy

import pytest
import torch

from memfit.nn.gptq import gptq, quantize_gptq, refit_scales
from memfit.nn.quant import QuantizedWeight, quantize_model
from memfit.ops.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from tests.nn.test_awq import tiny_model


def _inputs(rows, features, seed=0):
    """Correlated inputs with a few loud channels, as a layer sees (one distribution; `seed`
    draws other samples of it)."""
    mix = torch.randn(features, features, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g) @ (torch.eye(features) + mix / features**0.5)
    x[:, :3] *= 6.0
    return x


@pytest.mark.parametrize(("kind", "group"), [("int4", 32), ("int4", 16), ("int8", None)])
def test_one_layer_errs_less_than_round_to_nearest_on_the_same_grid(kind, group):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 96, generator=g)
    x = _inputs(512, 96)
    state, dequantized = quantize_gptq(weight, x.T @ x / x.shape[0], kind, group)
    if kind == "int4":
        rtn = quantize_int4(weight, group)
        back = dequantize_int4(state, torch.float32)
        assert torch.equal(state["zero"], rtn["zero"])  # the same zero points
        assert state["scale"].shape == rtn["scale"].shape and (state["scale"] > 0).all()
        plain = dequantize_int4(rtn, torch.float32)
    else:
        rtn = quantize_int8(weight)
        back = dequantize_int8(state, torch.float32)
        assert state["scale"].shape == rtn["scale"].shape and (state["scale"] > 0).all()
        plain = dequantize_int8(rtn, torch.float32)
    torch.testing.assert_close(back, dequantized, rtol=0, atol=1e-6)  # what it returns is stored
    held_out = _inputs(256, 96, seed=2)  # other samples of the calibration's inputs
    error = (held_out @ (back - weight).T).pow(2).mean()
    error_rtn = (held_out @ (plain - weight).T).pow(2).mean()
    assert error < 0.8 * error_rtn, (error.item(), error_rtn.item())


def test_refit_scales_is_the_least_squares_fit_of_each_rows_output():
    g = torch.Generator().manual_seed(3)
    rows, columns, group = 6, 48, 16
    weight = torch.randn(rows, columns, generator=g, dtype=torch.float64)
    steps = torch.round(weight * 3 + torch.randn(rows, columns, generator=g, dtype=torch.float64))
    steps[5] = -steps[5]  # a row whose fit is negative
    steps[2, :group] = 0  # a group with every weight at its zero point keeps its scale
    x = _inputs(200, columns).double()
    old = torch.full((rows, columns // group), 0.25, dtype=torch.float64)
    fitted = refit_scales(weight, x.T @ x, steps, old)
    for r in range(rows):
        # min over s of |X w_r - sum_g s_g X_g steps_r,g|^2: a column of the design per group
        design = torch.stack(
            [x[:, c : c + group] @ steps[r, c : c + group] for c in range(0, columns, group)], 1
        )
        live = design.abs().sum(0) > 0
        direct = torch.linalg.lstsq(design[:, live], (x @ weight[r])[:, None]).solution[:, 0]
        expected = old[r].clone()
        expected[live] = direct
        if (direct > 0).all():
            torch.testing.assert_close(fitted[r], expected, rtol=1e-4, atol=1e-8)
        else:  # a negative fit keeps the old scale
            assert torch.equal(fitted[r][live][direct <= 0], old[r][live][direct <= 0])
    assert fitted[2, 0] == 0.25 and (fitted[5] == 0.25).all()
    moved = (fitted - 0.25).abs() > 0.005
    assert moved[:5].sum() == 5 * 3 - 1  # every other scale moved


@torch.no_grad()
def test_a_model_quantized_by_gptq_is_closer_than_round_to_nearest():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    calibration = torch.randint(0, 96, (4, 48), generator=g)
    held_out = torch.randint(0, 96, (2, 40), generator=g)
    reference = model(held_out)
    plain = copy.deepcopy(model)
    quantize_model(plain, "int4", dtype=torch.float32, group=32)
    states = gptq(model, calibration, "int4", group=32)
    assert len(states) == 4 * len(model.layers)
    dequantized = model(held_out)  # gptq leaves the weights at their dequantized values
    quantize_model(model, "int4", dtype=torch.float32, group=32, states=states)
    out = model(held_out)
    torch.testing.assert_close(out, dequantized, rtol=1e-5, atol=1e-5)
    error = (out - reference).pow(2).mean()
    error_rtn = (plain(held_out) - reference).pow(2).mean()
    assert error < error_rtn, (error.item(), error_rtn.item())


def test_bad_states_and_kinds_are_refused():
    weight = torch.randn(8, 64)
    state = quantize_int4(weight, 32)
    with pytest.raises(ValueError, match="has tensors"):
        QuantizedWeight(weight, "int4", torch.float32, group=64, state=state)
    with pytest.raises(ValueError, match="int8 and int4 only"):
        QuantizedWeight(weight, "nf4", torch.float32, state=state)
    with pytest.raises(ValueError, match="GPTQ quantizes to int4 or int8"):
        gptq(tiny_model(), torch.zeros(1, 4, dtype=torch.long), "nf4")
