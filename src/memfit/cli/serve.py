"""`memfit serve MODEL`: load the model in the engine's process, size the KV pool, and answer
the OpenAI API over HTTP (uvicorn) in this one until interrupted."""

from __future__ import annotations

import argparse
import logging

from rich.console import Console

from memfit.train.engine import resolve_device

log = logging.getLogger("memfit.serve")


def run_serve(args: argparse.Namespace, console: Console) -> int:
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
        "prefix_caching": not args.no_prefix_caching,
    }  # fmt: skip
    engine_options = {"max_waiting": args.max_waiting, "stream_interval": args.stream_interval}
    if args.engine_in_thread:
        from memfit.inference.llm import LLM

        engine = AsyncEngine(LLM(args.model, **options), **engine_options)
    else:
        log.info("loading %s in the engine process", args.model)
        engine = AsyncEngine.spawn(str(args.model), **options, **engine_options)
    name = args.served_model_name or str(args.model)
    limits = engine.limits
    log.info(
        "serving %s on %s: KV pool of %d blocks x %d tokens (%d tokens), max_model_len %d, "
        "at http://%s:%d/v1",
        name, engine.device, limits.num_blocks, limits.block_size,
        limits.num_blocks * limits.block_size, limits.max_context, args.host, args.port,
    )  # fmt: skip
    engine.start()
    try:
        uvicorn.run(build_app(engine, model_name=name), host=args.host, port=args.port)
    finally:
        engine.stop()
    return 0
