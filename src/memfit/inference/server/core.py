"""The engine's side of the server: a loop that steps an `Engine` and, after every step, hands
each request's new tokens to the HTTP side in one message.

It runs in a process of its own (`memfit serve`'s default, as vLLM's engine core does: the
engine's Python and the HTTP server's then never wait for each other's interpreter lock), or in
a thread of the server's process. Either way it speaks in messages:

    in   [("add", key, prompt, params, follows), ("abort", key), ("stop",)]   (lists of them)
    out  ("step", outputs, state)  after each step, outputs [(key, tokens, logprobs, finished,
                                   finish_reason, text)] of the requests with something new
         ("error", message)        the engine stopped

`key` is the HTTP side's name for a request; `follows` the key of an earlier sample of the same
prompt (its blocks are shared), or None. Several HTTP processes may share one engine (`memfit
serve --api-servers N`): each is a client with its own pair of pipes, its keys its own, and each
hears of its own requests only (and of the gauges).
"""

from __future__ import annotations

import gc
import logging
import queue
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any, NamedTuple

from memfit.inference.engine import Engine

log = logging.getLogger("memfit.serve")


class EngineState(NamedTuple):
    """The engine's gauges after a step, and how many added requests it has taken in."""

    running: int
    waiting: int
    kv_used: int
    kv_total: int
    kv_peak: int
    """The most blocks in use at once since the engine started."""
    prefix_hits: int
    prefix_queried: int
    taken: int


class EngineCore:
    def __init__(
        self,
        engine: Engine,
        emit: Callable[[tuple], Any] | list[Callable[[tuple], Any]],
        *,
        stream_interval: int = 1,
        log_interval: float = 10.0,
    ) -> None:
        """emit: called with each outgoing message (one for each client: a list). stream_interval:
        a request's tokens go out once this many have come (the first at once, the last ones at
        the finish)."""
        self.engine = engine
        self.emits = emit if isinstance(emit, list) else [emit]
        self.stream_interval, self.log_interval = stream_interval, log_interval
        # (client, key) -> engine request id, and tokens sent, of the requests not finished
        self.ids: dict[tuple[int, Any], int] = {}
        self.sent: dict[tuple[int, Any], int] = {}
        self.taken = [0] * len(self.emits)  # each client's requests taken in
        self.stopping = False
        self.generated = 0
        self.inbox: Inbox | None = None

    def attach(self, inbox: Inbox) -> None:
        """Serve the engine from `inbox` (one server an engine): after each step, pipelined ones
        too, its tokens go out, and messages that wait end a pipelined run."""
        if self.engine.on_step is not None:
            raise RuntimeError("this engine is already served (one server at a time)")
        self.inbox = inbox
        self.engine.on_step = self._on_step

    def _on_step(self) -> bool:
        self._deliver()
        return self.stopping or self.inbox.ready()

    def run(self) -> None:
        """Step until a ("stop",) message (or every client has gone); an exception inside the
        engine is sent as ("error", ...) to every client and ends the loop."""
        engine, inbox = self.engine, self.inbox
        last_log, logged = time.perf_counter(), 0
        try:
            while not self.stopping:
                idle = not (engine.waiting or engine.running)
                self._handle(inbox.get(timeout=0.5 if idle else 0.0))
                if self.stopping or not (engine.waiting or engine.running):
                    continue
                if idle:  # (the log's rate counts busy time only)
                    last_log, logged = time.perf_counter(), self.generated
                engine.step()
                now = time.perf_counter()
                if now - last_log >= self.log_interval:
                    state = self.state()
                    log.info(
                        "running %d, waiting %d, %.0f tokens/s, KV blocks %d of %d",
                        state.running, state.waiting, (self.generated - logged) / (now - last_log),
                        state.kv_used, state.kv_total,
                    )  # fmt: skip
                    last_log, logged = now, self.generated
        except BaseException as error:
            log.exception("the engine stopped")
            self._emit_all(("error", f"{type(error).__name__}: {error}"))
        finally:
            engine.on_step = None

    def state(self, client: int = 0) -> EngineState:
        engine, cache = self.engine, self.engine.cache
        pool = cache.pool
        return EngineState(
            len(engine.running), len(engine.waiting), pool.num_blocks - pool.num_free,
            pool.num_blocks, engine.peak_blocks, cache.prefix_hits, cache.prefix_queried,
            self.taken[client],
        )  # fmt: skip

    def _emit_all(self, message: tuple) -> None:
        for emit in self.emits:
            try:
                emit(message)
            except OSError:  # a client that went away
                pass

    def _handle(self, messages: list[tuple[int, tuple]]) -> None:
        aborted = False
        for client, message in messages:
            kind = message[0]
            if kind == "add":
                _, key, prompt, params, follows = message
                leader = self.ids.get((client, follows)) if follows is not None else None
                self.ids[client, key] = self.engine.add(prompt, params, follows=leader)
                self.sent[client, key] = 0
                self.taken[client] += 1
            elif kind == "abort":
                aborted |= self._abort((client, message[1]))
            elif kind == "gone":  # a client's pipe closed: its requests end with it
                for name in [name for name in self.ids if name[0] == client]:
                    aborted |= self._abort(name)
            elif kind == "stop":
                self.stopping = True
        if aborted:  # the freed blocks show at once
            self._deliver()

    def _abort(self, name: tuple[int, Any]) -> bool:
        request_id = self.ids.pop(name, None)
        if request_id is None:
            return False
        del self.sent[name]
        self.engine.abort(request_id)
        self.engine.forget(request_id)
        return True

    def _deliver(self) -> None:
        """Every request's tokens since the last delivery, one message to each client;
        finished requests leave the engine."""
        requests, sent, interval = self.engine.requests, self.sent, self.stream_interval
        outputs: list[list] = [[] for _ in self.emits]
        finished = []
        for name, request_id in self.ids.items():
            request = requests[request_id]
            start = sent[name]
            have = len(request.output)
            if not request.finished and (have == start or (0 < start and have - start < interval)):
                continue  # nothing new, or fewer than stream_interval (the first goes at once)
            logprobs = request.logprobs[start:] if request.logprobs is not None else None
            new = request.output[start:]
            sent[name] = have
            self.generated += len(new)
            client, key = name
            if request.finished:
                outputs[client].append(
                    (key, new, logprobs, True, request.finish_reason, request.text)
                )
                finished.append(name)
            else:
                outputs[client].append((key, new, logprobs, False, "", None))
        for name in finished:
            self.engine.forget(self.ids.pop(name))
            del sent[name]
        state = self.state()
        for client, emit in enumerate(self.emits):
            try:
                emit(("step", outputs[client], state._replace(taken=self.taken[client])))
            except OSError:  # a client that went away (its "gone" is on its way)
                pass


# -- inboxes: where the loop reads its messages -----------------------------------------------


class Inbox:
    def ready(self) -> bool:
        """Whether messages wait (cheap: called after every step)."""
        raise NotImplementedError

    def get(self, timeout: float) -> list[tuple]:
        """The messages that wait, after waiting up to `timeout` seconds for one."""
        raise NotImplementedError


class QueueInbox(Inbox):
    """In one process: the event loop puts, the engine thread gets (one client)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, message: tuple) -> None:
        self.queue.put(message)

    def ready(self) -> bool:
        return not self.queue.empty()

    def get(self, timeout: float) -> list[tuple[int, tuple]]:
        messages = []
        try:
            messages.append(self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait())
            while True:
                messages.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        return [(0, message) for message in messages]


class PipeInbox(Inbox):
    """Across processes: lists of messages through one multiprocessing pipe a client. A client
    whose pipe closes (its process went away) reads as ("gone",); when the last one has gone,
    ("stop",)."""

    def __init__(self, connections) -> None:
        self.clients = {connection: client for client, connection in enumerate(connections)}

    def ready(self) -> bool:
        return bool(wait(list(self.clients), 0))

    def get(self, timeout: float) -> list[tuple[int, tuple]]:
        messages: list[tuple[int, tuple]] = []
        for connection in wait(list(self.clients), timeout):
            client = self.clients[connection]
            try:
                while connection.poll():
                    messages += [(client, message) for message in connection.recv()]
            except (EOFError, OSError):
                del self.clients[connection]
                messages.append((client, ("gone",)))
                if not self.clients:
                    messages.append((client, ("stop",)))
        return messages


# -- the engine process ------------------------------------------------------------------------


def engine_process(
    inboxes: list, outboxes: list, model: str, llm_options: dict, core_options: dict,
    log_level: int, on_load,
) -> None:  # fmt: skip
    """The engine process's main: load the model, tell each client what the server needs to
    know, then step until told to stop. Ctrl-C reaches the server's processes, which stop this
    one in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(log_level)
    try:
        from memfit.inference.llm import LLM, Texts

        llm = LLM(model, **llm_options)
        ready = {
            "texts": Texts(llm.tokenizer, llm.info),
            "limits": llm.engine.limits,
            "device": str(llm.device),
            "block_size": llm.cache.block_size,
        }
    except BaseException as error:  # (the server's process raises it with this text)
        from memfit.train.checkpoint import CheckpointError

        # what a user's input causes (a missing or damaged checkpoint, a bad option) is said in
        # one line; anything else is a bug, and the server shows it as one
        said = isinstance(error, (ValueError, OSError, CheckpointError))
        for outbox in outboxes:
            outbox.send(("failed", f"{type(error).__name__}: {error}", said))
        return
    core = EngineCore(llm.engine, [outbox.send for outbox in outboxes], **core_options)
    core.attach(PipeInbox(inboxes))
    if on_load is not None:
        on_load(llm)
    # what loading left (the model's modules, the tokenizer, the graphs' tensors) is kept out of
    # the collector's full passes: they would scan it all and stall a step now and then
    gc.collect()
    gc.freeze()
    for outbox in outboxes:
        outbox.send(("ready", ready, core.state()))
    core.run()


def configure_logging(level: int) -> None:
    from rich.console import Console
    from rich.logging import RichHandler

    handler = RichHandler(
        console=Console(stderr=True, emoji=False), show_path=False, show_time=False
    )
    logging.basicConfig(level=level, format="%(message)s", handlers=[handler])
