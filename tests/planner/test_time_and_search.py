import json
from pathlib import Path

import pytest

from memfit.models import PRESETS
from memfit.planner import GPUS, Strategy, rank_strategies, step_time

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "train_step.json"


def measured_train_steps():
    """memfit's records of the newest run that measured HF too (the run the time model was fitted
    to; later runs, e.g. memfit against memfit with another attention kernel, measure other
    things)."""
    runs = json.loads(RESULTS.read_text())
    run = [r for r in runs if any(rec["system"] != "memfit" for rec in r["records"])][-1]
    return [r for r in run["records"] if r["system"] == "memfit"]


@pytest.mark.parametrize(
    "record", measured_train_steps(), ids=lambda r: f"{r['checkpointing']}-mb{r['micro_batch']}"
)
def test_time_model_matches_the_measured_h100_steps(record):
    """The efficiencies were fitted to these H100 runs (BENCHMARKS.md); the recompute term was not."""
    strategy = Strategy(
        micro_batch=record["micro_batch"],
        seq_len=record["seq_len"],
        checkpointing=record["checkpointing"],
    )
    predicted = step_time(PRESETS["llama-1b"], strategy, GPUS["h100-sxm"]).tokens_per_s
    assert predicted == pytest.approx(record["tokens_per_s"], rel=0.05)


def test_checkpointing_and_small_batches_cost_time():
    model, gpu = PRESETS["llama-1b"], GPUS["h100-sxm"]
    none = step_time(model, Strategy(micro_batch=4), gpu).tokens_per_s
    selective = step_time(
        model, Strategy(micro_batch=4, checkpointing="selective"), gpu
    ).tokens_per_s
    full = step_time(model, Strategy(micro_batch=4, checkpointing="full"), gpu).tokens_per_s
    assert none > selective > full
    assert step_time(model, Strategy(micro_batch=1), gpu).tokens_per_s < none
    assert step_time(model, Strategy(micro_batch=4, precision="fp32"), gpu).tokens_per_s < none / 5


def test_recommend_ranks_fitting_strategies_fastest_first():
    found = rank_strategies(PRESETS["llama-1b"], GPUS["h100-sxm"], seq_len=2048)
    assert found and all(r.plan.fits for r in found)
    speeds = [r.time.tokens_per_s for r in found]
    assert speeds == sorted(speeds, reverse=True)
    assert found[0].strategy.checkpointing == "none"
    # a 24 GB card needs checkpointing or small micro-batches for the same model
    small = rank_strategies(PRESETS["llama-1b"], GPUS["rtx4090"], seq_len=2048)
    assert all(r.plan.required_bytes <= GPUS["rtx4090"].memory_bytes for r in small)


def test_recommend_refuses_what_the_engine_cannot_run():
    assert rank_strategies(PRESETS["llama-2-7b"], GPUS["h100-sxm"]) == []
    with pytest.raises(ValueError, match="ZeRO"):
        rank_strategies(PRESETS["llama-1b"], GPUS["h100-sxm"], gpus=4)


def test_package_level_contract():
    import memfit

    result = memfit.plan("llama-1b", gpu="h100-sxm", micro_batch=4, seq_len=2048)
    assert result.fits and result.peak_bytes == sum(result.breakdown.values())
    strategies = memfit.recommend("llama-1b", "h100-sxm", seq_len=2048)
    assert strategies and isinstance(strategies[0], Strategy)
