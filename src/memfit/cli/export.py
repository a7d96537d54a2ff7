"""`memfit export RUN --out DIR`: a memfit run or checkpoint as a Hugging Face checkpoint
directory (config.json, model.safetensors under Hugging Face's names, and the base's tokenizer
and generation files where the run started from a Hugging Face checkpoint), which transformers,
vLLM and memfit itself load. A LoRA run's adapters are merged into the weights (`--merge` is what
export does for them; the adapters alone are in RUN/adapter, in peft's format)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from memfit.models import get_family, load_pretrained
from memfit.models.config import to_hf_config

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_BASE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "generation_config.json", "chat_template.jinja", "chat_template.json", "added_tokens.json",
    "vocab.json", "merges.txt",
)  # fmt: skip


CALIBRATION_ROW = 512  # tokens a row of calibration text


@dataclass(frozen=True)
class Calibration:
    """How `memfit export --quantize` calibrates (memfit.nn.gptq.calibrate): the method, the
    text file (None: Python's LICENSE.txt) and how many of its tokens."""

    method: str
    text: str | None = None
    tokens: int = 8192

    def ids(self, tokenizer, max_seq_len: int) -> torch.Tensor:
        """(rows, CALIBRATION_ROW or the model's max_seq_len) token ids of the text's first
        `tokens` tokens."""
        import sysconfig

        if tokenizer is None:
            raise ValueError("--calibrate needs the checkpoint's tokenizer; this one has none")
        path = Path(self.text or Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt")
        if not path.is_file():
            raise ValueError(f"no calibration text at {str(path)!r}: pass --calibration-text")
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        ids = ids[: self.tokens]
        row = min(CALIBRATION_ROW, max_seq_len)
        rows = len(ids) // row
        if rows == 0:
            raise ValueError(f"{str(path)!r} gives {len(ids)} tokens; calibrating takes {row}")
        return torch.tensor(ids[: rows * row]).view(rows, row)


def run_export(
    path: str, out: str, dtype: str, console: Console, quantize: str | None = None,
    device: str = "cpu", calibration: Calibration | None = None,
) -> int:  # fmt: skip
    destination = Path(out)
    if destination.exists() and any(destination.iterdir()):
        raise ValueError(f"--out {out!r} exists and is not empty; export into a new directory")
    if quantize is not None:
        return _export_quantized(path, destination, dtype, quantize, device, console, calibration)
    model, info = load_pretrained(path, device="cpu", dtype=_DTYPES[dtype])
    if info.format != "memfit":
        raise ValueError(f"{path!r} is already a Hugging Face checkpoint; nothing to export")
    hf_config, base, recorded, run = _exported_config(info, dtype)
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
    for file in _BASE_FILES if base is not None else ():
        if (base / file).is_file():
            shutil.copy2(base / file, partial / file)
            copied.append(file)
    tokenizer = _run_tokenizer(run)
    if not copied and tokenizer is not None:  # a run's own tokenizer.json
        shutil.copy2(tokenizer, partial / "tokenizer.json")
        copied.append("tokenizer.json")
    if destination.exists():
        destination.rmdir()
    partial.rename(destination)
    merged = " (LoRA adapters merged)" if info.lora else ""  # (QLoRA: the base dequantized)
    console.print(
        f"exported [cyan]{escape(str(info.path))}[/] (step {info.step}){merged} to "
        f"[cyan]{escape(str(destination))}[/]: {len(weights)} tensors in {dtype}"
        + (f", {', '.join(copied)}" if copied else ", no tokenizer files (the run used "
           "memfit's byte tokenizer)"),
        highlight=False,
    )  # fmt: skip
    if recorded and base is None:
        console.print(
            f"[yellow]warning[/]: the run started from {escape(recorded)!r}, which is no longer "
            "a Hugging Face checkpoint here: its tokenizer and config extras were not copied",
            highlight=False,
        )
    return 0


def _exported_config(info, dtype: str) -> tuple[dict, Path | None, str, dict]:
    """A memfit checkpoint's Hugging Face config.json in `dtype` (its base's, where the run
    started from a Hugging Face checkpoint still here), the base, the name the run recorded
    and the run's config."""
    run = _run_config(info.path)
    base, recorded = _base_directory(run)
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    hf_config = to_hf_config(info.config, name)
    generation = info.generation
    if generation.eos_token_ids:
        eos = list(generation.eos_token_ids)
        hf_config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if generation.bos_token_id is not None:
        hf_config["bos_token_id"] = generation.bos_token_id
    if base is not None:  # the base's own config: its token ids, model type and extras
        hf_config = json.loads((base / "config.json").read_text())
    hf_config |= {"torch_dtype": name, "dtype": name}  # (transformers 4 and 5 read one each)
    return hf_config, base, recorded, run


def _export_quantized(
    path: str, destination: Path, dtype: str, kind: str, device: str, console: Console,
    calibration: Calibration | None = None,
) -> int:  # fmt: skip
    """A Hugging Face checkpoint or memfit run with its blocks' linear weights quantized
    (memfit.models.quantized): each block quantized as soon as it is read, or, calibrated, the
    whole model read, calibrated on text and then quantized."""
    from memfit.models.quantized import save_quantized, stored_quantization
    from memfit.nn.quant import quantize_model

    if (held := stored_quantization(path)) is not None:
        raise ValueError(f"{path!r} already holds {held}-quantized weights")
    torch_dtype = _DTYPES[dtype]

    def on_block(model, index: int) -> None:
        quantize_model(model, kind, dtype=torch_dtype, blocks=[index])

    states = None
    if calibration is None:
        model, info = load_pretrained(path, device=device, dtype=torch_dtype, on_block=on_block)
    else:
        from memfit.nn.gptq import calibrate

        model, info = load_pretrained(path, device=device, dtype=torch_dtype)
        ids = calibration.ids(info.tokenizer, info.config.max_seq_len)
        ids = ids.to(next(model.parameters()).device)
        console.print(
            f"calibrating ({calibration.method}) on {ids.numel():,} tokens of "
            f"{escape(calibration.text or 'Python LICENSE.txt')}",
            highlight=False,
        )
        model.eval()
        states = calibrate(model, ids, kind, calibration.method)
    quantize_model(model, kind, dtype=torch_dtype, states=states)  # (all, or what on_block left)
    if info.format == "memfit":
        hf_config, base, _, run = _exported_config(info, dtype)
        files_from = base
        tokenizer = _run_tokenizer(run)
    else:
        hf_config = json.loads((Path(info.path) / "config.json").read_text())
        files_from, tokenizer = Path(info.path), None
    save_quantized(
        model, destination, hf_config, files_from=files_from, extra_files=_BASE_FILES,
        calibration=calibration.method if calibration else None,
    )  # fmt: skip
    if tokenizer is not None and not (destination / "tokenizer.json").exists():
        shutil.copy2(tokenizer, destination / "tokenizer.json")
    size = (destination / "model.safetensors").stat().st_size
    console.print(
        f"exported [cyan]{escape(str(info.path))}[/] with its blocks' linear weights in {kind} "
        + (f"({calibration.method}) " if calibration else "")
        + f"to [cyan]{escape(str(destination))}[/]: {size / 2**30:.2f} GiB",
        highlight=False,
    )
    return 0


def _run_config(checkpoint: Path) -> dict:
    """The run's config.toml (empty where it has none)."""
    from memfit.config import tomllib

    path = checkpoint / "config.toml"
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def _base_directory(run: dict) -> tuple[Path | None, str]:
    """The Hugging Face checkpoint a run started from (its config.toml's model.name) if it is
    one and is still there, and the name recorded."""
    from memfit.models.config import PRESETS
    from memfit.train.engine import pretrained_directory

    name = run.get("model", {}).get("name", "")
    if not name or name in PRESETS:
        return None, ""
    try:
        return pretrained_directory(name), name
    except ValueError:
        return None, name


def _run_tokenizer(run: dict) -> Path | None:
    """The tokenizer.json a run trained with (--tokenizer), if it is one and is there."""
    name = run.get("data", {}).get("tokenizer", "byte")
    path = Path(name)
    path = path / "tokenizer.json" if path.is_dir() else path
    return path if name != "byte" and path.is_file() else None
