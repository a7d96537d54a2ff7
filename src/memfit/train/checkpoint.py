"""Checkpoint I/O: atomic, verifiable, resumable.

A checkpoint is a directory `RUN/checkpoints/step_000123/` holding
    model.safetensors   the model's weights (fp32 master weights, memfit names; ZeRO-3, where no
                        rank holds them whole: exported from trainer/ by rank 0)
    trainer.pt          optimizer, LR schedule, loss scaler, data position, RNG states, step
      or trainer/       the same, sharded (ZeRO runs): torch.distributed.checkpoint files, each
                        rank's part of the optimizer state written by that rank
    meta.json           model shape, tokenizer, step, and each file's size (checked on load)
    config.toml         the run's configuration
and `RUN/checkpoints/latest` names the newest complete one.

Atomicity: everything is written into `step_000123.tmp`, flushed to disk, and only then renamed
to its final name (a rename within a directory is atomic on POSIX); `latest` is replaced the same
way. A crash mid-save leaves at worst a `.tmp` directory, which is ignored and cleaned up, and the
previous checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from memfit.models.config import ModelConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_FILES = ("model.safetensors", "meta.json")  # and trainer.pt, or trainer/ when sharded


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, partial, corrupt, or from another model."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with path.open("rb+") as f:
        os.fsync(f.fileno())


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(
    run_dir: str | Path,
    *,
    step: int,
    model: torch.nn.Module,
    model_config: ModelConfig,
    trainer_state: dict[str, Any],
    config_toml: str,
    tokenizer: str,
    keep: int = 2,
    write_sharded: Callable[[Path], None] | None = None,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
    weights_from_sharded: bool = False,
) -> Path:
    """Write a checkpoint for `step` atomically and prune all but the `keep` newest.

    Data-parallel runs call this on every rank: rank 0 (`is_main`) writes the model's weights,
    the config and meta.json; `write_sharded(directory)`, when given, is called on every rank
    between `barrier`s and writes the training state sharded (ZeRO: each rank its own part, into
    `trainer/`) instead of trainer.pt. With `weights_from_sharded` (ZeRO-3: the parameters of
    `model` hold no values between steps) rank 0 writes model.safetensors from the weights in
    `trainer/` instead of from `model.state_dict()` (parameters only: the sharded state holds no
    buffers)."""
    if weights_from_sharded and write_sharded is None:
        raise ValueError("weights_from_sharded=True needs write_sharded (the weights' source)")
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:07d}"
    tmp = root / f"step_{step:07d}.tmp"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    if write_sharded is not None:
        write_sharded(tmp / "trainer")
    barrier()
    if is_main:
        if weights_from_sharded:
            from memfit.distributed.checkpoint import export_safetensors

            export_safetensors(
                tmp / "trainer", tmp / "model.safetensors", metadata={"step": str(step)}
            )
        else:
            weights = {
                name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()
            }
            save_file(
                weights,
                str(tmp / "model.safetensors"),
                metadata={"format": "memfit", "step": str(step)},
            )
        if write_sharded is None:
            torch.save(trainer_state, tmp / "trainer.pt")
        (tmp / "config.toml").write_text(config_toml)
        files = sorted(f for f in tmp.rglob("*") if f.is_file())
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "model": dataclasses.asdict(model_config),
            "tokenizer": tokenizer,
            "sizes": {
                str(f.relative_to(tmp)): f.stat().st_size for f in files if f.name != "config.toml"
            },
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        for f in (*files, tmp / "meta.json"):
            _fsync_file(f)
        for directory in {f.parent for f in files} | {tmp}:
            _fsync_dir(directory)
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _atomic_write_text(root / "latest", final.name + "\n")
        _prune(root, keep)
        logger.info("saved checkpoint %s", final)
    barrier()
    return final


def is_sharded(checkpoint: Path) -> bool:
    """Whether the checkpoint's training state was saved sharded (ZeRO), in `trainer/`."""
    return (checkpoint / "trainer").is_dir()


def _complete(checkpoint: Path) -> bool:
    return all((checkpoint / f).is_file() for f in _FILES) and (
        (checkpoint / "trainer.pt").is_file() or (checkpoint / "trainer" / ".metadata").is_file()
    )


def _complete_checkpoints(root: Path) -> list[Path]:
    found = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")]
    return sorted((p for p in found if _complete(p)), key=lambda p: p.name)


def _prune(root: Path, keep: int) -> None:
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in _complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint directory for `path`: a checkpoint itself, or a run directory (its
    `latest`, falling back to the newest complete one). None if the run has none."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    root = path / "checkpoints"
    if not root.is_dir():
        return None
    latest = root / "latest"
    if latest.is_file():
        candidate = root / latest.read_text().strip()
        if _complete(candidate):
            return candidate
        logger.warning(
            "%s names %s, which is incomplete; using the newest complete checkpoint",
            latest,
            candidate,
        )
    complete = _complete_checkpoints(root)
    return complete[-1] if complete else None


def read_meta(checkpoint: Path) -> dict[str, Any]:
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r} has an unreadable meta.json: {error}"
        ) from None
    for name, size in meta.get("sizes", {}).items():
        actual = (checkpoint / name).stat().st_size if (checkpoint / name).is_file() else None
        if actual != size:
            raise CheckpointError(
                f"checkpoint {str(checkpoint)!r} is partial or corrupt: {name} has {actual} bytes, "
                f"meta.json recorded {size}; resume from an earlier checkpoint or start fresh"
            )
    return meta


def check_model_matches(meta: dict[str, Any], model_config: ModelConfig, checkpoint: Path) -> None:
    saved = meta["model"]
    current = dataclasses.asdict(model_config)
    differences = [
        f"{key}: checkpoint {saved.get(key)!r} vs this run {value!r}"
        for key, value in current.items()
        if key not in ("name", "init_std", "max_seq_len") and saved.get(key) != value
    ]
    if differences:
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r} is from another model ({saved.get('name')!r}); "
            f"it differs from this run's model ({model_config.name!r}) in " + "; ".join(differences)
        )


def load_model_weights(checkpoint: Path, model: torch.nn.Module) -> None:
    try:
        weights = load_file(
            str(checkpoint / "model.safetensors"), device=str(next(model.parameters()).device)
        )
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(
            f"cannot read {str(checkpoint / 'model.safetensors')!r}: {error}"
        ) from None
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    try:
        return torch.load(checkpoint / "trainer.pt", map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"cannot read {str(checkpoint / 'trainer.pt')!r}: {error}") from None
