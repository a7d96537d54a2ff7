"""The training engine: one process, or one rank of a torchrun data-parallel run.

`Trainer(config)` builds, in this order (each step documented where it is done):
  1. process group, device, precision, seeds; the config's rules that need the world size;
  2. data (tokenizer, packed token batches, this rank's share);
  3. the model, constructed on the meta device and materialized on the target device;
  4. techniques applied to the plain model (distributed/parallelize.py): activation checkpointing,
     then torch.compile, then ZeRO-3 parameter sharding;
  5. the optimizer side (one process: LocalOptimizer; data parallel or offload: ZeroOptimizer
     over the same parameter groups), LR schedule, loss scaler;
  6. resume from the run directory's latest checkpoint if asked.
`Trainer.fit()` runs the optimizer steps, each one `train/step.py`'s `train_step` (the one the
profiler observes), and stops with `TrainingDiverged` on a non-finite loss in fp32/bf16, before
anything is saved.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import memfit.distributed.launch as launch
from memfit.config import Config, check_parallelism, to_toml
from memfit.distributed import ZeroOptimizer
from memfit.distributed.parallelize import compiles_blocks, parallelize
from memfit.functional import resolve_attention
from memfit.models.config import load_model_config
from memfit.models.llama import build_model
from memfit.optim import LocalOptimizer, build_scheduler, make_optimizer, parameter_groups
from memfit.planner.advice import planner_advice, preflight
from memfit.train import checkpoint as ckpt
from memfit.train.data import build_data
from memfit.train.metrics import StepMetrics, device_peak_flops, memory_stats
from memfit.train.precision import DTYPES, DynamicLossScaler, resolve_precision
from memfit.train.step import StepObserver, train_step

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or inf (fp32/bf16), or fp16 kept overflowing."""


class OutOfMemory(torch.OutOfMemoryError):
    """GPU memory ran out during a step; the message says what the planner would run instead."""


class ConfigError(ValueError):
    """A strategy that cannot run as configured."""


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device = {spec!r} but no CUDA device is present; use 'auto' or 'cpu'"
        )
    return device


def default_run_dir(model_name: str) -> str:
    return os.path.join("runs", f"{Path(model_name).stem}-{time.strftime('%Y%m%d-%H%M%S')}")


class Trainer:
    def __init__(self, config: Config) -> None:
        self.config = config
        train = config.train
        zero, offload = config.distributed.zero, config.distributed.offload

        # 1. process group, device, precision, seeds
        self.world, self.device = launch.init_world(
            resolve_device(train.device), timeout_s=config.distributed.timeout_s
        )
        try:
            check_parallelism(
                zero=zero, offload=offload, optimizer=train.optimizer,
                world_size=self.world.world_size,
            )  # fmt: skip
            launch.check_same({"config": to_toml(config)})
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.precision = resolve_precision(train.precision, self.device)
        if (
            self.precision == "bf16"
            and self.device.type == "cuda"
            and not torch.cuda.is_bf16_supported()
        ):
            raise ConfigError(
                "precision bf16 needs a GPU with bfloat16 support (Ampere or newer); use fp16 or fp32"
            )
        random.seed(train.seed)
        torch.manual_seed(train.seed)

        # 2. data
        self.model_config = load_model_config(config.model.name)
        if config.data.seq_len > self.model_config.max_seq_len:
            raise ConfigError(
                f"--seq-len {config.data.seq_len} exceeds model {self.model_config.name!r}'s "
                f"max_seq_len={self.model_config.max_seq_len}"
            )
        self.tokenizer, self.batches = build_data(
            config.data.source,
            config.data.tokenizer,
            seq_len=config.data.seq_len,
            micro_batch=train.micro_batch,
            seed=train.seed,
            rank=self.world.rank,
            world_size=self.world.world_size,
            jsonl_field=config.data.jsonl_field,
        )
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ConfigError(
                f"tokenizer {self.tokenizer.name!r} has {self.tokenizer.vocab_size} tokens but model "
                f"{self.model_config.name!r} only {self.model_config.vocab_size} embeddings"
            )

        # 3. model (meta-device construction, then materialized and initialized)
        attention = resolve_attention(
            config.model.attention,
            self.device,
            precision=self.precision,
            head_dim=self.model_config.head_dim,
            window=self.model_config.sliding_window,
        )
        self.attention = attention
        if self.device.type == "cuda":
            from memfit.planner import detect_gpu

            gpu = detect_gpu()
            verdict, message = (
                preflight(self.model_config, self.strategy(), gpu) if gpu else ("ok", None)
            )
            if verdict == "refuse":
                raise ConfigError(message)
            if verdict == "warn" and self.world.is_main:
                logger.warning("%s", message)
        self.model = build_model(
            self.model_config, device=self.device, attention=attention, seed=train.seed
        )
        self.model.train()

        # 4. techniques, in order: activation checkpointing, compile, ZeRO-3 sharding
        groups = parameter_groups(self.model, train.weight_decay)
        self.compiled = compiles_blocks(config.model.compile, self.device, train.checkpointing)
        self.sharded = parallelize(
            self.model,
            checkpointing=train.checkpointing,
            compile=self.compiled,
            zero=zero,
            param_groups=groups,
            param_dtype=DTYPES[self.precision],
            offload_params=offload == "params",
        )

        # 5. the optimizer side (ZeRO-sharded across ranks, or offloaded), schedule, loss scaler
        self.zero: ZeroOptimizer | None = None
        if offload != "none" and (threads := launch.use_host_threads()):
            logger.info("offload: the CPU step runs on %d threads on this rank", threads)
        if self.world.distributed or offload != "none":
            step_device = torch.device("cpu") if offload != "none" else self.device
            self.zero = ZeroOptimizer(
                groups,
                lambda shard_groups: make_optimizer(shard_groups, train, step_device),
                stage=zero,
                offload=offload,
                reduce_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[
                    config.distributed.reduce_dtype
                ],
                sharded=self.sharded,
            )
            self.updater: LocalOptimizer | ZeroOptimizer = self.zero
        else:
            self.updater = LocalOptimizer(make_optimizer(groups, train, self.device))
        self.optimizer = self.updater.optimizer
        self.scheduler = build_scheduler(self.optimizer, train)
        ls = config.loss_scale
        self.scaler = DynamicLossScaler(
            init_scale=ls.init_scale,
            growth_factor=ls.growth_factor,
            backoff_factor=ls.backoff_factor,
            growth_interval=ls.growth_interval,
            enabled=self.precision == "fp16",
        )
        self.step = 0
        self.tokens_seen = 0
        self.consecutive_skips = 0
        if config.checkpoint.resume and not config.checkpoint.out:
            raise ConfigError("--resume needs --out DIR, the run directory to continue")
        run_dir = config.checkpoint.out or default_run_dir(self.model_config.name)
        if self.world.distributed:  # one run directory: rank 0's default name
            shared = [run_dir]
            torch.distributed.broadcast_object_list(shared, src=0)
            run_dir = shared[0]
        self.run_dir = Path(run_dir)
        if not config.checkpoint.resume and ckpt.find_checkpoint(self.run_dir) is not None:
            raise ConfigError(
                f"{str(self.run_dir)!r} already holds a run with checkpoints; pass --resume to continue it, "
                "or choose another --out"
            )
        self.peak_flops = device_peak_flops(self.device)
        self.flops_per_token = self.model_config.flops_per_token(config.data.seq_len)

        # 6. resume
        self.resumed_from: Path | None = None
        if config.checkpoint.resume:
            self._resume()

    # -- checkpoints ------------------------------------------------------------------------

    def trainer_state(self, *, optimizer: bool = True) -> dict[str, Any]:
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "data": self.batches.state_dict(),
            "rng_cpu": torch.get_rng_state(),
        }
        if optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        if self.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _barrier(self) -> None:
        if self.world.distributed:
            torch.distributed.barrier()

    def save(self) -> Path:
        """A checkpoint of the current step (every rank calls it in a data-parallel run). ZeRO
        runs save the optimizer sharded, each rank its part (memfit.distributed.checkpoint)."""
        write_sharded = None
        if self.zero is not None:
            from memfit.distributed.checkpoint import save_zero

            extra = self.trainer_state(optimizer=False)

            def write_sharded(directory: Path) -> None:
                save_zero(directory, self.model, self.zero, extra=extra)

        return ckpt.save_checkpoint(
            self.run_dir,
            step=self.step,
            model=self.model,
            model_config=self.model_config,
            trainer_state=self.trainer_state() if write_sharded is None else {},
            weights_from_sharded=self.zero is not None and self.zero.stage == 3,
            config_toml=to_toml(self.config),
            tokenizer=self.config.data.tokenizer,
            keep=self.config.checkpoint.keep,
            write_sharded=write_sharded,
            is_main=self.world.is_main,
            barrier=self._barrier,
        )

    def _resume(self) -> None:
        checkpoint = ckpt.find_checkpoint(self.run_dir)
        if checkpoint is None:
            logger.warning("--resume: no checkpoint in %s; starting from step 0", self.run_dir)
            return
        meta = ckpt.read_meta(checkpoint)
        ckpt.check_model_matches(meta, self.model_config, checkpoint)
        sharded = ckpt.is_sharded(checkpoint)
        if sharded and self.zero is None:
            raise ConfigError(
                f"{str(checkpoint)!r} holds a ZeRO run's sharded optimizer state: resume it with "
                "--zero under torchrun (any number of processes), or --offload optimizer on one"
            )
        if not sharded and self.zero is not None:
            raise ConfigError(
                f"{str(checkpoint)!r} was saved without ZeRO: resume it without --zero/--offload "
                "(its weights alone load anywhere: `memfit generate`, or a fresh run from them)"
            )
        if sharded:
            from memfit.distributed.checkpoint import load_zero

            state = load_zero(checkpoint / "trainer", self.model, self.zero)
        else:
            ckpt.load_model_weights(checkpoint, self.model)
            state = ckpt.load_trainer_state(checkpoint)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.batches.load_state_dict(state["data"])
        torch.set_rng_state(state["rng_cpu"])
        if self.device.type == "cuda" and "rng_cuda" in state:
            torch.cuda.set_rng_state(state["rng_cuda"], self.device)
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.resumed_from = checkpoint
        logger.info("resumed from %s at step %d", checkpoint, self.step)

    # -- training ---------------------------------------------------------------------------

    def train_step(self, observer: StepObserver | None = None) -> StepMetrics:
        """One optimizer step over `grad_accum` micro-batches (`memfit.train.step.train_step`,
        told to `observer`). Out of GPU memory, it raises torch.OutOfMemoryError saying what
        memfit's planner would run instead."""
        try:
            return self._train_step(observer)
        except torch.OutOfMemoryError as error:
            raise self._out_of_memory(error) from error

    def strategy(self):
        """This run's settings as the planner's Strategy."""
        from memfit.planner import Strategy

        train, dist_cfg = self.config.train, self.config.distributed
        return Strategy(
            precision=self.precision, micro_batch=train.micro_batch,
            seq_len=self.config.data.seq_len, grad_accum=train.grad_accum,
            checkpointing=train.checkpointing, optimizer=train.optimizer,
            attention=self.attention, zero=dist_cfg.zero, offload=dist_cfg.offload,
            world_size=self.world.world_size,
        )  # fmt: skip

    def _out_of_memory(self, error: torch.OutOfMemoryError) -> OutOfMemory:
        from memfit.planner import detect_gpu

        first = str(error).strip().splitlines()[0] if str(error).strip() else "CUDA out of memory"
        lines = [f"step {self.step + 1} ran out of memory on {self.device}: {first}"]
        gpu = detect_gpu() if self.device.type == "cuda" else None
        if gpu is not None:
            lines += planner_advice(self.model_config, self.strategy(), gpu)[1]
        else:
            lines.append(
                "Try a smaller --micro-batch (with a larger --grad-accum), --checkpointing full, "
                "or a shorter --seq-len."
            )
        return OutOfMemory("\n".join(lines))

    def _train_step(self, observer: StepObserver | None) -> StepMetrics:
        train = self.config.train
        start = time.perf_counter()
        micro_batches = [next(self.batches) for _ in range(train.grad_accum)]
        result = train_step(
            self.model,
            self.updater,
            self.scaler,
            micro_batches,
            precision=self.precision,
            device=self.device,
            grad_clip=train.grad_clip,
            across_ranks=self.world.distributed,
            observer=observer,
        )
        loss_sum, num_tokens, finite = result.loss, result.num_tokens, result.finite
        lr = self.scheduler.get_last_lr()[0]
        if finite:  # a skipped step does not advance the schedule
            self.scheduler.step()

        if self.world.distributed:  # the step's loss and tokens over all ranks
            totals = torch.stack([loss_sum, torch.tensor(float(num_tokens), device=self.device)])
            torch.distributed.all_reduce(totals)
            loss_sum = totals[0] / self.world.world_size
            num_tokens = int(totals[1].item())
        loss_value = loss_sum.item()  # the one host sync of the step
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.step += 1
        self.tokens_seen += num_tokens
        if not finite:
            self.consecutive_skips += 1
            if self.consecutive_skips >= 50:
                raise TrainingDiverged(
                    f"fp16 gradients overflowed in 50 consecutive steps (last: step {self.step}); the loss "
                    f"scale fell to {self.scaler.scale_value:g}. Try bf16, a lower --lr, or gradient clipping"
                )
        else:
            self.consecutive_skips = 0
            if not math.isfinite(loss_value):
                raise TrainingDiverged(
                    f"loss became {loss_value} at step {self.step} ({self.precision}); nothing was saved for "
                    "this step. Lower --lr, raise warmup, or check the data; --resume restarts from the last checkpoint"
                )
        allocated, peak = memory_stats(self.device)
        tokens_per_s = num_tokens / elapsed
        return StepMetrics(
            step=self.step,
            loss=loss_value,
            tokens=num_tokens,
            tokens_per_s=tokens_per_s,
            step_time_s=elapsed,
            lr=lr,
            grad_norm=float(result.grad_norm),
            mem_allocated_bytes=allocated,
            mem_peak_bytes=peak,
            loss_scale=self.scaler.scale_value if self.scaler.enabled else None,
            skipped=not finite,
            mfu=tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else None,
        )

    def fit(self, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """Train until `train.steps`, writing metrics.jsonl and checkpoints. Returns this call's
        step metrics."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.run_dir / "metrics.jsonl"
        if self.world.is_main:  # one metrics file per run, written by rank 0
            self._prepare_metrics_file(metrics_path)
        else:
            metrics_path = Path(os.devnull)
        every = self.config.checkpoint.save_every
        history: list[StepMetrics] = []
        with metrics_path.open("a") as metrics_file:
            while self.step < self.config.train.steps:
                metrics = self.train_step()
                history.append(metrics)
                metrics_file.write(metrics.to_json() + "\n")
                metrics_file.flush()
                if on_step is not None:
                    on_step(metrics)
                if every and self.step % every == 0 and self.step < self.config.train.steps:
                    self.save()
        if history or self.resumed_from is None:
            self.save()
        return history

    def _prepare_metrics_file(self, path: Path) -> None:
        """Fresh run: start the file anew. Resumed run: keep the lines up to the resumed step, so
        the file reads as one uninterrupted run."""
        if not path.exists():
            return
        if self.step == 0:
            path.unlink()
            return
        kept = [
            line
            for line in path.read_text().splitlines()
            if line and json.loads(line)["step"] <= self.step
        ]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
