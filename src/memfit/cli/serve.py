"""`memfit serve MODEL`: load the model, size the KV pool, start the engine thread and answer
the OpenAI API over HTTP (uvicorn) until interrupted."""

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
    from memfit.inference.llm import LLM

    device = resolve_device(args.device)
    llm = LLM(
        args.model, device=device, memory_fraction=args.gpu_memory_fraction,
        block_size=args.block_size, max_seq_len=args.max_model_len,
        max_running=args.max_running, prefix_caching=not args.no_prefix_caching,
    )  # fmt: skip
    name = args.served_model_name or str(args.model)
    cache = llm.cache
    log.info(
        "serving %s on %s: KV pool of %d blocks x %d tokens (%d tokens), max_model_len %d, "
        "at http://%s:%d/v1",
        name, device, cache.pool.num_blocks, cache.block_size,
        cache.pool.num_blocks * cache.block_size, llm.engine.max_context, args.host, args.port,
    )  # fmt: skip
    engine = AsyncEngine(llm, max_waiting=args.max_waiting, stream_interval=args.stream_interval)
    engine.start()
    try:
        uvicorn.run(build_app(engine, model_name=name), host=args.host, port=args.port)
    finally:
        engine.stop()
    return 0
