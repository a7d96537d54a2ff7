"""The process group of a data-parallel run: torchrun's environment in, a process group out.

`torchrun --nproc_per_node N -m memfit train ...` starts N processes and gives each RANK,
WORLD_SIZE, LOCAL_RANK and a rendezvous (MASTER_ADDR/PORT, or the c10d rendezvous of a multi-node
launch); `init_world` joins them: NCCL on CUDA (one GPU per local rank), gloo on CPU. A process
started without torchrun is a world of one and joins nothing.

Failure within a timeout: every collective waits at most `timeout_s` (torch's NCCL watchdog then
aborts the process), and torchrun ends the other ranks when one exits, so a rank that dies ends
the run everywhere with the dead rank's error at the top of torchrun's report. Ranks launched with
different configurations stop at once, before any training, with the settings that differ.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["World", "agree", "check_same", "init_world", "launched_by_torchrun"]


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_world(device: torch.device, *, timeout_s: float) -> tuple[World, torch.device]:
    """Join the run's process group (when launched by torchrun) and return (world, the device this
    rank trains on): `device` itself on CPU, cuda:LOCAL_RANK on CUDA."""
    if not launched_by_torchrun():
        return World(), device
    world = World(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    if device.type == "cuda":
        if world.local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {world.local_rank} but this node has {torch.cuda.device_count()} "
                "GPU(s): launch at most one process per GPU (--nproc_per_node)"
            )
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        options = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **options)
    return world, device


def host_threads_per_rank() -> int:
    """This rank's share of the cores it may run on: the ranks of one node (LOCAL_WORLD_SIZE,
    set by torchrun) split them evenly."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def use_host_threads() -> int | None:
    """Offload steps the optimizer on the CPU, whose speed is the node's cores: raise torch's CPU
    threads to this rank's share when fewer are set (torchrun sets OMP_NUM_THREADS=1 for every
    process when it starts more than one). Returns the new count, or None if unchanged."""
    share = host_threads_per_rank()
    if torch.get_num_threads() >= share:
        return None
    torch.set_num_threads(share)
    return share


def check_same(settings: dict[str, str]) -> None:
    """Raise on every rank if the ranks were not given the same settings (name -> text)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    digest = {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in settings.items()}
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest)
    differ = sorted({k for d in everyone for k in d if d.get(k) != everyone[0].get(k)})
    if differ:
        raise ValueError(
            f"ranks were launched with different settings ({', '.join(differ)}): every rank of "
            "a torchrun launch needs the same command line and config file"
        )


def agree(flag: torch.Tensor) -> torch.Tensor:
    """The logical OR of a boolean (or 0/1) tensor over all ranks, e.g. 'a gradient overflowed'."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    value = flag.to(torch.float32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value > 0
