import json
from pathlib import Path

import pytest

from memfit.models import PRESETS
from memfit.planner import GPUS, Strategy, plan, rank_strategies, step_time
from memfit.planner.time import host_sets_pace

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
    """llama-1b's H100 runs the time model was once fitted to, no longer (it is fitted to
    time_model.json's designed set): within 10%, the issue's bar for runs not fitted to (-3% to
    -7%: these ran compiled blocks without checkpointing, and an older engine)."""
    strategy = Strategy(
        micro_batch=record["micro_batch"],
        seq_len=record["seq_len"],
        checkpointing=record["checkpointing"],
    )
    predicted = step_time(PRESETS["llama-1b"], strategy, GPUS["h100-sxm"]).tokens_per_s
    assert predicted == pytest.approx(record["tokens_per_s"], rel=0.1)


def test_checkpointing_and_small_batches_cost_time():
    """Checkpointing costs its recompute; selective's rerun skips attention but its policy sees
    every operation on the host, so it is the slower of the two where the host sets the pace
    (llama-1b, 8k tokens a micro-batch) and the faster where the GPU does (64k: measured 930 ms
    against full's 958, time_model.json)."""
    model, gpu = PRESETS["llama-1b"], GPUS["h100-sxm"]

    def speed(**fields):
        return step_time(model, Strategy(**fields), gpu).tokens_per_s

    none = speed(micro_batch=4)
    assert (
        none
        > speed(micro_batch=4, checkpointing="full")
        > speed(micro_batch=4, checkpointing="selective")
    )
    assert speed(micro_batch=16, seq_len=4096, checkpointing="selective") > speed(
        micro_batch=16, seq_len=4096, checkpointing="full"
    )
    assert speed(micro_batch=1) < none
    assert speed(micro_batch=4, precision="fp32") < none / 5


def test_recommend_ranks_fitting_strategies_fastest_first():
    found = rank_strategies(PRESETS["llama-1b"], GPUS["h100-sxm"], seq_len=2048)
    assert found and all(r.plan.fits for r in found)
    speeds = [r.time.tokens_per_s for r in found]
    assert speeds == sorted(speeds, reverse=True)
    assert found[0].strategy.checkpointing == "none"
    # a 24 GB card needs checkpointing or small micro-batches for the same model
    small = rank_strategies(PRESETS["llama-1b"], GPUS["rtx4090"], seq_len=2048)
    assert all(r.plan.required_bytes <= GPUS["rtx4090"].memory_bytes for r in small)


def test_recommend_checkpoints_only_the_blocks_a_micro_batch_needs():
    """llama-3-8b LoRA on a 24 GB card: micro-batch 1 fits with checkpointing but not without;
    the search also offers checkpointing the fewest blocks that fit, which recomputes less
    than every block, and its command line says how many."""
    from dataclasses import replace

    from memfit.cli.plan import train_command
    from memfit.planner import plan
    from memfit.planner.search import SAFETY_MARGIN

    gpu = GPUS["rtx4090"]
    found = rank_strategies(PRESETS["llama-3-8b"], gpu, lora_rank=16, limit=20)
    partial = [r for r in found if r.strategy.checkpoint_blocks is not None]
    assert partial
    budget = gpu.memory_bytes * (1 - SAFETY_MARGIN)
    for r in partial:
        k = r.strategy.checkpoint_blocks
        assert 0 < k < PRESETS["llama-3-8b"].num_layers
        assert r.plan.required_bytes <= budget
        fewer = replace(r.strategy, checkpoint_blocks=k - 1)
        assert plan(PRESETS["llama-3-8b"], fewer, gpu).required_bytes > budget
        every = replace(r.strategy, checkpoint_blocks=None)
        assert r.time.tokens_per_s > step_time(PRESETS["llama-3-8b"], every, gpu).tokens_per_s
        assert f"--checkpoint-blocks {k}" in train_command("llama-3-8b", r.strategy)


def test_checkpointing_auto_takes_the_fastest_that_fits():
    """--checkpointing auto: none where it fits; where it does not, the mode and the fewest
    blocks that fit the budget, faster than full checkpointing of every block; full where
    nothing fits (the engine's preflight then speaks)."""
    from dataclasses import replace

    from memfit.planner import plan
    from memfit.planner.search import SAFETY_MARGIN, choose_checkpointing

    model, gpu = PRESETS["llama-1b"], GPUS["h100-sxm"]
    budget = gpu.memory_bytes * (1 - SAFETY_MARGIN)
    roomy, why = choose_checkpointing(model, Strategy(micro_batch=4, seq_len=2048), gpu)
    assert (roomy.checkpointing, roomy.checkpoint_blocks) == ("none", None)
    assert "fits without" in why

    tight = Strategy(micro_batch=16, seq_len=4096)
    assert plan(model, tight, gpu).required_bytes > budget
    chosen, why = choose_checkpointing(model, tight, gpu)
    k = chosen.checkpoint_blocks
    assert chosen.checkpointing in ("selective", "full") and 0 < k < model.num_layers
    assert plan(model, chosen, gpu).required_bytes <= budget
    assert plan(model, replace(chosen, checkpoint_blocks=k - 1), gpu).required_bytes > budget
    full = replace(tight, checkpointing="full")
    assert step_time(model, chosen, gpu).total_s < step_time(model, full, gpu).total_s
    assert f"first {k} of {model.num_layers} blocks" in why and "faster than full" in why
    # (the other fields are kept)
    assert replace(chosen, checkpointing="none", checkpoint_blocks=None) == tight
    # a budget of its own: less memory, more blocks (or the heavier mode)
    smaller, _ = choose_checkpointing(
        model, tight, gpu, budget=plan(model, chosen, gpu).required_bytes - 2**30
    )
    assert step_time(model, smaller, gpu).total_s > step_time(model, chosen, gpu).total_s

    huge, why = choose_checkpointing(PRESETS["llama-3-8b"], Strategy(micro_batch=8), gpu)
    assert (huge.checkpointing, huge.checkpoint_blocks) == ("full", None)
    assert "nothing fits" in why


def test_recommend_refuses_what_the_engine_cannot_run():
    roomy, small = 512 * 2**30, 16 * 2**30  # host memory: offload pins at most half of it
    assert rank_strategies(PRESETS["llama-3-70b"], GPUS["h100-sxm"], host_memory=roomy) == []
    # llama-2-7b on one H100: fp32 AdamW fits only with the parameters and the optimizer in CPU
    # memory (ZeRO-3 offload); without the host memory for it, only 8-bit AdamW with bf16
    # weights does
    lean = rank_strategies(PRESETS["llama-2-7b"], GPUS["h100-sxm"], host_memory=small)
    assert lean and {(r.strategy.optimizer, r.strategy.master_weights) for r in lean} == {
        ("adamw8bit", "none")
    }
    offloaded = rank_strategies(PRESETS["llama-2-7b"], GPUS["h100-sxm"], host_memory=roomy)
    assert offloaded and {
        (r.strategy.optimizer, r.strategy.zero, r.strategy.offload) for r in offloaded
    } == {("adamw", 3, "params")}
    assert all(r.plan.host_bytes <= roomy // 2 for r in offloaded)
    with pytest.raises(ValueError, match="gpus must be >= 1"):
        rank_strategies(PRESETS["llama-1b"], GPUS["h100-sxm"], gpus=0)


def test_recommend_searches_zero_stages_and_offload_on_several_gpus():
    """--gpus N: every ZeRO stage and offload the engine runs with the optimizer, a step of all
    N GPUs holding the tokens asked for; a model no stage fits on one GPU fits sharded."""
    from memfit.cli.plan import train_command
    from memfit.planner.search import layouts

    roomy = 2**40
    found = rank_strategies(
        PRESETS["llama-1b"], GPUS["h100-sxm"], gpus=4, limit=400, host_memory=roomy
    )
    assert {r.strategy.world_size for r in found} == {4}
    assert {(r.strategy.zero, r.strategy.offload) for r in found} == set(layouts(4))
    for r in found:
        s = r.strategy
        assert s.micro_batch * s.grad_accum * s.seq_len * 4 == max(2**19, s.micro_batch * 2048 * 4)
    speeds = [r.time.tokens_per_s for r in found]
    assert speeds == sorted(speeds, reverse=True)
    command = train_command("llama-1b", found[0].strategy)
    assert command.startswith("torchrun --nproc_per_node 4 -m memfit train --model llama-1b")
    if found[0].strategy.zero:
        assert f"--zero {found[0].strategy.zero}" in command
    big = PRESETS["llama-3-70b"]
    assert rank_strategies(big, GPUS["h100-sxm"], host_memory=roomy) == []
    sharded = rank_strategies(big, GPUS["h100-sxm"], gpus=8, host_memory=roomy)
    assert sharded and all(r.strategy.zero == 3 for r in sharded)
    # the factored optimizers keep whole tensors: one process only; LoRA: stages 0-2, no offload
    assert layouts(2, "adafactor") == [] and layouts(1, "sm3") == [(0, "none")]
    assert layouts(2, "adamw", lora_rank=16) == [(0, "none"), (1, "none"), (2, "none")]


def test_package_level_contract():
    import memfit

    result = memfit.plan("llama-1b", gpu="h100-sxm", micro_batch=4, seq_len=2048)
    assert result.fits and result.peak_bytes == sum(result.breakdown.values())
    strategies = memfit.recommend("llama-1b", "h100-sxm", seq_len=2048)
    assert strategies and isinstance(strategies[0], Strategy)


ZERO_RESULTS = RESULTS.parent / "zero.json"
SYSTEM_STRATEGY = {  # zero.py's memfit systems: (stage, offload)
    "zero0": (0, "none"), "zero1": (1, "none"), "zero2": (2, "none"), "zero3": (3, "none"),
    "zero0+offload": (0, "optimizer"), "zero3+offload": (3, "params"),
}  # fmt: skip


def measured_data_parallel_steps():
    """The newest measurement of each (model, memfit system, GPUs) in zero.json."""
    newest = {}
    for run in json.loads(ZERO_RESULTS.read_text()):
        gpu = "h200" if "H200" in run["env"].get("gpu", "") else "h100-sxm"
        for r in run["records"]:
            if "step_s" in r and r["system"] in SYSTEM_STRATEGY:
                key = (r["model"], r["system"], r["gpus"], r["micro_batch"], r.get("grad_accum", 1))
                newest[key] = (gpu, r)
    return list(newest.values())


def record_strategy(record: dict) -> Strategy:
    zero, offload = SYSTEM_STRATEGY[record["system"]]
    return Strategy(
        micro_batch=record["micro_batch"], seq_len=record["seq_len"],
        checkpointing=record["checkpointing"], zero=zero, offload=offload,
        world_size=record["gpus"], grad_accum=record.get("grad_accum", 1),
    )  # fmt: skip


@pytest.mark.parametrize(
    "gpu, record",
    measured_data_parallel_steps(),
    ids=lambda x: x if isinstance(x, str) else f"{x['model']}-{x['system']}-{x['gpus']}gpu",
)
def test_the_planner_matches_the_measured_zero_and_offload_runs(gpu, record):
    """1 and 2 GPUs, every stage, offload (benchmarks/zero.py): step time within 10% (the
    issue-6 bar is 15%), peak memory within 5% (the planner's bar)."""
    from memfit.planner import plan

    model, strategy = PRESETS[record["model"]], record_strategy(record)
    # the H100 machine has 16 cores, the two-H200 one 32 (older records do not say)
    cpus = record.get("host_cpus") or (16 if gpu == "h100-sxm" else 32)
    predicted = step_time(model, strategy, GPUS[gpu], host_cpus=cpus).total_s
    assert predicted == pytest.approx(record["step_s"], rel=0.10)
    planned = plan(model, strategy).peak_bytes
    assert planned == pytest.approx(max(record["peak_allocated_per_rank"]), rel=0.05)


# zero.json runs made after the time model's constants were last fitted (git history of
# src/memfit/planner/time.py): commit 05e7304 fitted them to the runs up to 56557b1 (llama-1b to
# llama-2-13b, 1 and 2 H200s, the H100 offload runs of c4090ac / f569115) and to bandwidth.json;
# 48c177b then fitted the CPU step's growth with the host's cores to the two-GPU offload runs of
# ab6e1a6 and e1aeb55. Nothing was fitted to these: each recorded the planner's prediction
# (`planned_step_s`) before it ran.
HELD_OUT_RUNS = {
    "a207e91": "validation runs of 42186cc: accumulation 2 x 4 (stages 1-3), micro-batch 4",
    "c920c3d": "one H100, --zero 3 --offload params after the asynchronous-gather fix",
}


def held_out_steps():
    """(gpu, record) of every memfit run of zero.json in HELD_OUT_RUNS."""
    found = []
    for run in json.loads(ZERO_RESULTS.read_text()):
        if run["env"]["commit"] in HELD_OUT_RUNS:
            gpu = "h200" if "H200" in run["env"].get("gpu", "") else "h100-sxm"
            found += [
                (gpu, r) for r in run["records"] if "step_s" in r and r["system"] in SYSTEM_STRATEGY
            ]
    return found


def test_the_held_out_runs_are_there():
    runs = {
        (r["model"], r["system"], r["micro_batch"], r.get("grad_accum", 1))
        for _, r in held_out_steps()
    }
    assert len(runs) == 6, sorted(runs)


@pytest.mark.parametrize(
    "gpu, record",
    held_out_steps(),
    ids=lambda x: (
        x
        if isinstance(x, str)
        else (
            f"{x['model']}-{x['system']}-{x['gpus']}gpu-mb{x['micro_batch']}x{x.get('grad_accum', 1)}"
        )
    ),
)
def test_the_time_model_predicts_runs_it_was_not_fitted_to(gpu, record):
    """Step time of the held-out runs (HELD_OUT_RUNS), today's model and the prediction the run
    recorded before it ran: within 5% where the GPU sets the pace, 10% with offload, whose CPU
    step and PCIe copies rest on a handful of host measurements (the issue-6 bar is 15%)."""
    tolerance = 0.10 if record["system"].endswith("+offload") else 0.05
    cpus = record.get("host_cpus") or (16 if gpu == "h100-sxm" else 32)
    model, strategy = PRESETS[record["model"]], record_strategy(record)
    predicted = step_time(model, strategy, GPUS[gpu], host_cpus=cpus).total_s
    assert predicted == pytest.approx(record["step_s"], rel=tolerance)
    assert record["planned_step_s"] == pytest.approx(record["step_s"], rel=tolerance)


def test_communication_volume_per_stage():
    from memfit.planner.time import communication_bytes

    model = PRESETS["llama-2-7b"]
    P = model.num_params

    def moved(**options):
        return communication_bytes(model, Strategy(world_size=4, **options)) / (P * 3 / 4)

    assert communication_bytes(model, Strategy()) == 0
    # all-reduce = reduce-scatter + all-gather of fp32; stage 3 gathers bf16 twice instead
    assert moved(zero=0) == moved(zero=1) == moved(zero=2) == moved(zero=3) == pytest.approx(8)
    # accumulation: stages 0-1 reduce once per step, 2-3 per micro-batch
    assert moved(zero=1, grad_accum=4) == pytest.approx(8)
    assert moved(zero=2, grad_accum=4) == pytest.approx(4 * 4 + 4)
    assert moved(zero=3, grad_accum=4) == pytest.approx(8 * 4)


def test_more_gpus_cost_communication_and_share_the_offload_cpu():
    model, gpu = PRESETS["llama-2-7b"], GPUS["h200"]

    def step(n, **options):
        return step_time(model, Strategy(micro_batch=2, world_size=n, **options), gpu)

    # (N-1)/N of the gradients cross the links: more GPUs, slower steps, never by 2x
    for zero in (0, 2, 3):
        times = [step(n, zero=zero).communication_s for n in (2, 4, 8)]
        assert times == sorted(times) and times[2] < 2 * times[0]
    # offload: the ranks of a node share its CPU, so the CPU step does not shrink with N (only
    # the PCIe copies, one link per GPU, do)
    from memfit.planner.time import cpu_adam_rate

    cpu = model.num_params / cpu_adam_rate()
    one = step(1, offload="optimizer").optimizer_s
    eight = step(8, zero=2, offload="optimizer").optimizer_s
    assert one > eight > cpu


def test_offload_plans_its_host_memory():
    from memfit.planner import plan

    model = PRESETS["llama-2-7b"]
    offloaded = plan(model, Strategy(world_size=4, zero=3, offload="params"))
    assert offloaded.host_bytes == pytest.approx(16 * model.num_params / 4, rel=1e-6)
    assert plan(model, Strategy()).host_bytes == 0


TIME_MODEL_RESULTS = RESULTS.parent / "time_model.json"


def time_model_records(part: str) -> list[dict]:
    """The measured records of `part` in every run of time_model.json (benchmarks/time_model.py)."""
    return [
        r
        for run in json.loads(TIME_MODEL_RESULTS.read_text())
        for r in run["records"]
        if r["part"] == part and "step_s" in r
    ]


def _model_and_strategy(record: dict, tmp_path):
    """A time_model.json record's model (a preset, or its Hugging Face config) and Strategy."""
    from memfit.models.config import from_hf_config

    if record["hf_config"] is None:
        model = PRESETS[record["model"]]
    else:
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**record["hf_config"], "_name_or_path": record["model"]}))
        model = from_hf_config(path)
    fields = {**record["strategy"], "lora_targets": tuple(record["strategy"]["lora_targets"])}
    return model, Strategy(**{**fields, "teacher": None})


def _predicted(record: dict, tmp_path):
    return step_time(*_model_and_strategy(record, tmp_path), GPUS["h100-sxm"])


@pytest.mark.parametrize(
    "record",
    time_model_records("held_out") + time_model_records("recommend"),
    ids=lambda r: (
        f"{r['part']}-{r['model']}-mb{r['micro_batch']}x{r['grad_accum']}-"
        f"{r['strategy']['checkpointing']}"
    ),
)
def test_the_time_model_predicts_models_it_was_not_fitted_to(record, tmp_path):
    """Hugging Face models from 135M to 8B parameters (five with 128k+ vocabularies), and
    `--recommend`'s first three strategies of five of them, none fitted on (the designed set
    and the host-bound steps are, benchmarks/fit_time_model.py), each run on a machine of its
    own: every step the GPU sets the pace of within 10% on the first machine and 12.3% on the
    second (Llama-3.2-3B, whose host was slower), and where the host's launches set it (the
    smallest models) within 45%: the host's speed moved such steps by up to 2x between
    machines of the same kind (SmolLM2-135M: 73 to 143 ms on seven machines), which no
    constant follows, nor a host calibration timed before each (planner/time.py)."""
    model, strategy = _model_and_strategy(record, tmp_path)
    predicted = step_time(model, strategy, GPUS["h100-sxm"])
    error = predicted.total_s / record["step_s"] - 1
    host_bound = host_sets_pace(model, strategy, GPUS["h100-sxm"])
    assert abs(error) < (0.45 if host_bound else 0.13), (error, host_bound)


def test_the_time_model_fits_its_designed_set(tmp_path):
    """The designed set it is fitted on (hidden sizes 576 to 8192, head dims 64 and 128, GQA 1
    to 8, SwiGLU 2x to 6x, sequences 1k to 16k, vocabularies 32k to 152k, every checkpointing
    mode, bf16 and fp16, optimizer offload): rms error under 12%, and the GPU-bound steps'
    under 8%."""
    errors, gpu_bound = [], []
    for record in time_model_records("fit"):
        model, strategy = _model_and_strategy(record, tmp_path)
        predicted = step_time(model, strategy, GPUS["h100-sxm"])
        errors.append(predicted.total_s / record["step_s"] - 1)
        if not host_sets_pace(model, strategy, GPUS["h100-sxm"]):
            gpu_bound.append(errors[-1])

    def rms(values):
        return (sum(e * e for e in values) / len(values)) ** 0.5

    assert len(errors) >= 40 and len(gpu_bound) >= 30
    assert rms(errors) < 0.12 and rms(gpu_bound) < 0.08, (rms(errors), rms(gpu_bound))


def test_the_time_model_prices_short_captured_steps_by_their_kernels(tmp_path):
    """Steps captured in a CUDA graph of 256 to 4096 tokens a micro-batch (the designed shapes
    it is fitted on and five Hugging Face models it is not, on an H200): each kernel's least time
    and the products' rate at few rows put every one within 12%, where a model without them
    was 13-74% short."""
    records = time_model_records("graph_floor") + time_model_records("graph_floor_held_out")
    assert len(records) >= 45
    for record in records:
        model, strategy = _model_and_strategy(record, tmp_path)
        assert strategy.cuda_graphs
        predicted = step_time(model, strategy, GPUS["h200"]).total_s
        assert abs(predicted / record["step_s"] - 1) < 0.12, (record["model"], predicted)


def test_a_short_captured_step_costs_its_kernels(monkeypatch):
    """Captured, a step of few tokens takes at least its kernels' least time, accumulation
    pays it again for every micro-batch (so the search prefers one micro-batch of 8 to 8 of 1),
    and a long step hardly notices it."""
    from memfit.planner import time as time_model

    model, h100 = PRESETS["llama-1b"], GPUS["h100-sxm"]
    short = Strategy(seq_len=256, micro_batch=1, cuda_graphs=True)
    floor = time_model.kernel_floor_seconds(model, short)
    assert floor > model.num_layers * 40 * time_model.KERNEL_SECONDS
    assert step_time(model, short, h100).compute_s > floor
    one = step_time(model, Strategy(seq_len=256, micro_batch=8, cuda_graphs=True), h100)
    many = Strategy(seq_len=256, micro_batch=1, grad_accum=8, cuda_graphs=True)
    assert time_model.kernel_floor_seconds(model, many) == pytest.approx(8 * floor)
    assert step_time(model, many, h100).total_s > 1.3 * one.total_s
    long = Strategy(seq_len=4096, micro_batch=4, cuda_graphs=True)
    priced = {s: step_time(model, s, h100).total_s for s in (short, long)}
    monkeypatch.setattr(time_model, "KERNEL_SECONDS", 0.0)
    assert priced[short] - step_time(model, short, h100).total_s > 0.7 * floor  # (less its passes)
    assert step_time(model, long, h100).total_s == pytest.approx(priced[long], rel=0.01)


def test_each_recommendation_says_why_it_is_there():
    """The first is the fastest predicted; each other says how much slower and how much memory
    it saves; a strategy's offload, checkpointing or lean optimizer each name what the strategy
    without it would need (over the GPU)."""
    gpu = GPUS["h100-sxm"]
    found = rank_strategies(PRESETS["llama-2-7b"], gpu, limit=3, host_memory=512 * 2**30)
    first, *others = found
    assert first.reasons.startswith("the fastest predicted")
    assert all("slower than the first" in r.reasons for r in others)
    s = first.strategy
    assert (s.zero, s.offload) == (3, "params")
    assert "ZeRO-3 with params offload: stage 0 on the GPU needs" in first.reasons
    if s.checkpoint_blocks is not None:
        assert f"on the fewest blocks that fit ({s.checkpoint_blocks} of 32)" in first.reasons
    assert first.reasons in first.why()
    lean = rank_strategies(PRESETS["llama-2-7b"], gpu, limit=1, host_memory=16 * 2**30)[0]
    assert "adamw8bit: nothing fits with adamw" in lean.reasons
    assert "bf16 weights: nothing fits with fp32 masters" in lean.reasons


@pytest.mark.parametrize(
    "record",
    time_model_records("fp32_parts"),
    ids=lambda r: (
        f"{r['model']}-{r['strategy']['checkpointing']}-{r['precision']}-"
        f"{r['strategy']['fp32_parts'] or 'none'}-{r['strategy']['fp32_matmul']}"
    ),
)
def test_the_plan_prices_fp32_parts(record, tmp_path):
    """`--fp32-parts` on an H100 (llama-1b and Llama-3.2-1B, the head to two blocks at each
    end, none and full checkpointing, bf16 and fp16, fp32 and tf32 products): step time
    within 13% and peak within 2% of the plan (measured -5% to +12%, peaks within 1.7%)."""
    model, strategy = _model_and_strategy(record, tmp_path)
    predicted = step_time(model, strategy, GPUS["h100-sxm"])
    assert abs(predicted.total_s / record["step_s"] - 1) < 0.13
    planned = plan(model, strategy, GPUS["h100-sxm"])
    assert abs(planned.peak_bytes / record["peak_bytes"] - 1) < 0.02


@pytest.mark.parametrize("allocator", ["expandable_segments:True", "expandable_segments:False"])
def test_the_allocator_slack_holds_at_the_gpus_capacity(allocator, monkeypatch, tmp_path):
    """Runs planned at 95-102% of an H100 under each allocator, planned for the memory the GPU
    reports (79.18 GiB, as `detect_gpu` finds it): every one the plan says fits ran (with
    expandable segments 2% of slack, with the default 10%), and with expandable segments the
    plan says so of three of the eight that ran (5% said so of none)."""
    import dataclasses

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", allocator)
    runs = [
        run
        for run in json.loads(TIME_MODEL_RESULTS.read_text())
        if run["env"].get("alloc_conf") == allocator
        and any(r["part"] == "capacity" for r in run["records"])
    ]
    newest = runs[-1]  # (of the results file, which runs are appended to)
    assert len(newest["records"]) == 13
    gpu = dataclasses.replace(GPUS["h100-sxm"], memory_bytes=newest["gpu_capacity_bytes"])
    said_fits, ran = 0, 0
    for r in newest["records"]:
        planned = plan(*_model_and_strategy(r, tmp_path), gpu)
        assert planned.slack == (0.02 if allocator.endswith("True") else 0.10)
        if planned.fits:
            said_fits += 1
            assert "step_s" in r, r.get("error")
        ran += "step_s" in r
    if allocator.endswith("True"):
        assert ran == 8 and said_fits == 3
