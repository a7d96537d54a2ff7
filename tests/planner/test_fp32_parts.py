"""The planner's price of `--fp32-parts` (memfit.planner.memory.block_activation_bytes,
memfit.planner.time.fp32_parts_seconds)."""

import itertools

import pytest

from memfit.models import PRESETS
from memfit.planner import Strategy, get_gpu, plan, step_time

MODEL, GPU = PRESETS["llama-1b"], get_gpu("h100-sxm")


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_every_part_in_fp32_plans_as_an_fp32_run(checkpointing):
    """bf16 with every block and the head in fp32 keeps what an fp32 run keeps, byte for byte,
    and takes the time of one within a few percent (the fp32 run's weight traffic and
    elementwise passes are priced more coarsely)."""
    everything = f"first:{MODEL.num_layers},head"
    mixed = Strategy(micro_batch=4, checkpointing=checkpointing, fp32_parts=everything)
    fp32 = Strategy(precision="fp32", micro_batch=4, checkpointing=checkpointing)
    assert plan(MODEL, mixed, GPU).peak_bytes == plan(MODEL, fp32, GPU).peak_bytes
    assert plan(MODEL, mixed, GPU).forward_kept_bytes == plan(MODEL, fp32, GPU).forward_kept_bytes
    assert step_time(MODEL, mixed, GPU).total_s == pytest.approx(
        step_time(MODEL, fp32, GPU).total_s, rel=0.05
    )


def test_each_fp32_part_costs_time_and_blocks_cost_memory():
    times, kept = {}, {}
    for parts in ("", "head", "last:1,head", "first:1,last:1,head", "first:2,last:2,head"):
        strategy = Strategy(micro_batch=4, fp32_parts=parts)
        times[parts] = step_time(MODEL, strategy, GPU).total_s
        kept[parts] = plan(MODEL, strategy, GPU).forward_kept_bytes
    ordered = list(times)
    assert all(times[a] < times[b] for a, b in itertools.pairwise(ordered))
    # the fp32 head keeps a 4-byte norm input and gradient but no bf16 copy of its weight
    assert kept["head"] > kept[""]
    assert all(kept[a] < kept[b] for a, b in itertools.pairwise(ordered[1:]))


def test_fp32_parts_are_spelled_one_way_and_refused_where_weights_are_not_fp32():
    strategy = Strategy(fp32_parts="head, last ,first:2")
    assert strategy.fp32_parts == "first:2,last:1,head"
    assert "fp32 first:2,last:1,head" in strategy.describe()
    for bad in (
        {"precision": "fp32"},
        {"lora_rank": 8},
        {"zero": 3, "world_size": 2},
        {"master_weights": "none", "optimizer": "adamw8bit"},
    ):
        with pytest.raises(ValueError, match="fp32_parts 'head' computes those parts"):
            Strategy(fp32_parts="head", **bad)
    with pytest.raises(ValueError, match="last:17, but the model has 16 blocks"):
        plan(MODEL, Strategy(fp32_parts="last:17"), GPU)


def test_fp32_blocks_of_a_flash_model_plan_as_sdpa():
    """memfit's flash kernel hands fp32 calls to SDPA (memfit.functional.attention): an fp32
    block of a flash run keeps what it keeps under SDPA (grouped k and v repeated)."""

    def grown(attention):
        kept = [
            plan(MODEL, Strategy(micro_batch=4, attention=attention, fp32_parts=p), GPU)
            for p in ("", "first:2,last:2")
        ]
        return kept[1].forward_kept_bytes - kept[0].forward_kept_bytes

    assert grown("flash") == grown("sdpa") > 0
