"""The engine behind the HTTP server: one thread steps the (single-threaded) `Engine` while
requests arrive and leave from the server's event loop.

    engine = AsyncEngine(llm, max_waiting=256)
    engine.start()
    async for update in engine.generate(prompt_ids, params):   # in a request handler
        ...                                                     # new tokens, then the finish

The event loop never touches the engine: it posts ("add", ...) and ("abort", ...) to an inbox
that the engine thread drains between steps, and the engine thread hands each request's new
tokens back with `loop.call_soon_threadsafe`. A handler that stops listening (its client went
away) aborts its request, which frees its blocks at the next step boundary. At most
`max_waiting` requests may wait for a slot; past that `generate` raises QueueFull (the server
answers 429) instead of letting the queue grow without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from memfit.inference.llm import LLM
from memfit.inference.sampling_params import SamplingParams

log = logging.getLogger("memfit.serve")


class QueueFull(RuntimeError):
    """More requests wait than the server takes (HTTP 429)."""


@dataclass
class Update:
    """A request's tokens since the last update; the last update has `finished` set, with the
    finish reason and, where a stop string cut the output, the output's text."""

    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool = False
    finish_reason: str = ""
    text: str | None = None


class _Sink:
    """Where one request's updates wait for its handler, on the handler's event loop. Updates
    that pile up while the handler is busy go out merged, as one (vLLM's output collector does
    the same): under load a stream gets several tokens a chunk instead of falling behind."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.updates: list[Update | BaseException] = []  # (touched on the loop only)
        self.waiter: asyncio.Future | None = None
        self.request_id: int | None = None
        self.follows: _Sink | None = None  # another sample of the same prompt, added before
        self.sent = 0
        self.added = time.perf_counter()
        self.last_token: float | None = None

    def push(self, update: Update | BaseException) -> None:  # on the loop
        self.updates.append(update)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> Update:
        """Everything since the last take, as one update (waits for one)."""
        while not self.updates:
            self.waiter = self.loop.create_future()
            await self.waiter
        updates, self.updates = self.updates, []
        for update in updates:
            if isinstance(update, BaseException):
                raise RuntimeError("the engine stopped") from update
        if len(updates) == 1:
            return updates[0]
        last = updates[-1]
        logprobs = None if last.logprobs is None else [p for u in updates for p in u.logprobs]
        tokens = [t for u in updates for t in u.token_ids]
        return Update(tokens, logprobs, last.finished, last.finish_reason, last.text)


def _dispatch(pushes: list[tuple[_Sink, Update | BaseException]]) -> None:
    for sink, update in pushes:
        sink.push(update)


class Metrics:
    """The server's Prometheus metrics, in a registry of their own (one per server)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("memfit_requests_running", "Requests being decoded", registry=r)
        self.waiting = Gauge("memfit_requests_waiting", "Requests waiting for a slot", registry=r)
        self.kv_used = Gauge("memfit_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("memfit_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.prefix_hits = Gauge(
            "memfit_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", registry=r
        )
        self.prefix_rate = Gauge(
            "memfit_prefix_cache_hit_rate", "Of the prompt tokens, those found cached", registry=r
        )
        self.tokens = Counter("memfit_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("memfit_prompt_tokens", "Prompt tokens taken", registry=r)
        self.finished = Counter(
            "memfit_requests_finished", "Requests finished", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "memfit_time_to_first_token_seconds", "From arrival to the first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "memfit_inter_token_latency_seconds", "Between two tokens of a request",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28), registry=r,
        )  # fmt: skip


class AsyncEngine:
    def __init__(
        self,
        llm: LLM,
        *,
        max_waiting: int = 256,
        log_interval: float = 10.0,
        stream_interval: int = 1,
    ) -> None:
        """llm: the loaded model, cache and engine. max_waiting: requests that may wait for a
        slot before new ones are refused. Tokens are handed out after every step, pipelined
        ones too; a request that arrives ends a pipelined run so that it joins at once.
        stream_interval: a stream's tokens go out once this many have come (the first token and
        the last ones at once; vLLM's --stream-interval): fewer events, less host work a token,
        burstier streams."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.llm, self.engine = llm, llm.engine
        self.stream_interval = stream_interval
        self.max_waiting = max_waiting
        self.log_interval = log_interval
        self.metrics = Metrics()
        self.metrics.kv_total.set(self.engine.cache.pool.num_blocks)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[int, _Sink] = {}
        self._leaders: dict[object, _Sink] = {}  # the first sample of each group (event loop)
        self._pending = 0  # added to the inbox, not yet running (the event loop's count)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memfit-engine", daemon=True)
        self.error: BaseException | None = None
        self.generated = 0  # tokens, for the log line

    # -- the event loop's side --------------------------------------------------------------

    def start(self) -> None:
        if self.engine.on_step is not None:
            raise RuntimeError("this engine is already served (one AsyncEngine at a time)")
        self.engine.on_step = self._on_step
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        if self.engine.on_step == self._on_step:
            self.engine.on_step = None

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """ValueError for a request the engine could never run; QueueFull when too many wait."""
        self.engine.check(prompt, params)  # reads only what never changes
        with self._lock:
            if self._pending + len(self.engine.waiting) >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting")

    async def generate(
        self, prompt: list[int], params: SamplingParams, *, group: object = None
    ) -> AsyncIterator[Update]:
        """The request's updates as the engine makes them; checked first (see `check`). Leaving
        the loop early (a client that went away) aborts the request. `group`: a key shared by
        the samples of one prompt (a request's `n`): they share the prompt's KV blocks."""
        self.check(prompt, params)
        sink = _Sink(asyncio.get_running_loop())
        if group is not None:
            sink.follows = self._leaders.setdefault(group, sink)
            if sink.follows is sink:
                sink.follows = None
        with self._lock:
            self._pending += 1
        self.metrics.prompt_tokens.inc(len(prompt))
        self._inbox.put(("add", prompt, params, sink))
        self._wake.set()
        finished = False
        try:
            while not finished:
                update = await sink.take()
                finished = update.finished
                yield update
        finally:
            if group is not None and self._leaders.get(group) is sink:
                del self._leaders[group]
            if not finished:
                self._inbox.put(("abort", sink))
                self._wake.set()

    # -- the engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        engine, last_log, logged_tokens = self.engine, time.perf_counter(), 0
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not (engine.waiting or engine.running):
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                engine.step()  # hands out tokens through _on_step
                now = time.perf_counter()
                if now - last_log >= self.log_interval:
                    tokens = self.generated
                    log.info(
                        "running %d, waiting %d, %.0f tokens/s, KV blocks %d of %d",
                        len(engine.running), len(engine.waiting),
                        (tokens - logged_tokens) / (now - last_log),
                        engine.cache.pool.num_blocks - engine.cache.pool.num_free,
                        engine.cache.pool.num_blocks,
                    )  # fmt: skip
                    last_log, logged_tokens = now, tokens
        except BaseException as error:  # every waiting handler hears of it; /health says so
            self.error = error
            log.exception("the engine stopped")
            self._send([(sink, error) for sink in self._sinks.values()])

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "add":
                _, prompt, params, sink = message
                leader = sink.follows.request_id if sink.follows is not None else None
                sink.request_id = self.engine.add(prompt, params, follows=leader)
                self._sinks[sink.request_id] = sink
                with self._lock:
                    self._pending -= 1
            else:
                sink = message[1]
                if sink.request_id is not None and sink.request_id in self._sinks:
                    self.engine.abort(sink.request_id)
                    self._finish(sink)
                    self._update_gauges()

    def _on_step(self) -> bool:
        """After each step: its tokens go out; a pipelined run stops when messages wait."""
        self._deliver()
        return self._stop.is_set() or not self._inbox.empty()

    def _deliver(self) -> None:
        """Each request's tokens since the last delivery, sent to the event loop in one call;
        the finished requests leave the engine."""
        now, pushes, count = time.perf_counter(), [], 0
        itl = self.metrics.itl
        for sink in list(self._sinks.values()):
            request = self.engine.requests[sink.request_id]
            waiting = len(request.output) - sink.sent
            if 0 < sink.sent and waiting < self.stream_interval and not request.finished:
                continue  # (the first token goes out at once)
            new = request.output[sink.sent :]
            if new:
                if sink.last_token is None:
                    self.metrics.ttft.observe(now - sink.added)
                else:
                    gap = (now - sink.last_token) / len(new)
                    for _ in new:
                        itl.observe(gap)
                sink.last_token = now
                count += len(new)
            logprobs = request.logprobs[sink.sent :] if request.logprobs is not None else None
            sink.sent = len(request.output)
            if request.finished:
                pushes.append(
                    (sink, Update(new, logprobs, True, request.finish_reason, request.text))
                )
                self._finish(sink)
            elif new:
                pushes.append((sink, Update(new, logprobs)))
        if count:
            self.metrics.tokens.inc(count)
            self.generated += count
        self._send(pushes)
        self._update_gauges()

    def _send(self, pushes: list[tuple[_Sink, Update | BaseException]]) -> None:
        """One wake-up of each event loop for all its sinks' updates."""
        loops: dict[asyncio.AbstractEventLoop, list] = {}
        for sink, update in pushes:
            loops.setdefault(sink.loop, []).append((sink, update))
        for loop, batch in loops.items():
            loop.call_soon_threadsafe(_dispatch, batch)

    def _finish(self, sink: _Sink) -> None:
        request = self.engine.requests[sink.request_id]
        self.metrics.finished.labels(request.finish_reason).inc()
        del self._sinks[sink.request_id]
        self.engine.forget(sink.request_id)

    def _update_gauges(self) -> None:
        engine, metrics = self.engine, self.metrics
        metrics.running.set(len(engine.running))
        metrics.waiting.set(len(engine.waiting))
        cache = engine.cache
        metrics.kv_used.set(cache.pool.num_blocks - cache.pool.num_free)
        metrics.prefix_hits.set(cache.prefix_hits)
        metrics.prefix_rate.set(cache.prefix_hits / max(cache.prefix_queried, 1))
