"""`memfit serve MODEL`: load the model in the engine's process, size the KV pool, and answer
the OpenAI API over HTTP (uvicorn) in this one until interrupted."""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import socket
import tempfile

from rich.console import Console

from memfit.train.engine import resolve_device

log = logging.getLogger("memfit.serve")


def check_serve_flags(args: argparse.Namespace) -> None:
    """serve's flags, refused with the flag and the value before the model is loaded."""
    from memfit.cli.generate import check_engine_flags
    from memfit.config import check_at_least, check_between

    check_engine_flags(args)
    check_between("--port", args.port, 1, 65535)
    for flag in ("max_running", "max_waiting", "stream_interval", "max_step_tokens", "api_servers"):
        check_at_least("--" + flag.replace("_", "-"), getattr(args, flag), 1)
    if args.api_servers > 1 and args.engine_in_thread:
        raise ValueError(
            f"--api-servers {args.api_servers} needs the engine in its own process: drop "
            "--engine-in-thread"
        )


def run_serve(args: argparse.Namespace, console: Console) -> int:
    check_serve_flags(args)
    if args.api_servers > 1 and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        # every HTTP process writes its metrics here and /metrics adds them up (set before
        # prometheus_client is imported, here and in the processes that inherit it)
        metrics_dir = tempfile.TemporaryDirectory(prefix="memfit-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.name
    try:
        import uvicorn

        from memfit.inference.server import AsyncEngine, build_app
    except ImportError as error:
        raise SystemExit(f"memfit serve needs {error.name}: pip install 'memfit[serve]'") from None

    device = resolve_device(args.device)
    options = {
        "device": str(device), "memory_fraction": args.gpu_memory_fraction,
        "block_size": args.block_size, "max_seq_len": args.max_model_len,
        "max_running": args.max_running, "max_step_tokens": args.max_step_tokens,
        "prefix_caching": not args.no_prefix_caching, "quantize": args.quantize,
        "kv_cache_dtype": args.kv_cache_dtype,
    }  # fmt: skip
    engine_options = {"max_waiting": args.max_waiting, "stream_interval": args.stream_interval}
    servers = args.api_servers
    if args.engine_in_thread:
        from memfit.inference.llm import LLM

        engine = AsyncEngine(LLM(args.model, **options), **engine_options)
    else:
        log.info("loading %s in the engine process", args.model)
        engine = AsyncEngine.spawn(
            str(args.model), **options, **engine_options, api_servers=servers
        )
    name = args.served_model_name or str(args.model)
    limits = engine.limits
    log.info(
        "serving %s on %s: KV pool of %d blocks x %d tokens (%d tokens), max_model_len %d, "
        "at http://%s:%d/v1, %d HTTP process%s",
        name, engine.device, limits.num_blocks, limits.block_size,
        limits.num_blocks * limits.block_size, limits.max_context, args.host, args.port,
        servers, "es" if servers > 1 else "",
    )  # fmt: skip
    engine.start()
    if servers == 1:
        try:
            uvicorn.run(build_app(engine, model_name=name), host=args.host, port=args.port)
        finally:
            engine.stop()
        return 0
    # several HTTP processes accept on one socket, each with its own pipes to the engine
    sock = _listen(args.host, args.port)
    context = multiprocessing.get_context("spawn")
    level = logging.getLogger().getEffectiveLevel()
    ready = [context.Event() for _ in engine.handles]
    workers = [
        context.Process(
            target=http_process,
            name=f"memfit-http-{i + 1}",
            daemon=True,
            args=(handle, sock, name, args.max_waiting, level, up),
        )
        for i, (handle, up) in enumerate(zip(engine.handles, ready, strict=True))
    ]
    for worker in workers:
        worker.start()
    try:
        for worker, up in zip(workers, ready, strict=True):  # every one serving before this one
            while not up.wait(0.5):
                if not worker.is_alive():
                    raise SystemExit(f"{worker.name} exited before it was ready")
        config = uvicorn.Config(build_app(engine, model_name=name), log_level=level)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for worker in workers:  # (Ctrl-C in a terminal reaches them already)
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGINT)
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
        engine.stop()
    return 0


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        raise SystemExit(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock.set_inheritable(True)
    return sock


def http_process(handle, sock: socket.socket, name: str, max_waiting: int, level: int, ready):
    """Another HTTP process of `memfit serve --api-servers N`: the API over its own pipes to the
    engine process, accepting on the shared socket until interrupted."""
    import uvicorn

    from memfit.inference.server import AsyncEngine, build_app
    from memfit.inference.server.core import configure_logging

    configure_logging(level)
    engine = AsyncEngine.connect(handle, max_waiting=max_waiting)
    engine.start()
    ready.set()
    try:
        config = uvicorn.Config(build_app(engine, model_name=name), log_level=level)
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # (uvicorn re-raises the Ctrl-C it handled: nothing to report)
        pass
    finally:
        engine.stop()
