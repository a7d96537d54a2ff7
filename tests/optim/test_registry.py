"""The optimizer registry's rules across optimizers: which run under ZeRO and offload, and what
the planner counts for each."""

import pytest

from memfit.config import build_config, check_parallelism
from memfit.optim import OPTIMIZERS, model_state_bytes


@pytest.mark.parametrize("optimizer", ["adafactor", "sm3"])
def test_per_tensor_optimizers_run_on_one_process_only(optimizer):
    build_config(flags={"train": {"optimizer": optimizer}})  # one process: fine
    message = f"optimizer '{optimizer}' keeps per-tensor states"
    with pytest.raises(ValueError, match=message):
        build_config(flags={"train": {"optimizer": optimizer}, "distributed": {"zero": 1}})
    with pytest.raises(ValueError, match=message):
        build_config(
            flags={"train": {"optimizer": optimizer}, "distributed": {"offload": "optimizer"}}
        )
    with pytest.raises(ValueError, match=message):
        check_parallelism(zero=0, offload="none", optimizer=optimizer, world_size=2)


def test_elementwise_optimizers_shard():
    for optimizer in ("adamw", "adamw8bit", "sgd"):
        check_parallelism(zero=2, offload="none", optimizer=optimizer, world_size=2)
        check_parallelism(zero=1, offload="optimizer", optimizer=optimizer, world_size=1)


def test_the_planner_counts_each_optimizers_states():
    P = 10**9
    assert set(OPTIMIZERS) >= {"adamw", "adamw8bit", "adafactor", "sm3", "sgd"}
    states = {name: model_state_bytes(P, optimizer=name)["optimizer_states"] for name in OPTIMIZERS}
    assert states["adamw"] == 8 * P
    assert states["adamw8bit"] == pytest.approx(2.03125 * P)
    assert states["adafactor"] <= 0.1 * P
    assert states["sm3"] < states["adamw"]


@pytest.mark.parametrize(
    ("optimizer", "option"),
    [("sgd", "beta1"), ("sgd", "beta2"), ("adamw", "momentum"), ("adamw8bit", "momentum"),
     ("adafactor", "beta1"), ("sm3", "beta2")],
)  # fmt: skip
def test_an_option_that_does_not_apply_is_named(optimizer, option):
    with pytest.raises(ValueError, match=f"train.{option} = 0.5 does not apply to optimizer"):
        build_config(flags={"train": {"optimizer": optimizer, option: 0.5}})
    build_config(flags={"train": {"optimizer": optimizer}})  # the defaults are no error
