"""Quantized checkpoints: a model whose blocks' linear weights were quantized (int8 or int4,
memfit.nn.quant.quantize_model) saved as they are held, so that quantizing is done once.

    memfit export path/to/Llama-3.1-8B --quantize int4 --out llama-8b-int4
    LLM("llama-8b-int4")                       # loads the int4 weights as stored

The directory is laid out like a Hugging Face checkpoint: config.json (the source's, with
"quantization_config": {"quant_method": "memfit", "kind": ..., "group": ..., "format": 1}),
model.safetensors under memfit's own tensor names (each quantized layer's `quant.q` / `quant.packed`,
`quant.scale` and `quant.zero` as stored, every other tensor in the dtype it was saved in) and the
source's tokenizer and generation files. `load_pretrained` recognizes it: the model is built on
the meta device, its layers turned into quantized ones of the same shapes, and the file's
tensors put in place (the float ones cast to the dtype asked for); names and shapes are checked
against the file's header before anything is read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

QUANT_METHOD = "memfit"
FORMAT = 1
KINDS = ("int8", "int4")


def quantization_of(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """The quantization_config of a memfit quantized checkpoint's config.json, else None."""
    found = hf_config.get("quantization_config") or {}
    return found if found.get("quant_method") == QUANT_METHOD else None


def stored_quantization(directory: str | Path) -> str | None:
    """The kind ('int8', 'int4') a checkpoint directory holds quantized, None for float weights
    (or no checkpoint directory)."""
    config = Path(directory) / "config.json"
    if not config.is_file():
        return None
    try:
        found = quantization_of(json.loads(config.read_text()))
    except (json.JSONDecodeError, AttributeError):
        return None
    return found.get("kind") if found else None


def _kind_and_group(model: torch.nn.Module) -> tuple[str, int]:
    from memfit.nn.quant import QuantLinear

    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    kinds = {layer.quant.kind for layer in layers}
    if len(kinds) != 1 or not kinds <= set(KINDS):
        raise ValueError(
            "save a model whose blocks' linear layers are all quantized to one of "
            f"{', '.join(KINDS)} (memfit.nn.quant.quantize_model); found {sorted(kinds) or 'none'}"
        )
    groups = [layer.quant.group for layer in layers if layer.quant.group]
    return kinds.pop(), max(groups) if groups else 0


def save_quantized(
    model: torch.nn.Module, destination: str | Path, hf_config: dict[str, Any], *,
    files_from: Path | None = None, extra_files: tuple[str, ...] = (),
    calibration: str | None = None,
) -> Path:  # fmt: skip
    """Write `model` (its blocks quantized) to the new or empty directory `destination`, with
    `hf_config` (its Hugging Face config) and the files of `extra_files` found in `files_from`
    (tokenizer, generation config). Written beside it first, renamed when complete.
    `calibration`: how the levels were chosen (memfit.nn.gptq.CALIBRATIONS), recorded."""
    destination = Path(destination)
    if destination.exists() and any(destination.iterdir()):
        raise ValueError(f"{str(destination)!r} exists and is not empty; save into a new directory")
    kind, group = _kind_and_group(model)
    config = dict(hf_config)
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD, "kind": kind, "group": group, "format": FORMAT,
        "modules": "the blocks' linear layers", "calibration": calibration or "round to nearest",
    }  # fmt: skip
    partial = destination.with_name(destination.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in extra_files if files_from is not None else ():
        if (files_from / name).is_file():
            shutil.copy2(files_from / name, partial / name)
    if destination.exists():
        destination.rmdir()
    partial.rename(destination)
    return destination


def load_quantized_weights(
    model: torch.nn.Module, directory: Path, quantization: dict[str, Any], device: torch.device,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    """Turn the meta-device `model`'s blocks into quantized layers as the checkpoint's config
    says and put the tensors of `directory`/model.safetensors in place (float ones in `dtype`,
    quantized ones as stored). ValueError naming what does not match, before any data is read."""
    from memfit.nn.quant import quantize_model

    kind, group, version = (quantization.get(key) for key in ("kind", "group", "format"))
    if kind not in KINDS or version != FORMAT:
        raise ValueError(
            f"{str(directory)!r} holds memfit-quantized weights of kind {kind!r}, format "
            f"{version!r}; this memfit reads {', '.join(KINDS)}, format {FORMAT}"
        )
    quantize_model(model, kind, dtype=dtype, group=group or 128)  # meta: shapes only
    expected = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    path = directory / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"no model.safetensors in {str(directory)!r}")
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        missing = sorted(set(expected) - set(shapes))
        unexpected = sorted(set(shapes) - set(expected))
        wrong = [
            f"{name} {shapes[name]} (the model's {expected[name][0]})"
            for name in expected
            if name in shapes and shapes[name] != expected[name][0]
        ]
        if missing or unexpected or wrong:
            problems = [
                f"{label}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
                for label, items in (("missing", missing), ("unexpected", unexpected),
                                     ("wrong shape", wrong))
                if items
            ]  # fmt: skip
            raise ValueError(
                f"{str(path)!r} does not hold this {kind} model's tensors; " + "; ".join(problems)
            )
        state = {}
        for name, (_, want) in expected.items():
            tensor = handle.get_tensor(name)
            if tensor.is_floating_point() and want.is_floating_point:
                tensor = tensor.to(dtype if not name.endswith(".quant.scale") else want)
            elif tensor.dtype != want:
                raise ValueError(f"{name} is stored as {tensor.dtype}; a {kind} layer holds {want}")
            state[name] = tensor.to(device)
    model.load_state_dict(state, assign=True)
