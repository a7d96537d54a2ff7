"""The training step captured in a CUDA graph (`train.cuda_graphs`, memfit.train.graphs): what it
refuses and why, what the planner prices for it, and on a GPU the losses, learning rates and
weights of eager steps."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memfit.config import build_config
from memfit.models.config import PRESETS
from memfit.planner import Strategy
from memfit.planner.time import GRAPHED_HOST_SECONDS_PER_STEP, host_seconds
from memfit.train import graphs
from memfit.train.engine import ConfigError, Trainer


def make_trainer(tmp_path, name, compile="auto", lora=None, resume=False, **train):
    flags = {
        "model": {"compile": compile},
        "data": {"seq_len": 64},
        "train": {"steps": 8, "micro_batch": 4, "warmup_steps": 2, "precision": "fp32", **train},
        "checkpoint": {"out": str(tmp_path / name), "resume": resume},
        **({"lora": lora} if lora else {}),
    }
    return Trainer(build_config(flags=flags))


def test_refused_on_cpu_with_the_reason(tmp_path):
    with pytest.raises(ConfigError, match="--cuda-graphs: .*captured on a CUDA device"):
        make_trainer(tmp_path, "cpu", device="cpu", cuda_graphs=True)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"precision": "fp16"}, "loss scaling decides on the host"),
        ({"world_size": 2}, "talk to other ranks"),
        ({"offload": "optimizer"}, "talk to other ranks or the CPU"),
        ({"offload_activations": True, "checkpointing": "full"}, "copies to and from the CPU"),
        ({"teacher": PRESETS["tiny"]}, "distillation"),
        ({"optimizer": "sgd"}, "only the fused AdamW .* this run has --optimizer sgd"),
    ],
)
def test_refusals(change, reason):
    """The one rule the engine and the search share (memfit.planner.search.capture_refusal)."""
    from memfit.planner.search import capture_refusal

    assert capture_refusal(Strategy()) is None
    why = capture_refusal(Strategy(**change))
    assert why is not None
    assert re.search(reason, why), why


def test_planner_prices_no_host_launches_for_a_captured_step():
    model = PRESETS["tiny"]
    eager = Strategy(micro_batch=4, seq_len=256)
    graphed = Strategy(micro_batch=4, seq_len=256, cuda_graphs=True)
    assert host_seconds(model, eager) > 10 * GRAPHED_HOST_SECONDS_PER_STEP
    assert host_seconds(model, graphed) == GRAPHED_HOST_SECONDS_PER_STEP


def test_make_capturable_keeps_the_schedule_on_the_device():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=1e-3, fused=param.device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    graphs.make_capturable(optimizer, param.device)
    lr = optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and optimizer.param_groups[0]["capturable"]
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] is lr  # filled in place: a graph keeps reading it
    assert float(lr) == pytest.approx(5e-4)
    assert float(scheduler.get_last_lr()[0]) == pytest.approx(5e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "settings",
    [
        {"precision": "bf16", "grad_accum": 2},
        {"precision": "fp32"},
        {"precision": "bf16", "checkpointing": "selective"},
        {"precision": "bf16", "checkpointing": "full", "checkpoint_blocks": 1},
        {"precision": "bf16", "compile": "off"},  # (auto: compiled blocks without checkpointing)
        {
            "precision": "bf16",
            "lr": 1e-2,
            "lora": {"rank": 4, "targets": "q_proj,v_proj,down_proj"},
        },
        {"precision": "bf16", "lr": 1e-2, "lora": {"rank": 4, "quantize": "nf4"}},
    ],
)
def test_graphed_steps_train_as_eager_steps_do(tmp_path, settings):
    """Eight steps from one seed, eager and captured (step 1 eager on a side stream, step 2
    captured and replayed, then replays): the same losses, gradient norms, learning rates and
    weights, to the rounding of a product whose algorithm may differ under capture. Compiled
    blocks start afresh for each case: after the earlier cases' compilations, one of the two
    runs could fall back to eager blocks (torch's recompile limit) and round differently
    (QLoRA's at lr 1e-2 then 0.4% apart; alone, its eager and captured losses are equal)."""
    torch._dynamo.reset()
    runs = {}
    for graphed in (False, True):
        trainer = make_trainer(
            tmp_path, f"g{graphed}", device="cuda", cuda_graphs=graphed, **settings
        )  # fmt: skip
        steps = [trainer.train_step() for _ in range(8)]
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        runs[graphed] = (steps, weights)
        if graphed:
            assert trainer.graphed.graph is not None
    (eager, w_eager), (captured, w_captured) = runs[False], runs[True]
    for a, b in zip(eager, captured, strict=True):
        assert b.loss == pytest.approx(a.loss, rel=1e-4)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-3)
        assert b.lr == pytest.approx(a.lr, rel=1e-6)
    assert captured[-1].loss < captured[0].loss
    for name, value in w_eager.items():
        torch.testing.assert_close(w_captured[name], value, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_run_resumes_as_it_would_have_gone_on(tmp_path):
    """Four captured steps, saved; a new captured run resumed from them (its learning rates made
    device tensors again after the load) gives the uninterrupted captured run's steps 5-8."""
    settings = {"device": "cuda", "cuda_graphs": True, "precision": "bf16", "grad_accum": 2}
    straight = make_trainer(tmp_path, "straight", **settings)
    expected = [straight.train_step() for _ in range(8)]
    first = make_trainer(tmp_path, "resumed", **settings)
    for _ in range(4):
        first.train_step()
    first.save()
    del first
    second = make_trainer(tmp_path, "resumed", resume=True, **settings)
    assert second.step == 4
    lr = second.optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.device.type == "cuda"
    history = second.fit()
    assert second.graphed.graph is not None
    for a, b in zip(expected[4:], history, strict=True):
        assert b.loss == pytest.approx(a.loss, rel=1e-4)
        assert b.lr == pytest.approx(a.lr, rel=1e-6)
    for name, p in second.model.named_parameters():
        torch.testing.assert_close(
            p, dict(straight.model.named_parameters())[name], rtol=1e-3, atol=1e-5
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_observed_step_of_a_captured_run_is_an_eager_one(tmp_path):
    """`memfit profile`'s observer gets an eager step between replays: it starts from no
    gradients (a replay leaves none behind) and the replays after it go on as before."""
    from memfit.train.step import StepObserver

    settings = {"device": "cuda", "precision": "bf16", "compile": "off"}
    eager = make_trainer(tmp_path, "eager", **settings)
    expected = [eager.train_step() for _ in range(6)]
    captured = make_trainer(tmp_path, "captured", cuda_graphs=True, **settings)
    steps = [captured.train_step() for _ in range(3)]
    assert all(p.grad is None for p in captured.model.parameters())
    steps.append(captured.train_step(StepObserver()))
    steps += [captured.train_step() for _ in range(2)]
    for a, b in zip(expected, steps, strict=True):
        assert b.loss == pytest.approx(a.loss, rel=1e-4)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-3)


CANNOT_BE_CAPTURED = """
import sys
import pytest
from tests.train.test_graphs import make_trainer
from pathlib import Path

trainer = make_trainer(Path(sys.argv[1]), "bad", device="cuda", cuda_graphs=True, precision="bf16")
forward = trainer.loss_model.forward

def reads_the_device(*args, **kwargs):
    loss = forward(*args, **kwargs)
    float(loss.detach().sum().item())
    return loss

trainer.loss_model.forward = reads_the_device
trainer.train_step()  # the warm-up step is eager
with pytest.raises(RuntimeError) as raised:
    trainer.train_step()
assert trainer.graphed.graph is None
print(raised.value)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_that_cannot_be_captured_says_so(tmp_path):
    """A forward that reads the device on the host (here: a wrapper calling .item()) cannot be
    captured: the second step raises the reason and how to go on, and leaves no graph. In a
    process of its own: a failed capture leaves the process's CUDA state unfit to go on (the
    run ends there)."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", CANNOT_BE_CAPTURED, str(tmp_path)], cwd=root, capture_output=True,
        text=True, timeout=600, env={**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(
        r"--cuda-graphs: the step could not be captured.*\(.+\); run without --cuda-graphs",
        done.stdout,
    ), done.stdout


def test_the_search_captures_host_bound_steps_only():
    """`--recommend` and `--auto` list a small model's short steps captured (the host would set
    their pace) with the reason, and a step whose eager host launches take half the GPU's time
    or more (a slower host would set its pace); a step the GPU sets the pace of stays eager."""
    from memfit.models.config import ModelConfig
    from memfit.planner import GPUS, rank_strategies

    small = ModelConfig(
        name="smollm2-135m-like", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
        num_kv_heads=3, intermediate_size=1536, max_seq_len=8192, tie_embeddings=True,
    )  # fmt: skip
    found = rank_strategies(small, GPUS["h100-sxm"], seq_len=2048, tokens_per_step=2**14)
    assert found[0].strategy.cuda_graphs
    assert "captured in a CUDA graph" in found[0].reasons
    assert "cuda graphs" in found[0].strategy.describe()
    # llama-1b: the micro-batches whose eager host launches take under half the GPU's time
    # stay eager; mb 2's (78%) is captured, saying why (host memory given: the activation
    # offload strategies listed depend on it)
    from dataclasses import replace

    from memfit.planner.search import GRAPHS_HOST_SHARE, capture_refusal
    from memfit.planner.time import host_share

    h100, llama = GPUS["h100-sxm"], PRESETS["llama-1b"]
    large = rank_strategies(llama, h100, seq_len=2048, host_memory=64 * 2**30, limit=20)
    for r in large:
        eager = replace(r.strategy, cuda_graphs=False)
        capturable = capture_refusal(eager) is None
        share = host_share(llama, eager, h100)
        assert r.strategy.cuda_graphs == (capturable and share >= GRAPHS_HOST_SHARE), (eager, share)
    assert not large[0].strategy.cuda_graphs
    graphed = [r for r in large if r.strategy.cuda_graphs]
    assert graphed and all("host launches take" in r.reasons for r in graphed)
