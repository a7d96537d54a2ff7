"""Fault injection: what a crash, a damaged file, a full disk, a signal, a stopped rank or a
diverging run leaves behind, and that memfit says so and loses nothing.

Each test breaks one thing the way it breaks in practice (kill -9 at each phase of a save, a bit
flip or a truncation of each checkpoint file, a torn metrics line, ENOSPC, an unwritable run
directory, SIGTERM mid-step, SIGSTOP of a rank under torchrun, NaN weights) and checks the
guarantee the README states: a checkpoint is complete and verified or it is not used, the
previous good one is never lost, and the message says what happened."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memfit.cli.main import main
from memfit.config import build_config
from memfit.train import checkpoint as ckpt
from memfit.train.engine import ConfigError, Trainer, TrainingDiverged

SMALL = ["--seq-len", "32", "--micro-batch", "2", "--device", "cpu", "--precision", "fp32"]


def config(
    out, *, steps=4, save_every=1, resume=False, resume_from="", lr=3e-3, device="cpu",
    precision="fp32", optimizer="adamw", **sections,
):  # fmt: skip
    flags = {
        "data": {"seq_len": 32},
        "train": {"steps": steps, "micro_batch": 2, "warmup_steps": 1, "device": device,
                  "precision": precision, "lr": lr, "optimizer": optimizer},
        "checkpoint": {"out": str(out), "save_every": save_every, "resume": resume,
                       "resume_from": resume_from},
        **sections,
    }  # fmt: skip
    return build_config(flags=flags)


def params_of(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 4-step run: its losses and final weights, and its run directory with
    checkpoints of steps 3 and 4 (keep=2)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    trainer = Trainer(config(out))
    history = trainer.fit()
    return [m.loss for m in history], params_of(trainer), out


def fresh_copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def finish(out, reference, **kwargs):
    """Resume the run in `out` to step 4 and check it ends exactly where the reference does."""
    losses, params, _ = reference
    trainer = Trainer(config(out, resume=True, **kwargs))
    start = trainer.step
    history = trainer.fit()
    assert [m.loss for m in history] == losses[start:]
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p, params[name], rtol=0, atol=0)
    return start


# -- kill -9 at each phase of a save ---------------------------------------------------------

# Wrap one function that a save calls; at the save of step 2, SIGKILL the process there.
_KILL_AT = """
import os, signal, sys
import torch
from memfit.config import build_config
from memfit.train import checkpoint as ckpt
from memfit.train.engine import Trainer
out, phase = sys.argv[1], sys.argv[2]
module, name, after = {phases}[phase]
target = {{"ckpt": ckpt, "os": os, "torch": torch}}[module]
original = getattr(target, name)
def wrapped(*args, **kwargs):
    saving_step_2 = any("step_0000002" in str(a) for a in args)
    if saving_step_2 and not after:
        os.kill(os.getpid(), signal.SIGKILL)
    result = original(*args, **kwargs)
    if saving_step_2 and after:
        file = next(a for a in args if "step_0000002" in str(a))
        with open(file, "r+b") as f:  # the write had reached the disk only in part
            f.truncate(os.path.getsize(file) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    return result
setattr(target, name, wrapped)
flags = {flags}
trainer = Trainer(build_config(flags=flags))
trainer.train_step(); trainer.save()
trainer.train_step(); trainer.save()
print("not killed")
"""

PHASES = {
    "before the weights": ("ckpt", "save_file", False),
    "mid-write of the weights": ("ckpt", "save_file", True),
    "before trainer.pt": ("torch", "save", False),
    "before hashing": ("ckpt", "file_sha256", False),
    "before the rename": ("os", "rename", False),
    "before latest": ("ckpt", "_atomic_write_text", False),
    "before pruning": ("ckpt", "_prune", False),
}


@pytest.mark.parametrize("phase", PHASES)
def test_kill_9_at_each_phase_of_a_save_loses_no_step(tmp_path, reference, phase):
    out = tmp_path / "run"
    flags = config(out).to_dict()
    script = _KILL_AT.format(phases=PHASES, flags=flags)
    done = subprocess.run(
        [sys.executable, "-c", script, str(out), phase], capture_output=True, text=True
    )
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    start = finish(out, reference)
    # killed before `latest` named step 2, the run goes on from step 1 (and saves step 2 anew)
    assert start == (2 if phase == "before pruning" else 1)
    assert not list((out / "checkpoints").glob("*.tmp"))


def _two_rank_worker(rank, port, out, phase, queue):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import memfit.distributed.checkpoint as dcp_io

    victim, module, name = {
        "while the ranks write the sharded state": (1, dcp_io, "save_zero"),
        "while rank 0 writes the weights": (0, ckpt, "save_file"),
        "before the rename": (0, os, "rename"),
        "ENOSPC while rank 0 writes the weights": (0, ckpt, "save_file"),
    }[phase]
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        if any("step_0000002" in str(a) for a in args) and rank == victim:
            if phase == "ENOSPC while rank 0 writes the weights":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(module, name, wrapped)  # Trainer.save imports save_zero when it saves
    try:
        trainer = Trainer(config(out, distributed={"zero": 1, "timeout_s": 60, "heartbeat_s": 10}))
        trainer.train_step()
        trainer.save()
        trainer.train_step()
        trainer.save()
        queue.put((rank, "not killed", ""))
    except Exception as error:  # the surviving rank: its peer is gone
        queue.put((rank, type(error).__name__, str(error)))


@pytest.mark.parametrize(
    "phase",
    [
        "while the ranks write the sharded state",
        "while rank 0 writes the weights",
        "before the rename",
    ],
)
def test_kill_9_of_a_rank_mid_save_keeps_the_previous_checkpoint(tmp_path, phase):
    run_two_ranks(tmp_path, phase, ends_by=-signal.SIGKILL)


def test_a_full_disk_on_rank_0_stops_every_rank_with_the_reason(tmp_path):
    queue = run_two_ranks(tmp_path, "ENOSPC while rank 0 writes the weights", ends_by=0)
    results = dict((r[0], r[1:]) for r in (queue.get(timeout=10) for _ in range(2)))
    assert results[0][0] == results[1][0] == "CheckpointError", results
    assert "no space left on device" in results[0][1] and "another rank failed" in results[1][1]
    assert "step_0000001 is kept" in results[1][1]


def run_two_ranks(tmp_path, phase, *, ends_by):
    import torch.multiprocessing as mp

    from tests.train.test_engine_distributed import free_port

    out = tmp_path / "run"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_two_rank_worker, args=(r, port, str(out), phase, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            pytest.fail(f"a rank still runs 120 s after its peer failed {phase}")
    assert ends_by in [p.exitcode for p in procs]
    # step 1 is the run's checkpoint, complete and verified; step 2 never became one
    checkpoint, meta = ckpt.select_checkpoint(out)
    assert checkpoint.name == "step_0000001" and meta["step"] == 1
    # and a one-process resume (a ZeRO checkpoint loads with --offload optimizer) goes on
    trainer = Trainer(config(out, resume=True, distributed={"offload": "optimizer"}))
    assert trainer.step == 1
    history = trainer.fit()
    assert [m.step for m in history] == [2, 3, 4]
    assert not list((out / "checkpoints").glob("*.tmp"))
    return queue


# -- damaged files ---------------------------------------------------------------------------


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "bit flip":
        data[len(data) // 2] ^= 0x10
    else:
        del data[len(data) * 2 // 3 :]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["bit flip", "truncation"])
@pytest.mark.parametrize("name", ["model.safetensors", "trainer.pt", "meta.json", "config.toml"])
def test_a_damaged_file_is_refused_and_the_newest_valid_one_named(tmp_path, reference, name, how):
    out = fresh_copy(reference[2], tmp_path)
    damage(out / "checkpoints" / "step_0000004" / name, how)
    with pytest.raises(ckpt.CheckpointError) as refused:
        Trainer(config(out, steps=6, resume=True))
    message = str(refused.value)
    assert "step_0000004" in message and (name in message or "meta.json" in message)
    assert "newest valid checkpoint is step_0000003" in message
    assert "--resume-from step_0000003" in message

    # generation needs only the weights: a damaged trainer.pt or config.toml does not stop it
    from memfit.models.loading import load_pretrained

    if name in ("trainer.pt", "config.toml"):
        _, info = load_pretrained(out, device="cpu", dtype=torch.float32)
        assert info.step == 4
    else:
        with pytest.raises(ckpt.CheckpointError, match="step_0000004.*step_0000003.*pass it"):
            load_pretrained(out, device="cpu", dtype=torch.float32)


def test_resume_from_latest_valid_goes_on_and_never_prunes_the_good_checkpoint(tmp_path, reference):
    out = fresh_copy(reference[2], tmp_path)
    damage(out / "checkpoints" / "step_0000004" / "model.safetensors", "bit flip")
    trainer = Trainer(config(out, steps=4, resume_from="latest-valid", save_every=0))
    assert trainer.step == 3
    trainer.fit()  # saves step 4 anew (keep=2)
    names = sorted(p.name for p in ckpt.complete_checkpoints(out / "checkpoints"))
    assert names == ["step_0000003", "step_0000004"]
    ckpt.read_meta(out / "checkpoints" / "step_0000004", files="all")  # the damaged one replaced


def test_an_unchecked_newer_checkpoint_does_not_push_out_a_good_one(tmp_path, reference):
    """Checkpoints 3 and 4 (good) and 5 (damaged, never checked): going on from 3, the save
    of step 4 prunes nothing, as 5 does not count as good."""
    out = fresh_copy(reference[2], tmp_path)
    root = out / "checkpoints"
    shutil.copytree(root / "step_0000004", root / "step_0000005")  # a newer one, never checked
    damage(root / "step_0000005" / "trainer.pt", "bit flip")
    trainer = Trainer(config(out, steps=4, resume_from="step_0000003", save_every=0))
    trainer.fit()
    names = sorted(p.name for p in ckpt.complete_checkpoints(root))
    assert names == ["step_0000003", "step_0000004", "step_0000005"]
    assert (root / "latest").read_text().strip() == "step_0000004"


def test_resuming_with_another_optimizer_is_refused(tmp_path, reference):
    out = fresh_copy(reference[2], tmp_path)
    with pytest.raises(ConfigError, match="trained with --optimizer adamw.*resume with --opt"):
        Trainer(config(out, steps=6, resume=True, optimizer="sgd"))


def test_a_second_run_into_the_same_directory_is_refused(tmp_path, reference):
    out = fresh_copy(reference[2], tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
         "fcntl.flock(f, fcntl.LOCK_EX); f.write('pid 1\\n'); f.flush(); print('held', "
         "flush=True); time.sleep(60)", str(out / ".lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="is in use by another memfit run"):
            Trainer(config(out, steps=6, resume=True))
    finally:
        holder.kill()
    assert Trainer(config(out, steps=6, resume=True)).step == 4


def test_what_is_in_the_way_of_a_run_is_named_before_training(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("")
    with pytest.raises(ConfigError, match="checkpoints' is in the way"):
        Trainer(config(out))


def test_resume_from_names_what_exists(tmp_path, reference):
    out = fresh_copy(reference[2], tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="step_0000003, step_0000004"):
        Trainer(config(out, steps=6, resume_from="7"))
    assert Trainer(config(out, steps=6, resume_from="3")).step == 3


def test_a_nan_in_a_checkpoint_is_refused_at_resume(tmp_path, reference):
    """A checkpoint with NaN weights but no hashes (a version-1 checkpoint, written before memfit
    refused to save such states): the resume says so, instead of a 'lower --lr' later."""
    out = fresh_copy(reference[2], tmp_path)
    checkpoint = out / "checkpoints" / "step_0000004"
    weights = ckpt.load_file(str(checkpoint / "model.safetensors"))
    next(iter(weights.values()))[0] = math.nan
    ckpt.save_file(weights, str(checkpoint / "model.safetensors"))
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta = {key: value for key, value in meta.items() if key not in ("sha256", "meta_sha256")}
    meta["format_version"], meta["sizes"] = (
        1,
        {name: (checkpoint / name).stat().st_size for name in meta["sizes"]},
    )
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="step_0000004.*holds NaN or inf in"):
        Trainer(config(out, steps=6, resume=True))


# -- metrics.jsonl ---------------------------------------------------------------------------


def test_a_torn_last_metrics_line_is_dropped_at_resume(tmp_path, reference):
    out = fresh_copy(reference[2], tmp_path)
    metrics = out / "metrics.jsonl"
    torn = metrics.read_text().splitlines()[-1].replace('"step": 4', '"step": 5')[:40]
    with metrics.open("a") as f:
        f.write(torn)  # the crash cut the line of step 5, after the checkpoint of step 4
    Trainer(config(out, steps=6, resume=True)).fit()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_bad_metrics_line_inside_the_file_is_named(tmp_path, reference):
    out = fresh_copy(reference[2], tmp_path)
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[1] = lines[1][:25]
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2 is not a metrics line"):
        Trainer(config(out, steps=6, resume=True)).fit()


# -- full disk, unwritable run directory -----------------------------------------------------


def test_a_full_disk_is_said_before_writing_and_loses_nothing(tmp_path, monkeypatch, caplog):
    out = tmp_path / "run"
    trainer = Trainer(config(out, steps=2, save_every=0))
    trainer.train_step()
    good = trainer.save()
    trainer.train_step()
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 1 << 20)
    with pytest.raises(ckpt.CheckpointError) as full:
        trainer.save()
    message = str(full.value)
    assert "no space left on device: a checkpoint needs about 10.2 MiB at" in message
    assert "1.0 MiB free" in message and "step_0000001 is kept" in message
    assert ckpt.select_checkpoint(out)[0] == good
    assert not list((out / "checkpoints").glob("*.tmp"))

    # a resume on the still-full disk warns at start, before the data and model are built
    caplog.clear()
    Trainer(config(out, steps=3, resume=True))
    assert "saving will fail" in caplog.text


def test_enospc_mid_write_removes_the_partial_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    trainer = Trainer(config(out, steps=2, save_every=0))
    trainer.train_step()
    trainer.save()
    trainer.train_step()

    def full(*args, **kwargs):
        Path(args[1]).write_bytes(b"x" * 1000)  # part of the file made it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "save_file", full)
    with pytest.raises(ckpt.CheckpointError, match="no space left on device.*B free"):
        trainer.save()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_0000001"]


@pytest.mark.parametrize(
    "writer, error",
    [  # what torch.save and safetensors raise when the disk fills under them
        ("torch", RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9 vs 7")),
        ("torch", RuntimeError("basic_ios::clear: iostream error")),
        ("safetensors", Exception('Error while serializing: IoError(Os { code: 28, kind: '
                                  'StorageFull, message: "No space left on device" })')),
    ],
)  # fmt: skip
def test_a_full_disk_under_torch_save_or_safetensors_is_said(tmp_path, monkeypatch, writer, error):
    out = tmp_path / "run"
    trainer = Trainer(config(out, steps=2, save_every=0))
    trainer.train_step()
    trainer.save()
    trainer.train_step()
    disk = {"full": False}  # room enough before the save; full once the write failed
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 1 << 20 if disk["full"] else 1 << 40)

    def fails(*args, **kwargs):
        disk["full"] = True
        raise error

    if writer == "torch":
        monkeypatch.setattr(torch, "save", fails)
    else:
        monkeypatch.setattr(ckpt, "save_file", fails)
    with pytest.raises(ckpt.CheckpointError) as full:
        trainer.save()
    assert "could not save the checkpoint of step 2: no space left on device" in str(full.value)
    assert "step_0000001 is kept" in str(full.value)
    assert not list((out / "checkpoints").glob("*.tmp"))


def test_an_unwritable_run_directory_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    import memfit.train.engine as engine

    def not_reached(*args, **kwargs):
        raise AssertionError("the data was built before the run directory was checked")

    monkeypatch.setattr(engine, "build_data", not_reached)
    a_file = tmp_path / "taken"
    a_file.write_text("")
    with pytest.raises(ConfigError, match="is a file, not a run directory"):
        Trainer(config(a_file))
    with pytest.raises(ConfigError, match="cannot write to the run directory"):
        Trainer(config(a_file / "run"))  # under a file
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anywhere: a read-only file system it is, then
        write_bytes = Path.write_bytes

        def refused(self, data):
            if self.parent.parent == read_only:
                raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            return write_bytes(self, data)

        monkeypatch.setattr(Path, "write_bytes", refused)
    with pytest.raises(ConfigError, match="cannot write to the run directory.*choose another"):
        Trainer(config(read_only / "run"))


# -- NaN divergence --------------------------------------------------------------------------


def test_nan_weights_are_never_saved(tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(config(out, steps=6, save_every=1))
    original = trainer.updater.step

    def poisoned_step(*args, **kwargs):  # step 3's update makes the weights NaN
        result = original(*args, **kwargs)
        if trainer.step == 2:
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.mul_(math.nan)
        return result

    trainer.updater.step = poisoned_step
    with pytest.raises(TrainingDiverged) as diverged:
        trainer.fit()
    message = str(diverged.value)
    assert "step 3 made" in message and "no checkpoint was written for it" in message
    assert "--resume-from step_0000001" in message
    for checkpoint in ckpt.complete_checkpoints(out / "checkpoints"):
        weights = ckpt.load_file(str(checkpoint / "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values())


def test_a_diverging_run_from_the_command_line(tmp_path, capsys):
    """A learning rate high enough to diverge, with --save-every 1: the error says which step and
    which checkpoint to go on from (not the one whose weights gave the NaN), every checkpoint
    left is finite, and following the advice with a lower --lr trains to the end."""
    out = tmp_path / "run"
    base = ["train", "--out", str(out), *SMALL, "--save-every", "1", "--steps", "8"]
    assert main([*base, "--lr", "30", "--set", "train.warmup_steps=4"]) == 2
    error = capsys.readouterr().err
    assert "became inf at step 4" in error or "became nan at step 4" in error, error
    assert "checkpoint step_0000003 holds the weights step 4 started from" in error
    assert "--resume-from step_0000002" in error
    for checkpoint in ckpt.complete_checkpoints(out / "checkpoints"):
        weights = ckpt.load_file(str(checkpoint / "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values())
    resume = ["--resume-from", "step_0000002"]
    assert main([*base, "--lr", "1e-3", *resume]) == 0, capsys.readouterr().err


def test_resuming_a_run_past_its_steps_says_so(tmp_path, reference, capsys):
    out = fresh_copy(reference[2], tmp_path)
    assert main(["train", "--out", str(out), *SMALL, "--steps", "2", "--resume"]) == 2
    error = capsys.readouterr().err
    assert "--steps 2, but the run" in error and "already at step 4" in error
    assert "Traceback" not in error
    # at its end already: nothing to train, said, exit 0
    assert main(["train", "--out", str(out), *SMALL, "--steps", "4", "--resume"]) == 0
    assert "already at step 4 of 4" in capsys.readouterr().out


# -- signals ---------------------------------------------------------------------------------


def start_training(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "memfit", "train", "--out", str(out), *SMALL, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for_steps(process: subprocess.Popen, out: Path, steps: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        if process.poll() is not None:
            pytest.fail(f"training ended early: {process.communicate()}")
        time.sleep(0.1)
    process.kill()
    pytest.fail(f"no {steps} steps in {timeout} s")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_run_after_the_step_with_a_checkpoint(tmp_path, signum):
    out = tmp_path / "run"
    process = start_training(out, "--steps", "10000")
    wait_for_steps(process, out, 2)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    checkpoint, meta = ckpt.select_checkpoint(out)
    assert meta["step"] == last  # not a step lost
    assert f"stopped by {signal.Signals(signum).name} after step {last}" in stdout + stderr
    # and the run goes on from there
    process = start_training(out, "--steps", str(last + 2), "--resume")
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert ckpt.select_checkpoint(out)[1]["step"] == last + 2


def test_a_second_signal_ends_the_run_at_once(tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "memfit", "train", "--out", str(out), "--device", "cpu",
         "--precision", "fp32", "--seq-len", "256", "--micro-batch", "8", "--grad-accum", "32",
         "--steps", "10000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # steps of 32 micro-batches (seconds each): the second signal must come while the step the
    # first one let finish still runs, not after the run has saved and exited
    wait_for_steps(process, out, 1)
    process.send_signal(signal.SIGTERM)
    for line in process.stderr:  # the first is heard: the run finishes its step, then saves
        if "SIGTERM received" in line:
            break
    time.sleep(1.0)  # a copy within a second is the same event (torchrun forwards signals)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM  # ended by the signal itself, not by memfit


def test_sigterm_to_torchrun_stops_every_rank_after_the_same_step(tmp_path):
    """torchrun forwards SIGTERM to its workers (a scheduler may signal them too): every rank
    stops after the same step, and the checkpoint of that step is saved."""
    out = tmp_path / "run"
    launcher = start_torchrun(out, "--steps", "10000")
    wait_for_steps(launcher, out, 2, timeout=180)
    for pid in [launcher.pid, *worker_pids(launcher.pid)]:  # as `scancel` signals the job
        os.kill(pid, signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=60)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    _, meta = ckpt.select_checkpoint(out)
    assert meta["step"] == last, stderr[-3000:]
    assert f"stopped by SIGTERM after step {last}" in stdout


def start_torchrun(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "memfit", "train", "--out", str(out), *SMALL, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip


# -- a stopped rank ---------------------------------------------------------------------------


def worker_pids(parent: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    return children


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_a_stopped_rank_ends_the_whole_run_within_a_minute(tmp_path):
    """torchrun, 2 ranks on gloo: SIGSTOP one worker mid-run. The other names it and exits
    within the heartbeat deadline; torchrun then ends every process, the stopped one too."""
    out = tmp_path / "run"
    launcher = start_torchrun(out, "--steps", "10000", "--set", "distributed.heartbeat_s=5")
    wait_for_steps(launcher, out, 2, timeout=180)
    workers = worker_pids(launcher.pid)
    assert len(workers) == 2
    stopped = time.monotonic()
    os.kill(workers[1], signal.SIGSTOP)
    try:
        _, stderr = launcher.communicate(timeout=90)
        took = time.monotonic() - stopped
        time.sleep(1)
        survivors = [pid for pid in workers if alive(pid)]
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert launcher.returncode != 0
    assert "has not answered for 5 s" in stderr, stderr[-3000:]
    assert took < 60, f"the run took {took:.0f} s to end"
    assert not survivors, "torchrun left a worker running"


# -- GPU twins: the same guarantees where the states live on CUDA ------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_gpu_nan_states_are_never_saved_and_damage_is_refused(tmp_path, precision, offload):
    out = tmp_path / "run"

    def cuda_config(**kwargs):
        return config(
            out, device="cuda", precision=precision, distributed={"offload": offload}, **kwargs
        )

    trainer = Trainer(cuda_config(steps=6, save_every=1))
    original = trainer.updater.step

    def poisoned_step(*args, **kwargs):  # step 3's update makes the states NaN
        result = original(*args, **kwargs)
        if trainer.step == 2:
            with torch.no_grad():
                for _, tensor in trainer._state_tensors():
                    tensor.mul_(math.nan)
        return result

    trainer.updater.step = poisoned_step
    with pytest.raises(TrainingDiverged, match="step 3 made .* NaN or inf"):
        trainer.fit()
    damage(out / "checkpoints" / "step_0000002" / "model.safetensors", "bit flip")
    with pytest.raises(ckpt.CheckpointError, match="newest valid checkpoint is step_0000001"):
        Trainer(cuda_config(steps=6, resume=True))
    resumed = Trainer(cuda_config(steps=4, resume_from="latest-valid"))
    assert resumed.step == 1 and [m.step for m in resumed.fit()] == [2, 3, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sigterm_ends_the_run_after_the_step_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "memfit", "train", "--out", str(out), "--device", "cuda",
         "--steps", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for_steps(process, out, 20, timeout=300)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert ckpt.select_checkpoint(out)[1]["step"] == last
