"""Checkpoint I/O: atomic, verified, resumable.

A checkpoint is a directory `RUN/checkpoints/step_000123/` holding
    model.safetensors   the model's weights (fp32 master weights, memfit names; ZeRO-3, where no
                        rank holds them whole: exported from trainer/ by rank 0)
    trainer.pt          optimizer, LR schedule, loss scaler, data position, RNG states, step
      or trainer/       the same, sharded (ZeRO runs): torch.distributed.checkpoint files, each
                        rank's part of the optimizer state written by that rank
    meta.json           model shape, tokenizer, step, and each file's size and SHA-256 (and a
                        LoRA run's adapter settings: what the weights file holds)
    config.toml         the run's configuration
and `RUN/checkpoints/latest` names the newest complete one.

Atomicity: everything is written into `step_000123.tmp`, hashed, flushed to disk, and only then
renamed to its final name (a rename within a directory is atomic on POSIX); `latest` is replaced
the same way. A crash mid-save leaves at worst a `.tmp` directory, which is ignored and cleaned
up, and the previous checkpoint intact; a save that fails (a full disk) removes its `.tmp` itself
and says how much space it needed.

Verification: what a reader needs is checked against meta.json's sizes and hashes before it is
used (`read_meta`: the weights, for `memfit generate`; `files="all"`: everything, for a resume).
A checkpoint whose parameters or optimizer state hold NaN or inf is never written (`nonfinite`,
called by the trainer before it saves). Pruning keeps the `keep` newest checkpoints known to be
good (written or verified by this process), never deleting an older good one because of a newer
one that was not checked.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from memfit.models.config import ModelConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: meta.json records each file's SHA-256 (1: sizes only, still readable)
_FILES = ("model.safetensors", "meta.json")  # and trainer.pt, or trainer/ when sharded
_WEIGHTS = "model.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, partial, corrupt, or from another model, or one that could
    not be written."""


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


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """The SHA-256 of a file, read in 4 MiB chunks (about 1 GB/s with the CPU's SHA
    instructions; the file was just written, so it is read from the page cache)."""
    digest = hashlib.sha256()
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of `path` (or of its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def no_space_message(needed: int, where: Path) -> str:
    return (
        f"no space left on device: a checkpoint needs about {gib(needed)} at {str(where)!r}, "
        f"{gib(free_bytes(where))} free"
    )


def nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor that holds NaN or inf, or None (one host
    synchronization for all of them)."""
    named = [(name, t) for name, t in tensors if t.is_floating_point() and t.numel()]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(t).all().cpu() for _, t in named])
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


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
    any_rank: Callable[[bool], bool] = lambda flag: flag,
    weights_from_sharded: bool = False,
    expected_bytes: int = 0,
    known_good: set[str] | None = None,
    extra_meta: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint for `step` atomically and prune all but the `keep` newest good ones.

    Data-parallel runs call this on every rank: rank 0 (`is_main`) writes the model's weights,
    the config and meta.json; `write_sharded(directory)`, when given, is called on every rank
    between `barrier`s and writes the training state sharded (ZeRO: each rank its own part, into
    `trainer/`) instead of trainer.pt. With `weights_from_sharded` (ZeRO-3: the parameters of
    `model` hold no values between steps) rank 0 writes model.safetensors from the weights in
    `trainer/` instead of from `model.state_dict()` (parameters only: the sharded state holds no
    buffers).

    `expected_bytes`, the checkpoint's estimated size, is checked against the free space before
    anything is written. `known_good`, the names of the checkpoints this run wrote or verified,
    gains this one; pruning deletes only checkpoints older than the `keep` newest of them. A
    failed write (OSError: a full disk, a vanished directory) removes the partial `.tmp`, keeps
    every earlier checkpoint, and raises CheckpointError saying so, on every rank (`any_rank`:
    whether a flag is true on any rank)."""
    if weights_from_sharded and write_sharded is None:
        raise ValueError("weights_from_sharded=True needs write_sharded (the weights' source)")
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:07d}"
    tmp = root / f"step_{step:07d}.tmp"
    previous = newest_complete(root)
    if previous == final:  # re-saving a step: what is kept is the one before it
        previous = ([p for p in complete_checkpoints(root) if p.name < final.name] or [None])[-1]

    def prepare() -> None:
        if is_main:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            if expected_bytes and free_bytes(root) < expected_bytes:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            tmp.mkdir()

    def write() -> None:
        if write_sharded is not None:
            write_sharded(tmp / "trainer")
        barrier()
        if is_main:
            _write_main(
                tmp, step, model, model_config, trainer_state, config_toml, tokenizer,
                sharded=write_sharded is not None, weights_from_sharded=weights_from_sharded,
                extra_meta=extra_meta,
            )  # fmt: skip
            if final.exists():  # re-saving the same step (e.g. after a resume): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(root)
            _atomic_write_text(root / "latest", final.name + "\n")

    for phase in (prepare, write):  # every rank hears of a failure on any, after each phase
        failed: CheckpointError | None = None
        try:
            phase()
        except Exception as failure:
            error = _os_error(failure, root)
            if error is None:
                raise
            if is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                reason = no_space_message(expected_bytes, root) if expected_bytes else str(error)
            else:
                reason = f"{type(error).__name__}: {error}"
            failed = CheckpointError(f"could not save the checkpoint of step {step}: {reason}")
            failed.__cause__ = failure
        if any_rank(failed is not None):
            kept = f"; the previous checkpoint {previous.name} is kept" if previous else ""
            said = failed or f"could not save the checkpoint of step {step}: another rank failed"
            raise CheckpointError(f"{said}; the partial {tmp.name} was removed{kept}") from (
                failed.__cause__ if failed else None
            )
    if is_main:
        if known_good is not None:
            known_good.add(final.name)
        _prune(root, keep, known_good)
        logger.info("saved checkpoint %s", final)
    barrier()
    return final


def _meta_hash(meta: dict[str, Any]) -> str:
    """The SHA-256 of meta.json's own content (bar this hash), so that it is verified too."""
    body = {key: value for key, value in meta.items() if key != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# How torch.save and safetensors report a write that failed (a full disk among the causes): in
# their own error types, whose text is all there is to go by.
_WRITE_FAILED = (
    "No space left",
    "StorageFull",
    "unexpected pos",
    "iostream error",
    "failed writing",
)


def _os_error(error: BaseException, where: Path) -> OSError | None:
    """The OSError behind a failed write: itself; one a rank raised inside
    torch.distributed.checkpoint (which wraps every rank's failure in a CheckpointException);
    or, for torch.save's and safetensors' own error types, ENOSPC when the file system of `where`
    is (nearly) full and EIO otherwise. None for anything else (a bug keeps its traceback)."""
    if isinstance(error, OSError):
        return error
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        for wrapped in error.failures.values():
            inner = _os_error(wrapped[0] if isinstance(wrapped, tuple) else wrapped, where)
            if inner is not None:
                return inner
        return None
    text = str(error)
    if not any(mark in text for mark in _WRITE_FAILED):
        return None
    full = "No space left" in text or "StorageFull" in text or free_bytes(where) < 64 << 20
    code = errno.ENOSPC if full else errno.EIO
    return OSError(code, os.strerror(code) if full else text.strip().splitlines()[-1])


def _write_main(
    tmp: Path,
    step: int,
    model: torch.nn.Module,
    model_config: ModelConfig,
    trainer_state: dict[str, Any],
    config_toml: str,
    tokenizer: str,
    *,
    sharded: bool,
    weights_from_sharded: bool,
    extra_meta: dict[str, Any] | None = None,
) -> None:
    """Rank 0's part of a save into `tmp`: the weights, trainer.pt (unless sharded), config.toml
    and meta.json with every file's size and hash; all of it flushed to disk."""
    if weights_from_sharded:
        from memfit.distributed.checkpoint import export_safetensors

        export_safetensors(tmp / "trainer", tmp / _WEIGHTS, metadata={"step": str(step)})
    else:
        weights = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
        save_file(weights, str(tmp / _WEIGHTS), metadata={"format": "memfit", "step": str(step)})
    if not sharded:
        torch.save(trainer_state, tmp / "trainer.pt")
    (tmp / "config.toml").write_text(config_toml)
    files = sorted(f for f in tmp.rglob("*") if f.is_file())
    recorded = {str(f.relative_to(tmp)): f for f in files}
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "model": dataclasses.asdict(model_config),
        "tokenizer": tokenizer,
        "sizes": {name: f.stat().st_size for name, f in recorded.items()},
        "sha256": {name: file_sha256(f) for name, f in recorded.items()},
        **(extra_meta or {}),
    }
    meta["meta_sha256"] = _meta_hash(meta)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    for f in (*files, tmp / "meta.json"):
        _fsync_file(f)
    for directory in {f.parent for f in files} | {tmp}:
        _fsync_dir(directory)


def is_sharded(checkpoint: Path) -> bool:
    """Whether the checkpoint's training state was saved sharded (ZeRO), in `trainer/`."""
    return (checkpoint / "trainer").is_dir()


def _complete(checkpoint: Path) -> bool:
    return all((checkpoint / f).is_file() for f in _FILES) and (
        (checkpoint / "trainer.pt").is_file() or (checkpoint / "trainer" / ".metadata").is_file()
    )


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints in `root` (a run's checkpoints/), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")]
    return sorted((p for p in found if _complete(p)), key=lambda p: p.name)


def newest_complete(root: Path) -> Path | None:
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def remove_partial(root: Path) -> None:
    """Delete what interrupted saves left in `root` (`step_*.tmp` directories)."""
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def _prune(root: Path, keep: int, known_good: set[str] | None) -> None:
    """Delete the checkpoints older than the `keep` newest known good ones (all complete ones
    count as good when `known_good` is None)."""
    remove_partial(root)
    complete = complete_checkpoints(root)
    good = [p.name for p in complete if known_good is None or p.name in known_good]
    if len(good) <= keep:
        return
    cutoff = good[-keep]
    for old in complete:
        if old.name < cutoff:
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
    return newest_complete(root)


def read_meta(checkpoint: Path, *, files: Literal["weights", "all"] = "weights") -> dict[str, Any]:
    """meta.json of `checkpoint`, after checking the files a reader needs against the sizes and
    SHA-256 hashes it recorded: the weights (`memfit generate` needs nothing else), or every
    file (`"all"`, for a resume). Raises CheckpointError naming the file that does not match."""
    where = str(checkpoint)
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"checkpoint {where!r} has an unreadable meta.json: {error}"
        ) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"checkpoint {where!r} has a meta.json that is not memfit's")
    if "meta_sha256" in meta and _meta_hash(meta) != meta["meta_sha256"]:
        raise CheckpointError(
            f"checkpoint {where!r} is corrupt: meta.json does not match its own recorded SHA-256"
        )
    sizes, hashes = meta.get("sizes", {}), meta.get("sha256", {})
    if files == "all" and not _complete(checkpoint):
        raise CheckpointError(f"checkpoint {where!r} is partial: a file of it is missing")
    for name in sizes if files == "all" else [_WEIGHTS]:
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {where!r} is partial: {name} is missing")
        actual = path.stat().st_size
        if name in sizes and actual != sizes[name]:
            raise CheckpointError(
                f"checkpoint {where!r} is partial or corrupt: {name} has {actual} bytes, "
                f"meta.json recorded {sizes[name]}"
            )
        if name in hashes and file_sha256(path) != hashes[name]:
            raise CheckpointError(
                f"checkpoint {where!r} is corrupt: {name} does not match the SHA-256 that "
                "meta.json recorded at save (the file changed on disk since)"
            )
    return meta


def select_checkpoint(
    run_dir: str | Path, which: str = "latest"
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint of `run_dir` to resume from and its meta.json, verified in full
    (`read_meta(files="all")`).

    `which` is "latest" (the run's newest: if it fails verification, the error names the newest
    one that passes), "latest-valid" (the newest that passes; the failing newer ones are left
    as they are, named in a warning), or one checkpoint: "step_0000400", "400", or a path.
    None when the run has no checkpoint ("latest" only)."""
    root = Path(run_dir) / "checkpoints"
    if which == "latest":
        checkpoint = find_checkpoint(run_dir)
        if checkpoint is None:
            return None
        try:
            return checkpoint, read_meta(checkpoint, files="all")
        except CheckpointError as error:
            valid = _newest_valid(complete_checkpoints(root), before=checkpoint.name)
            hint = (
                f"; the newest valid checkpoint is {valid[0].name}: continue from it with "
                f"--resume-from {valid[0].name} (or --resume-from latest-valid)"
                if valid is not None
                else "; no earlier checkpoint of the run verifies: start a fresh run"
            )
            raise CheckpointError(f"{error}{hint}") from None
    if which == "latest-valid":
        valid = _newest_valid(complete_checkpoints(root))
        if valid is None:
            raise CheckpointError(f"no checkpoint in {str(root)!r} passes verification")
        return valid
    path = Path(which)
    if which.isdigit():
        path = root / f"step_{int(which):07d}"
    elif not path.is_dir() and (root / which).is_dir():
        path = root / which
    if not _complete(path):
        have = ", ".join(p.name for p in complete_checkpoints(root)) or "none"
        raise CheckpointError(
            f"--resume-from {which!r}: no complete checkpoint at {str(path)!r} "
            f"(complete checkpoints of {str(run_dir)!r}: {have})"
        )
    return path, read_meta(path, files="all")


def _newest_valid(
    candidates: list[Path], before: str | None = None
) -> tuple[Path, dict[str, Any]] | None:
    for candidate in reversed(candidates):
        if before is not None and candidate.name >= before:
            continue
        try:
            meta = read_meta(candidate, files="all")
        except CheckpointError as error:
            logger.warning("skipped: %s", error)
            continue
        bad = nonfinite(load_file(str(candidate / _WEIGHTS)).items())
        if bad is not None:
            logger.warning("skipped: checkpoint %s holds NaN or inf in %s", candidate, bad)
            continue
        return candidate, meta
    return None


def saved_optimizer(checkpoint: Path) -> str | None:
    """The optimizer a checkpoint was trained with (its config.toml), None if it does not say."""
    from memfit.config import tomllib

    try:
        with (checkpoint / "config.toml").open("rb") as f:
            return tomllib.load(f)["train"]["optimizer"]
    except (OSError, KeyError, TypeError, ValueError):
        return None


def check_model_matches(meta: dict[str, Any], model_config: ModelConfig, checkpoint: Path) -> None:
    # (a key a checkpoint lacks was added later: it had the field's default)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    saved = {**defaults, **meta["model"]}
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
