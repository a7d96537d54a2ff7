"""`memfit serve` over real HTTP on localhost (uvicorn in a thread), a tiny checkpoint saved by
transformers with a tokenizer and a chat template: httpx and the `openai` client as users call
it, with the engine in a process of its own (as `memfit serve` runs it) and in a thread.
Streamed and non-streamed outputs equal the offline engine's; concurrent streams all finish; a
client that disconnects frees its blocks; bad requests get OpenAI-style 400s and the server
keeps serving; a full queue answers 429; an engine process that dies turns /health to 503; an
fp8 KV cache and int8 / int4 weights serve the offline engine's tokens in the same setting."""

import asyncio
import json
import time

import httpx
import pytest
import torch

from memfit.inference import LLM, SamplingParams
from memfit.inference.server import AsyncEngine, BackgroundServer
from tests.inference.test_llm import _write_tokenizer
from tests.models.test_loading import _save_transformers_model

CHAT = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant{% endif %}"  # noqa: E501


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    _save_transformers_model(path, "llama")
    _write_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT}))
    return path


class Server(BackgroundServer):
    def __init__(self, engine: AsyncEngine):
        super().__init__(engine, model_name="tiny")

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(f"{name} not in {httpx.get(f'{self.url}/metrics').text}")

    def slow_steps(self, monkeypatch) -> None:
        """5 ms a step (an engine process is slowed from its start: `_slow_steps`)."""
        if self.engine.llm is not None:
            engine = self.engine.llm.engine
            monkeypatch.setattr(engine, "on_step", _slowed(engine.on_step))


def _slowed(on_step):
    """5 ms a step: a request of hundreds of tokens outlasts the client that leaves it."""
    return lambda: time.sleep(0.005) or on_step()


def _slow_steps(llm) -> None:  # (in the engine process)
    llm.engine.on_step = _slowed(llm.engine.on_step)


DEVICES = {
    "cpu": {"device": "cpu", "dtype": "fp32"},
    # the GPU twin: CUDA graphs, pipelined decode and the compiled sampler in the engine thread
    "cuda": {"device": "cuda", "dtype": "fp32", "kv_cache_bytes": 64 << 20},
}


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
    ],
)  # fmt: skip
def device(request):
    return request.param


@pytest.fixture(scope="module", params=["process", "thread"])
def server(request, checkpoint, device):
    options = {"block_size": 4, "prefix_caching": True, **DEVICES[device]}
    if request.param == "process":
        engine = AsyncEngine.spawn(str(checkpoint), on_load=_slow_steps, **options)
    else:
        engine = AsyncEngine(LLM(checkpoint, **options))
    server = Server(engine)
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(checkpoint, device):
    """The offline API on its own LLM (an engine is stepped by one thread only)."""
    return LLM(checkpoint, block_size=4, **DEVICES[device])


def offline(llm, prompt_ids, params):
    return llm.generate([prompt_ids], params, progress=False)[0]


def test_health_models_and_metrics(server):
    assert httpx.get(f"{server.url}/health").text == "ok"
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    assert server.metric("memfit_kv_blocks_total") > 0


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_the_offline_engine(server, reference, stream):
    body = {"model": "tiny", "prompt": "w5 w9 w12", "max_tokens": 8, "temperature": 0.9,
            "seed": 3, "n": 2, "return_token_ids": True, "logprobs": 1, "ignore_eos": True}  # fmt: skip
    prompt_ids = reference.encode("w5 w9 w12")
    expected = [
        offline(reference, prompt_ids, SamplingParams(max_tokens=8, temperature=0.9, seed=3 + i,
                                                logprobs=True, ignore_eos=True))
        for i in range(2)
    ]  # fmt: skip
    if not stream:
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        choices = sorted(response["choices"], key=lambda c: c["index"])
        assert response["usage"]["completion_tokens"] == 16
    else:
        choices = [{"text": "", "token_ids": [], "logprobs": []} for _ in range(2)]
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as response:  # fmt: skip
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in map(json.loads, events[:-1]):
            (choice,) = event["choices"]
            got = choices[choice["index"]]
            got["text"] += choice["text"]
            got["token_ids"] += choice["token_ids"]
            if choice["logprobs"]:
                got["logprobs"] += choice["logprobs"]["token_logprobs"]
            got["finish_reason"] = choice["finish_reason"]
    for got, want in zip(choices, expected, strict=True):
        assert got["token_ids"] == want.token_ids
        assert got["text"] == want.text and got["finish_reason"] == "length"
        logprobs = got["logprobs"] if stream else got["logprobs"]["token_logprobs"]
        assert logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_chat_with_the_openai_client(server, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    messages = [{"role": "user", "content": "w7 w8"}]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0
    )
    prompt = reference.tokenizer.encode("user w7 w8 assistant")
    want = offline(reference, prompt, SamplingParams(max_tokens=6))
    assert reply.choices[0].message.content == want.text
    chunks = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == want.text
    # no max_tokens: up to a stop token or the end of the context
    reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0)
    longest = reference.engine.max_context - len(prompt)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= longest


def test_concurrent_streams_all_finish(server):
    async def one(client, i):
        body = {"model": "tiny", "prompt": [5 + i, 9, 11], "max_tokens": 5 + i % 7,
                "temperature": 0.8, "seed": i, "stream": True, "return_token_ids": True,
                "ignore_eos": True}  # fmt: skip
        tokens = []
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
        return len(tokens) == 5 + i % 7

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert all(asyncio.run(main()))
    assert server.metric("memfit_kv_blocks_used") == 0


def test_a_client_that_disconnects_frees_its_blocks(server, monkeypatch):
    server.slow_steps(monkeypatch)
    longest = server.engine.max_context - 3
    aborted = 'memfit_requests_finished_total{finish_reason="abort"}'
    aborts = server.metric(aborted) if "abort" in httpx.get(f"{server.url}/metrics").text else 0
    generated = server.metric("memfit_generated_tokens_total")
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": longest, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then gone
    deadline = time.time() + 30
    while server.metric("memfit_kv_blocks_used") > 0 and time.time() < deadline:
        time.sleep(0.05)
    assert server.metric("memfit_kv_blocks_used") == 0
    assert server.metric(aborted) == aborts + 1
    assert server.metric("memfit_generated_tokens_total") - generated < longest


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("{not json", "JSON"),
        ({"model": "other", "prompt": "w5"}, "is not served here"),
        ({"model": "tiny", "prompt": "w5", "max_tokens": -1}, "max_tokens"),
        ({"model": "tiny", "prompt": [5] * 600, "max_tokens": 4}, "exceeds"),
        ({"model": "tiny", "prompt": "w5", "temperature": "hot"}, "temperature"),
        ({"model": "tiny", "prompt": [99999]}, "not a token id"),
    ],
)
def test_bad_requests_get_a_400_and_the_server_keeps_serving(server, body, message):
    if isinstance(body, str):
        response = httpx.post(f"{server.url}/v1/completions", content=body,
                              headers={"content-type": "application/json"})  # fmt: skip
    else:
        response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    ok = httpx.post(
        f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "w5", "max_tokens": 2}
    )
    assert ok.status_code == 200


def test_a_full_queue_answers_429(checkpoint, device):
    llm = LLM(checkpoint, block_size=4, **DEVICES[device])
    server = Server(AsyncEngine(llm, max_waiting=0))
    try:
        with pytest.raises(RuntimeError, match="already served"):  # one engine thread an engine
            AsyncEngine(llm).start()
        response = httpx.post(f"{server.url}/v1/completions",
                              json={"model": "tiny", "prompt": "w5", "max_tokens": 2})  # fmt: skip
        assert response.status_code == 429
        assert response.json()["error"]["type"] == "rate_limit_exceeded"
    finally:
        server.close()


def test_a_stream_interval_sends_tokens_in_groups(checkpoint, device, reference):
    """stream_interval=4: the first token at once, then events of at least 4 tokens (the last
    may hold fewer); the same tokens as the offline engine."""
    llm = LLM(checkpoint, block_size=4, **DEVICES[device])
    server = Server(AsyncEngine(llm, stream_interval=4))
    try:
        body = {"model": "tiny", "prompt": "w5 w9", "max_tokens": 11, "temperature": 0,
                "stream": True, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        groups = [len(e["choices"][0]["token_ids"]) for e in events]
        want = offline(reference, reference.encode("w5 w9"),
                       SamplingParams(max_tokens=11, ignore_eos=True))  # fmt: skip
        assert [t for e in events for t in e["choices"][0]["token_ids"]] == want.token_ids
        assert groups[0] == 1 and all(g >= 4 for g in groups[1:-1]) and sum(groups) == 11
        assert len(groups) <= 4
    finally:
        server.close()
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncEngine(llm, stream_interval=0)


def test_a_shared_prefix_is_computed_once(server, reference):
    """Two requests behind one 14-token prefix: the same tokens as each alone, and the second
    finds the first's 3 full blocks (12 tokens, block size 4) in the prefix cache."""
    prefix = " ".join(f"w{4 + i}" for i in range(14))
    hits = server.metric("memfit_prefix_cache_hit_tokens")
    for suffix in (" w40 w41", " w50"):
        body = {"model": "tiny", "prompt": prefix + suffix, "max_tokens": 5, "temperature": 0,
                "return_token_ids": True}  # fmt: skip
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        want = offline(reference, reference.encode(prefix + suffix), SamplingParams(max_tokens=5))
        assert got["choices"][0]["token_ids"] == want.token_ids
    assert server.metric("memfit_prefix_cache_hit_tokens") - hits >= 12


def test_n_samples_share_the_prompt_blocks(server, reference):
    """n = 4 of one 14-token prompt: the three followers start on the first's 3 cached full
    blocks (36 prompt tokens found cached); all four greedy samples equal the offline one."""
    prompt = " ".join(f"w{30 + i}" for i in range(14))
    hits = server.metric("memfit_prefix_cache_hit_tokens")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "n": 4,
            "return_token_ids": True}  # fmt: skip
    got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    want = offline(reference, reference.encode(prompt), SamplingParams(max_tokens=5))
    assert [c["token_ids"] for c in got["choices"]] == [want.token_ids] * 4
    assert got["usage"]["prompt_tokens"] == 14
    assert server.metric("memfit_prefix_cache_hit_tokens") - hits >= 36


def test_a_client_that_leaves_a_non_streamed_request_aborts_it(server, monkeypatch):
    server.slow_steps(monkeypatch)
    longest = server.engine.max_context - 3
    aborted = 'memfit_requests_finished_total{finish_reason="abort"}'
    aborts = server.metric(aborted) if "abort" in httpx.get(f"{server.url}/metrics").text else 0
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": longest, "ignore_eos": True,
            "n": 16}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before the answer
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.1)
    deadline = time.time() + 30
    while server.metric("memfit_kv_blocks_used") > 0 and time.time() < deadline:
        time.sleep(0.05)
    assert server.metric("memfit_kv_blocks_used") == 0
    assert server.metric(aborted) == aborts + 16


def test_an_engine_process_that_cannot_load_says_why(tmp_path):
    with pytest.raises(ValueError, match="could not start: FileNotFoundError: no checkpoint"):
        AsyncEngine.spawn(str(tmp_path / "missing"), device="cpu")


def test_an_engine_process_that_dies_turns_health_to_503(checkpoint):
    server = Server(AsyncEngine.spawn(str(checkpoint), block_size=4, device="cpu", dtype="fp32"))
    try:
        body = {"model": "tiny", "prompt": "w5", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
        server.engine._process.kill()
        deadline = time.time() + 30
        while httpx.get(f"{server.url}/health").status_code == 200 and time.time() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{server.url}/health").status_code == 503
        response = httpx.post(f"{server.url}/v1/completions", json=body)
        assert response.status_code == 503 and "stopped" in response.json()["error"]["message"]
    finally:
        server.close()


def test_prompts_arriving_together_are_tokenized_in_one_batch(checkpoint):
    """BatchTokenizer: texts encoded off the event loop, those that wait together in one
    encode_batch call; the ids of the model's own encode (an empty text: its start token); a
    tokenizer that fails fails each caller."""
    from memfit.inference.llm import Texts
    from memfit.inference.server.app import BatchTokenizer

    reference = LLM(checkpoint, block_size=4, device="cpu", dtype="fp32")
    texts = Texts(reference.tokenizer, reference.info)
    calls = []
    encode_batch = texts.encode_batch
    texts.encode_batch = lambda prompts: calls.append(len(prompts)) or encode_batch(prompts)
    batcher = BatchTokenizer(texts)
    prompts = [" ".join(f"w{5 + (i * j) % 40}" for j in range(i + 1)) for i in range(40)] + [""]

    async def main():
        return await asyncio.gather(*(batcher.encode(p) for p in prompts))

    assert asyncio.run(main()) == [reference.encode(p) for p in prompts]
    assert sum(calls) == len(prompts) and len(calls) < len(prompts)
    texts.encode_batch = lambda prompts: 1 / 0
    with pytest.raises(ZeroDivisionError):
        asyncio.run(batcher.encode("w5"))


def test_two_http_servers_share_one_engine_process(checkpoint, reference):
    """api_servers=2: a second HTTP side `connect`s to the engine process (here in this process,
    as `memfit serve --api-servers 2` does in another). Requests through both at once give the
    offline engine's tokens, each server hears of its own requests only, and when the second
    leaves the first keeps serving."""
    engine = AsyncEngine.spawn(
        str(checkpoint), api_servers=2, block_size=4, device="cpu", dtype="fp32"
    )
    first = Server(engine)
    second = Server(AsyncEngine.connect(engine.handles[0]))
    try:
        prompts = [f"w{5 + i} w{9 + i}" for i in range(8)]

        async def one(url, prompt):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "return_token_ids": True, "ignore_eos": True}  # fmt: skip
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                response = await client.post("/v1/completions", json=body)
            return response.json()["choices"][0]["token_ids"]

        async def main():
            servers = [first.url, second.url] * 4
            return await asyncio.gather(*map(one, servers, prompts))

        got = asyncio.run(main())
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        assert got == [offline(reference, reference.encode(p), params).token_ids for p in prompts]
        for server in (first, second):  # 4 requests each, of 6 tokens
            assert server.metric("memfit_generated_tokens_total") == 24
        second.close()
        assert httpx.post(f"{first.url}/v1/completions",
                          json={"model": "tiny", "prompt": "w5", "max_tokens": 2}).status_code == 200  # fmt: skip
        assert first.metric("memfit_kv_blocks_used") == 0 and first.engine.healthy
    finally:
        first.close()


def test_an_fp8_kv_cache_serves_the_offline_engines_tokens(checkpoint, monkeypatch):
    """`memfit serve --kv-cache-dtype fp8`: the engine process calibrates its fp8 cache as an
    offline LLM does; chat through the openai client, streamed or not, gives the offline fp8
    engine's text, and a client leaving mid-stream frees its blocks."""
    openai = pytest.importorskip("openai")
    options = {"block_size": 4, "kv_cache_dtype": "fp8", **DEVICES["cpu"]}
    reference = LLM(checkpoint, **options)
    server = Server(AsyncEngine.spawn(str(checkpoint), on_load=_slow_steps, **options))
    try:
        assert server.metric("memfit_kv_blocks_total") == reference.cache.pool.num_blocks
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        messages = [{"role": "user", "content": "w7 w8 w3"}]
        prompt = reference.tokenizer.encode("user w7 w8 w3 assistant")
        want = offline(reference, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        options = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0,
                   "extra_body": {"ignore_eos": True}}  # fmt: skip
        assert client.chat.completions.create(**options).choices[0].message.content == want.text
        chunks = client.chat.completions.create(**options, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
        test_a_client_that_disconnects_frees_its_blocks(server, monkeypatch)
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_weights_serve_the_offline_engines_tokens(checkpoint, kind, monkeypatch):
    """`memfit serve --quantize int8|int4`: the engine process quantizes the checkpoint at load
    as an offline LLM does (the blocks' weights, and the output head in int8); completions,
    greedy and seeded sampling, streamed or not, give the offline quantized engine's tokens and
    log-probabilities, which are not the full-precision model's; a client that leaves mid-stream
    frees its blocks."""
    options = {"block_size": 4, "quantize": kind, **DEVICES["cpu"]}
    reference = LLM(checkpoint, **options)
    full = LLM(checkpoint, block_size=4, **DEVICES["cpu"])
    server = Server(AsyncEngine.spawn(str(checkpoint), on_load=_slow_steps, **options))
    try:
        assert server.metric("memfit_kv_blocks_total") == reference.cache.pool.num_blocks
        prompt_ids = reference.encode("w5 w9 w12")
        for temperature in (0.0, 0.9):
            params = SamplingParams(
                max_tokens=10, temperature=temperature, seed=5, logprobs=True, ignore_eos=True
            )
            want = offline(reference, prompt_ids, params)
            body = {"model": "tiny", "prompt": "w5 w9 w12", "max_tokens": 10, "seed": 5,
                    "temperature": temperature, "return_token_ids": True, "logprobs": 1,
                    "ignore_eos": True}  # fmt: skip
            got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
            choice = got["choices"][0]
            assert choice["token_ids"] == want.token_ids
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
            with httpx.stream("POST", f"{server.url}/v1/completions",
                              json={**body, "stream": True}, timeout=60) as response:  # fmt: skip
                events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            streamed = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
            assert streamed == want.token_ids
        # the full-precision model scores the same tokens otherwise: a server that ignored
        # --quantize would fail the log-probabilities above
        unquantized = offline(full, prompt_ids, SamplingParams(
            max_tokens=10, logprobs=True, ignore_eos=True))  # fmt: skip
        greedy = offline(reference, prompt_ids, SamplingParams(
            max_tokens=10, logprobs=True, ignore_eos=True))  # fmt: skip
        assert unquantized.logprobs != pytest.approx(greedy.logprobs, abs=1e-4)
        test_a_client_that_disconnects_frees_its_blocks(server, monkeypatch)
    finally:
        server.close()
