"""Loading pretrained weights for inference: a Hugging Face checkpoint directory (Llama, Mistral,
Qwen2) or a memfit training checkpoint, straight into the dtype and onto the device asked for.

    model, info = load_pretrained("path/to/Llama-3.1-8B-Instruct", device="cuda")

Algorithm:
1. Read the shapes (config.json, or a memfit checkpoint's meta.json) and build the model on the
   meta device: every tensor has its shape and no memory.
2. Open the safetensors files (model.safetensors, or the shards model.safetensors.index.json
   names) and check each tensor's name and shape against the model from the files' headers
   alone. A checkpoint from another model, or a partial download, fails here with every
   problem named, before any weights are read.
3. Per model tensor: read its parts (q, k, v of a layer; gate, up; or one tensor), cast each to
   `dtype`, concatenate (memfit's fused qkv and gate_up), move to `device`. Then assign them
   all into the module (`load_state_dict(assign=True)`), which replaces the meta tensors.
   Peak memory is the model in `dtype` plus one fused tensor in transit; there is never a
   float32 copy of the whole model (8B parameters in bf16 need 16 GB, not 32 GB first).
4. Read generation_config.json, tokenizer.json and tokenizer_config.json (or the tokenizer a
   memfit checkpoint names) into `PretrainedInfo`.

Cautions: the Llama model holds no buffers at all: RoPE's cos and sin are computed in each
forward from the token positions (`Llama.forward`), so nothing is left to initialize after
step 3. A family that adds non-persistent buffers (which no checkpoint holds) must make them
here; `_check_materialized` refuses a model with a meta tensor left rather than return it.
Only safetensors are read: pickled `.bin` files can run code when loaded. Quantized weights
are refused, except memfit's own int8/int4 checkpoints (memfit.models.quantized), which are
read as stored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors import safe_open

from memfit.models.config import ModelConfig, from_hf_config
from memfit.models.quantized import load_quantized_weights, quantization_of

if TYPE_CHECKING:
    from memfit.train.data import Tokenizer

logger = logging.getLogger(__name__)

_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names of the dtypes memfit casts


@dataclass(frozen=True)
class GenerationDefaults:
    """A checkpoint's generation_config.json: the tokens that end a reply and how its authors
    sample. A field the file does not set is None (do_sample: False, as in transformers)."""

    eos_token_ids: tuple[int, ...] = ()
    """Every token that ends generation (Llama 3 Instruct: end_of_text, eom and eot)."""
    bos_token_id: int | None = None
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    def sampling_params(self, **overrides: Any):
        """memfit `SamplingParams` that sample as transformers would with this file: greedy
        unless `do_sample`, else its temperature, top_k and top_p, an unset one taking
        transformers' default (1.0, 50, 1.0), min_p where set; a repetition_penalty applies
        in both (as in transformers); stopping at `eos_token_ids`. `overrides` (any
        SamplingParams field) win."""
        from memfit.inference.sampling_params import SamplingParams

        fields: dict[str, Any] = {"stop_token_ids": self.eos_token_ids}
        if self.do_sample:
            fields["temperature"] = 1.0 if self.temperature is None else self.temperature
            fields["top_k"] = 50 if self.top_k is None else self.top_k
            fields["top_p"] = 1.0 if self.top_p is None else self.top_p
            if self.min_p is not None:
                fields["min_p"] = self.min_p
        if self.repetition_penalty is not None:
            fields["repetition_penalty"] = self.repetition_penalty
        if self.max_new_tokens is not None:
            fields["max_tokens"] = self.max_new_tokens
        return SamplingParams(**(fields | overrides))


class PretrainedTokenizer:
    """A checkpoint's tokenizer.json (the `tokenizers` library) with the special tokens its
    tokenizer_config.json names. It has what memfit's `Tokenizer` protocol asks
    (memfit.train.data), so generation takes it as it takes the training tokenizers.

    `encode` adds no special tokens unless asked (a chat template or the caller places BOS);
    `decode` skips them. `eos_id` is the tokenizer's own end token; a chat model may stop at
    more (`GenerationDefaults.eos_token_ids`)."""

    def __init__(self, backend: Any, *, name: str, bos_id: int | None, eos_id: int | None) -> None:
        self.backend = backend  # a tokenizers.Tokenizer, for whatever else a caller needs
        self.name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_id

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(token) for token in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"PretrainedTokenizer({self.name!r}, vocab_size={self.vocab_size})"


@dataclass(frozen=True)
class PretrainedInfo:
    """What came with the weights. `path` is the directory they were read from (a memfit run
    directory resolves to its newest complete checkpoint); `attention` the backend the model
    runs (`auto` resolved); `tokenizer` None where the directory has none; `step` the training
    step of a memfit checkpoint."""

    path: Path
    format: Literal["huggingface", "memfit"]
    config: ModelConfig
    dtype: torch.dtype
    attention: str
    generation: GenerationDefaults
    tokenizer: Tokenizer | None
    chat_template: str | None = None
    step: int | None = None
    lora: Any = None
    """The memfit.nn.lora.LoRASpec a memfit LoRA run trained with (its adapters are merged
    into the weights returned), else None."""
    quantize: str | None = None
    """'int8' or 'int4' for a quantized checkpoint (memfit.models.quantized), else None."""


def load_pretrained(
    path: str | Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    attention: str = "auto",
    prepare: Callable[[torch.nn.Module], None] | None = None,
    on_block: Callable[[torch.nn.Module, int], None] | None = None,
    config_changes: dict[str, Any] | None = None,
) -> tuple[torch.nn.Module, PretrainedInfo]:
    """The model in `path`, in eval mode, its weights in `dtype` on `device`, and its info.
    `config_changes`: ModelConfig fields that do not change the weights, set on a Hugging Face
    checkpoint's config (a sparse attention pattern: `attention_pattern`, `pattern_layers`).

    For a Hugging Face checkpoint, `prepare(model)` is called on the model while it is still on
    the meta device (before any weight is read), and with `on_block` the blocks' weights are
    read one block at a time, `on_block(model, index)` called as soon as block `index`'s are in
    place (QLoRA quantizes each block there: the model is never in `dtype` whole on `device`).
    Tensors that `prepare` adds and no checkpoint holds must be made by `on_block`.

    `path` is a Hugging Face checkpoint directory (config.json and safetensors weights) or a
    memfit training checkpoint (a step_* directory, or a run directory: its latest checkpoint).
    `attention` is a backend name (memfit.functional.resolve_attention; `auto` picks for
    `device` and `dtype`). Raises FileNotFoundError for what is absent and ValueError for what
    does not fit, naming it, and memfit.train.checkpoint.CheckpointError for a partial memfit
    checkpoint; nothing is returned half-loaded."""
    from memfit.train.checkpoint import CheckpointError, find_checkpoint

    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {str(directory)!r}")
    if dtype not in _PRECISION:
        raise ValueError(
            f"dtype {dtype} is not one memfit runs models in; choose torch.bfloat16, "
            "torch.float16 or torch.float32"
        )
    device = torch.device(device)
    if (directory / "config.json").is_file():
        return _load_huggingface(
            directory, device, dtype, attention, prepare, on_block, config_changes or {}
        )
    if prepare is not None or on_block is not None or config_changes:
        raise ValueError(f"{str(directory)!r} is no Hugging Face checkpoint (no config.json)")
    checkpoint = find_checkpoint(directory)
    if checkpoint is not None:
        try:
            return _load_memfit(checkpoint, device, dtype, attention)
        except CheckpointError as error:
            if checkpoint == directory:
                raise
            raise CheckpointError(f"{error}{_earlier_weights(checkpoint)}") from None
    hint = (
        "; its checkpoints/ holds no complete checkpoint"
        if (directory / "checkpoints").is_dir()
        else ""
    )
    raise FileNotFoundError(
        f"{str(directory)!r} has no config.json (a Hugging Face checkpoint) and is no memfit "
        f"training checkpoint (meta.json, or a run directory with checkpoints/){hint}"
    )


def _earlier_weights(checkpoint: Path) -> str:
    """'; ... pass RUN/checkpoints/step_N': the newest checkpoint of the run before `checkpoint`
    whose weights pass verification, for an error about `checkpoint`; '' if there is none."""
    from memfit.train.checkpoint import CheckpointError, complete_checkpoints, read_meta

    for earlier in reversed(complete_checkpoints(checkpoint.parent)):
        if earlier.name >= checkpoint.name:
            continue
        try:
            read_meta(earlier)
        except CheckpointError:
            continue
        return f"; the newest earlier checkpoint whose weights verify is {str(earlier)!r}: pass it"
    return ""


def check_tensor_shapes(
    expected: Mapping[str, Sequence[int]],
    found: Mapping[str, Sequence[int]],
    *,
    source: str,
    target: str,
    ignore: Callable[[str], bool] = lambda name: False,
) -> None:
    """Raise ValueError naming the tensors of `expected` (name -> shape) that `found` lacks,
    those `found` has beyond them (bar the `ignore`d), and each shape that differs."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(name for name in set(found) - set(expected) if not ignore(name))
    mismatched = sorted(
        name for name in set(expected) & set(found) if tuple(found[name]) != tuple(expected[name])
    )
    if not (missing or unexpected or mismatched):
        return
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_first(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {_first(unexpected)}")
    for name in mismatched[:5]:
        problems.append(
            f"{name} has shape {tuple(found[name])}, the model expects {tuple(expected[name])}"
        )
    if len(mismatched) > 5:
        problems.append(f"and {len(mismatched) - 5} more shape mismatches")
    raise ValueError(
        f"{source} do not fit {target}: " + "; ".join(problems) + ". Are the weights and the "
        "config from the same model, and is the download complete?"
    )


def _first(names: list[str], count: int = 5) -> str:
    more = f" and {len(names) - count} more" if len(names) > count else ""
    return ", ".join(names[:count]) + more


# -- Hugging Face ----------------------------------------------------------------------------


def _load_huggingface(
    directory: Path, device: torch.device, dtype: torch.dtype, attention: str,
    prepare: Callable[[torch.nn.Module], None] | None = None,
    on_block: Callable[[torch.nn.Module, int], None] | None = None,
    config_changes: dict[str, Any] | None = None,
) -> tuple[torch.nn.Module, PretrainedInfo]:  # fmt: skip
    from memfit.models import get_family

    config = from_hf_config(directory)
    if config_changes:
        config = dataclasses.replace(config, **config_changes)
    hf_config = json.loads((directory / "config.json").read_text())
    quantization = quantization_of(hf_config)
    _check_causal_lm(hf_config, directory, quantized=quantization is not None)
    generation, tokenizer, chat_template = _read_generation_and_tokenizer(directory, hf_config)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer in {str(directory)!r} has {tokenizer.vocab_size} tokens but the model "
            f"only {config.vocab_size} embeddings; are they from the same model?"
        )
    model, backend = _meta_model(config, device, dtype, attention)
    family = get_family(config.family)
    if quantization is not None:  # memfit's own quantized checkpoint (memfit.models.quantized)
        if prepare is not None:
            raise ValueError(
                f"{str(directory)!r} holds {quantization.get('kind')}-quantized weights, which "
                "load for inference only; train (LoRA, QLoRA) from a float checkpoint"
            )
        load_quantized_weights(model, directory, quantization, device, dtype)
        _check_materialized(model)
        return model.eval(), PretrainedInfo(
            path=directory, format="huggingface", config=config, dtype=dtype, attention=backend,
            generation=generation, tokenizer=tokenizer, chat_template=chat_template,
            quantize=quantization["kind"],
        )  # fmt: skip
    layout = family.hf_layout(model)
    if prepare is not None:
        prepare(model)
    _materialize(
        model,
        _safetensors_files(directory),
        layout,
        lambda found: family.check_hf_shapes(
            model, found, source=f"the weights in {str(directory)!r}"
        ),
        device,
        dtype,
        on_block,
    )
    info = PretrainedInfo(
        path=directory,
        format="huggingface",
        config=config,
        dtype=dtype,
        attention=backend,
        generation=generation,
        tokenizer=tokenizer,
        chat_template=chat_template,
    )
    return model, info


def _check_causal_lm(hf_config: dict[str, Any], directory: Path, quantized: bool = False) -> None:
    """from_hf_config checks the model_type; a classifier or reward model shares it but not the
    output layer, and quantized weights are no float tensors to cast."""
    architectures = hf_config.get("architectures") or []
    if architectures and not any(name.endswith("ForCausalLM") for name in architectures):
        raise ValueError(
            f"{str(directory / 'config.json')!r} describes {', '.join(architectures)}; memfit "
            "loads causal language models only (LlamaForCausalLM, MistralForCausalLM, "
            "Qwen2ForCausalLM)"
        )
    quantization = hf_config.get("quantization_config")
    if quantization and not quantized:
        raise ValueError(
            f"{str(directory)!r} holds quantized weights "
            f"({quantization.get('quant_method', 'unknown method')}); memfit loads float "
            "weights (fp32, fp16, bf16) and its own int8/int4 checkpoints (memfit export "
            "--quantize) only"
        )


def _safetensors_files(directory: Path) -> list[Path]:
    """The sharded files the index names, or model.safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(
                f"{str(index)!r} is not a safetensors index (JSON with a 'weight_map' of tensor "
                f"names to files): {error!r}"
            ) from None
        absent = [shard for shard in shards if not (directory / shard).is_file()]
        if absent:
            raise FileNotFoundError(
                f"{str(index)!r} names {len(shards)} shard(s) and {len(absent)} of them are "
                f"not in the directory: {_first(absent)}; was the download interrupted?"
            )
        return [directory / shard for shard in shards]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    pickled = sorted(p.name for p in directory.glob("*.bin")) + sorted(
        p.name for p in directory.glob("*.pt*")
    )
    hint = (
        f"; it has {_first(pickled)}, which memfit does not read (a pickle runs code when "
        "loaded): convert them with transformers' save_pretrained, which writes safetensors"
        if pickled
        else ""
    )
    raise FileNotFoundError(
        f"{str(directory)!r} has no weights: neither model.safetensors nor "
        f"model.safetensors.index.json with its shards{hint}"
    )


# -- memfit training checkpoints -------------------------------------------------------------


def _load_memfit(
    checkpoint: Path, device: torch.device, dtype: torch.dtype, attention: str
) -> tuple[torch.nn.Module, PretrainedInfo]:
    """A checkpoint written by memfit.train.checkpoint: meta.json holds the ModelConfig, and
    model.safetensors the fp32 master weights under memfit's own names (nothing to fuse)."""
    from memfit.train.checkpoint import read_meta
    from memfit.train.data import load_tokenizer

    meta = read_meta(checkpoint)  # CheckpointError when partial or corrupt
    try:
        config = ModelConfig(**meta["model"])
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{str(checkpoint / 'meta.json')!r} holds no model config memfit reads: {error}"
        ) from None
    model, backend = _meta_model(config, device, dtype, attention)
    lora = _lora_of_run(meta, checkpoint)
    if lora == "quantized":  # a QLoRA run: its quantized base and its adapters, merged
        model, lora = _load_qlora(model, checkpoint, meta, device, dtype)
    else:
        if lora is not None:  # a LoRA run's weights: its base and adapters, merged once loaded
            from memfit.nn.lora import apply_lora

            apply_lora(model, lora)
        expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        _materialize(
            model,
            [checkpoint / "model.safetensors"],
            {name: [(name, shape)] for name, shape in expected.items()},
            lambda found: check_tensor_shapes(
                expected,
                found,
                source=f"the weights in {str(checkpoint)!r}",
                target=f"model {config.name!r} of its meta.json",
            ),
            device,
            dtype,
        )
        if lora is not None:
            from memfit.nn.lora import merge_lora

            merge_lora(model)
            model.requires_grad_(False)
    try:
        tokenizer = load_tokenizer(meta["tokenizer"])
    except FileNotFoundError as error:  # trained from a tokenizer.json since moved
        logger.warning("%s; the model loads without a tokenizer", error)
        tokenizer = None
    generation = GenerationDefaults(
        eos_token_ids=(tokenizer.eos_id,) if tokenizer is not None else (),
        bos_token_id=tokenizer.bos_id if tokenizer is not None else None,
    )
    info = PretrainedInfo(
        path=checkpoint,
        format="memfit",
        config=config,
        dtype=dtype,
        attention=backend,
        generation=generation,
        tokenizer=tokenizer,
        step=meta.get("step"),
        lora=lora,
    )
    return model, info


@torch.no_grad()
def _load_qlora(model, checkpoint: Path, meta: dict[str, Any], device, dtype):
    """A QLoRA run's model (`model`: its meta-device skeleton) with its quantized base and its
    adapters read from the checkpoint, the adapters merged and every weight dequantized to
    `dtype`: a plain model, as a LoRA run's loads. Made in CPU memory, then moved to `device`."""
    from safetensors.torch import load_file

    from memfit.config import LoRASection
    from memfit.nn.lora import apply_lora, merge_lora
    from memfit.nn.quant import dequantize_model, quantize_model

    section = LoRASection(**meta["lora"])
    spec = section.spec()
    model.to(dtype)
    model.to_empty(device="cpu")  # (every value is read below)
    apply_lora(model, spec)
    quantize_model(model, section.quantize, dtype=dtype)  # the buffers' shapes and kinds
    weights = load_file(str(checkpoint / "model.safetensors"))
    expected = model.state_dict()
    check_tensor_shapes(
        {name: tuple(t.shape) for name, t in expected.items()},
        {name: tuple(t.shape) for name, t in weights.items()},
        source=f"the weights in {str(checkpoint)!r}",
        target=f"the QLoRA model of its meta.json ({section.quantize}, rank {spec.rank})",
    )
    for name, tensor in expected.items():
        tensor.copy_(weights[name])
    del weights
    merge_lora(model)
    dequantize_model(model)
    model.requires_grad_(False)
    bad = next((n for n, p in model.named_parameters() if not _all_finite(p)), None)
    if bad is not None:
        raise ValueError(
            f"{bad!r} of {str(checkpoint)!r} holds NaN or inf once merged and dequantized; use "
            "an earlier checkpoint"
        )
    return model.to(device), spec


def _lora_of_run(meta: dict[str, Any], checkpoint: Path):
    """The LoRASpec a memfit checkpoint's weights were trained with (meta.json's "lora", which
    verification covers), "quantized" for a QLoRA run, or None."""
    from memfit.config import LoRASection

    section = meta.get("lora")
    if not section or not section.get("rank"):
        return None
    if section.get("quantize", "none") != "none":
        return "quantized"
    try:
        return LoRASection(**section).spec()
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{str(checkpoint / 'meta.json')!r}: its LoRA settings are not memfit's: {error}"
        ) from None


# -- the shared path: meta model -> checked headers -> tensors in dtype on device ------------


def _meta_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, attention: str
) -> tuple[torch.nn.Module, str]:
    from memfit.functional import resolve_attention
    from memfit.models import build_model

    backend = resolve_attention(
        attention,
        device,
        precision=_PRECISION[dtype],
        head_dim=config.head_dim,
        window=config.some_window,
    )
    return build_model(config, device="meta", attention=backend), backend


def _materialize(
    model: torch.nn.Module,
    files: list[Path],
    layout: Mapping[str, Sequence[tuple[str, Sequence[int]]]],
    check: Callable[[dict[str, tuple[int, ...]]], None],
    device: torch.device,
    dtype: torch.dtype,
    on_block: Callable[[torch.nn.Module, int], None] | None = None,
) -> None:
    """Fill the meta-device `model` from `files`: `layout` maps each model tensor to the file
    tensors it concatenates along dim 0; `check(shapes of every file tensor)` raises before any
    is read. With `on_block`, the tensors outside the blocks are put in place first, then each
    block's, `on_block(model, index)` called after each block."""
    start = time.perf_counter()
    with ExitStack() as stack:
        handles, shapes, dtypes, file_of = {}, {}, {}, {}
        for file in files:
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as error:  # safetensors raises its own types for corrupt headers
                raise ValueError(f"cannot read {str(file)!r} as safetensors: {error}") from None
            for name in handle.keys():
                header = handle.get_slice(name)  # reads the header, not the data
                handles[name], file_of[name] = handle, file
                shapes[name] = tuple(header.get_shape())
                dtypes[name] = header.get_dtype()
        check(shapes)
        not_float = [
            f"{hf} ({dtypes[hf]})"
            for parts in layout.values()
            for hf, _ in parts
            if dtypes[hf] not in _FLOAT_DTYPES
        ]
        if not_float:
            raise ValueError(
                f"tensors stored in a non-float dtype: {_first(not_float)}; memfit loads float "
                "weights (fp32, fp16, bf16) only, not quantized ones"
            )
        nbytes = 0

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            state = {}
            for name in names:
                parts = layout[name]
                # cast part by part before concatenating: the fused tensor exists only in `dtype`
                tensors = [handles[hf].get_tensor(hf).to(dtype) for hf, _ in parts]
                fused = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
                state[name] = fused.to(device)
                if not _all_finite(state[name]):  # on the device: fast where it is a GPU
                    _refuse_non_finite(parts, tensors, handles, file_of, dtype)
            return state

        if on_block is None:
            state = read(list(layout))
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            model.load_state_dict(state, assign=True)  # the meta tensors replaced, not copied into
        else:
            blocks: dict[int, list[str]] = {}
            for name in layout:
                index = _block_index(name)
                blocks.setdefault(-1 if index is None else index, []).append(name)
            for index in sorted(blocks):
                state = read(blocks[index])
                nbytes += sum(t.numel() * t.element_size() for t in state.values())
                unexpected = model.load_state_dict(state, assign=True, strict=False).unexpected_keys
                if unexpected:  # (a `prepare` hook that renamed what the layout names)
                    raise RuntimeError(
                        f"the model has no tensors {_first(unexpected)} that the checkpoint "
                        "layout names: did load_pretrained's prepare hook rename them?"
                    )
                del state
                if index >= 0:
                    on_block(model, index)
    _check_materialized(model)
    model.eval()
    seconds = time.perf_counter() - start
    logger.info(
        "loaded %d tensors (%.2f GB in %s) from %d file(s) onto %s in %.1f s (%.2f GB/s)",
        len(layout),
        nbytes / 1e9,
        dtype,
        len(files),
        device,
        seconds,
        nbytes / 1e9 / max(seconds, 1e-9),
    )


def _block_index(name: str) -> int | None:
    """3 for "layers.3.mlp.down.weight"; None for a tensor outside the blocks."""
    head, _, rest = name.partition(".")
    index = rest.partition(".")[0]
    return int(index) if head == "layers" and index.isdigit() else None


def _all_finite(tensor: torch.Tensor, chunk: int = 2**24) -> bool:
    """torch.isfinite(tensor).all(), chunk by chunk so that its bool temporary stays small
    (16 MiB) beside the weights being loaded; one synchronization."""
    if tensor.numel() == 0:
        return True
    parts = tensor.reshape(-1).split(chunk)
    return bool(torch.stack([torch.isfinite(part).all() for part in parts]).all())


def _refuse_non_finite(
    parts: Sequence[tuple[str, Sequence[int]]],
    tensors: list[torch.Tensor],
    handles: dict[str, Any],
    file_of: dict[str, Path],
    dtype: torch.dtype,
) -> None:
    """Raise ValueError naming the file tensor of `parts` that holds NaN or inf once cast to
    `dtype` (`tensors`), and whether the file holds it or the cast made it (an overflow)."""
    name = next(hf for (hf, _), t in zip(parts, tensors, strict=True) if not _all_finite(t))
    where = f"{name!r} in {str(file_of[name])!r}"
    if _all_finite(handles[name].get_tensor(name)):
        raise ValueError(
            f"{where} overflows {dtype} (values beyond its range); load the model in a dtype "
            "with the range of the stored one (fp32 or bf16)"
        )
    raise ValueError(
        f"{where} holds NaN or inf: the checkpoint is corrupt or was saved from a run that "
        "diverged; use an earlier checkpoint"
    )


def _check_materialized(model: torch.nn.Module) -> None:
    left = [
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if tensor.is_meta
    ]
    if left:
        raise RuntimeError(
            f"after loading, {_first(left)} are still on the meta device: the model has tensors "
            "no checkpoint holds (non-persistent buffers); memfit.models.loading must make them"
        )


# -- generation_config.json, tokenizer.json, tokenizer_config.json ---------------------------


def _read_generation_and_tokenizer(
    directory: Path, hf_config: dict[str, Any]
) -> tuple[GenerationDefaults, PretrainedTokenizer | None, str | None]:
    """End tokens come from generation_config.json, else config.json (transformers' generate
    reads them in this order), else the tokenizer."""
    generation = _read_json(directory / "generation_config.json")
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    eos_ids = _token_ids(_first_set(generation, hf_config, key="eos_token_id"))
    bos_id = _first_set(generation, hf_config, key="bos_token_id")
    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        tokenizer = _read_tokenizer(directory, tokenizer_config, eos_ids=eos_ids, bos_id=bos_id)
        eos_ids = eos_ids or _token_ids(tokenizer.eos_id)
        bos_id = tokenizer.bos_id if bos_id is None else bos_id
    elif (directory / "tokenizer.model").is_file():
        logger.warning(
            "%s has a sentencepiece tokenizer.model but no tokenizer.json, the only tokenizer "
            "memfit reads; the model loads without a tokenizer",
            directory,
        )
    chat_template = tokenizer_config.get("chat_template")
    if isinstance(chat_template, list):  # older files: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in chat_template}
        chat_template = named.get("default", next(iter(named.values()), None))
    if (directory / "chat_template.jinja").is_file():  # newer transformers save it apart
        chat_template = (directory / "chat_template.jinja").read_text()
    defaults = GenerationDefaults(
        eos_token_ids=eos_ids,
        bos_token_id=bos_id,
        do_sample=bool(generation.get("do_sample", False)),
        temperature=generation.get("temperature"),
        top_k=generation.get("top_k"),
        top_p=generation.get("top_p"),
        min_p=generation.get("min_p"),
        repetition_penalty=generation.get("repetition_penalty"),
        max_new_tokens=generation.get("max_new_tokens"),
    )
    return defaults, tokenizer, chat_template


def _read_tokenizer(
    directory: Path,
    tokenizer_config: dict[str, Any],
    *,
    eos_ids: tuple[int, ...],
    bos_id: int | None,
) -> PretrainedTokenizer:
    """tokenizer.json, its BOS and EOS the tokens tokenizer_config.json names (else the ids of
    the generation config)."""
    from tokenizers import Tokenizer as RustTokenizer

    path = directory / "tokenizer.json"
    try:
        backend = RustTokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises a bare Exception on bad JSON
        raise ValueError(f"cannot read {str(path)!r} as a tokenizer.json: {error}") from None
    special = {"bos": bos_id, "eos": eos_ids[0] if eos_ids else None}
    for role in special:
        value = tokenizer_config.get(f"{role}_token")
        token = value.get("content") if isinstance(value, dict) else value  # or an AddedToken
        if token is None:
            continue
        special[role] = backend.token_to_id(token)
        if special[role] is None:
            raise ValueError(
                f"{str(directory / 'tokenizer_config.json')!r} names {role}_token {token!r}, "
                f"which {str(path)!r} does not have"
            )
    return PretrainedTokenizer(
        backend, name=str(path), bos_id=special["bos"], eos_id=special["eos"]
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON: {error}") from None


def _first_set(*sources: dict[str, Any], key: str) -> Any:
    return next((source[key] for source in sources if source.get(key) is not None), None)


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)
