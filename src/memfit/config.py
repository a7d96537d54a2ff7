"""Run configuration: one dataclass per section, loaded from TOML, overridden by CLI flags and by
`--set section.key=value`, validated on construction.

Precedence, lowest first: the defaults below, `--config file.toml`, CLI flags, `--set`.
An unknown section or key is an error that names the nearest valid one.

    [model]
    name = "llama-1b"          # a preset or the path of a Hugging Face config.json
    [train]
    micro_batch = 4
    precision = "bf16"
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class _Section:
    """Checks every `Literal` field against its allowed values after construction."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        section = _SECTION_NAMES.get(type(self).__name__, type(self).__name__)
        for f in dataclasses.fields(self):
            allowed = _literal_values(hints[f.name])
            value = getattr(self, f.name)
            if allowed is not None and value not in allowed:
                raise ValueError(
                    f"{section}.{f.name} = {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}"
                )
            # NaN passes every `value <= 0` check below, and inf is no learning rate or timeout
            if float in (hints[f.name], *typing.get_args(hints[f.name])) and (
                isinstance(value, float) and not math.isfinite(value)
            ):
                raise ValueError(f"{section}.{f.name} = {value!r} is not a finite number")
        self.validate()

    def validate(self) -> None:
        pass


def _literal_values(hint: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return None


def _positive(section: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{section}.{name} must be > 0, got {value!r}")


def _named(name: str, value: Any) -> str:
    """`--flag 'value'` for a command-line flag, `section.key = 'value'` for a config key."""
    return f"{name} {value!r}" if name.startswith("-") else f"{name} = {value!r}"


def check_at_least(name: str, value: float, minimum: float, *, what: str = "") -> None:
    """Refuse `value` below `minimum` (and NaN) with a ValueError naming `name` (a flag such as
    '--block-size', or a config key) and the value; `what` says what the bound means."""
    if not value >= minimum:
        raise ValueError(f"{name} must be >= {minimum}{what}, got {value!r}")


def check_between(
    name: str, value: float, low: float, high: float, *, low_open: bool = False, what: str = ""
) -> None:
    """Refuse `value` outside [low, high] ((low, high] with `low_open`), NaN included."""
    if not ((low < value if low_open else low <= value) and value <= high):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name} must be in {interval}{what}, got {value!r}")


DEVICE_TYPES = ("cpu", "cuda", "mps")


def check_device_spec(spec: str, name: str = "train.device") -> None:
    """Refuse a device other than 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps' with a ValueError naming
    `name` (a flag or a config key) and the value, so that nothing hands a bad one to torch
    (whether a CUDA device is present is the engine's `resolve_device`'s to say)."""
    if spec == "auto":
        return
    import torch

    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if (
        device is None
        or device.type not in DEVICE_TYPES
        or (device.index is not None and device.type != "cuda")
    ):
        raise ValueError(
            f"{_named(name, spec)} is not a device; use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
        )


@dataclass(kw_only=True)
class ModelSection(_Section):
    name: str = "tiny"
    """A preset (tiny, llama-1b, llama-2-7b, ...), the path of a Hugging Face config.json (its
    shapes, random weights), or a Hugging Face checkpoint directory (config.json and safetensors
    weights: training starts from those weights)."""
    attention: Literal["auto", "flash", "sdpa", "eager"] = "auto"
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile each transformer block; auto: on for CUDA without activation checkpointing."""
    attention_pattern: str = ""
    """A sparse attention pattern (memfit.ops.attention.sparse.parse: "local:512",
    "longformer:256:globals=0", "bigbird:128:globals=0:random=2", "strided:256", "dilated:4")
    for the layers `pattern_layers` names; "" keeps the model's own attention."""
    pattern_layers: str = "all"
    """all, even, odd (alternating with dense layers) or comma-separated layer indices."""

    def validate(self) -> None:
        if self.attention_pattern:
            from memfit.ops.attention.sparse import parse

            parse(self.attention_pattern)
        elif self.pattern_layers != "all":
            raise ValueError(
                f"model.pattern_layers = {self.pattern_layers!r} says where the sparse "
                "attention pattern applies: set model.attention_pattern too"
            )


@dataclass(kw_only=True)
class DataSection(_Section):
    source: str = "synthetic"
    """'synthetic' (built in), or a .txt / .jsonl file or a folder of them."""
    tokenizer: str = "byte"
    """'byte' or the path of a tokenizer.json (Hugging Face tokenizers)."""
    seq_len: int = 256
    jsonl_field: str = "text"

    def validate(self) -> None:
        _positive("data", seq_len=self.seq_len)
        # refused here, before a run directory, the data or the model is made
        if self.source != "synthetic" and not Path(self.source).exists():
            raise FileNotFoundError(
                f"data.source = {self.source!r} does not exist; pass 'synthetic', a "
                ".txt/.md/.jsonl file or a directory of them"
            )
        if self.tokenizer != "byte" and not Path(self.tokenizer).exists():
            raise FileNotFoundError(
                f"data.tokenizer = {self.tokenizer!r} does not exist; pass 'byte', a "
                "tokenizer.json or a directory holding one"
            )
        if not self.jsonl_field:
            raise ValueError("data.jsonl_field must name a key of the JSONL records, got ''")


@dataclass(kw_only=True)
class TrainSection(_Section):
    steps: int = 200
    micro_batch: int = 8
    grad_accum: int = 1
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """auto: bf16 on a GPU that has it, else fp32."""
    checkpointing: Literal["none", "full", "selective", "auto"] = "none"
    """auto: the planner's choice for the GPU the run starts on (the fastest predicted that fits
    its memory: none, or selective or full on every block or on as few blocks as it takes);
    none without a GPU of the planner's catalog."""
    checkpoint_blocks: int | None = None
    """With checkpointing full or selective: how many blocks, the first ones, are checkpointed;
    the others keep their activations (less recompute, more memory). None: every block."""
    fp32_parts: str = ""
    """Parts that compute in fp32 while the rest runs in the compute dtype (bf16 or fp16),
    comma-separated: head (the final norm, the output product and the loss), first:N and last:N
    (the first and the last N blocks; first, last: one). '' : none. Their weights are the fp32
    master weights themselves; memfit.train.precision.apply_fp32_parts says what runs how."""
    fp32_matmul: Literal["fp32", "tf32"] = "fp32"
    """How fp32 products run (the fp32 parts', an fp32 run's, fp16's fp32 loss gradients and
    distillation's): fp32 on the CUDA cores, or tf32 on the tensor cores (inputs rounded to 10
    mantissa bits, bf16 has 7; fp32 sums), about 4x the rate on an H100: tf32 turns on
    torch.backends.cuda.matmul.allow_tf32 for the process; fp32 leaves it as it is (off unless
    the process turned it on)."""
    offload_activations: bool = False
    """Each block's input (with checkpointing full or selective), or else each tensor of at least
    1 MiB that a block saves, goes to pinned CPU memory during the forward and comes back one
    block ahead in the backward (memfit.train.offload)."""
    cuda_graphs: bool = False
    """Capture the step in a CUDA graph once and replay it (memfit.train.graphs): the host's
    launches leave the step, which then goes at the GPU's pace (small models, short sequences).
    One process, bf16 or fp32, the fused AdamW; fixed shapes."""
    optimizer: str = "adamw"
    master_weights: Literal["fp32", "none"] = "fp32"
    """fp32: the parameters are fp32 master weights (autocast casts them per matmul); none: the
    parameters are bf16 themselves (precision bf16), updated with stochastic rounding (adamw8bit),
    and so are their gradients: 4 bytes per parameter fewer."""
    """A registered optimizer (memfit.optim.OPTIMIZERS): adamw, adamw8bit (8-bit states),
    adafactor (factored second moments), sm3, sgd."""
    lr: float | None = None
    """The peak learning rate; None (or "auto"): by the model's size, 3e-3 for the tiny preset
    down to 1.5e-4 at 8B parameters (memfit.optim.default_lr)."""
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    momentum: float = 0.9
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    seed: int = 0
    device: str = "auto"
    """auto: cuda if present, else cpu."""

    def checkpointing_label(self) -> str:
        """'full', or 'full (first 24 blocks)' with checkpoint_blocks."""
        if self.checkpoint_blocks is None:
            return self.checkpointing
        return f"{self.checkpointing} (first {self.checkpoint_blocks} blocks)"

    def validate(self) -> None:
        _positive(
            "train", steps=self.steps, micro_batch=self.micro_batch, grad_accum=self.grad_accum
        )
        if self.lr is not None:
            _positive("train", lr=self.lr)
        check_between("train.min_lr_ratio", self.min_lr_ratio, 0, 1)
        if self.checkpoint_blocks is not None:
            check_at_least("train.checkpoint_blocks", self.checkpoint_blocks, 0)
            if self.checkpointing == "auto":
                raise ValueError(
                    f"train.checkpoint_blocks = {self.checkpoint_blocks} with checkpointing auto: "
                    "auto chooses the blocks; drop one of them"
                )
            if self.checkpointing == "none":
                raise ValueError(
                    f"train.checkpoint_blocks = {self.checkpoint_blocks} says how many blocks "
                    "are checkpointed: set checkpointing full or selective too"
                )
            if self.offload_activations:
                raise ValueError(
                    "train.checkpoint_blocks with offload_activations is not supported yet: "
                    "offload checkpoints every block (drop checkpoint_blocks) or none"
                )
        if self.fp32_parts:
            parts = parse_fp32_parts(self.fp32_parts)  # (refuses a malformed list)
            if self.precision == "fp32":
                raise ValueError(
                    f"train.fp32_parts = {self.fp32_parts!r} with precision fp32: every part "
                    "computes in fp32 already; drop one of them"
                )
            if self.master_weights == "none":
                raise ValueError(
                    f"train.fp32_parts = {self.fp32_parts!r} computes those parts from fp32 "
                    "master weights, and master_weights = 'none' keeps bf16 ones: drop one of them"
                )
            del parts
        for name in ("beta1", "beta2", "momentum"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"train.{name} must be in [0, 1), got {value!r}")
        for name in ("warmup_steps", "grad_clip", "weight_decay"):
            check_at_least(f"train.{name}", getattr(self, name), 0)
        if not 0 <= self.seed < 2**64:  # what the data sampler, `random` and torch all take
            raise ValueError(f"train.seed must be in [0, 2**64), got {self.seed!r}")
        check_device_spec(self.device, "train.device")
        from memfit.optim.registry import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"train.optimizer = {self.optimizer!r} is not a registered optimizer; choose one "
                f"of {', '.join(map(repr, OPTIMIZERS))}"
            )
        if self.master_weights not in ("fp32", "none"):
            raise ValueError(
                f"train.master_weights must be 'fp32' or 'none', got {self.master_weights!r}"
            )
        if self.master_weights == "none" and self.optimizer != "adamw8bit":
            raise ValueError(
                f"train.master_weights = 'none' keeps bf16 parameters, whose updates need "
                f"stochastic rounding: use it with --optimizer adamw8bit (got {self.optimizer!r})"
            )
        if self.master_weights == "none" and self.precision in ("fp32", "fp16"):
            raise ValueError(
                f"train.master_weights = 'none' keeps the parameters in bf16: it needs precision "
                f"bf16 (got {self.precision!r})"
            )
        takes = OPTIMIZERS[self.optimizer].options
        for name in ("beta1", "beta2", "momentum"):
            value, default = getattr(self, name), TrainSection.__dataclass_fields__[name].default
            if name not in takes and value != default:
                raise ValueError(
                    f"train.{name} = {value!r} does not apply to optimizer {self.optimizer!r} "
                    f"(of beta1, beta2 and momentum it takes: {', '.join(takes) or 'none'})"
                )


@dataclass(kw_only=True)
class LossScaleSection(_Section):
    """Dynamic loss scaling for fp16 (ignored in fp32 and bf16)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def validate(self) -> None:
        _positive("loss_scale", init_scale=self.init_scale, growth_interval=self.growth_interval)
        if self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"loss_scale.growth_factor must be > 1 and backoff_factor in (0, 1); "
                f"got {self.growth_factor} and {self.backoff_factor}"
            )


@dataclass(kw_only=True)
class CheckpointSection(_Section):
    out: str = ""
    """Run directory: metrics.jsonl, checkpoints/ ('' : runs/<model>-<date>-<time>)."""
    save_every: int = 0
    """Save every N optimizer steps (0: only at the end)."""
    keep: int = 2
    """How many most recent checkpoints to keep."""
    resume: bool = False
    resume_from: str = ""
    """Resume from this checkpoint instead of the newest: 'latest-valid' (the newest that passes
    verification), 'step_0000400', '400', or a checkpoint's path. Implies resume."""

    def validate(self) -> None:
        check_at_least("checkpoint.save_every", self.save_every, 0, what=" (0: at the end)")
        check_at_least("checkpoint.keep", self.keep, 1)


@dataclass(kw_only=True)
class LoRASection(_Section):
    """LoRA adapters on a frozen base (memfit.nn.lora); rank 0 trains every weight."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "all-linear"
    """Comma-separated Hugging Face layer names (q_proj, k_proj, v_proj, o_proj, gate_proj,
    up_proj, down_proj), or all-linear."""
    rslora: bool = False
    """Scale the update by alpha / sqrt(rank) instead of alpha / rank."""
    quantize: Literal["none", "nf4", "int8"] = "none"
    """QLoRA: the frozen base's linear layers stored as 4-bit NormalFloat with double-quantized
    scales (nf4) or int8 per row, dequantized for each product (memfit.nn.quant)."""

    def validate(self) -> None:
        check_at_least("lora.rank", self.rank, 0, what=" (0: no LoRA)")
        if self.quantize != "none" and not self.rank:
            raise ValueError(
                f"lora.quantize = {self.quantize!r} quantizes the frozen base of a LoRA run: "
                "set lora.rank (--lora-rank) too"
            )
        if self.rank:
            try:
                self.spec()
            except ValueError as error:
                raise ValueError(f"[lora]: {error}") from None

    def spec(self):
        """The memfit.nn.lora.LoRASpec, or None when LoRA is off."""
        if not self.rank:
            return None
        from memfit.nn.lora import LoRASpec

        targets = tuple(t.strip() for t in self.targets.split(",") if t.strip())
        return LoRASpec(
            rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=targets,
            rslora=self.rslora,
        )  # fmt: skip


@dataclass(kw_only=True)
class DistillSection(_Section):
    """Distillation from a teacher (memfit.train.distill); no teacher: plain cross-entropy."""

    teacher: str = ""
    """A Hugging Face or memfit checkpoint directory with the student's vocabulary."""
    alpha: float = 0.5
    """The distillation term's weight; 1 - alpha is the cross-entropy's."""
    temperature: float = 1.0
    kind: Literal["kl", "jsd"] = "kl"
    teacher_quantize: Literal["none", "nf4", "int8"] = "none"
    """Keep the teacher's linear layers in NF4 or int8 (its memory: 4.13 or 8 bits a weight)."""

    def validate(self) -> None:
        check_between("distill.alpha", self.alpha, 0, 1)
        if not self.temperature > 0:
            raise ValueError(f"distill.temperature must be > 0, got {self.temperature!r}")
        if self.teacher and not Path(self.teacher).is_dir():
            raise FileNotFoundError(
                f"distill.teacher = {self.teacher!r} is not a checkpoint directory"
            )


@dataclass(kw_only=True)
class DistributedSection(_Section):
    zero: Literal[0, 1, 2, 3] = 0
    offload: Literal["none", "optimizer", "params"] = "none"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of the gradient collectives: bf16 halves their bytes, fp32 sums exactly as one GPU."""
    timeout_s: float = 600.0
    """How long a collective may wait for the other ranks."""
    heartbeat_s: float = 30.0
    """End the run when a rank has not answered for this long (stopped or frozen); 0: off."""

    def validate(self) -> None:
        _positive("distributed", timeout_s=self.timeout_s)
        check_at_least("distributed.heartbeat_s", self.heartbeat_s, 0, what=" (0: off)")


@dataclass(kw_only=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    loss_scale: LossScaleSection = field(default_factory=LossScaleSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    lora: LoRASection = field(default_factory=LoRASection)
    distill: DistillSection = field(default_factory=DistillSection)

    def __post_init__(self) -> None:
        check_parallelism(
            zero=self.distributed.zero,
            offload=self.distributed.offload,
            optimizer=self.train.optimizer,
        )
        if self.train.master_weights == "none" and (
            self.distributed.zero or self.distributed.offload != "none"
        ):
            raise ValueError(
                "train.master_weights = 'none' runs on one process without --zero and --offload "
                "for now (ZeRO shards and offloads fp32 master weights)"
            )

        if self.lora.rank and (self.distributed.zero == 3 or self.distributed.offload != "none"):
            raise ValueError(
                "LoRA trains with --zero 0, 1 or 2 (one process, or data-parallel under "
                "torchrun), without --zero 3 and --offload for now: its adapters and their states "
                "are a few MB, and the frozen base is stored once in the compute dtype on each GPU"
            )
        if self.train.fp32_parts and (self.lora.rank or self.distributed.zero == 3):
            holder = "LoRA's frozen base" if self.lora.rank else "ZeRO-3's gathered parameters"
            raise ValueError(
                f"train.fp32_parts = {self.train.fp32_parts!r}: {holder} are held in the compute "
                "dtype, so those parts would compute from rounded weights; use it with full "
                "training at --zero 0, 1 or 2"
            )
        if parse_fp32_parts(self.train.fp32_parts).head and self.distill.teacher:
            raise ValueError(
                "train.fp32_parts with head and a teacher: the distillation loss computes the "
                "head's product in the compute dtype; keep first:N and last:N, drop head"
            )
        if self.lora.rank and self.train.master_weights == "none":
            raise ValueError(
                "with LoRA the frozen base is already stored in the compute dtype and the "
                "adapters keep fp32 weights: drop --master-weights none"
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        sections: dict[str, Any] = {}
        for name, values in data.items():
            section_cls = _section_class(name)
            if not isinstance(values, dict):
                raise ValueError(f"[{name}] must be a table of keys, got {values!r}")
            known = {f.name: f for f in dataclasses.fields(section_cls)}
            kwargs = {}
            for key, value in values.items():
                if key not in known:
                    raise ValueError(_unknown(f"{name}.{key}", [f"{name}.{k}" for k in known]))
                kwargs[key] = _coerce(
                    f"{name}.{key}", value, typing.get_type_hints(section_cls)[key]
                )
            sections[name] = section_cls(**kwargs)
        return cls(**sections)


def check_parallelism(
    *, zero: int, offload: str, optimizer: str = "adamw", world_size: int | None = None
) -> None:
    """The rules across sections for sharding and offload, in one place (the config, the planner's
    Strategy and the engine, once it knows the world size, all call this). Raises ValueError."""
    from memfit.optim.registry import check_sharding

    if offload == "params" and zero != 3:
        raise ValueError(
            f"--offload params keeps parameter shards in CPU memory, which needs --zero 3 "
            f"(got --zero {zero}); --offload optimizer works with any stage"
        )
    check_sharding(optimizer, zero, offload=offload, world_size=world_size)
    if world_size == 1 and zero > 0 and offload == "none":
        raise ValueError(
            f"--zero {zero} shards the training state across processes, and this run has one: "
            f"launch with `torchrun --nproc_per_node N -m memfit train --zero {zero} ...` (N "
            "GPUs), or plan it with --gpus N; on one GPU, --offload optimizer (or --zero 3 "
            "--offload params) keeps the optimizer (and the parameters) in CPU memory instead"
        )


@dataclass(frozen=True)
class Fp32Parts:
    """The parts of a model that compute in fp32 under mixed precision (`train.fp32_parts`)."""

    head: bool = False
    first: int = 0
    last: int = 0

    def blocks(self, num_layers: int) -> list[int]:
        """The indices of the fp32 blocks of a model of `num_layers` blocks (the first and the
        last may overlap). Raises ValueError when a count exceeds the blocks."""
        for name in ("first", "last"):
            if getattr(self, name) > num_layers:
                raise ValueError(
                    f"fp32 parts {name}:{getattr(self, name)}, but the model has {num_layers} "
                    "blocks"
                )
        return sorted({*range(self.first), *range(num_layers - self.last, num_layers)})

    def __bool__(self) -> bool:
        return self.head or self.first > 0 or self.last > 0

    def __str__(self) -> str:
        """The canonical spelling: 'first:2,last:1,head' ('' for none)."""
        parts = [
            f"{name}:{getattr(self, name)}" for name in ("first", "last") if getattr(self, name)
        ]
        return ",".join([*parts, *(["head"] if self.head else [])])


def parse_fp32_parts(spec: str | Fp32Parts) -> Fp32Parts:
    """'head,first:2,last:2' -> Fp32Parts(head=True, first=2, last=2); '' -> none."""
    if isinstance(spec, Fp32Parts):
        return spec
    head, counts = False, {"first": 0, "last": 0}
    for item in (t.strip() for t in spec.split(",") if t.strip()):
        name, colon, count = item.partition(":")
        if name == "head" and not colon:
            head = True
        elif name in counts and (not colon or (count.isdigit() and int(count) > 0)):
            counts[name] = max(counts[name], int(count or 1))
        elif name in ("embed", "embedding"):
            raise ValueError(
                "fp32 parts: the embedding computes nothing (its lookup copies rows of the fp32 "
                "master weights, and its gradient is summed in fp32); with first:N its rows "
                "enter the first N blocks unrounded"
            )
        else:
            raise ValueError(
                f"fp32 parts: {item!r} is not one; give head, first:N and last:N (N >= 1), "
                "comma-separated, e.g. 'head,first:1,last:1'"
            )
    return Fp32Parts(head=head, **counts)


_SECTIONS = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "loss_scale": LossScaleSection,
    "checkpoint": CheckpointSection,
    "distributed": DistributedSection,
    "lora": LoRASection,
    "distill": DistillSection,
}
_SECTION_NAMES = {cls.__name__: name for name, cls in _SECTIONS.items()}


def _section_class(name: str) -> type:
    if name not in _SECTIONS:
        raise ValueError(
            _unknown(f"[{name}]", [f"[{s}]" for s in _SECTIONS], what="config section")
        )
    return _SECTIONS[name]


def _unknown(name: str, valid: list[str], what: str = "config key") -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(valid)}"
    return f"unknown {what} {name!r}{hint}"


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Turn a TOML value or a `--set` string into the field's type, with a clear error."""
    allowed = _literal_values(hint)
    target = type(allowed[0]) if allowed else hint
    if typing.get_origin(target) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        optional = type(None) in typing.get_args(target)
        target = next(t for t in typing.get_args(target) if t is not type(None))
        if optional and (value is None or str(value).lower() in ("none", "all", "auto")):
            return None  # (`--set train.checkpoint_blocks=all` clears a file's value)
    try:
        if target is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in (
                "true",
                "1",
                "yes",
                "on",
                "false",
                "0",
                "no",
                "off",
            ):
                return value.lower() in ("true", "1", "yes", "on")
            raise ValueError
        if target is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if target is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if target is str:
            return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} = {value!r} is not a valid {target.__name__}") from None
    return value


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{str(path)!r} is not valid TOML: {error}") from None


def apply_set(data: dict[str, Any], assignment: str) -> None:
    """Apply one `section.key=value` to a config dict (values coerced later by from_dict)."""
    if "=" not in assignment or "." not in assignment.split("=", 1)[0]:
        raise ValueError(f"--set expects section.key=value, got {assignment!r}")
    dotted, value = assignment.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    _section_class(section)
    data.setdefault(section, {})[key] = value.strip()


def build_config(
    config_file: str | None = None,
    flags: dict[str, dict[str, Any]] | None = None,
    sets: list[str] | None = None,
) -> Config:
    """Merge defaults < TOML file < CLI flags < --set assignments into a validated Config."""
    data: dict[str, dict[str, Any]] = {}
    if config_file:
        for section, values in load_toml(config_file).items():
            _section_class(section)
            if not isinstance(values, dict):
                raise ValueError(f"[{section}] in {config_file!r} must be a table")
            data.setdefault(section, {}).update(values)
    for section, values in (flags or {}).items():
        data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    for assignment in sets or []:
        apply_set(data, assignment)
    return Config.from_dict(data)


def to_toml(config: Config) -> str:
    """Serialize a Config as TOML (flat sections of scalars), for run directories."""
    lines: list[str] = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:  # (an optional setting left unset: its default when read back)
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, (int, float)):
                text = repr(value)
            else:
                text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)
