"""`memfit export RUN --out DIR`: a memfit run or checkpoint as a Hugging Face checkpoint
directory (config.json, model.safetensors under Hugging Face's names, and the base's tokenizer
and generation files where the run started from a Hugging Face checkpoint), which transformers,
vLLM and memfit itself load. A LoRA run's adapters are merged into the weights (`--merge` is what
export does for them; the adapters alone are in RUN/adapter, in peft's format)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from memfit.models import get_family, load_pretrained
from memfit.models.config import to_hf_config

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_BASE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "generation_config.json",
)  # fmt: skip


def run_export(path: str, out: str, dtype: str, console: Console) -> int:
    destination = Path(out)
    if destination.exists() and any(destination.iterdir()):
        raise ValueError(f"--out {out!r} exists and is not empty; export into a new directory")
    model, info = load_pretrained(path, device="cpu", dtype=_DTYPES[dtype])
    if info.format != "memfit":
        raise ValueError(f"{path!r} is already a Hugging Face checkpoint; nothing to export")
    base = _base_directory(info.path)
    hf_config = to_hf_config(info.config, {"bf16": "bfloat16", "fp16": "float16",
                                           "fp32": "float32"}[dtype])  # fmt: skip
    if base is not None:  # the base's own config: its token ids, model type and extras
        hf_config = json.loads((base / "config.json").read_text()) | {
            "torch_dtype": hf_config["torch_dtype"]
        }
    weights = get_family(info.config.family).to_hf_state_dict(model)
    from safetensors.torch import save_file

    partial = destination.with_name(destination.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(
        {name: t.contiguous() for name, t in weights.items()},
        str(partial / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (partial / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    copied = []
    for name in _BASE_FILES if base is not None else ():
        if (base / name).is_file():
            shutil.copy2(base / name, partial / name)
            copied.append(name)
    if destination.exists():
        destination.rmdir()
    partial.rename(destination)
    merged = " (LoRA adapters merged)" if info.lora else ""
    console.print(
        f"exported [cyan]{escape(str(info.path))}[/] (step {info.step}){merged} to "
        f"[cyan]{escape(str(destination))}[/]: {len(weights)} tensors in {dtype}"
        + (f", {', '.join(copied)} from the base" if copied else ", no tokenizer files (the run "
           "did not start from a Hugging Face checkpoint)"),
        highlight=False,
    )  # fmt: skip
    return 0


def _base_directory(checkpoint: Path) -> Path | None:
    """The Hugging Face checkpoint a run started from (its config.toml's model.name), if it is
    one and is still there."""
    from memfit.config import tomllib
    from memfit.train.engine import pretrained_directory

    path = checkpoint / "config.toml"
    if not path.is_file():
        return None
    name = tomllib.loads(path.read_text()).get("model", {}).get("name", "")
    return pretrained_directory(name) if name else None
