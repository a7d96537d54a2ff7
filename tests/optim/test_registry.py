"""The optimizer registry's rules across optimizers: which run under ZeRO and offload, and what
the planner counts for each."""

import math

import pytest
import torch

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


def test_master_weights_none_needs_bf16_adamw8bit_on_one_process():
    ok = {"optimizer": "adamw8bit", "precision": "bf16", "master_weights": "none"}
    build_config(flags={"train": ok})
    with pytest.raises(ValueError, match="use it with --optimizer adamw8bit"):
        build_config(flags={"train": {**ok, "optimizer": "adamw"}})
    with pytest.raises(ValueError, match="it needs precision bf16"):
        build_config(flags={"train": {**ok, "precision": "fp32"}})
    with pytest.raises(ValueError, match="without --zero and --offload"):
        build_config(flags={"train": ok, "distributed": {"offload": "optimizer"}})


def test_the_planner_counts_bf16_weights_without_masters():
    from memfit.models.config import PRESETS
    from memfit.planner import Strategy, plan

    model = PRESETS["llama-3-8b"]
    common = {"precision": "bf16", "checkpointing": "full", "optimizer": "adamw8bit"}
    masters = plan(model, Strategy(**common))
    bf16 = plan(model, Strategy(**common, master_weights="none"))
    P = model.num_params
    assert bf16.breakdown["params"] == 2 * P and masters.breakdown["params"] == 4 * P
    # 2 bytes fewer of parameters and 2 of gradients per parameter (no autocast copies either)
    assert masters.peak_bytes - bf16.peak_bytes >= 3.9 * P
    with pytest.raises(ValueError, match="needs bf16 precision on one process"):
        Strategy(**common, master_weights="none", zero=1, world_size=2)
    # the time model's update: bf16 parameters and gradients move 6 bytes per parameter fewer
    from memfit.planner import get_gpu, step_time

    h100 = get_gpu("h100-sxm")
    fp32_step = step_time(model, Strategy(**common), h100).optimizer_s
    bf16_step = step_time(model, Strategy(**common, master_weights="none"), h100).optimizer_s
    fp32_bytes = OPTIMIZERS["adamw8bit"].update_bytes_per_param
    assert bf16_step / fp32_step == pytest.approx((fp32_bytes - 6) / fp32_bytes)


def test_the_recommender_reaches_for_the_lean_forms_only_where_adamw_does_not_fit():
    from memfit.models.config import PRESETS
    from memfit.planner import get_gpu, rank_strategies

    h100 = get_gpu("h100-sxm")
    host = 16 * 2**30  # (too little host memory to offload an 8B model's state)
    small = rank_strategies(PRESETS["llama-1b"], h100, host_memory=host)
    assert small and all(r.strategy.optimizer == "adamw" for r in small)
    # llama-3-8b: fp32 AdamW states and master weights alone take 96 GiB; 8-bit states with
    # bf16 weights fit one H100 (the full fine-tuning without offload)
    big = rank_strategies(PRESETS["llama-3-8b"], h100, host_memory=host)
    assert big
    assert all(
        (r.strategy.optimizer, r.strategy.master_weights) == ("adamw8bit", "none") for r in big
    )


def test_recommend_prints_the_command_that_runs_its_first_strategy():
    """`memfit plan --recommend`'s last line is a `memfit train` command line that the CLI
    parses into the recommended strategy's settings."""
    import shlex

    from memfit.cli.main import _run_config, build_parser
    from memfit.cli.plan import train_command
    from memfit.models.config import PRESETS
    from memfit.planner import get_gpu, rank_strategies

    for host in (16 * 2**30, 2**40):  # 8-bit AdamW on the GPU; AdamW with its state offloaded
        best = rank_strategies(PRESETS["llama-3-8b"], get_gpu("h100-sxm"), host_memory=host)
        best = best[0].strategy
        argv = shlex.split(train_command("llama-3-8b", best))
        assert argv[:2] == ["memfit", "train"]
        config = _run_config(build_parser().parse_args(argv[1:]))
        train = config.train
        assert (train.optimizer, train.master_weights) == (best.optimizer, best.master_weights)
        assert (train.micro_batch, train.grad_accum, train.checkpointing) == (
            best.micro_batch, best.grad_accum, best.checkpointing
        )  # fmt: skip
        assert (config.distributed.zero, config.distributed.offload) == (best.zero, best.offload)
        assert config.data.seq_len == best.seq_len and config.model.name == "llama-3-8b"
    assert best.offload != "none"


def test_adamw8bit_keeps_the_embedding_in_32_bit_states(tmp_path):
    """The trainer's parameter groups mark the embedding table; 8-bit AdamW keeps its moments
    in fp32 and quantizes the other matrices; the planner counts both kinds of state."""
    from memfit.config import build_config
    from memfit.models import PRESETS
    from memfit.train.engine import Trainer

    flags = {
        "data": {"seq_len": 32},
        "train": {"steps": 1, "micro_batch": 2, "device": "cpu", "precision": "fp32",
                  "optimizer": "adamw8bit"},
        "checkpoint": {"out": str(tmp_path)},
    }  # fmt: skip
    trainer = Trainer(build_config(flags=flags))
    trainer.train_step()
    optimizer = trainer.optimizer
    embedding = trainer.model.embed.weight
    assert optimizer.state[embedding]["exp_avg"].dtype == torch.float32
    matrix = trainer.model.layers[0].mlp.down.weight
    assert matrix.numel() >= 4096 and "exp_avg_codes" in optimizer.state[matrix]
    config = PRESETS["tiny"]
    E = config.vocab_size * config.hidden_size
    P = sum(p.numel() for p in trainer.model.parameters())
    planned = model_state_bytes(P, optimizer="adamw8bit", embedding_params=E)
    assert planned["optimizer_states"] == math.ceil((2 + 8 / 256) * (P - E) + 8 * E)


def test_a_checkpoint_of_bf16_weights_is_counted_at_two_bytes_a_weight(tmp_path):
    """The free-space check before a save: bf16 weights (no masters) take 2 bytes each."""
    from memfit.config import build_config
    from memfit.train.engine import Trainer

    sizes = {}
    for master_weights in ("fp32", "none"):
        flags = {
            "train": {"device": "cpu", "precision": "bf16", "optimizer": "adamw8bit",
                      "master_weights": master_weights},
            "checkpoint": {"out": str(tmp_path / master_weights)},
        }  # fmt: skip
        sizes[master_weights] = Trainer(build_config(flags=flags)).checkpoint_bytes()
    from memfit.models import PRESETS

    assert sizes["fp32"] - sizes["none"] == 2 * PRESETS["tiny"].num_params
