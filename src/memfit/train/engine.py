"""The training engine: one process, or one rank of a torchrun data-parallel run.

`Trainer(config)` builds, in this order (each step documented where it is done):
  1. process group, device, precision, seeds; the config's rules that need the world size; the
     ranks' heartbeat;
  2. the run directory, checked before anything costly is built: writable, free space for a
     checkpoint, and, when resuming, the checkpoint chosen and verified;
  3. data (tokenizer, packed token batches, this rank's share);
  4. the model, constructed on the meta device and materialized on the target device;
  5. techniques applied to the plain model (distributed/parallelize.py): activation checkpointing,
     then torch.compile, then ZeRO-3 parameter sharding;
  6. the optimizer side (one process: LocalOptimizer; data parallel or offload: ZeroOptimizer
     over the same parameter groups), LR schedule, loss scaler;
  7. the resume itself, refusing a checkpoint that holds NaN or inf.
`Trainer.fit()` runs the optimizer steps, each one `train/step.py`'s `train_step` (the one the
profiler observes), and stops with `TrainingDiverged` on a non-finite loss in fp32/bf16, before
anything is saved (and `save` never writes non-finite parameters or optimizer state). SIGTERM or
SIGINT ends `fit` after the current step with a checkpoint (`stopped_by` names the signal); the
same signal again ends the process at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import memfit.distributed.launch as launch
from memfit.config import (
    Config,
    Fp32Parts,
    TrainSection,
    check_parallelism,
    parse_fp32_parts,
    to_toml,
)
from memfit.distributed import ZeroOptimizer
from memfit.distributed.parallelize import compiles_blocks, parallelize
from memfit.functional import resolve_attention
from memfit.models.config import check_seq_len, format_params, load_model_config
from memfit.models.llama import build_model
from memfit.optim import (
    LocalOptimizer,
    build_scheduler,
    default_lr,
    make_optimizer,
    parameter_groups,
)
from memfit.planner.advice import planner_advice, preflight
from memfit.planner.hardware import GPU
from memfit.train import checkpoint as ckpt
from memfit.train import graphs
from memfit.train.data import build_data
from memfit.train.metrics import StepMetrics, device_peak_flops, memory_stats
from memfit.train.offload import ActivationOffload
from memfit.train.precision import DTYPES, DynamicLossScaler, resolve_precision
from memfit.train.step import StepObserver, StepResult, train_step

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
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(
            f"device {spec!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device = {spec!r} but no CUDA device is present; use 'auto' or 'cpu'"
        )
    return device


def pretrained_directory(name: str) -> Path | None:
    """`name` as a Hugging Face checkpoint directory with weights (config.json and safetensors
    files), or None: a preset or a config.json alone gives shapes only."""
    path = Path(name)
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    weights = ("model.safetensors", "model.safetensors.index.json")
    if any((path / w).is_file() for w in weights):
        return path.resolve()
    if any(path.glob("*.bin")) or any(path.glob("*.pt*")):  # weights, none memfit reads
        from memfit.models.loading import _safetensors_files

        try:
            _safetensors_files(path)  # (says which, and how to convert them)
        except (FileNotFoundError, ValueError) as error:
            raise ConfigError(str(error)) from None
    return None


def default_run_dir(model_name: str) -> str:
    """runs/NAME-DATE-TIME, NAME the last part of the model's name ("meta-llama/Llama-3.2-1B":
    Llama-3.2-1B, dots kept)."""
    name = model_name.rstrip("/").rsplit("/", 1)[-1].removesuffix(".json") or "run"
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


EXPANDABLE_SEGMENTS = "expandable_segments:True"
"""The caching allocator's setting the engine asks for unless PYTORCH_CUDA_ALLOC_CONF says
otherwise: segments that grow in place instead of blocks cut from fixed ones. Measured on an
H100 over 16 training configurations (benchmarks/results/time_model.json): the reserved peak
0.2-3.2% over the allocated one (17-21% for two; mean 3.8%) against 1.9-22% (mean 7.2%)
without, at the same step times."""


def use_expandable_segments() -> bool:
    """Ask for EXPANDABLE_SEGMENTS if the user set no allocator configuration and CUDA's
    allocator has not started yet (it reads the setting once). Returns whether it is asked for."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return EXPANDABLE_SEGMENTS in os.environ.get(
            "PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", "")
        )
    if torch.cuda.is_initialized():
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    return True


class Trainer:
    def __init__(self, config: Config) -> None:
        self.config = config
        train = config.train
        zero, offload = config.distributed.zero, config.distributed.offload
        self.expandable_segments = use_expandable_segments()

        # 1. process group, device, precision, seeds
        self.world, self.device = launch.init_world(
            resolve_device(train.device), timeout_s=config.distributed.timeout_s
        )
        try:
            check_parallelism(
                zero=zero, offload=offload, optimizer=train.optimizer,
                world_size=self.world.world_size,
            )  # fmt: skip
            launch.check_same(
                {
                    f"{section}.{key}": repr(value)
                    for section, values in config.to_dict().items()
                    for key, value in values.items()
                }
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.precision = resolve_precision(train.precision, self.device)
        if self.device.type == "cuda" and train.fp32_matmul == "tf32":  # (for the process)
            torch.backends.cuda.matmul.allow_tf32 = True
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

        self.model_config = load_model_config(config.model.name)
        if config.model.attention_pattern:  # (the run's choice, kept in its checkpoints' meta)
            from memfit.ops.attention.sparse import SPEC_BLOCK, parse

            try:
                self.model_config = dataclasses.replace(
                    self.model_config,
                    attention_pattern=config.model.attention_pattern,
                    pattern_layers=config.model.pattern_layers,
                )
                pattern = parse(config.model.attention_pattern)
                pattern.check(config.data.seq_len, pattern.block or SPEC_BLOCK)
            except ValueError as error:
                raise ConfigError(f"model.attention_pattern: {error}") from None
        self.pretrained = pretrained_directory(config.model.name)
        if self.pretrained is not None:  # recorded absolute: export and adapters find it later
            model = dataclasses.replace(config.model, name=str(self.pretrained))
            config = self.config = dataclasses.replace(config, model=model)
        if self.pretrained is not None and config.data.tokenizer == "byte":
            # a pretrained model is fine-tuned on its own tokenizer unless told otherwise
            if not any((self.pretrained / f).is_file() for f in ("tokenizer.json",)):
                raise ConfigError(
                    f"{config.model.name!r} has no tokenizer.json: pass the tokenizer its weights "
                    "were trained with (--tokenizer path/to/tokenizer.json)"
                )
            config = self.config = dataclasses.replace(
                config, data=dataclasses.replace(config.data, tokenizer=str(self.pretrained))
            )
            logger.info("tokenizer of %s", self.pretrained)
        check_seq_len(self.model_config, config.data.seq_len, error=ConfigError)
        if train.lr is None:  # by the model's size
            lr = default_lr(self.model_config.num_params)
            train = dataclasses.replace(train, lr=lr)
            config = self.config = dataclasses.replace(config, train=train)
            logger.info(
                "learning rate %.2g, by the model's size (%s parameters; --lr sets another)",
                lr, format_params(self.model_config.num_params),
            )  # fmt: skip
        blocks = config.train.checkpoint_blocks
        if blocks is not None and blocks > self.model_config.num_layers:
            raise ConfigError(
                f"train.checkpoint_blocks = {blocks}, but {self.model_config.name} has "
                f"{self.model_config.num_layers} blocks"
            )
        fp32_parts = self._fp32_parts()
        self.heartbeat = (
            launch.Heartbeat(self.world, deadline_s=config.distributed.heartbeat_s)
            if self.world.distributed and config.distributed.heartbeat_s > 0
            else None
        )

        # 2. the run directory, before anything is built: writable, holding a run only when
        # resuming it, and then the checkpoint to resume from chosen and verified
        self.run_dir = self._run_directory()
        self.known_good: set[str] = set()  # checkpoints written or verified by this process
        self.resume_from: tuple[Path, dict[str, Any]] | None = None
        if config.checkpoint.resume or config.checkpoint.resume_from:
            self.resume_from = self._on_main(self._choose_checkpoint)
        self._on_main(self._check_free_space)

        # 3. data
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

        # 4. model (meta-device construction, then materialized and initialized)
        attention = resolve_attention(
            config.model.attention,
            self.device,
            precision=self.precision,
            head_dim=self.model_config.head_dim,
            window=self.model_config.some_window,
        )
        self.attention = attention
        lora = config.lora.spec()
        gpu = None
        if self.device.type == "cuda":
            from memfit.planner import detect_gpu

            gpu = detect_gpu()
        if train.checkpointing == "auto":
            train = self._choose_checkpointing(gpu)
            config = self.config
        if gpu is not None:
            verdict, message = preflight(self.model_config, self.strategy(), gpu)
            if verdict == "refuse":
                raise ConfigError(message)
            if verdict == "warn" and self.world.is_main:
                logger.warning("%s", message)
        # QLoRA: the base is never on the device whole in the compute dtype: read from a
        # checkpoint or made from random weights one block at a time, each block quantized
        # before the next is read or made (`_qlora_hooks`)
        qlora = config.lora.quantize != "none"
        build_on = torch.device("meta") if qlora else self.device
        if self.pretrained is not None:  # a Hugging Face checkpoint: start from its weights
            from memfit.models.loading import load_pretrained

            # LoRA keeps the frozen base in the compute dtype: read it so, never in fp32 whole
            dtype = DTYPES[self.precision] if lora is not None else torch.float32
            pattern = {
                "attention_pattern": self.model_config.attention_pattern,
                "pattern_layers": self.model_config.pattern_layers,
            }  # (the run's sparse attention, if any: the checkpoint's weights do not change)
            self.model, _ = load_pretrained(
                self.pretrained, device=self.device, dtype=dtype, attention=attention,
                config_changes=pattern if config.model.attention_pattern else None,
                **(self._qlora_hooks(lora) if qlora else {}),
            )  # fmt: skip
            logger.info("weights from %s (%s)", self.pretrained, dtype)
        else:  # (LoRA: the frozen base made in the compute dtype, as a checkpoint is read)
            self.model = build_model(
                self.model_config, device=build_on, attention=attention, seed=train.seed,
                dtype=DTYPES[self.precision] if lora is not None else None,
            )  # fmt: skip
        if lora is not None:
            self._apply_lora(lora)
        self.model.to(self.device)
        if train.master_weights == "none":  # the parameters are the bf16 weights themselves
            if self.precision != "bf16":
                raise ConfigError(
                    f"--master-weights none keeps bf16 parameters: it needs --precision bf16 "
                    f"(this run resolved to {self.precision})"
                )
            self.model.to(torch.bfloat16)
        self.model.train()

        # 5. techniques, in order: activation checkpointing, compile, ZeRO-3 sharding
        groups = parameter_groups(self.model, train.weight_decay)
        self.compiled = compiles_blocks(
            config.model.compile, self.device, train.checkpointing, train.checkpoint_blocks
        )
        self.activation_offload = (
            ActivationOffload(self.device) if train.offload_activations else None
        )
        self.sharded = parallelize(
            self.model,
            checkpointing=train.checkpointing,
            checkpoint_blocks=train.checkpoint_blocks,
            compile=self.compiled,
            zero=zero,
            param_groups=groups,
            param_dtype=DTYPES[self.precision],
            offload_params=offload == "params",
            offload_activations=self.activation_offload,
            fp32_parts=fp32_parts,
        )

        self.loss_model: torch.nn.Module = self.model
        if config.distill.teacher:
            self.loss_model = self._distillation()

        # 6. the optimizer side (ZeRO-sharded across ranks, or offloaded), schedule, loss scaler
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
        self.graphed = self._graphed_step() if train.cuda_graphs else None
        self.step = 0
        self.tokens_seen = 0
        self.consecutive_skips = 0
        self.peak_flops = device_peak_flops(self.device)
        self.flops_per_token = self.model_config.flops_per_token(config.data.seq_len)

        # 7. resume
        self.resumed_from: Path | None = None
        if self.resume_from is not None:
            self._resume(*self.resume_from)

    def _distillation(self) -> torch.nn.Module:
        """The student (self.model) against the configured teacher, which is loaded in the
        compute dtype (or quantized) for inference only."""
        from memfit.models.loading import load_pretrained
        from memfit.train.distill import Distillation

        distill = self.config.distill
        kind = distill.teacher_quantize
        teacher, info = load_pretrained(
            distill.teacher, device="cpu" if kind != "none" else self.device,
            dtype=DTYPES[self.precision],
        )  # fmt: skip
        if info.config.vocab_size != self.model_config.vocab_size:
            raise ConfigError(
                f"the teacher {distill.teacher!r} has a vocabulary of {info.config.vocab_size} "
                f"and the student {self.model_config.vocab_size}: distillation compares their "
                "distributions token by token, so they must share one tokenizer"
            )
        if kind != "none":
            from memfit.nn.quant import quantize_model

            quantize_model(teacher, kind, dtype=DTYPES[self.precision], device=self.device)
            teacher.to(self.device)
        teacher.requires_grad_(False)
        teacher.eval()
        stored = sum(t.numel() * t.element_size() for t in (*teacher.parameters(),
                                                           *teacher.buffers()))  # fmt: skip
        logger.info(
            "distilling from %s (%s, %s): %.2f GiB; alpha %g, temperature %g, %s",
            distill.teacher, info.config.name, kind if kind != "none" else self.precision,
            stored / 2**30, distill.alpha, distill.temperature, distill.kind,
        )  # fmt: skip
        return Distillation(
            self.model, teacher, alpha=distill.alpha, temperature=distill.temperature,
            kind=distill.kind,
        )  # fmt: skip

    def _apply_lora(self, spec) -> None:
        """Adapters on the targeted layers (seeded), the rest frozen and kept in the compute
        dtype: no gradient, no optimizer state, no fp32 copy of the base."""
        from memfit.nn.lora import apply_lora, lora_layers

        layers = lora_layers(self.model)  # (QLoRA from a checkpoint: applied while reading it)
        if not layers:
            layers = apply_lora(self.model, spec)
        first = next(iter(layers.values()))
        if next(first.lora_A.parameters()).is_meta:
            self._make_quantized_blocks(spec)  # QLoRA from random weights
        elif self.config.lora.quantize == "none":
            generator = torch.Generator(device=self.device).manual_seed(self.config.train.seed)
            for layer in layers.values():
                layer.reset_adapters(generator)
            for param in self.model.parameters():
                if not param.requires_grad:
                    param.data = param.data.to(DTYPES[self.precision])
        if self.config.lora.quantize != "none":
            from memfit.nn.quant import QuantizedWeight

            stored = sum(m.nbytes() for m in self.model.modules() if isinstance(m, QuantizedWeight))
            logger.info("base quantized to %s block by block: the blocks' linear weights take "
                        "%.2f GiB", self.config.lora.quantize, stored / 2**30)  # fmt: skip
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.model.parameters())
        logger.info(
            "LoRA rank %d on %s (%d linear layers): %s trainable parameters of %s (%.2f%%)",
            spec.rank, ", ".join(spec.names), len(layers), f"{trainable:,}", f"{total:,}",
            100 * trainable / total,
        )  # fmt: skip

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

        bad = self._nonfinite()
        if bad is not None:
            raise TrainingDiverged(
                f"step {self.step} made {bad} NaN or inf, so no checkpoint was written for it; "
                f"{self._divergence_advice(self.step)} (or raise the warmup, or check the data)"
            )
        saved = ckpt.save_checkpoint(
            self.run_dir,
            expected_bytes=self.checkpoint_bytes(),
            known_good=self.known_good,
            step=self.step,
            model=self.model,
            model_config=self.model_config,
            trainer_state=self.trainer_state() if write_sharded is None else {},
            weights_from_sharded=self.zero is not None and self.zero.stage == 3,
            config_toml=to_toml(self.config),
            tokenizer=self.config.data.tokenizer,
            keep=self.config.checkpoint.keep,
            write_sharded=write_sharded,
            extra_meta={"lora": dataclasses.asdict(self.config.lora)}
            if self.config.lora.rank
            else None,
            is_main=self.world.is_main,
            barrier=self._barrier,
            any_rank=lambda flag: bool(launch.agree(torch.tensor(float(flag), device=self.device))),
        )
        if self.config.lora.rank and self.world.is_main:  # the adapters as peft reads them
            from memfit.nn.lora import save_peft_adapter

            base = str(self.pretrained or self.config.model.name)
            save_peft_adapter(self.model, self.run_dir / "adapter", base=base)
        return saved

    def _on_main(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run by rank 0 alone (file system checks, checkpoint verification), its result
        or its error given to every rank, so that all ranks go on or stop together."""
        result: Any = None
        error: Exception | None = None
        if self.world.is_main:
            try:
                result = fn()
            except (ValueError, OSError, ckpt.CheckpointError) as failure:
                error = failure
        if self.world.distributed:
            box = [(result, error)]
            torch.distributed.broadcast_object_list(box, src=0)
            result, error = box[0]
        if error is not None:
            raise error
        return result

    def _run_directory(self) -> Path:
        checkpoint = self.config.checkpoint
        resuming = checkpoint.resume or checkpoint.resume_from
        if resuming and not checkpoint.out:
            raise ConfigError("--resume needs --out DIR, the run directory to continue")
        run_dir = Path(checkpoint.out or default_run_dir(self.model_config.name))
        if self.world.distributed:  # one run directory: rank 0's default name
            shared = [run_dir]
            torch.distributed.broadcast_object_list(shared, src=0)
            run_dir = shared[0]

        def check() -> None:
            if run_dir.exists() and not run_dir.is_dir():
                raise ConfigError(f"--out {str(run_dir)!r} is a file, not a run directory")
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                probe = run_dir / f".memfit-write-test-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as error:
                raise ConfigError(
                    f"cannot write to the run directory {str(run_dir)!r}: "
                    f"{error.strerror or error}; choose another --out"
                ) from None
            for name, kind in (("checkpoints", "directory"), ("metrics.jsonl", "file")):
                entry = run_dir / name
                if entry.exists() and entry.is_dir() != (kind == "directory"):
                    raise ConfigError(
                        f"{str(entry)!r} is in the way: the run writes a {kind} there; remove "
                        "it, or choose another --out"
                    )
            self._lock = _RunLock(run_dir)
            if not resuming and ckpt.find_checkpoint(run_dir) is not None:
                raise ConfigError(
                    f"{str(run_dir)!r} already holds a run with checkpoints; pass --resume to "
                    "continue it, or choose another --out"
                )

        self._on_main(check)
        return run_dir

    def _choose_checkpoint(self) -> tuple[Path, dict[str, Any]] | None:
        """The checkpoint to resume from (checkpoint.resume_from: latest, latest-valid, step_N),
        verified in full; ConfigError when it is already at or past train.steps."""
        which = self.config.checkpoint.resume_from or "latest"
        ckpt.remove_partial(self.run_dir / "checkpoints")
        chosen = ckpt.select_checkpoint(self.run_dir, which)
        if chosen is None:
            logger.warning("--resume: no checkpoint in %s; starting from step 0", self.run_dir)
            return None
        checkpoint, meta = chosen
        ckpt.check_model_matches(meta, self.model_config, checkpoint)
        saved = ckpt.saved_optimizer(checkpoint)
        if saved is not None and saved != self.config.train.optimizer:
            raise ConfigError(
                f"checkpoint {str(checkpoint)!r} was trained with --optimizer {saved}, and its "
                f"state does not carry over to {self.config.train.optimizer!r}: resume with "
                f"--optimizer {saved}, or start a fresh run from its weights"
            )
        steps = self.config.train.steps
        if int(meta["step"]) > steps:
            raise ConfigError(
                f"--steps {steps}, but the run in {str(self.run_dir)!r} is already at step "
                f"{meta['step']} ({checkpoint.name}): --steps is the run's total; pass more than "
                f"{meta['step']} to train further"
            )
        return checkpoint, meta

    def checkpoint_bytes(self) -> int:
        """About how many bytes one checkpoint of this run takes: the weights (fp32, or bf16
        with --master-weights none), the optimizer state, and (ZeRO) the parameters again in
        the sharded state."""
        from memfit.optim.registry import get_optimizer

        params = self.model_config.num_params
        state = get_optimizer(self.config.train.optimizer).state_bytes_per_param
        weights = 2 if self.config.train.master_weights == "none" else 4
        sharded = self.world.distributed or self.config.distributed.offload != "none"
        if self.config.lora.rank:  # the frozen base in the compute dtype; state for adapters
            base = 4 if self.precision == "fp32" else 2
            base = {"nf4": 0.52, "int8": 1.0}.get(self.config.lora.quantize, base)
            trainable = self._lora_trainable()
            return int(params * base + trainable * (4 + state)) + (1 << 20)
        return int(params * (weights + state + (4 if sharded else 0))) + (1 << 20)

    def _qlora_hooks(self, spec) -> dict:
        """`load_pretrained`'s hooks for QLoRA: the adapters put on the meta-device model, and
        each block, once read, given its adapters (seeded, in the order `_apply_lora` draws
        them) and its linear weights quantized before the next block is read."""
        from memfit.nn.lora import LoRALinear, apply_lora
        from memfit.nn.quant import quantize_model

        kind, compute, device = self.config.lora.quantize, DTYPES[self.precision], self.device
        adapters = torch.Generator(device=device).manual_seed(self.config.train.seed)

        def on_block(model: torch.nn.Module, index: int) -> None:
            for module in model.layers[index].modules():
                if isinstance(module, LoRALinear):
                    module.lora_A.to_empty(device=device)
                    module.lora_B.to_empty(device=device)
                    module.reset_adapters(adapters)
            try:
                quantize_model(model, kind, dtype=compute, blocks=[index])
            except ValueError as error:
                raise ConfigError(f"--quantize-base {kind}: {error}") from None

        return {"prepare": lambda model: apply_lora(model, spec), "on_block": on_block}

    def _make_quantized_blocks(self, spec) -> None:
        """QLoRA from random weights: materialize the meta-device LoRA model on the device one
        block at a time, each in the compute dtype, initialized and quantized (`_qlora_hooks`)
        before the next is made. The weights and adapters are those `build_model` and
        `_apply_lora` make (the same seeded draws in the same order): the run equals its LoRA
        run but for the quantization (the same global RNG state after it too)."""
        model, device = self.model, self.device
        weights = torch.Generator(device=device).manual_seed(self.config.train.seed)
        on_block = self._qlora_hooks(spec)["on_block"]
        others = [name for name, _ in model.named_children() if name != "layers"]
        for name in others:
            model.get_submodule(name).to_empty(device=device)
        model.init_weights(weights, "embed")  # (the order of Llama.init_weights' draws)
        for index, block in enumerate(model.layers):
            block.to_empty(device=device)
            model.init_weights(weights, f"layers.{index}")
            on_block(model, index)
        for name in others:
            if name != "embed":
                model.init_weights(weights, name)

    def _lora_trainable(self) -> int:
        """The adapters' parameter count, from a model on the meta device (the free-space check
        runs before the model is built)."""
        from memfit.nn.lora import apply_lora

        model = build_model(self.model_config, device="meta")
        apply_lora(model, self.config.lora.spec())
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    def _check_free_space(self) -> None:
        need, keep = self.checkpoint_bytes(), self.config.checkpoint.keep
        free = ckpt.free_bytes(self.run_dir)
        if free < need:
            logger.warning(
                "a checkpoint of this run takes about %s and %s has %s free: saving will fail "
                "(free space, or choose another --out)",
                ckpt.gib(need), self.run_dir, ckpt.gib(free),
            )  # fmt: skip
        elif free < need * (keep + 1):
            logger.warning(
                "a checkpoint of this run takes about %s; keeping %d of them while writing the "
                "next needs about %s, and %s has %s free",
                ckpt.gib(need), keep, ckpt.gib(need * (keep + 1)), self.run_dir, ckpt.gib(free),
            )  # fmt: skip

    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's parameters as the optimizer holds them (ZeRO: its shards) and their
        optimizer state, named."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        tensors = []
        for g, group in enumerate(self.optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                name = names.get(id(param), f"group {g} shard {i} on rank {self.world.rank}")
                tensors.append((name, param))
                for key, value in self.optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        tensors.append((f"{name} (optimizer {key})", value))
        return tensors

    def _nonfinite(self) -> str | None:
        """The first parameter or optimizer state holding NaN or inf, on any rank; None if all
        are finite."""
        bad = ckpt.nonfinite(self._state_tensors())
        flag = torch.tensor(float(bad is not None), device=self.device)
        if bool(launch.agree(flag)):
            return bad or "a tensor of another rank"
        return None

    def _divergence_advice(self, step: int) -> str:
        """What a run whose values became NaN or inf in `step` can go on from, truthfully. The
        checkpoint of the step before holds the weights that step started from, which gave them:
        resuming from it fails the same way whatever the learning rate, so the newest one
        before it is named."""
        complete = ckpt.complete_checkpoints(self.run_dir / "checkpoints")
        before = [c for c in complete if c.name < f"step_{step - 1:07d}"]
        suspect = [c.name for c in complete if c.name == f"step_{step - 1:07d}"]
        said = (
            f"checkpoint {suspect[0]} holds the weights step {step} started from (resuming from "
            "it fails the same way, whatever the --lr); "
            if suspect
            else ""
        )
        if not before:
            return f"{said}no checkpoint before: start afresh (another --out) with a lower --lr"
        return (
            f"{said}go on from {before[-1].name} with a lower --lr: --resume-from {before[-1].name}"
        )

    def _resume(self, checkpoint: Path, meta: dict[str, Any]) -> None:
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
        bad = self._nonfinite()
        if bad is not None:
            raise ckpt.CheckpointError(
                f"checkpoint {str(checkpoint)!r} holds NaN or inf in {bad}: it cannot be "
                "trained from; go on from an earlier one: --resume-from latest-valid (the newest "
                "whose weights are finite) or --resume-from step_N"
            )
        self.scheduler.load_state_dict(state["scheduler"])
        self._apply_configured_lr()
        if self.graphed is not None:  # (the loaded groups hold float learning rates)
            graphs.make_capturable(self.optimizer, self.device)
        self.scaler.load_state_dict(state["scaler"])
        self.batches.load_state_dict(state["data"])
        torch.set_rng_state(state["rng_cpu"])
        if self.device.type == "cuda" and "rng_cuda" in state:
            torch.cuda.set_rng_state(state["rng_cuda"], self.device)
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.resumed_from = checkpoint
        self.known_good.add(checkpoint.name)
        logger.info("resumed from %s at step %d", checkpoint, self.step)

    def _apply_configured_lr(self) -> None:
        """A resumed run takes its peak learning rate from the configuration, not from the
        checkpoint's schedule (so that a lower --lr after a divergence takes effect)."""
        lr, saved = self.config.train.lr, self.scheduler.base_lrs
        if all(base == lr for base in saved):
            return
        logger.warning(
            "learning rate %g from the configuration (the checkpoint's: %g)", lr, saved[0]
        )
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        self.scheduler.base_lrs = [lr] * len(saved)
        for group in self.optimizer.param_groups:
            group["initial_lr"], group["lr"] = lr, lr * factor
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

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
        from memfit.planner import Strategy, fine_tuning_fields

        train, dist_cfg = self.config.train, self.config.distributed
        return Strategy(
            precision=self.precision, micro_batch=train.micro_batch,
            seq_len=self.config.data.seq_len, grad_accum=train.grad_accum,
            checkpointing=train.checkpointing if train.checkpointing != "auto" else "none",
            checkpoint_blocks=train.checkpoint_blocks, optimizer=train.optimizer, master_weights=train.master_weights,
            attention=self.attention, zero=dist_cfg.zero, offload=dist_cfg.offload,
            offload_activations=train.offload_activations, world_size=self.world.world_size,
            cuda_graphs=train.cuda_graphs,
            fp32_parts=train.fp32_parts if self.precision != "fp32" else "",
            fp32_matmul=train.fp32_matmul,
            **fine_tuning_fields(self.config),
        )  # fmt: skip

    def _fp32_parts(self) -> Fp32Parts | None:
        """`train.fp32_parts`, checked against the model's blocks and said in the log (nothing to
        do when the whole run computes in fp32)."""
        spec = self.config.train.fp32_parts
        if not spec:
            return None
        parts = parse_fp32_parts(spec)
        if self.precision == "fp32":
            logger.info("fp32 parts %s: this run computes every part in fp32 already", parts)
            return None
        try:
            blocks = parts.blocks(self.model_config.num_layers)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if self.world.is_main:
            what = [f"{len(blocks)} of {self.model_config.num_layers} blocks"] if blocks else []
            logger.info(
                "fp32 parts: %s compute in fp32, the rest in %s",
                " and ".join([*what, *(["the head"] if parts.head else [])]), self.precision,
            )  # fmt: skip
        return parts

    def _choose_checkpointing(self, gpu: GPU | None) -> TrainSection:
        """`--checkpointing auto`: the planner's choice for this run on `gpu` (none, or selective
        or full on every block or on the first blocks it takes to fit: the fastest predicted that
        fits), written into the configuration; without a GPU of the planner's catalog, none."""
        from memfit.planner.search import choose_checkpointing

        train = self.config.train
        if gpu is None:
            chosen, checkpoint_blocks = "none", None
            why = f"no checkpointing: no GPU of the planner's catalog to plan for on {self.device}"
        else:
            picked, why = choose_checkpointing(self.model_config, self.strategy(), gpu)
            chosen, checkpoint_blocks = picked.checkpointing, picked.checkpoint_blocks
        if self.world.is_main:
            logger.info("checkpointing auto: %s", why)
        train = dataclasses.replace(
            train, checkpointing=chosen, checkpoint_blocks=checkpoint_blocks
        )
        self.config = dataclasses.replace(self.config, train=train)
        return train

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

    def _eager_step(self, micro_batches: list, observer: StepObserver | None) -> StepResult:
        train = self.config.train
        return train_step(
            self.loss_model, self.updater, self.scaler, micro_batches, precision=self.precision,
            device=self.device, grad_clip=train.grad_clip, across_ranks=self.world.distributed,
            observer=observer,
        )  # fmt: skip

    def _graphed_step(self) -> graphs.GraphedStep:
        """`train.cuda_graphs`: the step captured in a CUDA graph (memfit.train.graphs), or a
        ConfigError saying why this run cannot have it."""
        from memfit.planner.search import capture_refusal

        train = self.config.train
        why = (
            f"the step runs on {self.device}, and CUDA graphs are captured on a CUDA device"
            if self.device.type != "cuda"
            else capture_refusal(self.strategy())
        )
        if why is not None:
            raise ConfigError(f"--cuda-graphs: {why}")
        graphs.make_capturable(self.optimizer, self.device)
        if self.world.is_main:
            logger.info("cuda graphs: the step is captured once (step 2) and replayed")
        return graphs.GraphedStep(
            self.loss_model, self.updater, precision=self.precision, device=self.device,
            shape=(train.grad_accum, train.micro_batch, self.config.data.seq_len),
            vocab_size=self.model_config.vocab_size, grad_clip=train.grad_clip,
        )  # fmt: skip

    def _train_step(self, observer: StepObserver | None) -> StepMetrics:
        train = self.config.train
        start = time.perf_counter()
        micro_batches = [next(self.batches) for _ in range(train.grad_accum)]
        if self.graphed is not None and observer is None:
            result = self.graphed(micro_batches)
        else:
            result = self._eager_step(micro_batches, observer)
        loss_sum, num_tokens, finite = result.loss, result.num_tokens, result.finite
        lr = float(self.scheduler.get_last_lr()[0])
        if finite:  # a skipped step does not advance the schedule
            self.scheduler.step()

        signalled = self._signals is not None and self._signals.received is not None
        if self.world.distributed:  # the step's loss, tokens and stop signals over all ranks
            counts = torch.tensor([float(num_tokens), float(signalled)], device=self.device)
            totals = torch.cat([loss_sum.reshape(1), counts])
            torch.distributed.all_reduce(totals)
            loss_sum = totals[0] / self.world.world_size
            num_tokens, signalled = int(totals[1].item()), bool(totals[2].item() > 0)
        self.stop_agreed = signalled  # every rank stops after the same step
        loss_value = loss_sum.item()  # the one host sync of the step
        grad_norm = float(result.grad_norm)
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
            if math.isfinite(loss_value) and not math.isfinite(grad_norm):
                raise TrainingDiverged(
                    f"the gradient norm became {grad_norm} at step {self.step} ({self.precision}), "
                    f"so nothing was saved for it; {self._divergence_advice(self.step)} (or raise "
                    "the warmup, or check the data)"
                )
            if not math.isfinite(loss_value):
                raise TrainingDiverged(
                    f"loss became {loss_value} at step {self.step} ({self.precision}), so nothing "
                    f"was saved for it; {self._divergence_advice(self.step)} (or raise "
                    "the warmup, or check the data)"
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
            grad_norm=grad_norm,
            mem_allocated_bytes=allocated,
            mem_peak_bytes=peak,
            loss_scale=self.scaler.scale_value if self.scaler.enabled else None,
            skipped=not finite,
            mfu=tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else None,
        )

    def fit(self, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """Train until `train.steps`, writing metrics.jsonl and checkpoints. Returns this call's
        step metrics. SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) ends it after the
        current step with a checkpoint, all ranks at the same step, and sets `stopped_by`."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.run_dir / "metrics.jsonl"
        if self.world.is_main:  # one metrics file per run, written by rank 0
            self._prepare_metrics_file(metrics_path)
        else:
            metrics_path = Path(os.devnull)
        every = self.config.checkpoint.save_every
        history: list[StepMetrics] = []
        saved_at = None
        with metrics_path.open("a") as metrics_file, _StopSignals() as self._signals:
            while self.step < self.config.train.steps:
                metrics = self.train_step()
                history.append(metrics)
                if len(history) == 1 and self.activation_offload is not None:
                    offload = self.activation_offload
                    logger.info(
                        "activation offload: %.2f GiB to pinned CPU memory in step %d (a pool "
                        "of %d buffers, %.2f GiB)", offload.bytes_offloaded / 2**30, self.step,
                        offload.buffers_allocated, offload.pinned_bytes / 2**30,
                    )  # fmt: skip
                metrics_file.write(metrics.to_json() + "\n")
                metrics_file.flush()
                if on_step is not None:
                    on_step(metrics)
                if every and self.step % every == 0 and self.step < self.config.train.steps:
                    self.save()
                    saved_at = self.step
                if self.stop_agreed:
                    self.stopped_by = self._signals.received or "a signal to another rank"
                    logger.warning(
                        "%s: saving a checkpoint of step %d, then stopping (the same signal "
                        "again ends the run at once, without it)", self.stopped_by, self.step,
                    )  # fmt: skip
                    break
        self._signals = None
        if saved_at != self.step and (history or self.resumed_from is None):
            self.save()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        return history

    def close(self, *, failed: bool = False) -> None:
        """End this rank's part in a torchrun launch: wait for every rank (the heartbeat still
        ends this one if a peer is stopped meanwhile), stop the heartbeat, leave the process
        group. `failed`: this rank is leaving on an error, which the others may not share: only
        the heartbeat stops (torchrun ends the run). The CLI calls it once its work is done; a
        single-process run has nothing to end."""
        if self.world.distributed and not failed:
            self._barrier()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.world.distributed and not failed:
            launch.close_world()

    stopped_by: str | None = None
    """The signal that ended the last `fit` early (e.g. "SIGTERM"), None if it ran to the end."""
    stop_agreed = False
    """Whether a rank had a stop signal at the last step (agreed in the step's all-reduce)."""
    _signals: _StopSignals | None = None

    def _prepare_metrics_file(self, path: Path) -> None:
        """Fresh run: start the file anew. Resumed run: keep the lines up to the resumed step, so
        the file reads as one uninterrupted run; a last line cut short by a crash is dropped."""
        if not path.exists():
            return
        if self.step == 0:
            path.unlink()
            return
        lines = path.read_text(errors="replace").splitlines()
        kept = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                if number == len(lines):  # a crash cut the last line
                    logger.warning("%s:%d is cut short (a crash mid-write); dropped", path, number)
                    continue
                raise ValueError(
                    f"{str(path)}:{number} is not a metrics line ({error}); remove or fix it"
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(
                    f"{str(path)}:{number} is not a metrics line (no integer 'step'); remove or "
                    "fix it"
                )
            step = record["step"]
            if step <= self.step:
                kept.append(line)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)


class _RunLock:
    """An exclusive lock on a run directory (`.lock`, flock) for the life of the process: a
    run of another process into the same directory is refused instead of racing the first's
    checkpoints. (Trainers of one process, as in tests, share it.)"""

    _held: dict[Path, Any] = {}

    def __init__(self, run_dir: Path) -> None:
        import fcntl

        path = (run_dir / ".lock").resolve()
        if path in self._held:
            return
        self._file = path.open("a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise ConfigError(
                f"{str(run_dir)!r} is in use by another memfit run ({holder}); wait for it to "
                "end, or choose another --out"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()}\n")
        self._file.flush()
        self._held[path] = self._file


class _StopSignals:
    """Within the block, SIGTERM and SIGINT set `received` (the signal's name) instead of
    ending the process; the same signal again, a second or more later, ends it at once, as if
    unhandled. Copies within that second are one event: a terminal's Ctrl-C reaches torchrun's
    workers twice (from the terminal, and forwarded by torchrun), as a scheduler's SIGTERM may.
    Outside the main thread it does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    SAME_EVENT_S = 1.0

    def __init__(self) -> None:
        self.received: str | None = None
        self._first: dict[int, float] = {}
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if signum in self._first:
            if now - self._first[signum] >= self.SAME_EVENT_S:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        self._first[signum] = now
        if self.received is None:
            self.received = signal.Signals(signum).name
            logger.warning(
                "%s received: finishing the current step, then saving a checkpoint",
                self.received,
            )
