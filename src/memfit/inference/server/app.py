"""The OpenAI-compatible HTTP API (FastAPI): what clients of vLLM, SGLang, TGI or `transformers
serve` already speak.

    POST /v1/completions        prompt (text, token ids, or a list of either), n, stream, ...
    POST /v1/chat/completions   messages rendered by the checkpoint's chat template
    GET  /v1/models, /health, /metrics (Prometheus)

Streams are server-sent events (`data: {...}` chunks, then `data: [DONE]`). Text is decoded
as tokens arrive; a stream holds back the characters that might begin a stop string, and a
character whose bytes are still incomplete, until it knows. Errors have OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 for a request the server cannot run (with
the reason: over the context, an invalid value, an unknown model), 429 when the queue is full,
503 when the engine has stopped. A client that disconnects from a stream aborts its request.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from pydantic import BaseModel, ConfigDict, Field

from memfit.inference.llm import Texts
from memfit.inference.sampling_params import SamplingParams
from memfit.inference.server.async_engine import AsyncEngine, QueueFull, Update
from memfit.inference.server.chat import render_chat

# -- request bodies ---------------------------------------------------------------------------


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # other OpenAI fields are accepted and unused

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    # memfit's (vLLM's) extensions
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    ignore_eos: bool = False
    return_token_ids: bool = False  # each choice's token ids too


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=1)  # the chosen token's only


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0)
    max_completion_tokens: int | None = Field(default=None, ge=1)


OPEN_ENDED = 2**62  # no max_tokens: up to the end of the context (set per prompt)


class ServerError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


# -- the app ----------------------------------------------------------------------------------


def build_app(engine: AsyncEngine, *, model_name: str) -> FastAPI:
    """The API over a started `AsyncEngine`; `model_name` is the id clients ask for."""
    texts = engine.texts
    tokenizer = texts.tokenizer
    eos = tuple(texts.info.generation.eos_token_ids) if texts.info is not None else ()
    chat_template = getattr(texts.info, "chat_template", None)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # what start-up left (the app, the tokenizer, the libraries) is kept out of the
        # collector's full passes, which would scan it all and hold every stream up now and then
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()  # (a server in a thread of a longer-lived process: its garbage again)

    app = FastAPI(title="memfit", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(error)
        return _error(400, message, "invalid_request_error", where)

    @app.exception_handler(ServerError)
    async def server_error(request: Request, error: ServerError) -> JSONResponse:
        return _error(error.status, error.message, error.type, error.param)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        if not engine.healthy:
            return PlainTextResponse("the engine has stopped", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "memfit"}
        card["max_model_len"] = engine.max_context
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(_registry(engine)).decode(),
            media_type="text/plain; version=0.0.4",
        )

    def sampling(body: _Sampling, max_tokens: int | None, logprobs: bool) -> list[SamplingParams]:
        if body.model != model_name:
            raise ServerError(
                400, f"model {body.model!r} is not served here (this server has {model_name!r})",
                "invalid_request_error", "model",
            )  # fmt: skip
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if stop and tokenizer is None:
            raise ServerError(400, "stop strings need a tokenizer", "invalid_request_error", "stop")
        samples = []
        for index in range(body.n):
            try:
                params = SamplingParams(
                    max_tokens=max_tokens or OPEN_ENDED,
                    temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                    seed=None if body.seed is None else body.seed + index, stop=stop,
                    logprobs=logprobs, ignore_eos=body.ignore_eos,
                )  # fmt: skip
            except ValueError as error:
                raise ServerError(400, str(error), "invalid_request_error") from None
            samples.append(params if body.ignore_eos or not eos else params.with_stop_tokens(eos))
        return samples

    tokenizing = BatchTokenizer(texts)

    async def encode(prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if tokenizer is None:
            raise ServerError(400, "this model has no tokenizer (a preset with random weights): "
                              "give prompts as lists of token ids", "invalid_request_error",
                              "prompt")  # fmt: skip
        return await tokenizing.encode(prompt)

    respond = partial(_respond, model=model_name, engine=engine)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ServerError(400, "prompt is empty", "invalid_request_error", "prompt")
        samples = sampling(body, body.max_tokens, body.logprobs is not None)
        ids = await asyncio.gather(*map(encode, prompts))
        jobs = [(p, s) for p in ids for s in samples]
        return await respond(request, jobs, len(samples), body.stream, chat=False,
                             token_ids=body.return_token_ids)  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if chat_template is None or tokenizer is None:
            raise ServerError(
                400, "this model has no chat template (tokenizer_config.json): use /v1/completions",
                "invalid_request_error", "messages",
            )  # fmt: skip
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = render_chat(chat_template, messages, tokenizer)
        except Exception as error:  # the template's own raise_exception, or a bad message
            raise ServerError(400, f"chat template: {error}", "invalid_request_error") from None
        prompt = await tokenizing.encode(text)
        samples = sampling(body, body.max_completion_tokens or body.max_tokens, body.logprobs)
        jobs = [(prompt, s) for s in samples]
        return await respond(request, jobs, len(samples), body.stream, chat=True,
                             token_ids=body.return_token_ids)  # fmt: skip

    return app


def _registry(engine: AsyncEngine) -> CollectorRegistry:
    """This server's metrics; with several HTTP processes, all of theirs added up."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return engine.metrics.registry
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


class BatchTokenizer:
    """Prompt texts tokenized off the event loop, those that arrive together in one
    `encode_batch` call on a thread of its own (vLLM's API server batches them the same way): a
    Rust tokenizer then works on them in parallel without the interpreter lock, where a 1,000-word
    prompt encoded on the loop holds every stream up for about a millisecond."""

    def __init__(self, texts: Texts) -> None:
        self.texts = texts
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def encode(self, text: str) -> list[int]:
        """`texts.encode(text)`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="memfit-tokenize", daemon=True)
            self._thread.start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((text, future, loop))
        return await future

    def _work(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                ids = self.texts.encode_batch([text for text, _, _ in batch])
            except Exception as error:  # (each caller hears of it)
                ids = [error] * len(batch)
            for (_, future, loop), result in zip(batch, ids, strict=True):
                loop.call_soon_threadsafe(_resolve, future, result)


def _resolve(future: asyncio.Future, result) -> None:
    if future.cancelled():
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


# -- answering ----------------------------------------------------------------------------------


class _Text:
    """One choice's text as its tokens arrive: what may be sent now, and the rest at the end.
    Decoded incrementally, a few tokens at a time (the tokens just read give the next ones their
    context: a leading space, a character split across tokens), so that a long answer costs no
    more a token than a short one; the final text is decoded whole."""

    def __init__(self, texts: Texts, prompt: list[int], params: SamplingParams) -> None:
        self.texts, self.prompt = texts, prompt
        self.tokens: list[int] = []
        self.text = ""  # decoded so far
        self.sent = ""  # of it, what went out (a possible stop string's start is held back)
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self._window = list(prompt[-4:])  # the context tokens, then those not yet decoded
        self._read = len(self._window)

    def add(self, update: Update) -> str:
        self.tokens += update.token_ids
        if self.texts.tokenizer is None:
            return ""
        if update.finished:
            text = update.text if update.text is not None else self._decode()
            new, self.sent = text[len(self.sent) :], text
            return new
        self._window += update.token_ids
        decode = self.texts.tokenizer.decode
        before, after = decode(self._window[: self._read]), decode(self._window)
        if len(after) > len(before) and not after.endswith("\ufffd"):  # no bytes still to come
            self.text += after[len(before) :]
            self._window = self._window[self._read :]
            self._read = len(self._window)
        safe = len(self.text) - self.hold
        if safe <= len(self.sent):
            return ""
        new, self.sent = self.text[len(self.sent) : safe], self.text[:safe]
        return new

    def _decode(self) -> str:
        return self.texts.continuation(self.prompt, self.tokens)

    def token_text(self, token: int) -> str:
        tokenizer = self.texts.tokenizer
        return tokenizer.decode([token]) if tokenizer is not None else str(token)


async def _respond(
    request: Request, jobs, n: int, stream: bool, *, chat: bool, model: str, engine, token_ids
):
    """Run every job (prompt, params) at once; `n` choices per prompt, in order."""
    context = engine.max_context
    jobs = [
        (p, replace(s, max_tokens=max(context - len(p), 1)) if s.max_tokens == OPEN_ENDED else s)
        for p, s in jobs
    ]
    for prompt, params in jobs:  # every choice checked before any runs
        try:
            engine.check(prompt, params)
        except QueueFull as error:
            raise ServerError(429, str(error), "rate_limit_exceeded") from None
        except ValueError as error:
            raise ServerError(400, str(error), "invalid_request_error", "prompt") from None
    if not engine.healthy:
        raise ServerError(503, "the engine has stopped", "server_error")
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    texts = [_Text(engine.texts, prompt, params) for prompt, params in jobs]
    # the n samples of each prompt share its KV blocks
    updates = _merged(
        [engine.generate(p, params, group=(ident, i // n)) for i, (p, params) in enumerate(jobs)]
    )
    if stream:
        events = _stream(updates, texts, ident, created, model, chat, token_ids)
        return StreamingResponse(events, media_type="text/event-stream")
    content, logprobs, reasons = [""] * len(jobs), [[] for _ in jobs], [""] * len(jobs)

    async def collect() -> None:
        async for index, update in updates:
            content[index] += texts[index].add(update)
            logprobs[index] += update.logprobs or []
            reasons[index] = update.finish_reason

    # a client that disconnects aborts its requests (a stream notices by itself: writing to a
    # closed connection ends it; here nothing is written until the end)
    collecting = asyncio.create_task(collect())
    while not (await asyncio.wait({collecting}, timeout=0.25))[0]:
        if await request.is_disconnected():
            collecting.cancel()
            await asyncio.gather(collecting, return_exceptions=True)
            return Response(status_code=499)  # nobody to answer ("client closed request")
    collecting.result()  # the engine's error, if it stopped
    choices = [
        _choice(i, content[i], texts[i], logprobs[i], reasons[i], chat, True, None, token_ids)
        for i in range(len(jobs))
    ]
    prompt_tokens = sum(len(prompt) for prompt, _ in jobs[::n])
    completion_tokens = sum(len(t.tokens) for t in texts)
    body = {
        "id": ident, "object": "chat.completion" if chat else "text_completion",
        "created": created, "model": model, "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }  # fmt: skip
    return JSONResponse(body)


async def _merged(streams: list) -> AsyncIterator[tuple[int, Update]]:
    """The updates of several requests as they come, tagged with their index; all requests
    start at once. Closing this generator (a client gone) aborts those still running."""
    if len(streams) == 1:  # the common case: no queue between
        try:
            async for update in streams[0]:
                yield 0, update
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for update in streams[index]:
                await queue.put((index, update))
        except Exception as error:  # the engine stopped: the handler hears of it
            await queue.put((index, error))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        open_streams = len(streams)
        while open_streams:
            index, update = await queue.get()
            if update is None:
                open_streams -= 1
            elif isinstance(update, Exception):
                raise update
            else:
                yield index, update
    finally:
        for task in tasks:  # cancelled, each stream's generator aborts its request
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _choice(index, text, sample, logprobs, reason, chat, final, new=None, token_ids=False) -> dict:
    """One choice of a response (final) or of a stream's chunk; `new`: the chunk's tokens;
    `token_ids`: the tokens' ids too (a memfit and vLLM extension)."""
    choice = _choice_body(index, text, sample, logprobs, reason, chat, final, new)
    if token_ids:
        choice["token_ids"] = sample.tokens if new is None else new
    return choice


def _choice_body(index, text, sample: _Text, logprobs, reason, chat: bool, final: bool, new):
    tokens = sample.tokens if new is None else new
    reason = reason or None
    if chat:
        logs = None
        if logprobs:
            content = [
                {"token": sample.token_text(t), "logprob": lp}
                for t, lp in zip(tokens, logprobs, strict=False)
            ]
            logs = {"content": content}
        key, value = (
            ("message", {"role": "assistant", "content": text})
            if final
            else ("delta", {"content": text})
        )
        return {"index": index, key: value, "logprobs": logs, "finish_reason": reason}
    logs = None
    if logprobs:
        logs = {"token_logprobs": logprobs, "tokens": [sample.token_text(t) for t in tokens]}
    return {"index": index, "text": text, "logprobs": logs, "finish_reason": reason}


async def _stream(updates, texts, ident, created, model, chat, token_ids) -> AsyncIterator[str]:
    """Server-sent events of every choice, interleaved as their tokens come."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = json.dumps({"id": ident, "object": kind, "created": created, "model": model})
    head = f'data: {head[:-1]}, "choices": ['  # the same for every chunk: encoded once
    try:
        if chat:
            for index in range(len(texts)):
                chunk = {"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}  # fmt: skip
                yield f"{head}{json.dumps(chunk)}]}}\n\n"
        async for index, update in updates:
            text = texts[index]
            before = len(text.tokens)
            delta = text.add(update)
            if not delta and not update.finished and not (update.logprobs or token_ids):
                continue
            new = text.tokens[before:]
            chunk = _choice(
                index,
                delta,
                text,
                update.logprobs,
                update.finish_reason,
                chat,
                False,
                new,
                token_ids,
            )
            yield f"{head}{json.dumps(chunk)}]}}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await updates.aclose()
