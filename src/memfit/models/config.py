"""Model shapes: the `ModelConfig` dataclass, the built-in presets, and the reader of Hugging Face
`config.json` files for Llama-family models (Llama 2/3, Mistral, Qwen2), read from disk only.

The preset shapes are the published ones; benchmarks compare memfit against other systems on
exactly these shapes, so a change here is a change of every number in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the fields that count something: each must be an int >= 1
_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "max_seq_len",
)
# what Llama 3.1's RoPE scaling reads (memfit.ops.rotary)
LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Shapes of a Llama-family decoder.

    Attention has `num_heads` query heads and `num_kv_heads` key/value heads (GQA; MQA when 1),
    each of size `head_dim` (default hidden_size // num_heads). The MLP is SwiGLU of width
    `intermediate_size`. `rope_scaling` is Hugging Face's dict (only the "llama3" type is known).
    `sliding_window`, when set, limits each query to that many most recent keys (Mistral v0.1).
    """

    name: str = "custom"
    family: str = "llama"
    """The model family (memfit.models.FAMILIES): its model, spec and state-dict adapter."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=True)
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    init_std: float = 0.02
    attention_pattern: str | None = None
    """A sparse attention pattern for the layers `pattern_layers` names (memfit.ops.attention.
    sparse.parse: "local:512", "longformer:256:globals=0", "bigbird:128:globals=0:random=2",
    ...); None: dense causal attention."""
    pattern_layers: str = "all"
    """The layers `attention_pattern` applies to: all, even, odd (alternating with dense
    layers, as GPT-3 alternates), or a comma-separated list of layer indices."""

    def __post_init__(self) -> None:
        # every field is checked for its type too: a config.json may hold "64" or 64.5
        for key in _SIZES:
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise ValueError(
                    f"model {self.name!r}: {key} must be a positive integer, got {value!r}"
                )
        if not _is_int(self.head_dim) or self.head_dim < 0:
            raise ValueError(
                f"model {self.name!r}: head_dim must be a positive integer (0: hidden_size // "
                f"num_heads), got {self.head_dim!r}"
            )
        if self.sliding_window is not None and (
            not _is_int(self.sliding_window) or self.sliding_window < 1
        ):
            raise ValueError(
                f"model {self.name!r}: sliding_window must be a positive integer or None, got "
                f"{self.sliding_window!r}"
            )
        if self.attention_pattern is not None:
            from memfit.ops.attention.sparse import parse

            try:
                pattern = parse(self.attention_pattern)
                self.sparse_layer_indices()
            except ValueError as error:
                raise ValueError(f"model {self.name!r}: {error}") from None
            if not pattern.causal:
                raise ValueError(
                    f"model {self.name!r}: attention pattern {self.attention_pattern!r} lets "
                    "tokens see later ones; a causal language model takes causal patterns"
                )
            if self.sliding_window is not None:
                raise ValueError(
                    f"model {self.name!r} slides a window of {self.sliding_window} on every "
                    f"layer: it takes no attention pattern (got {self.attention_pattern!r})"
                )
        for key in ("rope_theta", "rms_norm_eps", "init_std"):
            value = getattr(self, key)
            if not _is_number(value) or not 0 < value < math.inf:
                raise ValueError(
                    f"model {self.name!r}: {key} must be a finite number > 0, got {value!r}"
                )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model {self.name!r}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}; grouped-query attention shares each key/value "
                "head among an equal number of query heads"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads != 0:
                raise ValueError(
                    f"model {self.name!r}: hidden_size={self.hidden_size} is not divisible by "
                    f"num_heads={self.num_heads}; set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"model {self.name!r}: head_dim must be even for RoPE, got {self.head_dim}"
            )
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise ValueError(
                    f"model {self.name!r}: rope_scaling must be a dict or None, got "
                    f"{self.rope_scaling!r}"
                )
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ("llama3", "default"):
                raise ValueError(
                    f"model {self.name!r}: rope_scaling type {rope_type!r} is not supported; "
                    "known: 'llama3' (Llama 3.1+) or none"
                )
            needed = LLAMA3_ROPE_KEYS if rope_type == "llama3" else ()
            bad = {key: self.rope_scaling.get(key) for key in needed}
            bad = {key: value for key, value in bad.items() if not _is_number(value)}
            if bad:
                raise ValueError(
                    f"model {self.name!r}: llama3 rope_scaling needs a number for each of "
                    f"{', '.join(needed)}; got {bad}"
                )

    def layer_window(self, index: int) -> int | None:
        """Layer `index`'s sliding window: the model's, or a local attention pattern's (a
        causal band of W tokens, `local:W`) on the layers it applies to; None: none."""
        if self.sliding_window is not None:
            return self.sliding_window
        if index in self.sparse_layer_indices():
            from memfit.ops.attention.sparse import parse

            return parse(self.attention_pattern).band
        return None

    @property
    def some_window(self) -> int | None:
        """A window some layer slides (choosing the attention kernel: SDPA has none), or None."""
        return next(filter(None, map(self.layer_window, range(self.num_layers))), None)

    @property
    def attention_window(self) -> int | None:
        """The window every layer shares (a static KV cache's masks), None if they differ or
        there is none."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    def sparse_layer_indices(self) -> tuple[int, ...]:
        """The layers whose attention follows `attention_pattern` (none without one)."""
        if self.attention_pattern is None:
            return ()
        which = self.pattern_layers.strip()
        if which == "all":
            return tuple(range(self.num_layers))
        if which in ("even", "odd"):
            return tuple(range(which == "odd", self.num_layers, 2))
        try:
            layers = tuple(sorted({int(i) for i in which.split(",") if i.strip()}))
        except ValueError:
            layers = ()
        if not layers or not all(0 <= i < self.num_layers for i in layers):
            raise ValueError(
                f"pattern_layers {self.pattern_layers!r}: all, even, odd or layer indices in "
                f"[0, {self.num_layers})"
            )
        return layers

    @functools.cached_property
    def spec(self):
        """The family's spec (parameters, FLOPs, activation bytes), which the planner reads."""
        from memfit.models import get_family

        return get_family(self.family).spec(self)

    @property
    def num_params(self) -> int:
        """Exact parameter count (embeddings included, tied ones counted once)."""
        return self.spec.num_params

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training FLOPs per token (the family's spec)."""
        return self.spec.flops_per_token(seq_len, causal=causal)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# Llama 3.2's RoPE: llama3 scaling of an 8k-token original context (1B and 3B alike)
LLAMA_3_2_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, ModelConfig] = {
    # A CPU demo: learns the built-in synthetic corpus in about two minutes on two cores.
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=258,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=352,
        max_seq_len=512,
    ),
    # 953.2M parameters: the 1B shape of the anchors (untied, MHA).
    "llama-1b": ModelConfig(
        name="llama-1b",
        vocab_size=32000,
        hidden_size=2048,
        num_layers=16,
        num_heads=16,
        num_kv_heads=16,
        intermediate_size=5632,
        max_seq_len=8192,
    ),
    "llama-2-7b": ModelConfig(
        name="llama-2-7b",
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        intermediate_size=11008,
        max_seq_len=4096,
    ),
    "llama-2-13b": ModelConfig(
        name="llama-2-13b",
        vocab_size=32000,
        hidden_size=5120,
        num_layers=40,
        num_heads=40,
        num_kv_heads=40,
        intermediate_size=13824,
        max_seq_len=4096,
    ),
    # Llama 3.2 1B: 1.24B parameters, tied embeddings, 8 kv heads of 64, llama3 RoPE scaling.
    "llama-3.2-1b": ModelConfig(
        name="llama-3.2-1b",
        vocab_size=128256,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=8192,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=LLAMA_3_2_ROPE_SCALING,
        tie_embeddings=True,
    ),
    # Llama 3.2 3B: 3.21B parameters, tied embeddings, 8 kv heads of 128, llama3 RoPE scaling.
    "llama-3.2-3b": ModelConfig(
        name="llama-3.2-3b",
        vocab_size=128256,
        hidden_size=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        intermediate_size=8192,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=LLAMA_3_2_ROPE_SCALING,
        tie_embeddings=True,
    ),
    "llama-3-8b": ModelConfig(
        name="llama-3-8b",
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama-3-70b": ModelConfig(
        name="llama-3-70b",
        vocab_size=128256,
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        intermediate_size=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # Mistral 7B v0.1: sliding window of 4096 tokens.
    "mistral-7b": ModelConfig(
        name="mistral-7b",
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        max_seq_len=32768,
        sliding_window=4096,
    ),
    "qwen2.5-7b": ModelConfig(
        name="qwen2.5-7b",
        vocab_size=152064,
        hidden_size=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        intermediate_size=18944,
        max_seq_len=131072,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        qkv_bias=True,
    ),
}

# Hugging Face `model_type`s whose config.json maps onto this decoder.
SUPPORTED_HF_TYPES = ("llama", "mistral", "qwen2")


def from_hf_config(path: str | Path) -> ModelConfig:
    """Read a Hugging Face `config.json` (or a directory holding one) of a Llama-family model."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face config.json at {str(path)!r}")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(hf, dict):
        raise ValueError(
            f"{str(path)!r} holds a JSON {type(hf).__name__}; a Hugging Face config.json is an "
            "object of keys (model_type, hidden_size, ...)"
        )
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_HF_TYPES:
        raise ValueError(
            f"{str(path)!r} describes model_type={model_type!r}, which memfit does not support; "
            f"supported: {', '.join(SUPPORTED_HF_TYPES)} (Llama-family decoders)"
        )
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
    ):
        if key not in hf:
            raise ValueError(
                f"{str(path)!r} lacks the key {key!r} that a {model_type} config must have"
            )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"{str(path)!r}: hidden_act={hf['hidden_act']!r} is not supported (SwiGLU needs 'silu')"
        )
    try:
        return _from_hf_dict(hf, path, model_type)
    except ValueError as error:  # the value of a key that ModelConfig refuses
        raise ValueError(f"{str(path)!r}: {error}") from None


def to_hf_config(config: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """A Hugging Face config.json for `config`: Qwen2 with qkv biases (its output projection has
    none, unlike Llama's attention_bias; its window, if any, on every layer), Mistral with a
    sliding window, Llama otherwise."""
    model_type, arch = "llama", "LlamaForCausalLM"
    if config.attention_pattern is not None:
        # a local window on every layer is Mistral's sliding window; nothing else has an
        # equivalent in these configs
        window = config.attention_window
        if window is None:
            raise ValueError(
                f"model {config.name!r} attends with the sparse pattern "
                f"{config.attention_pattern!r} on layers {config.pattern_layers}: a Hugging Face "
                "Llama, Mistral or Qwen2 config has no equivalent (a local:W pattern on every "
                "layer exports as Mistral's sliding window)"
            )
        config = dataclasses.replace(config, attention_pattern=None, sliding_window=window)
    if config.qkv_bias:
        model_type, arch = "qwen2", "Qwen2ForCausalLM"
    elif config.sliding_window is not None:
        model_type, arch = "mistral", "MistralForCausalLM"
    hf: dict[str, Any] = {
        "architectures": [arch], "model_type": model_type, "hidden_act": "silu",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim or config.hidden_size // config.num_heads,
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std, "torch_dtype": dtype,
        "bos_token_id": None, "eos_token_id": None,
    }  # fmt: skip
    if config.rope_scaling is not None:
        hf["rope_scaling"] = dict(config.rope_scaling)
    if model_type == "llama":
        hf["attention_bias"] = False
    if model_type == "mistral":
        hf["sliding_window"] = config.sliding_window
    if model_type == "qwen2":
        hf["use_sliding_window"] = config.sliding_window is not None
        if config.sliding_window is not None:
            hf["sliding_window"] = config.sliding_window
            hf["max_window_layers"] = 0  # (layers from this index on slide: all of them)
    return hf


def _name_of(path: Path) -> str:
    """A config file's model name: its directory's for a config.json (a checkpoint's, or
    ./config.json's: the working directory's), else the file's name less .json."""
    if path.name == "config.json":
        return path.resolve().parent.name or "config"
    return path.name.removesuffix(".json")


def _from_hf_dict(hf: dict[str, Any], path: Path, model_type: str) -> ModelConfig:
    def number(key: str, value: Any) -> float:
        if not _is_number(value):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)

    num_heads = hf["num_attention_heads"]
    sliding_window = hf.get("sliding_window") if model_type == "mistral" else None
    if model_type == "qwen2" and hf.get("use_sliding_window"):
        sliding_window = hf.get("sliding_window")
    rope_parameters = hf.get("rope_parameters")
    rope_parameters = rope_parameters if isinstance(rope_parameters, dict) else {}
    return ModelConfig(
        name=str(hf.get("_name_or_path") or _name_of(path)),
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        intermediate_size=hf["intermediate_size"],
        head_dim=hf.get("head_dim") or 0,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=number(
            "rope_theta", hf.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        ),
        rope_scaling=_rope_scaling(hf),
        rms_norm_eps=number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        sliding_window=sliding_window,
        init_std=number("initializer_range", hf.get("initializer_range", 0.02)),
    )


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be an object of keys, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return None
    return {k: v for k, v in scaling.items() if k != "rope_theta"}


def load_model_config(spec: str) -> ModelConfig:
    """A preset name (see `PRESETS`) or a path to a Hugging Face config.json (or its directory)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.suffix == ".json" or path.is_dir() or path.exists():
        return from_hf_config(path)
    close = difflib.get_close_matches(spec, PRESETS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown model {spec!r}{hint} Known presets: {', '.join(PRESETS)}; "
        "or give the path of a Hugging Face config.json"
    )


def check_seq_len(
    model: ModelConfig,
    seq_len: int,
    name: str = "--seq-len",
    error: type[ValueError] = ValueError,
) -> None:
    """Refuse a training sequence length outside [1, model.max_seq_len], raising `error` (a
    ValueError) that names `name`, the value and the model's limit. The training engine, `memfit
    plan` and the planner's search all call this, so that what the planner says fits is what
    `memfit train` runs."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise error(f"{name} must be a positive integer, got {seq_len!r}")
    if seq_len > model.max_seq_len:
        raise error(
            f"{name} {seq_len} exceeds model {model.name!r}: its max_seq_len is {model.max_seq_len}"
        )


def format_params(count: int) -> str:
    """953_200_000 -> '953.2M'."""
    if count >= 1e9:
        return f"{count / 1e9:.2f}B"
    if count >= 1e6:
        return f"{count / 1e6:.1f}M"
    return f"{count / 1e3:.1f}K" if count >= 1e3 else str(count)
