"""memfit.distributed.launch on one process: the heartbeat's threads end when it is stopped,
and a rank leaves its process group cleanly (close_world)."""

import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from memfit.distributed import launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stopped_heartbeat_ends_its_threads_and_the_group_closes():
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    try:
        beat = launch.Heartbeat(launch.World(), deadline_s=60, interval_s=0.05)
        names = {t.name for t in threading.enumerate()}
        assert {"memfit-heartbeat", "memfit-heartbeat-watch"} <= names
        beat.stop()
        assert not any(t.is_alive() for t in beat._threads)
    finally:
        launch.close_world()
    assert not dist.is_initialized()
    launch.close_world()  # (nothing left to close: a no-op)
