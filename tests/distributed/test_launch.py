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


EXITS_WITHOUT_CLOSING = """
import atexit, os, sys
import torch, torch.distributed as dist
from memfit.distributed import launch

atexit.register(lambda: print("group alive at exit:", dist.is_initialized(), flush=True))
world, _ = launch.init_world(torch.device("cpu"), timeout_s=30)
beat = launch.Heartbeat(world, deadline_s=60, interval_s=0.05)
raise SystemExit("a rank ends on an error, without Trainer.close")
"""


def test_a_rank_that_ends_on_an_error_still_leaves_its_group():
    import os
    import subprocess
    import sys

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run(
        [sys.executable, "-c", EXITS_WITHOUT_CLOSING],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "a rank ends on an error" in done.stderr
    assert "group alive at exit: False" in done.stdout, done.stdout + done.stderr
