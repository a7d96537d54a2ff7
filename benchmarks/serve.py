"""Serving benchmark: `memfit serve`'s HTTP API under load, against `transformers serve` on the
same checkpoint, machine and load. The load generator runs in a process of its own (Poisson
arrivals, streamed completions over localhost), as a client would.

    python benchmarks/serve.py                         # llama-3.2-1b shapes, random bf16 weights
    python benchmarks/serve.py --model tiny --device cpu --rates 4 inf --requests 8  # a smoke run

Parts (--parts):
- rates: requests with prompts uniform in 64..512 tokens and 128 new tokens each, arriving as a
  Poisson process at each rate of --rates (requests/s, "inf": all at once), after an unloaded
  run (one request at a time); per rate: output tokens/s, time to first token (TTFT) and
  inter-token latency (ITL, between two streamed tokens) p50/p99.
- chunk: the loads at --chunk-rates again with a prefill budget of --chunk-tokens tokens per
  step (chunked prefill: a long prompt is computed in pieces between the running decodes) and
  at most --chunk-max-running sequences a step: the ITL that the running streams see against
  the throughput.
- interval: the all-at-once load with tokens streamed --stream-intervals at a time.
- api_servers: `memfit serve --api-servers N` started from the command line, N in
  --api-servers, at --api-rates: several HTTP processes sharing one engine.
- offline: the all-at-once load's work through `LLM.generate` in this process (no HTTP).
- prefix: --prefix-requests (256) requests behind one shared 1,024-token system prompt (and 64
  tokens of their own), all at once, with prefix caching on and off: peak KV blocks, mean TTFT,
  throughput.
- n: one 1,024-token prompt with n=4 (128 new tokens) against four separate requests of it,
  prefix caching off for the latter: peak KV blocks.
- peer: `transformers serve` (continuous batching) on the checkpoint, the rates load at --peer-rates.

The checkpoint has random weights, a word-level tokenizer (token i is the word "w<i>") and no
end-of-sequence token, so that every request of both servers runs to its max_tokens; prompts are
text, tokenized by each server. Results go to benchmarks/results/serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from memfit.inference import LLM, SamplingParams  # noqa: E402
from memfit.inference.server import AsyncEngine, BackgroundServer  # noqa: E402
from memfit.models import PRESETS  # noqa: E402

# -- the checkpoint both servers load -------------------------------------------------------------


def write_checkpoint(directory: Path, preset: str, device: str) -> Path:
    """The preset's shapes as a transformers Llama checkpoint with random weights (bf16 on a GPU),
    a word-level tokenizer over the whole vocabulary and no BOS/EOS token."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    c = PRESETS[preset]
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        rope_parameters={"rope_theta": c.rope_theta, **(c.rope_scaling or {"rope_type": "default"})},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    vocab = {f"w{i}": i for i in range(c.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return directory


def prompts(count, low, high, vocab, seed=0, prefix="") -> list[str]:
    rng = random.Random(seed)
    return [
        prefix + " ".join(f"w{rng.randrange(1, vocab)}" for _ in range(rng.randint(low, high)))
        for _ in range(count)
    ]


# -- the load generator (processes of its own) --------------------------------------------------


async def _one(client, body, at) -> dict:
    """One streamed request sent at wall-clock time `at` (None: now): its time to first token,
    the gaps between its tokens, their count, and when its last token came."""
    if at is not None:
        await asyncio.sleep(max(0.0, at - time.time()))
    sent_at, sent, times, usage = time.time(), time.perf_counter(), [], None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:500]!r}")
        pending = b""
        async for data in response.aiter_raw():
            # a token's time is when its bytes came, not when this process got round to parsing
            # them: a client process parses several streams, and the others' events would count
            now = time.perf_counter()
            *events, pending = (pending + data).replace(b"\r\n", b"\n").split(b"\n\n")
            for raw in events:
                if not raw.startswith(b"data: {"):
                    continue
                event = json.loads(raw[6:])
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    ids = choice.get("token_ids")  # memfit's; else one word a token
                    count = len(ids) if ids is not None else len(choice.get("text", "").split())
                    times += [now] * count
    return {
        "ttft": times[0] - sent if times else None,
        "itl": [b - a for a, b in zip(times, times[1:], strict=False)],
        "tokens": len(times),
        "completion_tokens": usage["completion_tokens"] if usage else len(times),
        "sent_at": sent_at,
        "end": time.time(),
    }


async def _requests(url, bodies, ats) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        if ats is None:  # one after another
            return [await _one(client, body, None) for body in bodies]
        return await asyncio.gather(
            *(_one(client, body, at) for body, at in zip(bodies, ats, strict=True))
        )


def _client(url, bodies, ats) -> tuple[list[dict], float]:
    """One load-generating process's share; its records and the CPU time it took."""
    cpu = time.process_time()
    records = asyncio.run(_requests(url, bodies, ats))
    return records, time.process_time() - cpu


def run_load(clients, url, model, prompts, max_tokens, rate, n=1) -> dict:
    """Send every prompt, streamed: Poisson arrivals at `rate` per second (inf: all at once; 0:
    one after another, each sent when the one before has finished), spread over the `clients`
    processes (one Python client parsing every stream would be the bottleneck)."""
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    bodies = [body | {"prompt": p} | ({"n": n} if n > 1 else {}) for p in prompts]
    start = time.time() + 1.0
    if rate == 0:
        shares = [clients.submit(_client, url, bodies, None)]
    else:
        rng, ats, t = random.Random(0), [], start
        for _ in prompts:
            ats.append(t)
            t += 0.0 if rate == float("inf") else rng.expovariate(rate)
        ways = clients.count
        shares = [
            clients.submit(_client, url, bodies[i::ways], ats[i::ways])
            for i in range(min(ways, len(bodies)))
        ]
    done, cpu = [], 0.0
    for share in shares:
        records, seconds = share.result()
        done += records
        cpu += seconds
    if rate == 0:
        start = min(r["sent_at"] for r in done)
    seconds = max(r["end"] for r in done) - start
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    itl = [gap for r in done for gap in r["itl"]]
    tokens = sum(r["tokens"] for r in done)
    return {
        "rate": {0: "one at a time", float("inf"): "inf"}.get(rate, rate),
        "requests": len(prompts), "output_tokens": tokens,
        "usage_completion_tokens": sum(r["completion_tokens"] for r in done),
        "seconds": seconds, "tokens_per_s": tokens / seconds,
        "ttft_mean_s": sum(ttft) / len(ttft), "ttft": _percentiles(ttft),
        "itl": _percentiles(itl) if itl else {}, "client_cpu_s": cpu,
    }  # fmt: skip


class Clients(ProcessPoolExecutor):
    """The load generator's processes (spawned: no CUDA, no threads of this process)."""

    def __init__(self, count: int) -> None:
        super().__init__(count, mp_context=multiprocessing.get_context("spawn"))
        self.count = count


def _percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


# -- the servers ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MemfitServer(BackgroundServer):
    """memfit's API on a free localhost port, as `memfit serve` runs it: the engine in a process
    of its own (`llm`: an LLM of this process instead, stepped by a thread)."""

    def __init__(self, checkpoint: Path, args, *, llm: LLM | None = None, **options) -> None:
        engine_options = {"max_waiting": 100_000}
        if "stream_interval" in options:
            engine_options["stream_interval"] = options.pop("stream_interval")
        if llm is not None:
            engine = AsyncEngine(llm, **engine_options)
        else:
            options = {"device": args.device, "max_seq_len": args.max_model_len,
                       "prefix_caching": True, **options}  # fmt: skip
            engine = AsyncEngine.spawn(str(checkpoint), **engine_options, **options)
        super().__init__(engine, model_name="m")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time so far of the engine (its process, or its thread) and of the HTTP side (this
        process, or uvicorn's thread)."""
        if self.engine.llm is not None:  # one process: they share the interpreter's lock
            threads = {"engine": self.engine._worker, "http": self.thread}
            return {
                name: time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
                for name, thread in threads.items()
            }
        stat = Path(f"/proc/{self.engine._process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return {"engine": (int(stat[11]) + int(stat[12])) / ticks, "http": time.process_time()}


PEER = """
import sys
from transformers.cli.serve import Serve
Serve(force_model=sys.argv[1], continuous_batching=True, device=sys.argv[2], host="127.0.0.1",
      port=int(sys.argv[3]), log_level="warning")
"""


class ChildServer:
    """A server in a child process, its output to `log`, ready once /health answers."""

    def __init__(
        self, command: list[str], label: str, log: Path, port: int, stop=signal.SIGTERM
    ) -> None:
        self.label, self.log, self.stop = label, log, stop
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                command, env=os.environ.copy(), stdout=out, stderr=subprocess.STDOUT
            )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.process.poll() is not None:
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"{label} exited with {self.process.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.close()
        raise RuntimeError(f"{label} did not answer /health in 600 s")

    def close(self) -> None:
        self.process.send_signal(self.stop)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def __enter__(self) -> ChildServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def peer_server(checkpoint: Path, device: str) -> ChildServer:
    """`transformers serve CHECKPOINT --continuous-batching` (its access log: a line a request)."""
    port = _free_port()
    command = [sys.executable, "-c", PEER, str(checkpoint), device, str(port)]
    return ChildServer(command, "transformers serve", checkpoint / "peer.log", port)


def memfit_cli_server(checkpoint: Path, args, api_servers: int, *flags: str) -> ChildServer:
    """`memfit serve CHECKPOINT --api-servers N [flags]`, as a user starts it."""
    port = _free_port()
    command = [
        sys.executable, "-m", "memfit.cli.main", "serve", str(checkpoint), "--port", str(port),
        "--device", args.device, "--max-model-len", str(args.max_model_len),
        "--served-model-name", "m", "--max-waiting", "100000", "--api-servers", str(api_servers),
        *flags,
    ]  # fmt: skip
    log = checkpoint / f"memfit_serve_{api_servers}{'_'.join(flags)}.log"
    return ChildServer(command, "memfit serve", log, port, stop=signal.SIGINT)  # (as Ctrl-C)


# -- the parts ------------------------------------------------------------------------------------


def _line(label: str, row: dict) -> None:
    itl = row["itl"]
    print(
        f"{label}: {row['tokens_per_s']:,.0f} tokens/s, TTFT p50 {row['ttft']['p50'] * 1e3:.0f} ms "
        f"p99 {row['ttft']['p99'] * 1e3:.0f} ms, ITL p50 {itl.get('p50', 0) * 1e3:.1f} ms p99 "
        f"{itl.get('p99', 0) * 1e3:.1f} ms"
        + (
            ", host CPU s: " + ", ".join(f"{k} {v:.1f}" for k, v in row["cpu_seconds"].items())
            if "cpu_seconds" in row
            else ""
        ),
        flush=True,
    )


def warm_up(clients, url, model, args) -> None:
    """A few requests of the prompt lengths to come, together and alone (not timed)."""
    vocab = PRESETS[args.model].vocab_size
    batch = prompts(8, args.prompt_low, args.prompt_high, vocab, seed=5)
    for rate in (float("inf"), 0):
        run_load(clients, url, model, batch[:4] if rate == 0 else batch, 8, rate)


def load_rows(clients, server, model, args, rates, label, seed) -> list[dict]:
    """A load at each rate, each of prompts of its own (`seed` onwards): a prompt sent before
    would find its blocks in the prefix cache."""
    vocab = PRESETS[args.model].vocab_size
    rows = []
    for i, rate in enumerate(rates):
        count = args.unloaded_requests if rate == 0 else args.requests
        batch = prompts(count, args.prompt_low, args.prompt_high, vocab, seed=seed + i)
        cpu = server.cpu_seconds() if isinstance(server, MemfitServer) else None
        row = run_load(clients, server.url, model, batch, args.new_tokens, rate)
        if cpu is not None:
            row["cpu_seconds"] = {k: v - cpu[k] for k, v in server.cpu_seconds().items()}
        rows.append(row)
        _line(f"{label} rate {row['rate']}", row)
    return rows


def rates_part(clients, checkpoint, args) -> list[dict]:
    with MemfitServer(checkpoint, args) as server:
        warm_up(clients, server.url, "m", args)
        return load_rows(clients, server, "m", args, [0, *args.rates], "memfit", seed=100)


def chunk_part(clients, checkpoint, args) -> list[dict]:
    """The loads with smaller prefill budgets (`memfit serve --max-step-tokens`), each with
    every --chunk-max-running (`--max-running`: the most sequences a step decodes); with
    --chunk-api-servers N > 1, `memfit serve --api-servers N` started from the command line."""
    rows = []
    configs = [(b, r) for b in args.chunk_tokens for r in args.chunk_max_running]
    for i, (budget, running) in enumerate(configs):
        if args.chunk_api_servers > 1:
            flags = ("--max-step-tokens", str(budget), "--max-running", str(running))
            server = memfit_cli_server(checkpoint, args, args.chunk_api_servers, *flags)
        else:
            server = MemfitServer(checkpoint, args, max_step_tokens=budget, max_running=running)
        with server:
            warm_up(clients, server.url, "m", args)
            label, seed = f"budget {budget}, max running {running}", 200 + 10 * i
            loads = load_rows(clients, server, "m", args, args.chunk_rates, label, seed=seed)
        extra = {"max_step_tokens": budget, "max_running": running}
        if args.chunk_api_servers > 1:
            extra["api_servers"] = args.chunk_api_servers
        rows += [row | extra for row in loads]
    return rows


def interval_part(clients, checkpoint, args) -> list[dict]:
    """The all-at-once load with tokens streamed --stream-intervals at a time (`memfit serve
    --stream-interval`): what the host's work for each event costs."""
    rows = []
    for i, interval in enumerate(args.stream_intervals):
        with MemfitServer(checkpoint, args, stream_interval=interval) as server:
            warm_up(clients, server.url, "m", args)
            label, inf = f"stream interval {interval}", [float("inf")]
            (row,) = load_rows(clients, server, "m", args, inf, label, seed=400 + i)
        rows.append(row | {"stream_interval": interval})
    return rows


def in_process_part(clients, checkpoint, args) -> dict:
    """In this process, once the servers above are gone: the all-at-once load's work (fresh
    prompts of the same lengths) through `LLM.generate`, without HTTP (what the engine does
    alone), and the all-at-once load against a server whose engine is a thread of the HTTP
    server's process (`memfit serve --engine-in-thread`: one interpreter lock for both)."""
    llm = LLM(checkpoint, device=args.device, max_seq_len=args.max_model_len, prefix_caching=True)
    vocab = PRESETS[args.model].vocab_size
    batch = prompts(args.requests, args.prompt_low, args.prompt_high, vocab, seed=300)
    ids = [llm.encode(p) for p in batch]
    params = SamplingParams(max_tokens=args.new_tokens)  # (the checkpoint has no EOS token)
    start = time.perf_counter()
    outputs = llm.generate(ids, params, progress=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"offline LLM.generate: {tokens / seconds:,.0f} tokens/s", flush=True)
    offline = {"requests": len(ids), "output_tokens": tokens, "seconds": seconds,
               "tokens_per_s": tokens / seconds}  # fmt: skip
    with MemfitServer(checkpoint, args, llm=llm) as server:
        warm_up(clients, server.url, "m", args)
        inf = [float("inf")]
        (thread,) = load_rows(clients, server, "m", args, inf, "engine in a thread", seed=500)
    del llm
    return {"offline": offline, "engine_in_thread": thread}


def prefix_part(clients, checkpoint, args) -> list[dict]:
    vocab = PRESETS[args.model].vocab_size
    system = prompts(1, args.prefix_len, args.prefix_len, vocab, seed=2)[0] + " "
    batch = prompts(args.prefix_requests, 64, 64, vocab, seed=3, prefix=system)
    rows = []
    for caching in (False, True):
        with MemfitServer(checkpoint, args, prefix_caching=caching) as server:
            row = run_load(clients, server.url, "m", batch, args.new_tokens, float("inf"))
            row |= {"prefix_caching": caching, "peak_blocks": server.engine.state.kv_peak}
        rows.append(row)
        print(
            f"shared {args.prefix_len}-token prefix, caching {'on' if caching else 'off'}: peak "
            f"{row['peak_blocks']} blocks, mean TTFT {row['ttft_mean_s'] * 1e3:.0f} ms, "
            f"{row['tokens_per_s']:,.0f} tokens/s",
            flush=True,
        )
    return rows


def n_part(clients, checkpoint, args) -> dict:
    vocab = PRESETS[args.model].vocab_size
    prompt = prompts(1, args.prefix_len, args.prefix_len, vocab, seed=4)[0]
    result = {"prompt_tokens": args.prefix_len, "new_tokens": args.new_tokens}
    for label, caching, batch, n in (
        ("n=4", True, [prompt], 4),
        ("4 requests", False, [prompt] * 4, 1),
    ):
        with MemfitServer(checkpoint, args, prefix_caching=caching) as server:
            run_load(clients, server.url, "m", batch, args.new_tokens, float("inf"), n)
            result[label] = server.engine.state.kv_peak
    result["ratio"] = result["n=4"] / result["4 requests"]
    print(
        f"n=4 of a {args.prefix_len}-token prompt: peak {result['n=4']} blocks against "
        f"{result['4 requests']} for four requests ({result['ratio']:.0%})",
        flush=True,
    )
    return result


def api_servers_part(clients, checkpoint, args) -> list[dict]:
    """`memfit serve --api-servers N` (several HTTP processes on one engine) started as a user
    starts it, at --api-rates."""
    rows = []
    for i, count in enumerate(args.api_servers):
        with memfit_cli_server(checkpoint, args, count) as server:
            warm_up(clients, server.url, "m", args)
            label, seed = f"{count} HTTP processes", 600 + 10 * i
            loads = load_rows(clients, server, "m", args, args.api_rates, label, seed=seed)
        rows += [row | {"api_servers": count} for row in loads]
    return rows


def peer_part(clients, checkpoint, args) -> dict:
    import transformers

    server = peer_server(checkpoint, args.device)
    try:  # the first requests start its continuous-batching worker: not timed
        warm_up(clients, server.url, str(checkpoint), args)
        rows = load_rows(
            clients, server, str(checkpoint), args, args.peer_rates, "transformers", seed=100
        )
    finally:
        server.close()
    return {"transformers": transformers.__version__, "server": "transformers serve "
            "--continuous-batching (transformers.cli.serve.Serve)", "rates": rows}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["peer", "rates", "chunk", "interval", "api_servers", "prefix", "n", "in_process"],
    )
    parser.add_argument("--rates", nargs="+", type=float, default=[32, 64, 128, 256, float("inf")])
    parser.add_argument("--peer-rates", nargs="+", type=float, default=[float("inf")])
    parser.add_argument("--chunk-tokens", nargs="+", type=int, default=[512, 1024])
    parser.add_argument("--chunk-rates", nargs="+", type=float, default=[256, float("inf")])
    parser.add_argument("--chunk-max-running", nargs="+", type=int, default=[256])
    parser.add_argument("--chunk-api-servers", type=int, default=1)
    parser.add_argument("--stream-intervals", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--api-servers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--api-rates", nargs="+", type=float, default=[256, float("inf")])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--unloaded-requests", type=int, default=8)
    parser.add_argument("--prompt-low", type=int, default=64)
    parser.add_argument("--prompt-high", type=int, default=512)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--prefix-requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--clients", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    clients = Clients(args.clients)
    for started in [clients.submit(time.sleep, 1) for _ in range(args.clients)]:
        started.result()  # every client process up before the clock starts
    workdir = tempfile.TemporaryDirectory()
    checkpoint = write_checkpoint(Path(workdir.name), args.model, args.device)
    run = {"env": harness.environment(), "model": args.model, "new_tokens": args.new_tokens,
           "prompt_tokens": [args.prompt_low, args.prompt_high], "requests": args.requests}  # fmt: skip
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if "peer" in args.parts:  # first, while this process holds no GPU memory
        run["peer"] = peer_part(clients, checkpoint, args)
        if args.out is not None:
            (args.out / "serve_partial.json").write_text(json.dumps(run, indent=2))
    for part in ("rates", "chunk", "interval", "api_servers", "prefix", "n", "in_process"):
        if part in args.parts:
            run[part] = globals()[f"{part}_part"](clients, checkpoint, args)
            if args.out is not None:  # what a run cut short had measured
                (args.out / "serve_partial.json").write_text(json.dumps(run, indent=2))
    clients.shutdown()
    workdir.cleanup()
    if args.device == "cpu":
        print("(a CPU smoke run: nothing saved)")
        return
    if args.out is not None:
        harness.RESULTS = args.out
    print(f"results: {harness.append_results('serve', run)}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
