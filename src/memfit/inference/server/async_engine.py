"""The HTTP side of the engine: requests go to an `EngineCore` (memfit.inference.server.core)
that steps the engine, in a process of its own or in a thread, and their tokens come back to
the handlers that wait for them on the server's event loop.

    engine = AsyncEngine.spawn("path/to/checkpoint", max_waiting=256)   # the engine process
    engine = AsyncEngine(llm)                                           # or a thread, in-process
    engine.start()
    async for update in engine.generate(prompt_ids, params):   # in a request handler
        ...                                                     # new tokens, then the finish

The event loop never waits on the engine: it posts ("add", ...) and ("abort", ...) messages,
which the engine takes between steps, and a receiving thread hands each step's tokens to the
loop in one `call_soon_threadsafe`. A handler that stops listening (its client went away) aborts
its request, which frees its blocks at the next step boundary. At most `max_waiting` requests
may wait for a slot; past that `generate` raises QueueFull (the server answers 429) instead of
letting the queue grow without bound.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from memfit.inference.engine import Limits
from memfit.inference.llm import LLM, Texts
from memfit.inference.sampling_params import SamplingParams
from memfit.inference.server.core import EngineCore, EngineState, QueueInbox, engine_process

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
        self.key: int | None = None
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


def _push_all(pushes: list[tuple[_Sink, Update | BaseException]]) -> None:
    for sink, update in pushes:
        sink.push(update)


class Metrics:
    """The server's Prometheus metrics, in a registry of their own (one per server). With
    several HTTP processes (`memfit serve --api-servers N`, PROMETHEUS_MULTIPROC_DIR set before
    prometheus_client is imported) every process writes them to that directory and `/metrics`
    adds them up: the gauges, the engine's, are each the most recent value."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=r, multiprocess_mode="mostrecent")

        self.running = gauge("memfit_requests_running", "Requests being decoded")
        self.waiting = gauge("memfit_requests_waiting", "Requests waiting for a slot")
        self.kv_used = gauge("memfit_kv_blocks_used", "KV cache blocks in use")
        self.kv_total = gauge("memfit_kv_blocks_total", "KV cache blocks in the pool")
        self.prefix_hits = gauge(
            "memfit_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache"
        )
        self.prefix_rate = gauge(
            "memfit_prefix_cache_hit_rate", "Of the prompt tokens, those found cached"
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
        """The engine of `llm`, stepped by a thread of this process. max_waiting: requests that
        may wait for a slot before new ones are refused. Tokens are handed out after every step,
        pipelined ones too; a request that arrives ends a pipelined run so that it joins at
        once. stream_interval: a stream's tokens go out once this many have come (the first
        token and the last ones at once; vLLM's --stream-interval): fewer events, less host work
        a token, burstier streams."""
        _check_interval(stream_interval)
        self._setup(llm, llm.engine.limits, max_waiting)
        self.llm, self.device = llm, str(llm.device)
        self._inbox = QueueInbox()
        self._post = self._inbox.put
        self._core = EngineCore(
            llm.engine, self._receive, stream_interval=stream_interval, log_interval=log_interval
        )
        self._worker = threading.Thread(target=self._core.run, name="memfit-engine", daemon=True)
        self._state = self._core.state()
        self._update_gauges(self._state)
        self._receiver: threading.Thread | None = None
        self._process, self.handles = None, []

    @classmethod
    def spawn(
        cls,
        model: str,
        *,
        max_waiting: int = 256,
        log_interval: float = 10.0,
        stream_interval: int = 1,
        on_load: Callable[[LLM], None] | None = None,
        api_servers: int = 1,
        **llm_options,
    ) -> AsyncEngine:
        """The engine in a process of its own: `LLM(model, **llm_options)` is built there (this
        returns once it is loaded and warm); this process keeps only the tokenizer. on_load: a
        picklable function called there with the LLM before it serves (instrumentation).
        api_servers: HTTP processes that share the engine; this is the first, and `handles` has
        what each other one passes to `connect`."""
        _check_interval(stream_interval)
        if api_servers < 1:
            raise ValueError(f"api_servers must be >= 1, got {api_servers}")
        context = multiprocessing.get_context("spawn")  # (CUDA does not survive a fork)
        pipes = [
            (context.Pipe(duplex=False), context.Pipe(duplex=False)) for _ in range(api_servers)
        ]
        inboxes = [inbox for (inbox, _), _ in pipes]
        outboxes = [outbox for _, (_, outbox) in pipes]
        core_options = {"stream_interval": stream_interval, "log_interval": log_interval}
        process = context.Process(
            target=engine_process, name="memfit-engine", daemon=True,
            args=(inboxes, outboxes, str(model), llm_options, core_options,
                  logging.getLogger().getEffectiveLevel(), on_load),
        )  # fmt: skip
        process.start()
        for connection in inboxes + outboxes:
            connection.close()  # (the child's ends: a child that dies closes the pipes)
        handles = [
            EngineHandle(to_engine, from_engine) for (_, to_engine), (from_engine, _) in pipes
        ]
        try:
            self = cls.connect(handles[0], max_waiting=max_waiting)
        except RuntimeError:
            process.join(timeout=10)
            raise
        self._process, self.handles = process, handles[1:]
        return self

    @classmethod
    def connect(cls, handle: EngineHandle, *, max_waiting: int = 256) -> AsyncEngine:
        """An HTTP process's side of an engine process that `spawn` started (in this process or
        in the one that passed it `handle`); waits until the engine is ready."""
        try:
            message = handle.from_engine.recv()
        except EOFError:
            raise RuntimeError("the engine process exited before it was ready") from None
        if message[0] == "failed":
            if message[2]:  # the model or an option the user gave: an error to say, not a bug
                raise ValueError(f"the engine could not start: {message[1]}")
            raise RuntimeError(f"the engine process could not start: {message[1]}")
        _, ready, state = message
        self = cls.__new__(cls)
        self._setup(ready["texts"], ready["limits"], max_waiting)
        self.llm, self.device = None, ready["device"]
        self._state = state
        self._update_gauges(state)
        self._process, self.handles = None, []
        self._from_engine = handle.from_engine
        outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._post = outgoing.put
        self._worker = threading.Thread(
            target=_forward, args=(outgoing, handle.to_engine), name="memfit-to-engine",
            daemon=True,
        )  # fmt: skip
        self._receiver = threading.Thread(
            target=self._receive_all, name="memfit-from-engine", daemon=True
        )
        return self

    def _setup(self, texts: Texts, limits: Limits, max_waiting: int) -> None:
        self.texts, self.limits = texts, limits
        self.max_context = limits.max_context
        self.max_waiting = max_waiting
        self.metrics = Metrics()
        self.metrics.kv_total.set(limits.num_blocks)
        self._sinks: dict[int, _Sink] = {}  # by key, the requests not finished
        self._keys = itertools.count()
        self._leaders: dict[object, _Sink] = {}  # the first sample of each group (event loop)
        self._added = 0  # requests posted to the engine
        self._stopping = False
        self.error: BaseException | None = None

    # -- the event loop's side --------------------------------------------------------------

    def start(self) -> None:
        if self._receiver is None:
            self._core.attach(self._inbox)
        self._worker.start()
        if self._receiver is not None:
            self._receiver.start()

    def stop(self) -> None:
        """Stop the engine; an HTTP process that only `connect`ed leaves it to the others."""
        self._stopping = True
        owner = self._receiver is None or self._process is not None
        self._post(("stop",) if owner else _LEAVE)
        self._worker.join(timeout=30)
        if self._process is not None:  # (then its pipe closes, and the receiver ends)
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.terminate()
            self._receiver.join(timeout=10)

    @property
    def state(self) -> EngineState:
        """The engine's gauges as of its last step (peak KV blocks among them)."""
        return self._state

    @property
    def healthy(self) -> bool:
        alive = self._worker.is_alive()
        if self._receiver is not None:
            alive = alive and self._receiver.is_alive()
        if self._process is not None:
            alive = alive and self._process.is_alive()
        return alive and self.error is None

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """ValueError for a request the engine could never run; QueueFull when too many wait."""
        self.limits.check(prompt, params)
        state = self._state
        if self._added - state.taken + state.waiting >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are already waiting")

    async def generate(
        self, prompt: list[int], params: SamplingParams, *, group: object = None
    ) -> AsyncIterator[Update]:
        """The request's updates as the engine makes them; checked first (see `check`). Leaving
        the loop early (a client that went away) aborts the request. `group`: a key shared by
        the samples of one prompt (a request's `n`): they share the prompt's KV blocks."""
        self.check(prompt, params)
        sink = _Sink(asyncio.get_running_loop())
        key = sink.key = next(self._keys)
        follows = None
        if group is not None:
            leader = self._leaders.setdefault(group, sink)
            follows = leader.key if leader is not sink else None
        self._sinks[key] = sink
        self._added += 1
        self.metrics.prompt_tokens.inc(len(prompt))
        self._post(("add", key, prompt, params, follows))
        finished = False
        try:
            while not finished:
                update = await sink.take()
                finished = update.finished
                yield update
        finally:
            if group is not None and self._leaders.get(group) is sink:
                del self._leaders[group]
            if not finished and self._sinks.pop(key, None) is not None:
                self._post(("abort", key))
                self.metrics.finished.labels("abort").inc()

    # -- what the engine sends back (on the engine thread, or the receiving thread) ---------

    def _receive_all(self) -> None:
        connection = self._from_engine
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    code = f" (code {self._process.exitcode})" if self._process is not None else ""
                    self._receive(("error", f"the engine process exited{code}"))
                return
            self._receive(message)

    def _receive(self, message: tuple) -> None:
        if message[0] == "error":
            self.error = RuntimeError(message[1])
            self._dispatch([(sink, self.error) for sink in list(self._sinks.values())])
            return
        _, outputs, state = message
        self._state = state
        metrics, now, pushes, count = self.metrics, time.perf_counter(), [], 0
        for key, tokens, logprobs, finished, reason, text in outputs:
            sink = self._sinks.get(key)
            if sink is None:
                continue  # aborted meanwhile
            if tokens:
                if sink.last_token is None:
                    metrics.ttft.observe(now - sink.added)
                else:
                    gap = (now - sink.last_token) / len(tokens)
                    for _ in tokens:
                        metrics.itl.observe(gap)
                sink.last_token = now
                count += len(tokens)
            if finished:
                self._sinks.pop(key, None)  # (its handler may be leaving at the same time)
                metrics.finished.labels(reason).inc()
            pushes.append((sink, Update(tokens, logprobs, finished, reason, text)))
        if count:
            metrics.tokens.inc(count)
        self._update_gauges(state)  # (before the handlers hear of the finish)
        self._dispatch(pushes)

    def _dispatch(self, pushes: list[tuple[_Sink, Update | BaseException]]) -> None:
        """One wake-up of each event loop for all its sinks' updates."""
        loops: dict[asyncio.AbstractEventLoop, list] = {}
        for sink, update in pushes:
            loops.setdefault(sink.loop, []).append((sink, update))
        for loop, batch in loops.items():
            loop.call_soon_threadsafe(_push_all, batch)

    def _update_gauges(self, state: EngineState) -> None:
        metrics = self.metrics
        metrics.running.set(state.running)
        metrics.waiting.set(state.waiting)
        metrics.kv_used.set(state.kv_used)
        metrics.prefix_hits.set(state.prefix_hits)
        metrics.prefix_rate.set(state.prefix_hits / max(state.prefix_queried, 1))


def _check_interval(stream_interval: int) -> None:
    if stream_interval < 1:
        raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")


_LEAVE = ("leave",)  # (not sent: the pipe closes, and the engine drops this client)


@dataclass
class EngineHandle:
    """What an HTTP process needs to talk to an engine process: its two pipe ends (picklable
    to a spawned process)."""

    to_engine: Connection
    from_engine: Connection


def _forward(outgoing: queue.SimpleQueue, connection) -> None:
    """The messages the event loop posted, to the engine process: all that wait in one send
    (a send may block while the engine is inside a long step; the event loop never does)."""
    while True:
        messages = [outgoing.get()]
        while True:
            try:
                messages.append(outgoing.get_nowait())
            except queue.Empty:
                break
        leave = messages[-1] == _LEAVE
        try:
            connection.send(messages[:-1] if leave else messages)
        except (BrokenPipeError, OSError):
            return
        if leave:
            connection.close()
            return
        if messages[-1] == ("stop",):
            return
