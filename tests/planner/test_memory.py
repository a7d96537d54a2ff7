import pytest
import torch

from memfit.config import build_config
from memfit.models import PRESETS, load_model_config
from memfit.planner import GPUS, Strategy, get_gpu, plan, what_would_fit
from memfit.planner.memory import _cross_entropy
from memfit.train.engine import Trainer
from tests.train.activation_memory import live_forward_bytes


def cpu_trainer(tmp_path, **train):
    flags = {
        "data": {"seq_len": 128},
        "train": {"micro_batch": 4, "precision": "fp32", "device": "cpu", **train},
        "checkpoint": {"out": str(tmp_path)},
    }
    return Trainer(build_config(flags=flags))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_model_state_bytes_are_exact(tmp_path, optimizer):
    trainer = cpu_trainer(tmp_path, optimizer=optimizer)
    trainer.train_step()  # creates the gradients and the optimizer states
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    states = sum(
        t.numel() * t.element_size()
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.numel() > 1
    )
    strategy = Strategy(precision="fp32", micro_batch=4, seq_len=128, optimizer=optimizer)
    result = plan(trainer.model_config, strategy)
    step = result.phases["optimizer"] - result.breakdown["runtime_overhead"]
    assert params == 4 * trainer.model_config.num_params
    assert states == (8 if optimizer == "adamw" else 4) * trainer.model_config.num_params
    expected_step = (
        2 * params + states + (params if optimizer == "sgd" else 0)
    )  # SGD's decay temporary
    assert step == expected_step


@pytest.mark.parametrize(
    "checkpointing, blocks",
    [("none", None), ("selective", None), ("full", None), ("full", 1), ("selective", 3)],
)
def test_activation_prediction_matches_what_the_forward_keeps(tmp_path, checkpointing, blocks):
    trainer = cpu_trainer(tmp_path, checkpointing=checkpointing, checkpoint_blocks=blocks)
    inputs, targets = next(trainer.batches)
    live, _ = live_forward_bytes(trainer.model, inputs, targets)
    config = trainer.model_config
    strategy = Strategy(
        precision="fp32",
        micro_batch=4,
        seq_len=128,
        checkpointing=checkpointing,
        checkpoint_blocks=blocks,
    )
    result = plan(config, strategy)
    predicted = result.forward_kept_bytes
    unchecked = config.num_layers if checkpointing == "none" else config.num_layers - (blocks or 4)
    # the plan is for CUDA, where fp32 grouped-query attention repeats k and v for the fused
    # kernel (of each block that keeps its activations); CPU attention takes the groups as they are
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    predicted -= unchecked * 2 * 4 * 4 * 128 * (q - kv)
    assert predicted == pytest.approx(live, rel=0.05)


def test_checkpointing_some_blocks_plans_between_none_and_full():
    """checkpoint_blocks: 0 plans as none, every block as full; in between the peak falls and the
    step time grows with each block checkpointed (its recompute), and the search finds the
    fewest blocks that fit a budget between none and full."""
    from memfit.planner import step_time
    from memfit.planner.search import fewest_checkpointed_blocks

    model, gpu = PRESETS["llama-3-8b"], get_gpu("h200")

    def strategy(mode="full", blocks=None):
        return Strategy(micro_batch=4, lora_rank=16, checkpointing=mode, checkpoint_blocks=blocks)

    layers = model.num_layers
    none, full = plan(model, strategy("none")), plan(model, strategy())
    peaks = [plan(model, strategy(blocks=k)).peak_bytes for k in range(layers + 1)]
    times = [step_time(model, strategy(blocks=k), gpu).total_s for k in range(layers + 1)]
    assert all(a > b for a, b in zip(peaks, peaks[1:], strict=False))
    assert all(a < b for a, b in zip(times, times[1:], strict=False))
    assert times[0] == pytest.approx(step_time(model, strategy("none"), gpu).total_s)
    assert times[-1] == pytest.approx(step_time(model, strategy(), gpu).total_s)
    budget = (none.required_bytes + full.required_bytes) / 2
    chosen = fewest_checkpointed_blocks(model, strategy(), gpu, budget=budget)
    k = chosen.checkpoint_blocks
    assert 0 < k < layers
    assert (
        plan(model, chosen).required_bytes
        <= budget
        < plan(model, strategy(blocks=k - 1)).required_bytes
    )
    assert f"ckpt full ({k} blocks)" in chosen.describe()
    with pytest.raises(ValueError, match="checkpoint_blocks = 33, but llama-3-8b has 32 blocks"):
        plan(model, strategy(blocks=33))
    with pytest.raises(ValueError, match="with checkpointing full or selective"):
        strategy("none", 4)


def test_llama_1b_bf16_plan_matches_the_measured_h100_figure():
    """Regression anchor: 21.58 GiB measured on the H100 (benchmarks/results/planner_accuracy.json)."""
    result = plan(PRESETS["llama-1b"], Strategy(micro_batch=4, seq_len=2048), GPUS["h100-sxm"])
    assert result.peak_bytes / 2**30 == pytest.approx(21.58, rel=0.05)
    assert result.fits


def test_a_plan_that_does_not_fit_says_by_how_much_and_what_fits():
    model = load_model_config("llama-2-7b")
    result = plan(
        model, Strategy(micro_batch=1, seq_len=2048, checkpointing="full"), get_gpu("h100-sxm")
    )
    assert not result.fits and result.shortfall_bytes > 20 * 2**30
    fixes = dict(what_would_fit(model, result.strategy, get_gpu("h100-sxm")))
    assert "--offload optimizer" in fixes or any(label.startswith("--zero 3") for label in fixes)


def test_what_would_fit_leaves_out_changes_the_strategy_cannot_take():
    """bf16 weights without masters run on one process without offload: the advice for a
    run of them that does not fit (what a GPU run's preflight prints) offers neither."""
    model = load_model_config("llama-3-8b")
    strategy = Strategy(
        precision="bf16", micro_batch=8, seq_len=4096, optimizer="adamw8bit", master_weights="none"
    )
    assert not plan(model, strategy, get_gpu("h100-sxm")).fits
    fixes = dict(what_would_fit(model, strategy, get_gpu("h100-sxm")))
    assert "--checkpointing full" in fixes
    assert not any("offload" in label or "zero" in label for label in fixes)


def test_loss_buffers_are_far_below_the_logits():
    model = PRESETS["llama-3-8b"]
    strategy = Strategy(micro_batch=4, seq_len=8192)
    saved, transient = _cross_entropy(model, strategy)
    logits_fp32 = 4 * 8192 * 4 * model.vocab_size
    assert saved + transient < logits_fp32 / 3


def test_bad_input_names_the_known_values():
    with pytest.raises(ValueError, match="unknown GPU 'h100'.*h100-sxm"):
        get_gpu("h100")
    # the config's rules across sections (config.check_parallelism), with the world size
    with pytest.raises(ValueError, match="--zero 2 shards .* this run has one.* --gpus N"):
        Strategy(zero=2)
    with pytest.raises(ValueError, match="offload params .* needs --zero 3"):
        Strategy(offload="params", zero=1, world_size=2)


def test_what_would_fit_a_refused_multi_gpu_run_shards_offloads_and_leans():
    """llama-2-7b with AdamW on 4 H100s at stage 0 needs 106 GiB a GPU: the single changes that
    fit shard the state over the same GPUs (stages 1, 2, 3), offload it, or take the 8-bit
    optimizer, each planned as it would run; none of them is over the GPU."""
    from memfit.planner.memory import what_would_fit

    model, gpu = PRESETS["llama-2-7b"], get_gpu("h100-sxm")
    strategy = Strategy(micro_batch=1, checkpointing="full", world_size=4)
    assert not plan(model, strategy, gpu).fits
    fixes = dict(what_would_fit(model, strategy, gpu))
    for label in ("--zero 1", "--zero 2", "--zero 3", "--offload optimizer",
                  "--zero 3 --offload params", "--optimizer adamw8bit"):  # fmt: skip
        assert label in fixes, sorted(fixes)
    assert all(p.fits for p in fixes.values())
    # (sharding more frees more)
    assert (
        fixes["--zero 3"].peak_bytes < fixes["--zero 2"].peak_bytes < fixes["--zero 1"].peak_bytes
    )
    # on one GPU there is nothing to shard over: no bare --zero
    alone = dict(what_would_fit(model, Strategy(micro_batch=1, checkpointing="full"), gpu))
    assert not any(label.startswith("--zero ") and " on " not in label and "offload" not in label
                   for label in alone)  # fmt: skip
