"""The planner's LoRA, QLoRA and distillation terms: against memfit's own measured H100 peaks
(benchmarks/results/lora.json), against the bytes a CPU model really holds, against the engine's
adapter and quantization layout, and their refusals."""

import inspect
import json
from pathlib import Path

import pytest
import torch

from memfit.config import build_config
from memfit.models import PRESETS, build_model
from memfit.planner import GPUS, Strategy, memory, plan, rank_goals, rank_strategies, what_would_fit
from memfit.planner.memory import (
    _allocated,
    adapter_params,
    frozen_model_bytes,
    quantized_weight_bytes,
)
from memfit.planner.time import step_time, training_flops_per_token
from memfit.train.engine import Trainer
from tests.train.activation_memory import live_forward_bytes

LORA_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "lora.json"
# the commits whose LoRALinear concatenated the parts' updates (memory.LORA_UPDATE "concat");
# later ones add it in one addmm's epilogue
CONCAT_COMMITS = {"6f05e43", "db86402"}
# measured rows whose peak is not a training step's as memfit runs it now
NOT_A_STEP = {
    ("db86402", "memfit QLoRA nf4"): "the base dequantized in PyTorch (fp32 temporaries), since "
    "replaced by memfit.ops.quant.matmul.dequantize",
    ("005dd84", "memfit QLoRA nf4", "llama-3-8b"): "made from random weights block by block with "
    "the embedding, final norm and head left in fp32 (a bug: +1.96 GiB, and the loss's bf16 copy "
    "of the head), and gate_up quantized whole in fp32 on the GPU; both since fixed",
}


def measured_lora_runs():
    """memfit's rows of benchmarks/lora.py (rank 16, alpha 32, all seven projections,
    checkpointing full, AdamW on the adapters, fused cross-entropy; torch.cuda.max_memory_allocated
    from the model's construction on), with the LoRA update of the commit that ran them, less
    NOT_A_STEP's."""
    found = []
    for run in json.loads(LORA_RESULTS.read_text()):
        commit = run["env"]["commit"]
        for record in run["records"]:
            system, model = record["system"], record["model"]
            if not system.startswith("memfit") or "peak_gib" not in record:
                continue
            if (commit, system) in NOT_A_STEP or (commit, system, model) in NOT_A_STEP:
                continue
            update = "concat" if commit in CONCAT_COMMITS else "addmm"
            found.append((run, record, update))
    return found


def _strategy(run: dict, record: dict) -> Strategy:
    return Strategy(
        micro_batch=record.get("micro_batch", run["micro_batch"]), seq_len=run["seq_len"],
        checkpointing="full", checkpoint_blocks=record.get("checkpoint_blocks"),
        lora_rank=run["rank"], quantize_base="nf4" if "QLoRA" in record["system"] else "none",
    )  # fmt: skip


def _run_id(x):
    if isinstance(x, str):
        return x
    if "system" in x:
        return f"{x['model']}-{x['system'].replace(' ', '-')}"
    return f"{x['env']['commit']}-mb{x['micro_batch']}"


@pytest.mark.parametrize("run, record, update", measured_lora_runs(), ids=_run_id)
def test_lora_peak_matches_the_measured_runs(run, record, update, monkeypatch):
    """Every measured peak (H100 and H200; llama-1b, llama-3.2-3b, llama-3-8b at micro-batch 1
    and 4; LoRA, QLoRA, and LoRA with 23 of 32 blocks checkpointed) planned with the dataflow of
    the commit that ran it: within 1.1% (the planner's bar is 5%; QLoRA's are 0.9-1.0% over)."""
    model = PRESETS[record["model"]]
    strategy = _strategy(run, record)
    assert adapter_params(model, strategy) == record["trainable_params"]
    monkeypatch.setattr(memory, "LORA_UPDATE", update)
    planned = plan(model, strategy).peak_bytes
    assert planned / 2**30 == pytest.approx(record["peak_gib"], rel=0.011)


def test_the_measured_runs_cover_both_updates_and_qlora():
    covered = {(update, r["system"]) for _, r, update in measured_lora_runs()}
    assert covered == {
        ("concat", "memfit"),
        ("addmm", "memfit"),
        ("addmm", "memfit QLoRA nf4"),
        ("addmm", "memfit within peft's peak"),
    }


def test_lora_time_is_within_a_tenth_at_micro_batch_4(monkeypatch):
    """Tokens/s of the same runs, by the time model refitted on full training (time_model.json;
    no LoRA run fitted): at micro-batch 4 within -9% (llama-3-8b, H100, the update of commit
    "concat") to +5% of the measured; at micro-batch 1 it predicts 22-30% more than measured: it
    counts the adapters' FLOPs and bytes, and the host's launches of a plain block, not the
    launches of the adapters' many small products and casts, which show where the products are
    small."""
    for run, record, update in measured_lora_runs():
        if record["system"] != "memfit":
            continue
        monkeypatch.setattr(memory, "LORA_UPDATE", update)
        gpu = GPUS["h200" if "H200" in run["env"]["gpu"] else "h100-sxm"]
        strategy = _strategy(run, record)
        predicted = step_time(PRESETS[record["model"]], strategy, gpu).tokens_per_s
        ratio = predicted / record["tokens_per_s"]
        if strategy.micro_batch >= 4:
            assert 0.9 < ratio < 1.06, (record, predicted)
        else:
            assert 1.0 < ratio < 1.35, (record, predicted)


def test_the_planner_mirrors_the_engine_constants():
    """What the planner copies of the engine (it imports neither torch nor triton): LoRA's layer
    names, the NF4 layout, the rows above which a quantized product dequantizes its weight, the
    distillation loss's chunk."""
    from memfit.nn import quant
    from memfit.nn.lora import LINEAR_NAMES
    from memfit.ops.distill import linear_distillation_loss
    from memfit.ops.quant import nf4

    assert memory.LORA_TARGETS == LINEAR_NAMES
    assert (memory.NF4_BLOCK, memory.NF4_SCALE_BLOCK) == (nf4.NF4_BLOCK, nf4.SCALE_BLOCK)
    assert memory.QUANT_FUSED_MAX_ROWS == quant.FUSED_MAX_ROWS
    chunk = inspect.signature(linear_distillation_loss).parameters["chunk_size"].default
    assert memory.DISTILL_CHUNK_ROWS == chunk


@pytest.mark.parametrize("model", ["llama-1b", "llama-3-8b", "qwen2.5-7b", "llama-3.2-3b"])
@pytest.mark.parametrize(
    "targets", [("all-linear",), ("q_proj", "v_proj"), ("k_proj", "gate_proj", "down_proj")]
)
def test_adapter_count_is_apply_loras(model, targets):
    from memfit.nn.lora import LoRASpec, apply_lora

    meta = build_model(PRESETS[model], device="meta")
    apply_lora(meta, LoRASpec(rank=8, targets=targets))
    trainable = sum(p.numel() for p in meta.parameters() if p.requires_grad)
    strategy = Strategy(lora_rank=8, lora_targets=",".join(targets))
    assert adapter_params(PRESETS[model], strategy) == trainable


@pytest.mark.parametrize(
    "kind,shape",
    [(k, s) for k in ("nf4", "int8") for s in ((97, 130), (64, 256), (1, 63))]
    + [("int4", s) for s in ((97, 256), (64, 576), (3, 80))],
)
def test_quantized_bytes_are_the_stored_state(kind, shape):
    from memfit.ops.quant import int4_group, quantize_int4, quantize_int8, quantize_nf4

    weight = torch.randn(*shape)
    if kind == "int4":
        state = quantize_int4(weight, int4_group(shape[1]))
    else:
        state = quantize_nf4(weight) if kind == "nf4" else quantize_int8(weight)
    stored = sum(_allocated(t.numel() * t.element_size()) for t in state.values())
    assert quantized_weight_bytes(*shape, kind) == stored


@pytest.mark.parametrize("kind", ["none", "nf4", "int8"])
def test_frozen_base_bytes_are_the_models(kind):
    """A tiny model made as a QLoRA run makes it (memfit.nn.lora, memfit.nn.quant): its frozen
    parameters and quantized buffers are what the planner counts for the base."""
    from memfit.nn.lora import LoRASpec, apply_lora
    from memfit.nn.quant import quantize_model

    config = PRESETS["tiny"]
    model = build_model(config, dtype=torch.bfloat16)
    apply_lora(model, LoRASpec(rank=4))
    if kind != "none":
        quantize_model(model, kind, dtype=torch.bfloat16)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    buffers = sum(_allocated(b.numel() * b.element_size()) for b in model.buffers())
    assert frozen_model_bytes(config, "bf16", kind) == frozen + buffers


def cpu_lora_trainer(tmp_path, quantize="none", **train):
    flags = {
        "data": {"seq_len": 128},
        "train": {"micro_batch": 4, "precision": "fp32", "device": "cpu", **train},
        "checkpoint": {"out": str(tmp_path)},
        "lora": {"rank": 8, "quantize": quantize},
    }
    return Trainer(build_config(flags=flags))


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_lora_model_states_are_exact(tmp_path, quantize):
    """The parameters, buffers and AdamW states a LoRA (QLoRA) run holds after a step."""
    trainer = cpu_lora_trainer(tmp_path, quantize)
    trainer.train_step()
    held = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    held += sum(_allocated(b.numel() * b.element_size()) for b in trainer.model.buffers())
    states = sum(
        t.numel() * t.element_size()
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.numel() > 1
    )
    strategy = Strategy(precision="fp32", micro_batch=4, seq_len=128, lora_rank=8,
                        quantize_base=quantize)  # fmt: skip
    result = plan(trainer.model_config, strategy)
    assert result.breakdown["params"] == held
    assert result.breakdown["optimizer_states"] == states == 8 * result.trainable_params


@pytest.mark.parametrize("quantize", ["none", "nf4", "int8"])
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_lora_activations_match_what_the_forward_keeps(tmp_path, quantize, checkpointing):
    """What a LoRA (QLoRA) forward leaves alive for backward on CPU, fp32: the full model's
    tensors with x A^T per adapted part, the stacked adapters, and nothing of the first
    block's norm (its input, the frozen embedding's output, needs no gradient)."""
    trainer = cpu_lora_trainer(tmp_path, quantize, checkpointing=checkpointing)
    inputs, targets = next(trainer.batches)
    live, _ = live_forward_bytes(trainer.model, inputs, targets)
    config = trainer.model_config
    strategy = Strategy(precision="fp32", micro_batch=4, seq_len=128, lora_rank=8,
                        quantize_base=quantize, checkpointing=checkpointing)  # fmt: skip
    predicted = plan(config, strategy).forward_kept_bytes
    if checkpointing == "none":  # (as test_memory.py: CPU attention takes grouped k, v as is)
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        predicted -= config.num_layers * 2 * 4 * 4 * 128 * (q - kv)
    assert predicted == pytest.approx(live, rel=0.05)


class _PeakRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes that storages made inside it held at once (checked after each op); the
    storages of `inputs` (and views of them) are not counted."""

    def __init__(self, *inputs: torch.Tensor) -> None:
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self.weak, self.live, self.now, self.peak = StorageWeakRef, {}, 0, 0
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for ptr in [p for p, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(ptr)[1]
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.live and storage.data_ptr() not in self.inputs:
                    self.live[storage.data_ptr()] = (self.weak(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


@pytest.mark.parametrize("kind, temperature", [("kl", 1.0), ("kl", 2.0), ("jsd", 1.0)])
def test_distillation_chunk_holds_what_the_planner_counts(kind, temperature):
    """memfit.ops.distill's forward on one chunk, fp32: the peak of its (C x V) fp32 tensors (as
    under bf16, where the products write their logits in fp32)."""
    from memfit.ops.distill import linear_distillation_loss

    rows, hidden_size, vocab = 96, 16, 1031
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    head, teacher_head = torch.randn(vocab, hidden_size), torch.randn(vocab, hidden_size)
    teacher_hidden, targets = torch.randn(rows, hidden_size), torch.randint(0, vocab, (rows,))
    recorder = _PeakRecorder(hidden, head, teacher_hidden, teacher_head, targets)
    with recorder:
        linear_distillation_loss(
            hidden, head, teacher_hidden, teacher_head, targets, kind=kind,
            temperature=temperature, chunk_size=rows,
        )  # fmt: skip
    units = memory.DISTILL_CHUNK_UNITS[kind] + (temperature != 1)
    chunk = rows * vocab * 4
    assert recorder.peak == pytest.approx(units * chunk, abs=0.05 * chunk)


def test_qlora_llama_3_8b_plans():
    """The issue's QLoRA bar: llama-3-8b at seq 2048, micro-batch 1 peaks at most 8 GiB
    (torchtune's QLoRA: 7.4 GiB on a 4090); NF4 and int8 against the bf16 base."""
    model = PRESETS["llama-3-8b"]

    def peak(quantize, micro_batch):
        strategy = Strategy(micro_batch=micro_batch, checkpointing="full", lora_rank=16,
                            quantize_base=quantize)  # fmt: skip
        return plan(model, strategy).peak_bytes / 2**30

    assert peak("nf4", 1) < 8 < peak("int8", 1) < peak("none", 1)
    assert peak("nf4", 1) < peak("nf4", 4) < peak("int8", 4) < peak("none", 4)
    # the base: 4.127 bits a block weight (plus the bf16 embeddings, head and norms)
    s = model.spec.sizes
    blocks = s["L"] * s["P_matmul_layer"]
    base = frozen_model_bytes(model, "bf16", "nf4") - 2 * (s["P"] - blocks)
    assert base * 8 / blocks == pytest.approx(4.127, abs=0.001)


def test_lora_time_counts_no_weight_gradient():
    model, gpu = PRESETS["llama-3-8b"], GPUS["h100-sxm"]
    full = Strategy(micro_batch=4, checkpointing="full")
    lora = Strategy(micro_batch=4, checkpointing="full", lora_rank=16)
    # 6 FLOPs a parameter become 4, less the input embedding's gradient, plus 6 per adapter
    P, embedding = model.num_params, model.vocab_size * model.hidden_size
    saved = training_flops_per_token(model, full) - training_flops_per_token(model, lora)
    assert saved == 2 * P + 2 * embedding - 6 * adapter_params(model, lora)
    assert step_time(model, lora, gpu).tokens_per_s > step_time(model, full, gpu).tokens_per_s
    # NF4 dequantizes the base for each product: slower than bf16 LoRA
    qlora = Strategy(micro_batch=4, checkpointing="full", lora_rank=16, quantize_base="nf4")
    assert step_time(model, qlora, gpu).total_s > step_time(model, lora, gpu).total_s


def test_a_teacher_costs_its_weights_its_forward_and_the_loss():
    student, teacher = PRESETS["llama-3.2-1b"], PRESETS["llama-3-8b"]
    gpu = GPUS["h100-sxm"]
    alone = Strategy(micro_batch=4, checkpointing="full", lora_rank=16)
    taught = Strategy(micro_batch=4, checkpointing="full", lora_rank=16, teacher=teacher)
    lean = Strategy(micro_batch=4, checkpointing="full", lora_rank=16, teacher=teacher,
                    teacher_quantize="nf4")  # fmt: skip
    without, with_teacher, with_nf4 = (plan(student, s) for s in (alone, taught, lean))
    assert with_teacher.teacher_bytes == 2 * teacher.num_params
    assert with_nf4.teacher_bytes < with_teacher.teacher_bytes / 2.5  # (bf16 embeddings)
    assert with_teacher.peak_bytes - without.peak_bytes > with_teacher.teacher_bytes
    times = [step_time(student, s, gpu) for s in (alone, taught)]
    assert times[0].teacher_s == 0
    # the teacher's forward alone: 2 FLOPs per teacher parameter a token, at its width's rate
    assert times[1].teacher_s > times[1].tokens * 2 * teacher.num_params / gpu.bf16_flops


def test_recommend_finds_qlora_and_lora_for_llama_3_8b_on_a_4090():
    found = rank_goals(PRESETS["llama-3-8b"], GPUS["rtx4090"], seq_len=2048)
    assert list(found) == ["full", "LoRA r16", "QLoRA nf4 r16"]
    assert found["full"] == []
    for goal in ("LoRA r16", "QLoRA nf4 r16"):
        assert found[goal] and all(r.plan.fits for r in found[goal])
        assert all(r.strategy.goal == goal for r in found[goal])
        assert all(r.time.tokens_per_s > 0 for r in found[goal])
    # bf16 LoRA fits with full checkpointing up to micro-batch 4 (19.1 GiB of the 24)
    ranked = rank_strategies(PRESETS["llama-3-8b"], GPUS["rtx4090"], lora_rank=16, limit=100)
    checkpointed = {r.strategy.micro_batch for r in ranked if r.strategy.checkpointing == "full"}
    assert {1, 2, 4} <= checkpointed and 16 not in checkpointed
    # --auto's search keeps the run's goal: QLoRA stays QLoRA, with the optimizer asked for
    kept = rank_strategies(PRESETS["llama-3-8b"], GPUS["rtx4090"], lora_rank=16,
                           quantize_base="nf4")  # fmt: skip
    assert kept and all(r.strategy.goal == "QLoRA nf4 r16" for r in kept)
    assert all(r.strategy.optimizer == "adamw" for r in kept)


def test_what_would_fit_offers_lora_last():
    """Training adapters instead of every weight changes what trains: offered after the changes
    that keep it (here only ZeRO-3 over 8 GPUs or more fits)."""
    model, gpu = PRESETS["llama-3-8b"], GPUS["rtx4090"]
    labels = [label for label, _ in what_would_fit(model, Strategy(checkpointing="full"), gpu)]
    assert labels[-2:] == [
        "--lora-rank 16 (LoRA: adapters on a frozen base)",
        "--lora-rank 16 --quantize-base nf4 (QLoRA: adapters on an NF4 base)",
    ]
    assert all(label.startswith("--zero 3") for label in labels[:-2])
    lora = Strategy(micro_batch=8, checkpointing="full", lora_rank=16)
    assert "--quantize-base nf4 (QLoRA: adapters on an NF4 base)" in dict(
        what_would_fit(model, lora, gpu)
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"lora_rank": 16, "zero": 3, "world_size": 2}, "LoRA trains with ZeRO stage 0, 1 or 2"),
        ({"lora_rank": 16, "offload": "optimizer"}, "LoRA trains with ZeRO stage 0, 1 or 2"),
        (
            {"lora_rank": 16, "optimizer": "adamw8bit", "master_weights": "none"},
            "drop --master-weights none",
        ),
        ({"quantize_base": "nf4"}, "quantizes the frozen base of a LoRA run: set lora_rank"),
        ({"lora_rank": -1}, "lora_rank must be >= 0"),
        ({"lora_rank": 16, "lora_targets": "q_proj,qkv"}, "LoRA targets 'qkv': choose among"),
        ({"lora_rank": 16, "lora_dropout": 1.0}, r"lora_dropout must be in \[0, 1\)"),
        ({"teacher_quantize": "nf4"}, "give the teacher"),
        ({"quantize_base": "fp8", "lora_rank": 4}, "quantize_base = 'fp8': choose"),
    ],
)
def test_bad_fine_tuning_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Strategy(**fields)


def test_a_teacher_of_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocabulary of 32000 and the student 'llama-3-8b' 128256"):
        plan(PRESETS["llama-3-8b"], Strategy(teacher=PRESETS["llama-1b"]))


def test_the_search_pins_at_most_half_the_host_memory():
    from memfit.planner import rank_strategies
    from memfit.planner.hardware import get_gpu
    from memfit.planner.search import HOST_PINNED_FRACTION

    model, gpu = PRESETS["llama-3-8b"], get_gpu("rtx4090")
    for host in (16 * 2**30, 64 * 2**30, 1024 * 2**30):
        found = rank_strategies(model, gpu, lora_rank=16, quantize_base="nf4", host_memory=host)
        assert found and all(r.plan.host_bytes <= host * HOST_PINNED_FRACTION for r in found)
    small = rank_strategies(model, gpu, lora_rank=16, quantize_base="nf4", host_memory=2**28)
    assert small and not any(r.strategy.offload_activations for r in small)
