"""The engine's --zero and --offload on CPU with gloo: 2 processes launched the way torchrun
launches them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the environment) train the same
steps as one process on the whole batch: rank r takes windows r, r + 2, ... of each epoch's
permutation, so 2 ranks x micro-batch 2 see exactly the windows of 1 process x micro-batch 4."""

import contextlib
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from memfit.config import build_config
from memfit.train.engine import ConfigError, Trainer

STEPS = 3


def config(
    tmp, *, micro_batch, grad_accum=1, zero=0, offload="none", lr=3e-3, name="run", steps=STEPS,
    resume=False, reduce_dtype="fp32", checkpointing="none", device="cpu", precision="fp32",
    offload_activations=False, lora=None,
):  # fmt: skip
    return build_config(
        flags={
            **({"lora": lora} if lora else {}),
            "data": {"seq_len": 32},
            "train": {
                "steps": steps,
                "micro_batch": micro_batch,
                "grad_accum": grad_accum,
                "warmup_steps": 1,
                "device": device,
                "precision": precision,
                "lr": lr,
                "checkpointing": checkpointing,
                "offload_activations": offload_activations,
            },
            "distributed": {
                "zero": zero,
                "offload": offload,
                "reduce_dtype": reduce_dtype,
                "timeout_s": 120,
            },  # fmt: skip
            "checkpoint": {"out": os.path.join(tmp, name), "resume": resume},
        }
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, tmp, kwargs, queue):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    try:
        per_rank = dict(kwargs)
        if rank == 1 and "rank1_lr" in per_rank:
            per_rank["lr"] = per_rank.pop("rank1_lr")
        per_rank.pop("rank1_lr", None)
        stop_at = per_rank.pop("stop_at", None)
        dies = per_rank.pop("rank1_dies", False)
        trainer = Trainer(config(tmp, **per_rank))
        if dies and rank == 1:
            os._exit(1)  # a rank that dies without a word (killed, segfault, lost node)
        if stop_at:  # interrupted: a checkpoint after stop_at of the configured steps
            losses = [trainer.train_step().loss for _ in range(stop_at)]
            trainer.save()
        else:
            losses = [trainer.train_step().loss for _ in range(STEPS)]
        # numpy arrays travel by value (tensors would need this process alive to be read)
        params = named_parameters(trainer)
        queue.put((rank, "ok", losses, params if rank == 0 else None))
    except Exception as error:
        queue.put((rank, type(error).__name__, str(error), traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def named_parameters(trainer: Trainer) -> dict:
    """The model's parameters as numpy arrays (ZeRO-3: gathered for the occasion)."""
    gathered = trainer.zero.summon_full_params() if trainer.zero else contextlib.nullcontext()
    with gathered:
        return {n: p.detach().cpu().numpy().copy() for n, p in trainer.model.named_parameters()}


def run_two(tmp, **kwargs):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, 2, port, str(tmp), kwargs, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict((r[0], r[1:]) for r in (queue.get(timeout=300) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    return results


def reference(tmp, *, micro_batch, grad_accum=1, **kwargs):
    trainer = Trainer(
        config(tmp, micro_batch=micro_batch, grad_accum=grad_accum, name="ref", **kwargs)
    )
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize(
    "zero, offload, grad_accum, checkpointing",
    [
        (0, "none", 1, "none"),
        (0, "optimizer", 1, "none"),  # every rank steps the whole model on the CPU
        (1, "none", 1, "none"),
        (2, "none", 1, "none"),
        (1, "none", 2, "none"),
        (2, "optimizer", 2, "none"),
        (3, "none", 1, "none"),
        (3, "none", 2, "full"),  # recompute in backward re-gathers nothing: the unit is there
        (3, "params", 1, "selective"),
    ],
)
def test_two_ranks_train_like_one_process(tmp_path, zero, offload, grad_accum, checkpointing):
    results = run_two(
        tmp_path, micro_batch=2, grad_accum=grad_accum, zero=zero, offload=offload,
        checkpointing=checkpointing,
    )  # fmt: skip
    assert all(r[0] == "ok" for r in results.values()), results
    ref_losses, ref_params = reference(tmp_path, micro_batch=4, grad_accum=grad_accum)
    _, losses, params = results[0]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert results[1][1] == losses  # every rank reports the step's loss over all ranks
    # AdamW divides by sqrt(v): a near-zero gradient element turns reduction-order noise into
    # ~1e-5 of parameter; a wrong gradient moves parameters by ~lr (3e-3) per step
    for name, ref in ref_params.items():
        torch.testing.assert_close(
            torch.from_numpy(params[name]), ref, rtol=1e-4, atol=1e-4, msg=name
        )


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_two_ranks_train_lora_adapters_like_one_process(tmp_path, zero):
    """LoRA data-parallel: the adapters' gradients are reduced (stages 1-2 shard their states),
    the frozen base stays as it was on every rank."""
    lora = {"rank": 4, "alpha": 8.0}
    results = run_two(tmp_path, micro_batch=2, zero=zero, lora=lora)
    assert all(r[0] == "ok" for r in results.values()), results
    ref_losses, ref_params = reference(tmp_path, micro_batch=4, lora=lora)
    _, losses, params = results[0]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert results[1][1] == losses
    adapters = [name for name in ref_params if "lora_" in name]
    assert adapters and any(float(ref_params[n].abs().max()) > 0 for n in adapters if "lora_B" in n)
    for name, ref in ref_params.items():
        torch.testing.assert_close(
            torch.from_numpy(params[name]), ref, rtol=1e-4, atol=1e-4, msg=name
        )


def test_a_two_rank_lora_run_resumes_at_another_stage(tmp_path):
    """Saved by 2 ranks at ZeRO-1 (step 2 of 3), resumed by 2 ranks at ZeRO-2: the adapters and
    their optimizer states come back, and the next step's loss is the uninterrupted run's."""
    lora = {"rank": 4, "alpha": 8.0}
    saved = run_two(tmp_path, micro_batch=2, zero=1, lora=lora, stop_at=2)
    assert all(r[0] == "ok" for r in saved.values()), saved
    resumed = run_two(tmp_path, micro_batch=2, zero=2, lora=lora, resume=True, stop_at=1)
    assert all(r[0] == "ok" for r in resumed.values()), resumed
    ref_losses, ref_params = reference(tmp_path, micro_batch=4, lora=lora)
    _, losses, params = resumed[0]
    assert losses == pytest.approx(ref_losses[2:], rel=1e-5)
    for name, ref in ref_params.items():  # (AdamW's moments came back too)
        torch.testing.assert_close(
            torch.from_numpy(params[name]), ref, rtol=1e-4, atol=1e-4, msg=name
        )


def test_activation_offload_composes_with_zero_3(tmp_path):
    # ZeRO-3 gathers each block's parameters around its forward and again for its recompute,
    # whose input comes back from CPU memory
    kwargs = {"zero": 3, "checkpointing": "full", "offload_activations": True}
    results = run_two(tmp_path, micro_batch=2, grad_accum=2, **kwargs)
    assert all(r[0] == "ok" for r in results.values()), results
    ref_losses, ref_params = reference(tmp_path, micro_batch=4, grad_accum=2)
    _, losses, params = results[0]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, ref in ref_params.items():
        torch.testing.assert_close(
            torch.from_numpy(params[name]), ref, rtol=1e-4, atol=1e-4, msg=name
        )


def test_activation_offload_trains_bitwise_like_checkpointing(tmp_path):
    plain = Trainer(config(str(tmp_path), micro_batch=2, grad_accum=2, checkpointing="full"))
    offloaded = Trainer(
        config(
            str(tmp_path), micro_batch=2, grad_accum=2, checkpointing="full",
            offload_activations=True, name="offload",
        )
    )  # fmt: skip
    for _ in range(STEPS):
        assert offloaded.train_step().loss == plain.train_step().loss
    assert offloaded.activation_offload.buffers_allocated > 0
    for (name, param), other in zip(
        plain.model.named_parameters(), offloaded.model.parameters(), strict=True
    ):
        assert torch.equal(param, other), name


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bf16_gradient_reduction_stays_close(tmp_path, zero):
    """--reduce-dtype bf16: the collectives run in bf16 (half the bytes); the losses follow the
    fp32 run to bf16 precision, not exactly."""
    results = run_two(tmp_path, micro_batch=2, zero=zero, reduce_dtype="bf16")
    assert all(r[0] == "ok" for r in results.values()), results
    ref_losses, _ = reference(tmp_path, micro_batch=4)
    losses = results[0][1]
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    assert losses[1:] != pytest.approx(ref_losses[1:], rel=1e-7)  # bf16 did round the gradients


def test_ranks_with_different_settings_stop_with_a_clear_error(tmp_path):
    results = run_two(tmp_path, micro_batch=2, zero=1, rank1_lr=1e-2)
    for status, message, *_ in results.values():
        assert status == "ConfigError", results
        assert "different settings: train.lr: rank 0 0.003, rank 1 0.01" in message


def test_a_rank_that_dies_ends_the_others_with_an_error(tmp_path):
    """Rank 1 exits right after start-up: rank 0's next collective fails (it does not hang),
    within the timeout."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    kwargs = {"micro_batch": 2, "zero": 2, "rank1_dies": True}
    procs = [
        ctx.Process(target=_worker, args=(r, 2, port, str(tmp_path), kwargs, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    rank, status, *_ = queue.get(timeout=180)
    for p in procs:
        p.join(timeout=60)
    assert rank == 0 and status != "ok"
    assert procs[1].exitcode == 1


def test_zero_without_a_process_group_says_how_to_launch(tmp_path):
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node N -m memfit train --zero 2"):
        Trainer(config(str(tmp_path), micro_batch=2, zero=2))
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node N -m memfit train --zero 3"):
        Trainer(config(str(tmp_path), micro_batch=2, zero=3))
    # a rule that needs no world size is the config's: the config itself refuses
    with pytest.raises(ValueError, match="--offload params .* needs --zero 3"):
        config(str(tmp_path), micro_batch=2, zero=2, offload="params")


def test_offload_takes_this_ranks_share_of_the_host_threads(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 for each of several processes; the CPU step of offload
    would then run on one core per rank."""
    from memfit.distributed import launch

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        torch.set_num_threads(1)
        share = launch.host_threads_per_rank()
        assert launch.use_host_threads() == (share if share > 1 else None)
        assert torch.get_num_threads() == share
        assert launch.use_host_threads() is None  # nothing to raise
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10**6))
        assert launch.host_threads_per_rank() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("zero, offload", [(0, "optimizer"), (3, "params")])
def test_offload_on_one_process_trains_like_the_plain_optimizer(tmp_path, zero, offload):
    plain = Trainer(config(str(tmp_path), micro_batch=2, name="plain"))
    offloaded = Trainer(
        config(str(tmp_path), micro_batch=2, zero=zero, offload=offload, name="offload")
    )
    for _ in range(STEPS):
        assert offloaded.train_step().loss == pytest.approx(plain.train_step().loss, rel=1e-5)
    assert offloaded.zero is not None and offloaded.zero.offload
    params = named_parameters(offloaded)
    for name, param in plain.model.named_parameters():
        torch.testing.assert_close(
            torch.from_numpy(params[name]), param.detach(), rtol=1e-4, atol=1e-4, msg=name
        )


@pytest.mark.parametrize(
    "zero, resumed_zero, resumed_offload", [(1, 0, "optimizer"), (3, 3, "params")]
)
def test_a_two_rank_zero_run_resumes_on_one_process(tmp_path, zero, resumed_zero, resumed_offload):
    """Saved sharded at 2 ranks (step 2 of 3), resumed by one process with offload (the same
    windows per step): the last step equals an uninterrupted run's."""
    results = run_two(tmp_path, micro_batch=2, zero=zero, stop_at=2)
    assert all(r[0] == "ok" for r in results.values()), results
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000002"
    assert (checkpoint / "trainer" / ".metadata").is_file()
    with pytest.raises(ConfigError, match="sharded optimizer state"):
        Trainer(config(str(tmp_path), micro_batch=4, resume=True))
    resumed = Trainer(
        config(
            str(tmp_path), micro_batch=4, zero=resumed_zero, offload=resumed_offload, resume=True
        )
    )
    assert resumed.step == 2
    saved_weights = load_file(checkpoint / "model.safetensors")  # ZeRO-3: exported at save
    for name, value in named_parameters(resumed).items():
        torch.testing.assert_close(torch.from_numpy(value), saved_weights[name])
    last = resumed.train_step().loss
    ref_losses, ref_params = reference(tmp_path, micro_batch=4)
    assert last == pytest.approx(ref_losses[-1], rel=1e-5)
    params = named_parameters(resumed)
    for name, ref in ref_params.items():
        torch.testing.assert_close(torch.from_numpy(params[name]), ref, rtol=1e-4, atol=1e-4)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@two_gpus
@pytest.mark.parametrize(
    "zero, offload, checkpointing, reduce_dtype",
    [
        (3, "none", "none", "fp32"),  # compiled blocks, bf16 parameters gathered
        (3, "none", "full", "fp32"),
        (3, "params", "selective", "fp32"),
        (2, "none", "none", "bf16"),
        (3, "none", "none", "bf16"),
    ],
)
def test_two_gpus_train_like_one(tmp_path, zero, offload, checkpointing, reduce_dtype):
    """The CPU tests' twin on NCCL in bf16: 2 GPUs x micro-batch 2 follow 1 GPU x 4 to bf16
    precision."""
    gpu = {"device": "cuda", "precision": "bf16", "checkpointing": checkpointing}
    results = run_two(
        tmp_path, micro_batch=2, zero=zero, offload=offload, reduce_dtype=reduce_dtype, **gpu
    )
    assert all(r[0] == "ok" for r in results.values()), results
    ref_losses, _ = reference(tmp_path, micro_batch=4, **gpu)
    assert results[0][1] == pytest.approx(ref_losses, rel=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("zero, offload", [(0, "optimizer"), (3, "params")])
def test_offload_on_one_gpu_trains_like_the_plain_optimizer(tmp_path, zero, offload, precision):
    """The CPU test's twin on CUDA: gradients go to the host on a copy stream during backward;
    fp16's unscaling and the clipping reach the CPU step through note_gradients_scaled."""
    gpu = {"device": "cuda", "precision": precision}
    plain = Trainer(config(str(tmp_path), micro_batch=2, name="plain", **gpu))
    offloaded = Trainer(
        config(str(tmp_path), micro_batch=2, zero=zero, offload=offload, name="offload", **gpu)
    )
    for _ in range(STEPS):
        assert offloaded.train_step().loss == pytest.approx(plain.train_step().loss, rel=1e-2)
