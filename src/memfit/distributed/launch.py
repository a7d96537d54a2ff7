"""The process group of a data-parallel run: torchrun's environment in, a process group out.

`torchrun --nproc_per_node N -m memfit train ...` starts N processes and gives each RANK,
WORLD_SIZE, LOCAL_RANK and a rendezvous (MASTER_ADDR/PORT, or the c10d rendezvous of a multi-node
launch); `init_world` joins them: NCCL on CUDA (one GPU per local rank), gloo on CPU. A process
started without torchrun is a world of one and joins nothing.

Failure within a timeout: every collective waits at most `timeout_s` (torch's NCCL watchdog then
aborts the process), and torchrun ends the other ranks when one exits, so a rank that dies ends
the run everywhere with the dead rank's error at the top of torchrun's report. A rank that stops
without dying (SIGSTOP, a frozen host) would hold the others in their next collective for all of
`timeout_s`: `Heartbeat` has every rank beat through the rendezvous store every few seconds and
ends a rank whose peers' beats stop for `deadline_s`, naming them, so the whole run ends within
about that long (torchrun then ends the stopped process too). Ranks launched with different
configurations stop at once, before any training, naming the settings that differ.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "Heartbeat",
    "World",
    "agree",
    "check_same",
    "close_world",
    "init_world",
    "launched_by_torchrun",
]

logger = logging.getLogger(__name__)


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
        atexit.register(close_world)  # a rank that ends on an error leaves the group too
    return world, device


def close_world() -> None:
    """Leave the process group joined by `init_world`, if any. A rank that exits with its group
    still alive leaves the C++ side of gloo/NCCL (and the store client) to the interpreter's
    shutdown, which can end the process with std::terminate (SIGABRT) while a peer is still
    finishing; `init_world` therefore also calls this at exit, for a rank that ends on an error
    without `Trainer.close`."""
    if dist.is_initialized():
        dist.destroy_process_group()


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
    """Raise on every rank if the ranks were not given the same settings (name -> text), naming
    each setting that differs and its value on each rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, settings)
    ranks = [d or {} for d in everyone]
    differ = sorted({k for d in ranks for k in d if d.get(k) != ranks[0].get(k)})
    if differ:
        shown = "; ".join(
            f"{key}: " + ", ".join(f"rank {r} {d.get(key)}" for r, d in enumerate(ranks))
            for key in differ[:5]
        )
        more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
        raise ValueError(
            f"ranks were launched with different settings: {shown}{more}; every rank of a "
            "torchrun launch needs the same command line and config file"
        )


class Heartbeat:
    """Every rank adds 1 to its counter in the process group's store each `interval_s`, reads
    the others', and ends its own process (exit code 1) when a peer's counter has not moved for
    `deadline_s` (the peer is stopped or frozen), or when the store has not answered for as long
    (its host is). Daemon threads; the beat needs the GIL only briefly, and torch's I/O, kernels
    and collectives release it, so a busy rank keeps beating."""

    def __init__(self, world: World, *, deadline_s: float, interval_s: float = 2.0) -> None:
        self.world, self.deadline_s, self.interval_s = world, deadline_s, interval_s
        self._store = dist.PrefixStore(
            "memfit/heartbeat/", dist.distributed_c10d._get_default_store()
        )
        now = time.monotonic()
        self._answered = now
        self._seen = [-1] * world.world_size
        self._moved = [now] * world.world_size
        self._stopped = threading.Event()
        self._threads = [
            threading.Thread(target=self._beat, name="memfit-heartbeat", daemon=True),
            threading.Thread(target=self._watch, name="memfit-heartbeat-watch", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        atexit.register(self.stop)  # before the group goes (atexit runs the newest first)

    def stop(self) -> None:
        """Stop beating and wait (briefly) for both threads to end, so that none is inside a
        store call when the process group goes away."""
        self._stopped.set()
        atexit.unregister(self.stop)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self.interval_s + 5.0)

    def _beat(self) -> None:
        while not self._stopped.is_set():
            try:
                self._store.add(str(self.world.rank), 1)
                counts = [self._store.add(str(r), 0) for r in range(self.world.world_size)]
            except Exception:  # the store went away: the run is ending; the watcher decides
                counts = None
            if counts is not None:
                now = time.monotonic()
                self._answered = now
                for r, count in enumerate(counts):
                    if count != self._seen[r]:
                        self._seen[r], self._moved[r] = count, now
            self._stopped.wait(self.interval_s)

    def _watch(self) -> None:
        while not self._stopped.wait(1.0):
            if not dist.is_initialized():  # the process group was destroyed: the run is over
                return
            now = time.monotonic()
            silent = [
                r
                for r in range(self.world.world_size)
                if r != self.world.rank and now - self._moved[r] > self.deadline_s
            ]
            if silent:
                self._end(
                    f"rank {', '.join(map(str, silent))} of {self.world.world_size} has not "
                    f"answered for {self.deadline_s:.0f} s (stopped, e.g. by SIGSTOP, or frozen)"
                )
            if now - self._answered > self.deadline_s:
                self._end(
                    f"the rendezvous store has not answered for {self.deadline_s:.0f} s (its "
                    "host, torchrun or rank 0, is stopped or gone)"
                )

    def _end(self, why: str) -> None:
        if self._stopped.is_set():
            return
        message = (
            f"memfit: rank {self.world.rank}: {why}; ending this rank so that the launcher "
            "ends the run (distributed.heartbeat_s sets the deadline, 0 turns it off)"
        )
        logger.error("%s", message)
        print(message, file=sys.stderr, flush=True)
        os._exit(1)  # the main thread may be inside a collective that will never return


def agree(flag: torch.Tensor) -> torch.Tensor:
    """The logical OR of a boolean (or 0/1) tensor over all ranks, e.g. 'a gradient overflowed'."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    value = flag.to(torch.float32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value > 0
