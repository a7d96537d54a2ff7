"""fp32 parts (`--fp32-parts`, memfit.train.precision.apply_fp32_parts): chosen blocks and the
head compute in fp32 under bf16 autocast, on CPU, against the same model in fp32."""

import itertools

import pytest
import torch

from memfit.config import Fp32Parts, build_config, parse_fp32_parts
from memfit.models.config import ModelConfig
from memfit.models.llama import build_model
from memfit.planner import Strategy, plan
from memfit.train.checkpointing import apply_activation_checkpointing
from memfit.train.engine import ConfigError, Trainer
from memfit.train.precision import apply_fp32_parts
from tests.train.activation_memory import live_forward_bytes

CONFIG = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=160,
    max_seq_len=64,
)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, CONFIG.vocab_size, (2, 41), generator=torch.Generator().manual_seed(0)
    )
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(parts: str | None, *, checkpointing: str = "none"):
    """The summed loss and the gradients of one forward and backward: parts None, the model in
    fp32 without autocast; otherwise under bf16 autocast with those parts in fp32."""
    model = build_model(CONFIG, attention="sdpa", seed=0)
    if parts is not None:
        apply_fp32_parts(model, parse_fp32_parts(parts))
    apply_activation_checkpointing(model, checkpointing)
    inputs, targets = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=parts is not None):
        loss = model(inputs, targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def exact():
    return loss_and_grads(None)


def test_every_part_in_fp32_computes_what_fp32_does(exact):
    loss, grads = loss_and_grads(f"first:{CONFIG.num_layers},head")
    torch.testing.assert_close(loss, exact[0], rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, exact[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_fp32_parts_take_the_loss_and_gradients_nearer_fp32(exact):
    """bf16 everywhere, then the head, the last block and the first block in fp32 too: the
    loss's error and every gradient's (as one vector) fall at each."""

    def gradient_error(grads):
        squares = [(grads[name] - exact[1][name]).norm() ** 2 for name in grads]
        return (
            torch.stack(squares).sum().sqrt()
            / torch.stack([g.norm() ** 2 for g in exact[1].values()]).sum().sqrt()
        ).item()

    errors = []
    for parts in ("", "head", "last:1,head", "first:1,last:1,head"):
        loss, grads = loss_and_grads(parts)
        errors.append((abs(loss - exact[0]).item(), gradient_error(grads)))
    for fewer, more in itertools.pairwise(errors):
        assert more[0] < fewer[0] and more[1] < fewer[1], errors


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_fp32_parts_compose_with_checkpointing(mode):
    plain = loss_and_grads("first:1,last:2,head")
    checked = loss_and_grads("first:1,last:2,head", checkpointing=mode)
    torch.testing.assert_close(checked[0], plain[0], rtol=0, atol=0)
    for name, grad in checked[1].items():
        torch.testing.assert_close(grad, plain[1][name], rtol=1e-6, atol=1e-7, msg=name)


def test_the_module_tree_and_state_dict_are_unchanged():
    model = build_model(CONFIG, seed=0)
    keys = list(model.state_dict())
    apply_fp32_parts(model, parse_fp32_parts("first:2,head"))
    assert list(model.state_dict()) == keys
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_parse_fp32_parts():
    assert parse_fp32_parts("") == Fp32Parts() and not Fp32Parts()
    parts = parse_fp32_parts(" last, head ,first:3 ")
    assert parts == Fp32Parts(head=True, first=3, last=1)
    assert str(parts) == "first:3,last:1,head"
    assert parts.blocks(4) == [0, 1, 2, 3] and parts.blocks(8) == [0, 1, 2, 7]
    with pytest.raises(ValueError, match="first:3, but the model has 2 blocks"):
        parts.blocks(2)
    for bad, says in [
        ("embed", "its rows enter the first N blocks unrounded"),
        ("first:0", "N >= 1"),
        ("last:", "N >= 1"),
        ("tail", "give head, first:N and last:N"),
        ("head:2", "give head"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_fp32_parts(bad)


@pytest.mark.parametrize(
    "train, sections, says",
    [
        ({"precision": "fp32"}, {}, "every part computes in fp32 already"),
        (
            {"precision": "bf16", "master_weights": "none", "optimizer": "adamw8bit"},
            {},
            "master_weights = 'none' keeps bf16 ones",
        ),
        ({"precision": "bf16"}, {"lora": {"rank": 4}}, "LoRA's frozen base"),
        ({"precision": "bf16"}, {"distributed": {"zero": 3}}, "ZeRO-3's gathered parameters"),
    ],
)
def test_fp32_parts_refused_where_the_weights_are_not_fp32(train, sections, says):
    with pytest.raises(ValueError, match=says):
        build_config(flags={"train": {"fp32_parts": "head", **train}, **sections})


def trainer(tmp_path, parts: str, **train) -> Trainer:
    flags = {
        "model": {"name": "tiny"},
        "data": {"seq_len": 64},
        "train": {"micro_batch": 2, "precision": "bf16", "device": "cpu", "fp32_parts": parts,
                  **train},
        "checkpoint": {"out": str(tmp_path)},
    }  # fmt: skip
    return Trainer(build_config(flags=flags))


def test_a_run_with_fp32_parts_trains_and_says_so(tmp_path, caplog):
    caplog.set_level("INFO")
    run = trainer(tmp_path, "head,last:1")
    layers = run.model_config.num_layers
    assert f"fp32 parts: 1 of {layers} blocks and the head compute in fp32, the rest in bf16" in (
        caplog.text
    )
    assert run.strategy().fp32_parts == "last:1,head"
    first = run.train_step().loss
    for _ in range(3):
        last = run.train_step().loss
    assert torch.isfinite(torch.tensor(last)) and last < first


def test_more_fp32_blocks_than_the_model_has_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="first:99, but the model has"):
        trainer(tmp_path, "first:99")


def test_the_plan_prices_what_fp32_parts_keep(tmp_path):
    """What the forward keeps for backward, measured on CPU under bf16 autocast, grows by what
    the planner adds for the fp32 parts (their activations in 4-byte elements, the head's
    fp32 input to its norm and gradient), less the bf16 weight copies they no longer make."""
    live = {}
    for parts in ("", "first:1,last:1,head"):
        run = trainer(tmp_path / (parts or "bf16"), parts)
        inputs, targets = next(run.batches)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            live[parts], _ = live_forward_bytes(run.model, inputs, targets)
    kept = {
        parts: plan(
            run.model_config, Strategy(micro_batch=2, seq_len=64, fp32_parts=parts)
        ).forward_kept_bytes
        for parts in live
    }
    # the plan is for CUDA, where fp32 grouped-query attention repeats k and v for the fused
    # kernel (in each of the two fp32 blocks); CPU attention takes the groups as they are
    config = run.model_config
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    repeated = 2 * (2 * 4 * 2 * 64 * (q - kv))
    grown = live["first:1,last:1,head"] - live[""]
    assert grown > 0
    assert kept["first:1,last:1,head"] - kept[""] - repeated == pytest.approx(grown, rel=0.01)
