"""LoRA (Hu et al. 2021): a frozen linear layer plus a trainable low-rank update,

    y = W x + b + s * B A dropout(x),    A: (r, in), B: (out, r), s = alpha / r
                                         (rsLoRA, Kalajdzievski 2023: s = alpha / sqrt(r))

B starts at zero, so an adapted model starts equal to its base. Only A and B train: the base
needs no gradient, no optimizer state and no fp32 master copy.

memfit fuses q, k and v into one projection `qkv` and gate and up into `gate_up`. Adapters are
per projection, as peft puts them on Hugging Face's separate q_proj, k_proj, ... layers: a fused
layer holds one (A, B) pair for each of its parts that is targeted, keyed by the part's Hugging
Face name, and adds each part's update to its rows of the output. A layer's update is two matrix
products: its parts' A stacked, then their B as one block-diagonal matrix whose product adds the
update to the base's output in its epilogue (`torch.addmm`). So adapters trained here are
peft's adapters (`save_peft_adapter`), and peft's load here (`load_peft_adapter`).

    spec = LoRASpec(rank=16, alpha=32, targets=("q_proj", "v_proj"))
    apply_lora(model, spec)        # wraps the targeted layers, freezes everything else
    ...train...
    save_peft_adapter(model, "out/adapter", base="path/to/Llama-3.2-1B")
    merge_lora(model)              # W += s B A, the plain layers back
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from memfit import functional as MF
from memfit.nn.linear import Linear, replace_module

# the Hugging Face names of the linear layers a Llama-family block has (peft's target_modules)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRASpec:
    """What to adapt and how. targets: Hugging Face layer names (LINEAR_NAMES), or
    ("all-linear",) for all of them (as peft's "all-linear": the output head excluded)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("all-linear",)
    rslora: bool = False
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        targets = tuple(self.targets)
        if not targets:
            raise ValueError("LoRA needs at least one target layer")
        unknown = [t for t in targets if t not in (*LINEAR_NAMES, "all-linear")]
        if unknown:
            raise ValueError(
                f"unknown LoRA target {unknown[0]!r}; choose among {', '.join(LINEAR_NAMES)} "
                "or 'all-linear'"
            )
        names = LINEAR_NAMES if "all-linear" in targets else targets
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "names", tuple(n for n in LINEAR_NAMES if n in names))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class LoRALinear(Linear):
    """A frozen `Linear` (its weight and bias, the same tensors) with LoRA adapters on some of
    its output parts. parts: (Hugging Face name, rows) of each part of the output, in order (one
    part for a plain projection; q, k, v for a fused qkv); those named in `spec.names` get an
    adapter: lora_A[name] (rank, in), lora_B[name] (rows, rank)."""

    def __init__(
        self,
        base: Linear,
        parts: list[tuple[str, int]],
        spec: LoRASpec,
        hf_modules: dict[str, str] | None = None,
    ) -> None:
        """hf_modules: each part's Hugging Face module name (model.layers.0.self_attn.q_proj),
        the names its adapters are saved under in peft's format."""
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        if sum(rows for _, rows in parts) != self.out_features:
            raise ValueError(f"parts {parts} do not add up to {self.out_features} output rows")
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.parts = list(parts)
        self.hf_modules = dict(hf_modules or {})
        self.rank, self.scale = spec.rank, spec.scale
        kw = {"device": self.weight.device, "dtype": torch.float32}
        if self.weight.dtype in (torch.float32, torch.float64):
            kw["dtype"] = self.weight.dtype
        adapted = [(name, rows) for name, rows in parts if name in spec.names]
        if not adapted:
            raise ValueError(f"none of {[n for n, _ in parts]} is a target of {spec.names}")
        self.lora_A = nn.ParameterDict(
            {
                name: nn.Parameter(torch.empty(spec.rank, self.in_features, **kw))
                for name, _ in adapted
            }
        )
        self.lora_B = nn.ParameterDict(
            {name: nn.Parameter(torch.zeros(rows, spec.rank, **kw)) for name, rows in adapted}
        )
        # one dropout mask for the input of all of a fused layer's adapters (peft, with separate
        # q, k, v layers, draws one per projection): the same expectation, correlated noise
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
        self.quant = None  # a QuantizedWeight in place of `weight` (QLoRA: `quantize`)
        self.reset_adapters()

    @torch.no_grad()
    def quantize(self, kind: str, dtype: torch.dtype, device: torch.device | None = None) -> None:
        """Replace the frozen weight by its quantized state (memfit.nn.quant, QLoRA's base) on
        `device` (default: the weight's); a bias stays, in `dtype`. The adapters stay where they
        are."""
        from memfit.nn.quant import QuantizedWeight

        if self.quant is not None:
            raise ValueError("this layer's base is already quantized")
        self.quant = QuantizedWeight(self.weight.detach().to(device), kind, dtype)
        del self.weight
        self.register_parameter("weight", None)
        if self.bias is not None:
            bias = self.bias.detach().to(device=device, dtype=dtype)
            self.bias = nn.Parameter(bias, requires_grad=False)

    @torch.no_grad()
    def reset_adapters(self, generator: torch.Generator | None = None) -> None:
        """A as nn.Linear initializes its weight (Kaiming-uniform, a = sqrt(5): peft's default),
        B zero."""
        bound = 1 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) on (r, in)
        for a in self.lora_A.values():
            if a.device.type != "meta":
                a.uniform_(-bound, bound, generator=generator)
        for b in self.lora_B.values():
            b.zero_()

    def _adapters(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(A, B) of all parts as one product: A stacks the adapted parts' A (k r, in); B is
        block-diagonal (out, k r), each adapted part's B in its rows and its rank's columns,
        zero rows for a part without an adapter. B A is every part's update at once."""
        names = [name for name, _ in self.parts if name in self.lora_A]  # (parts' order)
        a = torch.cat([self.lora_A[n] for n in names]) if len(names) > 1 else self.lora_A[names[0]]
        if len(self.parts) == 1:
            return _like(a, x), _like(self.lora_B[names[0]], x)
        blocks = [
            self.lora_B[name] if name in self.lora_B else a.new_zeros(rows, 0)
            for name, rows in self.parts
        ]
        return _like(a, x), _like(torch.block_diag(*blocks), x)

    def forward(self, x: Tensor, *, swiglu: bool = False, residual: Tensor | None = None) -> Tensor:
        """As `Linear.forward`: swiglu of the result for a fused gate/up projection, and the
        residual added. Two matrix products besides the base's, the update added in the second
        one's epilogue: y = base + s (dropout(x) A^T) B^T (exactly the base's output where B is
        zero)."""
        a, b = self._adapters(x)
        h = F.linear(self.dropout(x), a)  # (..., adapted parts x rank)
        if self.quant is not None:
            from memfit.nn.quant import quantized_linear

            base = quantized_linear(x, self.quant, self.bias)
        else:
            bias = None if self.bias is None else _like(self.bias, x)
            base = F.linear(x, _like(self.weight, x), bias)
        y = torch.addmm(
            base.reshape(-1, self.out_features), h.reshape(-1, h.shape[-1]), b.T, alpha=self.scale
        ).reshape(base.shape)
        if swiglu:
            y = MF.swiglu(y)
        return y if residual is None else residual + y

    @torch.no_grad()
    def merged_weight(self) -> Tensor:
        """W + s B A (each part's rows), in W's dtype (a quantized base: its compute dtype),
        computed in fp32."""
        if self.quant is not None:
            weight, dtype = self.quant.dequantize(torch.float32), self.quant.dtype
        else:
            weight, dtype = self.weight.float().clone(), self.weight.dtype
        at = 0
        for name, rows in self.parts:
            if name in self.lora_B:
                update = self.lora_B[name].float() @ self.lora_A[name].float()
                weight[at : at + rows] += self.scale * update
            at += rows
        return weight.to(dtype)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}, "
            f"adapters={list(self.lora_A)}"
        )


def _like(tensor: Tensor, x: Tensor) -> Tensor:
    """`tensor` for a product with x: as it is under autocast (which casts), else in x's dtype
    (an adapter in fp32 beside a bf16 base, outside autocast)."""
    return tensor if torch.is_autocast_enabled(x.device.type) else tensor.to(x.dtype)


# -- applying, merging -----------------------------------------------------------------------


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapted layers of `model`, by module path."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, spec: LoRASpec) -> dict[str, LoRALinear]:
    """Wrap each linear layer with a targeted part in a `LoRALinear` (its weights shared, not
    copied), freeze every other parameter, and remember `spec` as `model.lora_spec`. The parts
    and their names come from the family's Hugging Face layout, so a fused qkv gets adapters
    on exactly the q, k, v projections targeted. Returns the adapted layers by path."""
    from memfit.models import get_family

    if lora_layers(model):
        raise ValueError("the model already has LoRA adapters")
    layout = get_family(model.config.family).hf_layout(model)
    wrapped = {}
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    # (the layers' first draws of A leave the global RNG as it was: dropout's masks later do not
    # depend on whether the model was built on the meta device, where nothing is drawn)
    with torch.random.fork_rng(devices=cuda):
        for path, module in list(model.named_modules()):
            if type(module) is not Linear:
                continue
            hf = layout.get(f"{path}.weight", [])
            parts = [(name.rsplit(".", 2)[-2], shape[0]) for name, shape in hf]
            if not any(part in spec.names for part, _ in parts):
                continue
            modules = {
                part: name.rsplit(".", 1)[0] for (part, _), (name, _) in zip(parts, hf, strict=True)
            }
            layer = LoRALinear(module, parts, spec, modules)
            replace_module(model, path, layer)
            wrapped[path] = layer
    if not wrapped:
        raise ValueError(f"no linear layer of the model is one of the LoRA targets {spec.names}")
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    model.lora_spec = spec
    return wrapped


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer's weight (W += s B A) and put the plain layers back:
    the model then has its base's parameter names and shapes (for export or serving), every
    parameter trainable again as a freshly built model's are."""
    for path, layer in lora_layers(model).items():
        replace_module(model, path, Linear.holding(layer.merged_weight(), layer.bias))
    for param in model.parameters():
        param.requires_grad_(True)
    if hasattr(model, "lora_spec"):
        del model.lora_spec
    return model


# -- peft's format -----------------------------------------------------------------------------


def peft_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters under peft's names: base_model.model.<Hugging Face module>.lora_A.weight."""
    out = {}
    for layer in lora_layers(model).values():
        for part in layer.lora_A:
            prefix = f"base_model.model.{layer.hf_modules[part]}"
            out[f"{prefix}.lora_A.weight"] = layer.lora_A[part].detach()
            out[f"{prefix}.lora_B.weight"] = layer.lora_B[part].detach()
    return out


def save_peft_adapter(model: nn.Module, directory: str | Path, *, base: str | None = None) -> Path:
    """Write the adapters as peft does (adapter_config.json, adapter_model.safetensors), so that
    `peft.PeftModel.from_pretrained(transformers_model, directory)` loads them. `base`: the base
    model's path or hub name, recorded as base_model_name_or_path. Each file is written whole
    and then renamed into place."""
    from safetensors.torch import save_file

    spec: LoRASpec | None = getattr(model, "lora_spec", None)
    if spec is None or not lora_layers(model):
        raise ValueError("the model has no LoRA adapters to save")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    present = sorted({part for layer in lora_layers(model).values() for part in layer.lora_A})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
        "target_modules": present, "use_rslora": spec.rslora, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False,
    }  # fmt: skip
    tensors = {k: v.contiguous().cpu() for k, v in peft_state_dict(model).items()}
    for name, write in (
        (ADAPTER_WEIGHTS, lambda path: save_file(tensors, str(path), metadata={"format": "pt"})),
        (ADAPTER_CONFIG, lambda path: path.write_text(json.dumps(config, indent=2) + "\n")),
    ):
        partial = directory / f".{name}.partial"
        write(partial)
        partial.replace(directory / name)
    return directory


def read_peft_config(directory: str | Path) -> LoRASpec:
    """The LoRASpec of a peft adapter directory; ValueError for what memfit cannot apply."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"no {ADAPTER_CONFIG} in {str(directory)!r}: not a peft adapter")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}; memfit loads LORA only")
    plain = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "rank_pattern": {},
             "alpha_pattern": {}, "modules_to_save": None, "layers_to_transform": None}  # fmt: skip
    unsupported = [key for key, value in plain.items() if config.get(key) not in (None, value)]
    if unsupported:
        raise ValueError(
            f"{path}: memfit cannot apply an adapter with {', '.join(unsupported)} set"
        )
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        if targets != "all-linear":
            raise ValueError(
                f"{path}: target_modules {targets!r} is a pattern; memfit takes a list"
            )
        targets = [targets]
    # a name peft matched by its suffix (model.layers.0.self_attn.q_proj -> q_proj)
    targets = tuple(sorted({t.rsplit(".", 1)[-1] for t in targets}))
    return LoRASpec(
        rank=int(config["r"]), alpha=float(config.get("lora_alpha", 8)),
        dropout=float(config.get("lora_dropout", 0.0)), targets=targets,
        rslora=bool(config.get("use_rslora", False)),
    )  # fmt: skip


@torch.no_grad()
def load_peft_adapter(model: nn.Module, directory: str | Path) -> LoRASpec:
    """Apply the peft adapter in `directory` to `model` (a memfit model of the adapter's base):
    its layers wrapped as `apply_lora` does, then A and B read from adapter_model.safetensors.
    Raises ValueError naming missing, unexpected or mis-shaped tensors."""
    from safetensors.torch import load_file

    spec = read_peft_config(directory)
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    weights = Path(directory) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"no {ADAPTER_WEIGHTS} in {str(directory)!r}")
    found = load_file(str(weights))
    found = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
             for k, v in found.items()}  # fmt: skip
    apply_lora(model, spec)
    expected = peft_state_dict(model)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [k for k in expected if k in found and found[k].shape != expected[k].shape]
    if missing or unexpected or wrong:  # nothing half-applied: the model is as it was
        for path, layer in lora_layers(model).items():
            replace_module(model, path, Linear.holding(layer.weight, layer.bias))
        for name, param in model.named_parameters():
            param.requires_grad_(trainable[name])
        del model.lora_spec
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} tensors ({missing[0]}, ...)")
        if unexpected:
            problems.append(
                f"{len(unexpected)} tensors the model has no layer for ({unexpected[0]}, ...)"
            )
        if wrong:
            k = wrong[0]
            problems.append(
                f"{k} is {tuple(found[k].shape)}, the model's {tuple(expected[k].shape)}"
            )
        raise ValueError(
            f"the adapter in {str(directory)!r} does not fit this model: " + "; ".join(problems)
        )
    for key, tensor in expected.items():
        tensor.copy_(found[key])
    return spec
