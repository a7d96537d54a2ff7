"""The API served from a thread of this process on a free localhost port: for tests, benchmarks
and notebooks (`memfit serve` runs uvicorn in its main thread).

    with BackgroundServer(AsyncEngine.spawn("path/to/checkpoint"), model_name="m") as server:
        httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "Hi"})
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from memfit.inference.server.app import build_app
from memfit.inference.server.async_engine import AsyncEngine


class BackgroundServer:
    def __init__(self, engine: AsyncEngine, *, model_name: str, timeout: float = 60.0) -> None:
        """Starts `engine` and serves it; `close()` (or leaving the `with`) stops both."""
        self.engine = engine
        engine.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(
            build_app(engine, model_name=model_name), port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="memfit-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                engine.stop()
                raise RuntimeError(f"the HTTP server did not start on port {self.port}")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.stop()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
