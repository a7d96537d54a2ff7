import json
import math
import os

import pytest
import torch

from memfit.config import build_config
from memfit.train import checkpoint as ckpt
from memfit.train.engine import ConfigError, Trainer, TrainingDiverged
from tests.train.activation_memory import live_forward_bytes, saved_tensor_bytes


def make_trainer(
    tmp_path, name="run", *, seq_len=64, loss_scale=None, resume=False, save_every=0, **train
):
    flags = {
        "data": {"seq_len": seq_len},
        "train": {
            "steps": 8,
            "micro_batch": 4,
            "warmup_steps": 2,
            "device": "cpu",
            "precision": "fp32",
            **train,
        },
        "checkpoint": {"out": str(tmp_path / name), "resume": resume, "save_every": save_every},
        "loss_scale": loss_scale or {},
    }
    return Trainer(build_config(flags=flags))


def params_of(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_bf16_losses_stay_close_to_fp32(tmp_path):
    fp32 = [make_trainer(tmp_path, "a").train_step().loss]
    a = make_trainer(tmp_path, "fp32")
    b = make_trainer(tmp_path, "bf16", precision="bf16")
    losses_a = [a.train_step().loss for _ in range(8)]
    losses_b = [b.train_step().loss for _ in range(8)]
    assert fp32[0] == losses_a[0]
    for la, lb in zip(losses_a, losses_b, strict=True):
        assert abs(la - lb) < 0.05 * la, (losses_a, losses_b)
    assert losses_b[-1] < losses_b[0] - 0.5


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    # SGD: the update is linear in the gradient, so parameters compare the gradients directly
    big = make_trainer(tmp_path, "big", micro_batch=4, grad_accum=1, optimizer="sgd", lr=0.1)
    small = make_trainer(tmp_path, "small", micro_batch=2, grad_accum=2, optimizer="sgd", lr=0.1)
    for _ in range(3):
        loss_big = big.train_step().loss
        loss_small = small.train_step().loss
        assert loss_big == pytest.approx(loss_small, rel=1e-5)
    pa, pb = params_of(big), params_of(small)
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_normalizes_by_tokens_not_micro_batches(tmp_path):
    """With unequal numbers of valid targets per micro-batch, averaging per micro-batch would be
    wrong; the engine divides every micro-batch's summed loss by the step's token count."""
    trainer = make_trainer(tmp_path, micro_batch=2, grad_accum=2, optimizer="sgd", lr=0.1)
    (x1, y1), (x2, y2) = next(trainer.batches), next(trainer.batches)
    y1[:, :40] = -100  # the first micro-batch has far fewer targets
    batches = iter([(x1, y1), (x2, y2)])
    trainer.batches = batches
    model = trainer.model
    reference = make_trainer(tmp_path, "ref", micro_batch=4, grad_accum=1, optimizer="sgd", lr=0.1)
    reference.model.load_state_dict(model.state_dict())
    reference.batches = iter([(torch.cat([x1, x2]), torch.cat([y1, y2]))])
    trainer.train_step()
    reference.train_step()
    for (name, p), q in zip(model.named_parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def activation_bytes_and_grads(trainer):
    inputs, targets = next(trainer.batches)
    trainer.model.zero_grad(set_to_none=True)
    saved, _ = saved_tensor_bytes(trainer.model, inputs, targets)
    live, loss = live_forward_bytes(trainer.model, inputs, targets)
    loss.backward()
    return saved, live, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def test_activation_checkpointing_same_gradients_fewer_saved_bytes(tmp_path):
    results = {}
    for mode in ("none", "selective", "full"):
        trainer = make_trainer(tmp_path, mode, checkpointing=mode, seq_len=128)
        results[mode] = activation_bytes_and_grads(trainer)
    config = trainer.model_config
    saved_none, live_none, grads_none = results["none"]
    for mode in ("selective", "full"):
        for name, grad in results[mode][2].items():
            torch.testing.assert_close(
                grad, grads_none[name], rtol=1e-6, atol=1e-7, msg=f"{mode}: {name}"
            )

    tokens, hidden, ffn = 4 * 128, config.hidden_size, config.intermediate_size
    kv = config.num_kv_heads * config.head_dim
    fp32 = 4
    # Without checkpointing autograd keeps per layer at least: 2 norm inputs, 2 norm outputs, q, k
    # (post-RoPE) and v, the attention output, gate_up and the SwiGLU output.
    per_layer = tokens * fp32 * (4 * hidden + hidden + 2 * kv + hidden + 2 * ffn + ffn)
    assert config.num_layers * per_layer <= live_none <= 1.25 * config.num_layers * per_layer
    # full: each block keeps only its input; what lies outside the blocks (final norm input, the
    # loss's precomputed gradients) is the same in every mode.
    outside = results["full"][1] - config.num_layers * tokens * hidden * fp32
    assert 0 < outside < 0.1 * live_none
    # selective: also the attention output (tokens x heads x head_dim) and log-sum-exp of each layer
    attention_out = tokens * config.num_heads * config.head_dim * fp32
    live_full, live_selective = results["full"][1], results["selective"][1]
    assert live_selective - live_full == pytest.approx(config.num_layers * attention_out, rel=0.1)
    assert live_selective < live_none / 4
    # the saved-tensor hooks see the same ordering (they cannot see inside checkpointed regions)
    assert results["full"][0] <= results["selective"][0] < saved_none / 4


def test_checkpointing_some_blocks_keeps_the_rest_activations(tmp_path):
    """--checkpoint-blocks N: the same gradients; the forward keeps the N checkpointed blocks'
    inputs and the other blocks' activations, in between full and none block by block."""
    results = {}
    for name, mode, blocks in [("none", "none", None), ("full", "full", None), ("2", "full", 2)]:
        trainer = make_trainer(tmp_path, name, checkpointing=mode, checkpoint_blocks=blocks)
        results[name] = activation_bytes_and_grads(trainer)
    layers = trainer.model_config.num_layers
    assert layers == 4 and trainer.config.train.checkpoint_blocks == 2
    for name, grad in results["2"][2].items():
        torch.testing.assert_close(grad, results["none"][2][name], rtol=1e-6, atol=1e-7, msg=name)
    live_none, live_full, live_half = (results[k][1] for k in ("none", "full", "2"))
    assert live_half == pytest.approx((live_none + live_full) / 2, rel=0.02)


def test_checkpoint_blocks_is_checked_against_the_model_and_the_mode(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint_blocks = 5, but tiny has 4 blocks"):
        make_trainer(tmp_path, checkpointing="full", checkpoint_blocks=5)
    with pytest.raises(ValueError, match=r"set checkpointing full or selective too"):
        make_trainer(tmp_path, checkpoint_blocks=1)
    with pytest.raises(ValueError, match=r"train.checkpoint_blocks must be >= 0"):
        make_trainer(tmp_path, checkpointing="full", checkpoint_blocks=-1)


def test_checkpointing_auto_without_a_planned_gpu_is_none(tmp_path, caplog):
    """--checkpointing auto plans for the GPU the run starts on; on the CPU there is none to plan
    for: no checkpointing, said so, and the run's configuration records what it ran."""
    with caplog.at_level("INFO", logger="memfit"):
        trainer = make_trainer(tmp_path, checkpointing="auto")
    assert trainer.config.train.checkpointing == "none"
    assert trainer.config.train.checkpoint_blocks is None
    assert "checkpointing auto: no checkpointing: no GPU of the planner's catalog" in caplog.text
    trainer.train_step()
    with pytest.raises(ValueError, match=r"with checkpointing auto: auto chooses the blocks"):
        make_trainer(tmp_path, "b", checkpointing="auto", checkpoint_blocks=2)


def test_resume_gives_the_losses_of_the_uninterrupted_run(tmp_path):
    straight = make_trainer(tmp_path, "straight", steps=8)
    expected = [straight.train_step().loss for _ in range(8)]

    first = make_trainer(tmp_path, "resumed", steps=8)
    for _ in range(4):
        first.train_step()
    first.save()
    del first
    second = make_trainer(tmp_path, "resumed", steps=8, resume=True)
    assert second.step == 4
    history = second.fit()
    assert [m.loss for m in history] == expected[4:]
    for name, p in second.model.named_parameters():
        torch.testing.assert_close(p, dict(straight.model.named_parameters())[name], rtol=0, atol=0)
    lines = [
        json.loads(line)
        for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in lines] == [5, 6, 7, 8]
    assert {
        "step",
        "loss",
        "tokens",
        "tokens_per_s",
        "mem_allocated_bytes",
        "mem_peak_bytes",
    } <= set(lines[0])


def test_fp16_overflow_skips_step_and_backs_off(tmp_path):
    trainer = make_trainer(tmp_path, precision="fp16", loss_scale={"init_scale": 2.0**40})
    before = params_of(trainer)
    metrics = trainer.train_step()
    assert metrics.skipped and metrics.loss_scale == 2.0**39
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)
    assert not trainer.optimizer.state  # AdamW moments untouched too
    for _ in range(60):
        if not trainer.train_step().skipped:
            break
    else:
        pytest.fail("loss scale never backed off far enough")
    assert any((p != before[n]).any() for n, p in trainer.model.named_parameters())


def test_nan_loss_stops_with_step_number_and_saves_nothing(tmp_path):
    trainer = make_trainer(tmp_path, save_every=2)
    original = trainer.model.forward
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        out = original(*args, **kwargs)
        return out * float("nan") if calls["n"] == 3 else out

    trainer.model.forward = poisoned
    with pytest.raises(TrainingDiverged, match="step 3"):
        trainer.fit()
    checkpoint = ckpt.find_checkpoint(tmp_path / "run")
    assert checkpoint is not None and checkpoint.name == "step_0000002"


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path)
    trainer.train_step()
    good = trainer.save()
    trainer.train_step()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(
        ckpt.CheckpointError, match="step 2: OSError: disk full.*step_0000001 is kept"
    ):
        trainer.save()
    assert ckpt.find_checkpoint(tmp_path / "run") == good
    # the half-written step was removed, and a later save succeeds
    assert not (tmp_path / "run" / "checkpoints" / "step_0000002.tmp").exists()
    monkeypatch.undo()
    assert trainer.save().name == "step_0000002"


def test_corrupt_or_foreign_checkpoint_is_refused(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.train_step()
    path = trainer.save()
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match="partial or corrupt"):
        ckpt.read_meta(path)

    other = make_trainer(tmp_path, "other")
    other.train_step()
    other_path = other.save()
    meta = ckpt.read_meta(other_path)
    bigger = other.model_config.replace(hidden_size=256)
    with pytest.raises(ckpt.CheckpointError, match="another model.*hidden_size"):
        ckpt.check_model_matches(meta, bigger, other_path)


@pytest.mark.parametrize(
    "flags,sets,message",
    [
        ({}, ["train.lrr=0.1"], "did you mean 'train.lr'"),
        ({}, ["trian.lr=0.1"], "did you mean '\\[train\\]'"),
        ({"train": {"precision": "fp8"}}, [], "train.precision = 'fp8' is not allowed"),
        ({}, ["train.steps=ten"], "train.steps = 'ten' is not a valid int"),
        ({"train": {"micro_batch": 0}}, [], "train.micro_batch must be > 0"),
        ({}, ["train.lr"], "section.key=value"),
    ],
)
def test_bad_config_values_raise_clear_errors(flags, sets, message):
    with pytest.raises(ValueError, match=message):
        build_config(flags=flags, sets=sets)


def test_impossible_strategies_raise(tmp_path):
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node N"):
        Trainer(
            build_config(
                flags={"distributed": {"zero": 2}, "checkpoint": {"out": str(tmp_path / "z")}}
            )
        )
    with pytest.raises(ConfigError, match="exceeds model 'tiny'"):
        make_trainer(tmp_path, "long", seq_len=4096)
    with pytest.raises(ConfigError, match="--resume needs --out"):
        Trainer(build_config(flags={"checkpoint": {"resume": True}}))
    with pytest.raises(ValueError, match="unknown model 'llama-9b'"):
        Trainer(
            build_config(
                flags={"model": {"name": "llama-9b"}, "checkpoint": {"out": str(tmp_path / "m")}}
            )
        )


def test_fresh_run_refuses_to_overwrite_a_run_with_checkpoints(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.train_step()
    trainer.save()
    with pytest.raises(ConfigError, match="already holds a run"):
        make_trainer(tmp_path)


def test_sgd_and_grad_clip_paths(tmp_path):
    trainer = make_trainer(tmp_path, optimizer="sgd", lr=0.05, grad_clip=0.0)
    losses = [trainer.train_step().loss for _ in range(6)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_out_of_memory_says_what_the_planner_would_run(tmp_path, monkeypatch):
    import dataclasses

    import memfit.planner as planner

    trainer = make_trainer(tmp_path, micro_batch=8)

    def oom(observer=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trainer, "_train_step", oom)
    trainer.device = torch.device("cuda", 0)  # the planner's advice is for GPUs
    strategy = trainer.strategy()
    fix = dataclasses.replace(strategy, checkpointing="full")
    h100 = planner.get_gpu("h100-sxm")
    need = planner.plan(trainer.model_config, fix, h100).required_bytes
    small = dataclasses.replace(h100, memory_bytes=need + 2**20)  # fits checkpointing full
    monkeypatch.setattr(planner, "detect_gpu", lambda: small)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        trainer.train_step()
    message = str(caught.value)
    assert message.startswith("step 1 ran out of memory on cuda:0: CUDA out of memory.")
    assert "memfit's planner puts this run at" in message
    assert "single changes that fit: " in message
    assert (
        "--checkpointing full (" in message or "--checkpointing full --checkpoint-blocks" in message
    )
    monkeypatch.setattr(planner, "detect_gpu", lambda: dataclasses.replace(h100, memory_bytes=1))
    with pytest.raises(torch.OutOfMemoryError, match="no single change fits"):
        trainer.train_step()


def test_preflight_refuses_what_cannot_fit_and_says_what_would():
    """Before a CUDA run: over 1.25x the GPU, refused with the single changes that fit; over,
    but closer, a warning; else nothing."""
    import dataclasses

    import memfit.planner as planner
    from memfit.models.config import load_model_config
    from memfit.planner.advice import PREFLIGHT_REFUSE, preflight

    model = load_model_config("llama-2-7b")
    strategy = planner.Strategy(precision="bf16", micro_batch=2, seq_len=2048, zero=3, world_size=2)
    h100 = planner.get_gpu("h100-sxm")
    need = planner.plan(model, strategy, h100).required_bytes
    assert preflight(model, strategy, h100) == ("ok", None)
    close = dataclasses.replace(h100, memory_bytes=int(need / (PREFLIGHT_REFUSE - 0.1)))
    verdict, message = preflight(model, strategy, close)
    assert verdict == "warn" and "it may run out of memory" in message
    small = dataclasses.replace(h100, memory_bytes=need // 2)
    verdict, message = preflight(model, strategy, small)
    assert verdict == "refuse"
    assert message.startswith("llama-2-7b (bf16, mb 2, seq 2048, ckpt none, zero 3 x 2 GPUs)")
    assert "it cannot fit" in message and "single changes that fit: " in message
    assert "--zero 3 on 16 GPUs (" in message  # the planner's cheapest single change here


def test_the_engine_asks_for_expandable_segments_unless_told_otherwise(monkeypatch):
    """Before CUDA's allocator starts, the engine sets PYTORCH_CUDA_ALLOC_CONF to expandable
    segments (less memory held beyond the allocated peak: BENCHMARKS.md); an allocator setting
    of the user's is left as it is, and said whether it asks for them."""
    from memfit.train.engine import EXPANDABLE_SEGMENTS, use_expandable_segments

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert use_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == EXPANDABLE_SEGMENTS
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    assert not use_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # (too late to ask)
    assert not use_expandable_segments()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
