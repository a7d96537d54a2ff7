"""The offline API: a model, its tokenizer, a paged KV cache sized to the GPU and the engine, in
one object, in the shape people know from vLLM.

    from memfit.inference import LLM, SamplingParams

    llm = LLM("path/to/hf-checkpoint")            # or a memfit checkpoint, or a preset name
    for out in llm.generate(["The capital of France is"], SamplingParams(max_tokens=32)):
        print(out.text)

The KV pool takes what is left of `memory_fraction` of the GPU after the weights and the
largest step's activations (memfit.planner.serve plans the same numbers, `memfit plan --serve`
prints them). A preset name builds that shape with random weights (seeded), for benchmarks and
tests; its prompts are token ids, there being no tokenizer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from memfit.inference.engine import Engine
from memfit.inference.paged_cache import KV_DTYPES, PagedKVCache
from memfit.inference.sampling_params import SamplingParams

if TYPE_CHECKING:
    from memfit.train.data import Tokenizer

GiB = 2**30
CPU_KV_BYTES = 256 * 2**20
"""The KV pool on a CPU, where there is no device memory to fill (kv_cache_bytes sets another)."""
KV_CALIBRATION_ROWS = (2, 256)  # (rows, tokens) of random ids a quantized KV cache calibrates on
KV_FIRST_ROWS = 32  # and rows of one random id: the first position's own offsets (PagedKVCache)


def kv_calibration_rows(vocab: int) -> list[list[int]]:
    """The token rows (random ids, seeded) a quantized KV cache calibrates on: KV_CALIBRATION_ROWS
    for the offsets and scales, and KV_FIRST_ROWS one-token rows for the first position's."""
    generator = torch.Generator().manual_seed(0)
    rows, length = KV_CALIBRATION_ROWS
    ids = torch.randint(0, vocab, (rows, length), generator=generator).tolist()
    return ids + torch.randint(0, vocab, (KV_FIRST_ROWS, 1), generator=generator).tolist()


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    """"stop" (a stop token or string) or "length" (max_tokens)."""
    logprobs: list[float] | None = None


def _build_preset(name: str, device: torch.device, dtype: torch.dtype, seed: int, on_block=None):
    """A preset's model with random weights, made on the meta device and allocated straight in
    `dtype` (no fp32 copy); with `on_block`, one block at a time, `on_block(model, index)` called
    on each as soon as its weights are drawn (quantization: the model is never whole in
    `dtype`)."""
    from memfit.models import PRESETS, get_family

    config = PRESETS[name]
    model = get_family(config.family).build(config, device="meta").to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    if on_block is None:
        model.to_empty(device=device)
        model.init_weights(generator)
        return model.eval(), None
    for child, module in model.named_children():  # in the order init_weights draws them
        if child != "layers":
            module.to_empty(device=device)
            model.init_weights(generator, part=child)
            continue
        for index, block in enumerate(model.layers):
            block.to_empty(device=device)
            model.init_weights(generator, part=f"layers.{index}")
            on_block(model, index)
    return model.eval(), None


def _load(
    model: str | os.PathLike, device: torch.device, dtype: torch.dtype, seed: int,
    quantize: str | None = None,
):  # fmt: skip
    """The model and its checkpoint info; with `quantize` ('int8', 'int4') the blocks' linear
    weights quantized as they arrive (memfit.nn.quant.quantize_model), one block at a time: the
    model is never whole in `dtype` on `device`."""
    from memfit.models import PRESETS
    from memfit.nn.quant import quantize_model

    def on_block(loaded: torch.nn.Module, index: int) -> None:
        quantize_model(loaded, quantize, dtype=dtype, blocks=[index])

    if isinstance(model, str) and model in PRESETS:
        built, info = _build_preset(model, device, dtype, seed, on_block if quantize else None)
        return built, info
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(
            f"no checkpoint found at {str(model)!r}, and it is no model preset either "
            f"({', '.join(PRESETS)})"
        )
    from memfit.models.loading import load_pretrained
    from memfit.models.quantized import stored_quantization

    stored = stored_quantization(path)
    if stored is not None and quantize not in (None, stored):
        raise ValueError(
            f"{str(path)!r} holds {stored}-quantized weights; load it with quantize={stored!r} "
            f"(--quantize {stored}) or none, not {quantize!r}"
        )
    if stored is not None:  # quantized as stored
        quantize = None

    loaded, info = load_pretrained(
        path, device=device, dtype=dtype, on_block=on_block if quantize else None
    )
    return loaded.eval(), info


class Texts:
    """A model's text side: its tokenizer and checkpoint info (chat template, stop tokens), prompt
    text to token ids and output tokens back to text. An `LLM` is one; the HTTP process of
    `memfit serve` holds one without the model, which lives in the engine's process."""

    def __init__(self, tokenizer, info) -> None:
        self.tokenizer, self.info = tokenizer, info

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this model has no tokenizer (a preset with random weights): give prompts as "
                    "lists of token ids"
                )
            ids = self.tokenizer.encode(prompt)
            if not ids:  # an empty prompt starts a fresh document
                start = self.tokenizer.bos_id
                ids = [start if start is not None else self.tokenizer.eos_id]
            return ids
        return list(prompt)

    def encode_batch(self, prompts: list[str]) -> list[list[int]]:
        """`encode` of each text, in one call of the tokenizer's `encode_batch` where it has one
        (a Rust tokenizer then works on them in parallel, without the interpreter lock)."""
        encode_batch = getattr(self.tokenizer, "encode_batch", None)
        if encode_batch is None or not prompts:
            return [self.encode(p) for p in prompts]
        encoded = encode_batch(prompts)
        return [ids if ids else self.encode("") for ids in encoded]

    def continuation(self, prompt: list[int], output: list[int]) -> str:
        """The output's text as it continues the prompt: decoded after the prompt's last tokens
        and cut after their text, so a leading space or a character split across the boundary
        comes out as the stop-string checker (memfit.inference.sampling) makes it."""
        context = prompt[-4:]
        return self.tokenizer.decode(context + output)[len(self.tokenizer.decode(context)) :]


class LLM(Texts):
    def __init__(
        self,
        model: str | os.PathLike,
        *,
        device: str | torch.device | None = None,
        dtype: str | None = None,
        memory_fraction: float = 0.9,
        kv_cache_bytes: int | None = None,
        block_size: int = 16,
        max_seq_len: int | None = None,
        max_step_tokens: int = 2048,
        max_running: int = 256,
        cuda_graphs: bool | None = None,
        step_graphs: bool = True,
        seed: int = 0,
        prefix_caching: bool = False,
        tokenizer: Tokenizer | None = None,
        quantize: str | None = None,
        quantize_head: bool = True,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """model: a Hugging Face checkpoint directory, a memfit checkpoint, or a preset name.
        dtype: bf16, fp16 or fp32 (default bf16 on CUDA, fp32 on a CPU). memory_fraction: of the
        GPU's memory, for weights, activations and the KV pool together (vLLM's
        gpu_memory_utilization); kv_cache_bytes instead sets the pool directly (on a CPU:
        CPU_KV_BYTES by default). max_seq_len: the longest prompt + output a request may reach
        (default: the model's context). cuda_graphs: capture decode steps (default: on CUDA), and
        with step_graphs the steps that mix prefill chunks and decodes too.
        prefix_caching: requests reuse the KV blocks of a prefix computed before (a shared
        system prompt is computed once; `memfit serve` turns it on). tokenizer: one to use instead
        of the checkpoint's (memfit.train.data.load_tokenizer makes one); it may not have more
        tokens than the model has embeddings. quantize: 'int8' (per output channel) or 'int4'
        (groups of 128 input features, asymmetric) weight-only quantization of the blocks' linear
        layers at load (memfit.nn.quant; the embedding stays in `dtype`), and with
        quantize_head the output head in int8 (memfit.nn.quant.quantize_head): a decode step
        reads half or about a third of the bytes. A quantized checkpoint
        (memfit.models.quantized, `memfit export --quantize`) loads as it is stored; asking it
        for another kind is an error. kv_cache_dtype: 'auto' (the KV cache in `dtype`), 'fp8'
        (e4m3) or 'int8', with per-head scales: twice the tokens in the same memory
        (memfit.inference.PagedKVCache), calibrated at load on `kv_calibration_rows` (random
        token ids)."""
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        for name, value in (
            ("max_seq_len", max_seq_len),
            ("block_size", block_size),
            ("max_step_tokens", max_step_tokens),
            ("max_running", max_running),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or ("bf16" if self.device.type == "cuda" else "fp32")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        torch_dtype = _DTYPES[dtype]
        if quantize not in (None, "int8", "int4"):
            raise ValueError(f"quantize must be 'int8' or 'int4' (or None), got {quantize!r}")
        if kv_cache_dtype not in ("auto", *KV_DTYPES):
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or one of {list(KV_DTYPES)}, got {kv_cache_dtype!r}"
            )
        self.kv_cache_dtype = kv_cache_dtype
        kv_dtype = None if kv_cache_dtype == "auto" else kv_cache_dtype
        self.model, info = _load(model, self.device, torch_dtype, seed, quantize)
        # (a quantized checkpoint: the kind it holds)
        self.quantize = getattr(info, "quantize", None) or quantize
        if self.quantize and quantize_head:
            from memfit.nn.quant import quantize_head as int8_head

            int8_head(self.model, dtype=torch_dtype)
        super().__init__(tokenizer or getattr(info, "tokenizer", None), info)
        self.config = self.model.config
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.config.vocab_size:
            # its larger ids would index past the embedding table
            raise ValueError(
                f"tokenizer {self.tokenizer.name!r} has "
                f"{self.tokenizer.vocab_size} tokens but model {self.config.name!r} has only "
                f"{self.config.vocab_size} embeddings; use the model's own tokenizer"
            )
        self.block_size = block_size
        max_seq_len = max_seq_len or self.config.max_seq_len
        graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if kv_cache_bytes is None:
            kv_cache_bytes = (
                self._kv_budget(memory_fraction, max_step_tokens, max_running, max_seq_len, graphs)
                if self.device.type == "cuda"
                else CPU_KV_BYTES
            )
        self.cache = PagedKVCache.from_budget(
            self.config,
            kv_cache_bytes,
            block_size=block_size,
            dtype=torch_dtype,
            device=self.device,
            kv_dtype=kv_dtype,
        )
        if kv_dtype:
            self._calibrate_kv()
        self.engine = Engine(
            self.model, self.cache, max_step_tokens=max_step_tokens, max_running=max_running,
            max_seq_len=max_seq_len, cuda_graphs=graphs, step_graphs=step_graphs, seed=seed,
            prefix_caching=prefix_caching,
            decode=self.tokenizer.decode if self.tokenizer is not None else None,
        )  # fmt: skip
        self.last_stats: dict = {}
        if self.device.type == "cuda":
            self._warm_up()

    def _calibrate_kv(self) -> None:
        """The quantized cache's key offsets and scales from the model's keys and values over random
        token ids (seeded): they set where each head's values lie, not what text says."""
        vocab = self.config.vocab_size
        if self.tokenizer is not None:
            vocab = min(vocab, self.tokenizer.vocab_size)
        self.cache.calibrate(self.model, kv_calibration_rows(vocab))

    def _warm_up(self) -> None:
        """Compile the kernels of every kind of step before the first request: Triton compiles
        one variant per class of sizes (one row, a multiple of 16, any other) and the sampler
        compiles its kernels on first use, which would otherwise happen in the middle of
        serving, seconds at a time."""
        prompts = [[0] * 16, [0] * 17, [0] * 5, [0] * 32]
        for prompt in prompts:
            self.engine.add(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        # and the sampler's compiled kernels (truncation, the seeded race), alone and in a batch
        sampled = SamplingParams(
            max_tokens=2, temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, seed=0, ignore_eos=True
        )
        for prompt in ([0] * 3, [0] * 4, [0] * 6):
            self.engine.add(prompt, sampled)
        self.engine.run()
        self.engine.reset_counters()

    def _kv_budget(
        self, fraction: float, max_step_tokens: int, max_running: int, seq_len: int, graphs: bool
    ) -> int:
        """The pool `memfit plan --serve` plans (memfit.planner.serve) on this GPU, less whatever
        this process holds beyond the planned weights (another model, the caller's tensors)."""
        from memfit.planner.serve import plan_serve

        total = torch.cuda.get_device_properties(self.device).total_memory
        plan = plan_serve(
            self.config, total, dtype=next(self.model.parameters()).dtype,
            block_size=self.block_size, memory_fraction=fraction,
            max_step_tokens=max_step_tokens, max_running=max_running, seq_len=seq_len,
            cuda_graph_batch_sizes=None if graphs else (), quantize=self.quantize or "none",
            kv_cache_dtype=self.kv_cache_dtype,
        ).check_fits()  # fmt: skip
        extra = max(torch.cuda.memory_allocated(self.device) - plan.weights_bytes, 0)
        budget = plan.kv_pool_bytes - extra
        if budget <= 0:
            raise ValueError(
                f"memory_fraction {fraction} of {total / GiB:.1f} GiB leaves no room for a KV "
                f"cache: this process already holds {extra / GiB:.2f} GiB beyond the weights"
            )
        return budget

    # -- generation -------------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        progress: bool = True,
    ) -> list[RequestOutput]:
        """Every prompt (text, or a list of token ids) through the engine, continuously batched;
        their outputs in the order given. `params`: one for all, or one per prompt."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
        )
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise ValueError("generate needs at least one prompt")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params)} SamplingParams")
        eos = self.info.generation.eos_token_ids if self.info is not None else ()
        engine = self.engine
        ids = [self.encode(p) for p in batch]
        params = [p if p.ignore_eos or not eos else p.with_stop_tokens(eos) for p in params]
        for prompt, p in zip(ids, params, strict=True):  # every request, before any joins
            engine.check(prompt, p)
        request_ids = [engine.add(prompt, p) for prompt, p in zip(ids, params, strict=True)]
        before = (engine.steps, engine.preemptions, engine.decode_steps, engine.decode_seconds)
        waste_from = len(engine.waste_samples)
        engine.peak_blocks = 0
        start = time.perf_counter()
        if progress:
            self._run_with_progress(request_ids)
        else:
            engine.run()
        seconds = time.perf_counter() - start
        outputs = []
        for request_id, prompt, prompt_ids in zip(request_ids, batch, ids, strict=True):
            request = engine.requests[request_id]
            text = request.text  # cut at a stop string
            if text is None and self.tokenizer is not None:
                text = self.continuation(request.prompt, request.output)
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=prompt_ids,
                    token_ids=request.output,
                    text=text,
                    finish_reason=request.finish_reason,
                    logprobs=request.logprobs,
                )  # fmt: skip
            )
        waste = engine.waste_samples[waste_from:]
        generated = sum(len(o.token_ids) for o in outputs)
        self.last_stats = {
            "requests": len(outputs), "generated_tokens": generated, "seconds": seconds,
            "tokens_per_s": generated / seconds if seconds > 0 else 0.0,
            "steps": engine.steps - before[0], "preemptions": engine.preemptions - before[1],
            "decode_steps": engine.decode_steps - before[2],
            "decode_seconds": engine.decode_seconds - before[3],
            "kv_blocks": self.cache.pool.num_blocks, "kv_blocks_peak": engine.peak_blocks,
            "kv_waste_mean": sum(waste) / len(waste) if waste else 0.0,
        }  # fmt: skip
        return outputs

    def _run_with_progress(self, request_ids: list[int]) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        engine = self.engine
        columns = (
            TextColumn("generating"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
        )  # fmt: skip
        start = time.perf_counter()
        with Progress(*columns, transient=True) as bar:
            task = bar.add_task("generating", total=len(request_ids), rate="")
            shown = engine.steps
            while engine.waiting or engine.running:
                engine.step()  # one step, or up to 32 pipelined ones
                if engine.steps >= shown + 8 or not (engine.waiting or engine.running):
                    shown = engine.steps
                    done = sum(engine.requests[i].finished for i in request_ids)
                    tokens = sum(len(engine.requests[i].output) for i in request_ids)
                    rate = f"{tokens / (time.perf_counter() - start):,.0f} tok/s"
                    bar.update(task, completed=done, rate=rate)
