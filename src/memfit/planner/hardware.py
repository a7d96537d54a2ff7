"""Hardware catalog: memory, dense bf16 tensor-core rate, HBM bandwidth and GPU-to-GPU
interconnect of the GPUs memfit plans for. Figures are the vendors' datasheet values (dense, no
sparsity); the time model scales them by efficiencies fitted to measurements (planner/time.py)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

GB = 10**9
GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class GPU:
    name: str
    memory_bytes: int
    """What the driver reports as total memory (nvidia-smi), not the marketing figure."""
    bf16_flops: float
    hbm_bytes_per_s: float
    interconnect_bytes_per_s: float
    """Per-GPU bandwidth to its peers in one direction (NVLink, else PCIe)."""
    interconnect: str


GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        GPU(
            name="h100-sxm",
            memory_bytes=81559 * 2**20,
            bf16_flops=989e12,
            hbm_bytes_per_s=3.35e12,
            interconnect_bytes_per_s=450 * GB,
            interconnect="NVLink 4 (900 GB/s bidirectional)",
        ),
        GPU(
            name="h100-pcie",
            memory_bytes=81559 * 2**20,
            bf16_flops=756e12,
            hbm_bytes_per_s=2.0e12,
            interconnect_bytes_per_s=64 * GB,
            interconnect="PCIe Gen5 x16",
        ),
        GPU(
            name="h200",
            memory_bytes=143771 * 2**20,
            bf16_flops=989e12,
            hbm_bytes_per_s=4.8e12,
            interconnect_bytes_per_s=450 * GB,
            interconnect="NVLink 4 (900 GB/s bidirectional)",
        ),
        GPU(
            name="a100-40gb",
            memory_bytes=40960 * 2**20,
            bf16_flops=312e12,
            hbm_bytes_per_s=1.555e12,
            interconnect_bytes_per_s=300 * GB,
            interconnect="NVLink 3 (600 GB/s bidirectional)",
        ),
        GPU(
            name="a100-80gb",
            memory_bytes=81920 * 2**20,
            bf16_flops=312e12,
            hbm_bytes_per_s=2.039e12,
            interconnect_bytes_per_s=300 * GB,
            interconnect="NVLink 3 (600 GB/s bidirectional)",
        ),
        GPU(
            name="l40s",
            memory_bytes=46068 * 2**20,
            bf16_flops=362e12,
            hbm_bytes_per_s=0.864e12,
            interconnect_bytes_per_s=32 * GB,
            interconnect="PCIe Gen4 x16",
        ),
        GPU(
            name="a10g",
            memory_bytes=23028 * 2**20,
            bf16_flops=125e12,
            hbm_bytes_per_s=0.6e12,
            interconnect_bytes_per_s=32 * GB,
            interconnect="PCIe Gen4 x16",
        ),
        GPU(
            name="l4",
            memory_bytes=23034 * 2**20,
            bf16_flops=121e12,
            hbm_bytes_per_s=0.3e12,
            interconnect_bytes_per_s=32 * GB,
            interconnect="PCIe Gen4 x16",
        ),
        GPU(
            name="rtx4090",
            memory_bytes=24564 * 2**20,
            bf16_flops=165e12,
            hbm_bytes_per_s=1.008e12,
            interconnect_bytes_per_s=32 * GB,
            interconnect="PCIe Gen4 x16",
        ),
        GPU(
            name="rtx3090",
            memory_bytes=24576 * 2**20,
            bf16_flops=71e12,
            hbm_bytes_per_s=0.936e12,
            interconnect_bytes_per_s=32 * GB,
            interconnect="PCIe Gen4 x16",
        ),
    )
}


def get_gpu(name: str) -> GPU:
    if name in GPUS:
        return GPUS[name]
    close = difflib.get_close_matches(name.lower(), GPUS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown GPU {name!r}{hint} Known: {', '.join(GPUS)}")


def detect_gpu() -> GPU | None:
    """The catalog entry of the current CUDA device, by its name; None on CPU or if unknown."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower()
    total = torch.cuda.get_device_properties(0).total_memory
    if "h200" in name:
        base = GPUS["h200"]
    elif "h100" in name:
        base = GPUS["h100-pcie" if "pcie" in name else "h100-sxm"]
    elif "a100" in name:
        base = GPUS["a100-80gb" if total > 50 * GiB else "a100-40gb"]
    else:
        key = next(
            (k for k in GPUS if k.replace("-", " ") in name or k in name.replace(" ", "")), None
        )
        if key is None:
            return None
        base = GPUS[key]
    return GPU(**{**base.__dict__, "memory_bytes": total})
