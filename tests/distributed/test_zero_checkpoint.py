"""Sharded ZeRO checkpoints (memfit.distributed.checkpoint) with gloo on CPU: saved by 2
processes in stages 0-3 (and by one process without a process group: stage 1 with offload, stage
3 with offload params), resumed by 3 processes (stages 0, 2 and 3; stage 1 with offload) and by
one (offload, stages 0-3); every resumed run equals one uninterrupted single-process run to fp32
tolerance. On disk each rank's file holds only its shard's slices of the optimizer state (stage 3:
of the weights too), the weights are written once, and they export to safetensors. The GPU tests
(NCCL, fused AdamW) run where CUDA is."""

from __future__ import annotations

import datetime
import gc
import math
import random
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from memfit.distributed import ZeroOptimizer, shard_parameters
from memfit.distributed.checkpoint import export_safetensors, load_zero, range_boxes, save_zero
from memfit.models.config import PRESETS
from memfit.optim import parameter_groups
from memfit.train.checkpoint import read_meta, save_checkpoint

BEFORE, AFTER = 2, 2  # steps before the checkpoint, steps after it
ROWS, LR, BUCKET = 12, 1e-2, 50  # ROWS divides by world sizes 1, 2 and 3
TOL = {"rtol": 1e-5, "atol": 1e-6}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.LayerNorm(5), nn.Linear(5, 3)
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, 7, generator=generator), torch.randn(ROWS, 3, generator=generator)


def factory(lr: float, fused: bool = False):
    fast = {"fused": True} if fused else {"foreach": True}
    return lambda groups: torch.optim.AdamW(groups, lr=lr, **fast)


def build(
    stage: int,
    offload: bool | str = False,
    seed: int = 0,
    lr: float = LR,
    group=None,
    device="cpu",
    model: nn.Module | None = None,
):
    """A model and its ZeroOptimizer (on CUDA without offload: fused AdamW, as memfit does);
    stage 3 gathers the two first Linears one at a time (the rest: the root unit)."""
    model = (make_model(seed) if model is None else model).to(device)
    groups = parameter_groups(model, 0.1)
    sharded = None
    if stage == 3:
        units = [model[0], model[2]] if isinstance(model, nn.Sequential) else ()
        sharded = shard_parameters(
            model,
            units=units,
            param_groups=groups,
            process_group=group,
            offload_params=offload == "params",
        )
    zero = ZeroOptimizer(
        groups,
        factory(lr, fused=torch.device(device).type == "cuda" and not offload),
        stage=stage,
        process_group=group,
        bucket_numel=BUCKET,
        offload=offload,
        sharded=sharded,
    )
    return model, zero


def named(model: nn.Module, zero: ZeroOptimizer | None = None) -> dict[str, torch.Tensor]:
    """The parameters' values (stage 3: gathered, which every rank of `zero` must call)."""
    if zero is not None and zero.stage == 3:
        with zero.summon_full_params():
            return named(model)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class Odd(nn.Module):
    """Parameters of every kind of shape: 2-D, 3-D, empty, 0-d, 1-D."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        for name, shape in [
            ("matrix", (2, 3)),
            ("cube", (3, 5, 7)),
            ("empty", (0, 5)),
            ("scalar", ()),
            ("vector", (7,)),
        ]:
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=generator)))


def train(model, zero, steps) -> list[float]:
    """Steps on this rank's rows of each batch; returns the losses averaged over the ranks."""
    rows = ROWS // zero.world_size
    mine = slice(zero.rank * rows, (zero.rank + 1) * rows)
    losses = []
    device = next(model.parameters()).device
    for step in steps:
        x, y = (t[mine].to(device) for t in batch(step))
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        zero.clip_grad_norm_(0.5)
        zero.step()
        zero.zero_grad()
        total = loss.detach()
        if zero.distributed:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=zero.group)
        losses.append(total.item())
    return losses


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run: losses of all steps, weights at the checkpoint and at the end."""
    model = make_model()
    optimizer = factory(LR)(parameter_groups(model, 0.1))
    losses, at_checkpoint = [], None
    for step in range(BEFORE + AFTER):
        if step == BEFORE:
            at_checkpoint = named(model)
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "at_checkpoint": at_checkpoint, "final": named(model)}


# -- processes -------------------------------------------------------------------------------

SAVERS = [1, 2]  # the saving run's 2 processes: global ranks 1 and 2 (group ranks 0 and 1)
TARGETS = [(3, False), (2, False), (1, True), (0, False)]  # (stage, offload) of the runs at 3
CHECKPOINTS = ["stage0", "stage1", "stage2", "stage3", "world1", "world1-stage3"]


def worker(rank: int, world_size: int, store: str, root: str) -> None:
    """Save at 2 processes (a subgroup, so that the ranks of ShardedTensor placements are not
    the group's), then resume every checkpoint at 3; rank 0 writes what it saw."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",  # no TCP port to race for
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    root = Path(root)
    savers = dist.new_group(SAVERS)
    info = {}
    if rank in SAVERS:
        for stage in (0, 1, 2, 3):
            model, zero = build(stage, group=savers)
            losses = train(model, zero, range(BEFORE))
            extra = {"step": BEFORE, "rank": zero.rank}
            save_zero(root / f"stage{stage}", model, zero, extra=extra)
            names = {id(p): name for name, p in model.named_parameters()}
            info[stage] = {
                "losses": losses,
                "params": named(model, zero),
                # (parameter name, offset, numel) -> group rank whose shard holds that slice
                "pieces": {
                    (names[id(b.params[piece.index])], piece.param_start, piece.numel): r
                    for b in zero.buckets
                    for r in range(zero.world_size)
                    for piece in b.layout.pieces(r)
                },
            }
        # stage 3 ShardedTensors of 3-D, empty and 0-d parameters (no optimizer state)
        model, zero = build(3, group=savers, model=Odd(seed=0))
        save_zero(root / "odd", model, zero)
        if rank == SAVERS[0]:
            torch.save(info, root / "saved.pt")
    dist.barrier()
    results = {}
    for checkpoint in CHECKPOINTS:
        for stage, offload in TARGETS:
            # other initial weights and learning rate: both must come from the checkpoint
            model, zero = build(stage, offload, seed=1, lr=1.0)
            extra = load_zero(root / checkpoint, model, zero)
            loaded = named(model, zero)
            losses = train(model, zero, range(BEFORE, BEFORE + AFTER))
            results[(checkpoint, stage, offload)] = (extra, loaded, losses, named(model, zero))
    for stage in (3, 0):
        model, zero = build(stage, model=Odd(seed=1))
        load_zero(root / "odd", model, zero)
        results[("odd", stage)] = named(model, zero)
    if rank == 0:
        torch.save(results, root / "resumed.pt")
    # the process group dies here, not at interpreter exit (gloo's threads abort there)
    del model, zero
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Checkpoints after BEFORE steps: world1 and world1-stage3 by this process without a process
    group (stage 1, offload; stage 3, offload params), stage0/1/2/3 by 2 processes; and their
    resumption at 3 processes."""
    root = tmp_path_factory.mktemp("zero_checkpoints")
    for name, stage, offload in [("world1", 1, True), ("world1-stage3", 3, "params")]:
        model, zero = build(stage, offload=offload)
        train(model, zero, range(BEFORE))
        save_zero(root / name, model, zero, extra={"step": BEFORE, "rank": 0})
    mp.spawn(worker, args=(3, str(root / "store"), str(root)), nprocs=3, join=True)
    return root, torch.load(root / "saved.pt"), torch.load(root / "resumed.pt")


def check_resumed(result, reference) -> None:
    extra, loaded, losses, final = result
    assert extra == {"step": BEFORE, "rank": 0}  # rank 0's
    for name, expected in reference["at_checkpoint"].items():
        torch.testing.assert_close(loaded[name], expected, **TOL)
    torch.testing.assert_close(losses, reference["losses"][BEFORE:], **TOL)
    for name, expected in reference["final"].items():
        torch.testing.assert_close(final[name], expected, **TOL)


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_saving_run_matches_the_reference(runs, reference):
    _, saved, _ = runs
    for stage in (0, 1, 2, 3):
        torch.testing.assert_close(saved[stage]["losses"], reference["losses"][:BEFORE], **TOL)
        for name, expected in reference["at_checkpoint"].items():
            torch.testing.assert_close(saved[stage]["params"][name], expected, **TOL)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize(("stage", "offload"), TARGETS)
def test_resume_at_3_processes(runs, reference, checkpoint, stage, offload):
    _, _, resumed = runs
    check_resumed(resumed[(checkpoint, stage, offload)], reference)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize(
    ("stage", "offload"), [(0, True), (1, True), (2, True), (3, True), (3, "params")]
)
def test_resume_in_one_process_without_a_process_group(runs, reference, checkpoint, stage, offload):
    """Offload (offload params: the optimizer steps the shard itself, no copy)."""
    root, _, _ = runs
    model, zero = build(stage, offload=offload, seed=1, lr=1.0)
    extra = load_zero(root / checkpoint, model, zero)
    loaded = named(model, zero)
    losses = train(model, zero, range(BEFORE, BEFORE + AFTER))
    check_resumed((extra, loaded, losses, named(model, zero)), reference)
    for bucket in zero.buckets:  # the optimizer's CPU copies were refreshed too
        torch.testing.assert_close(bucket.cpu_shard, bucket.shard)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimizer_state_is_sharded_on_disk(runs, stage):
    """Each optimizer-state chunk on disk is one rank's slice of one parameter, in that rank's
    file; no file holds a whole state (in stage 0 too: each rank writes its shard's slices)."""
    root, info, _ = runs
    metadata = FileSystemReader(str(root / f"stage{stage}")).read_metadata()
    pieces = info[stage]["pieces"]
    files = {storage.relative_path for storage in metadata.storage_data.values()}
    assert len(files) == 2
    elements: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    rank_file: dict[int, str] = {}
    states = 0
    for index, storage in metadata.storage_data.items():
        meta = metadata.state_dict_metadata[index.fqn]
        if not (index.fqn.startswith("optim.state.") and len(meta.size) == 1):
            continue
        name, key = index.fqn[len("optim.state.") :].rsplit(".", 1)
        (chunk,) = [c for c in meta.chunks if c.offsets == index.offset]
        rank = pieces[(name, chunk.offsets[0], chunk.sizes[0])]
        assert rank_file.setdefault(rank, storage.relative_path) == storage.relative_path
        elements[key][storage.relative_path] += chunk.sizes[0]
        states += 1
    assert sorted(elements) == ["exp_avg", "exp_avg_sq"]
    assert len(set(rank_file.values())) == 2
    assert states == 2 * len(pieces)  # every piece of every parameter, once per state
    total = sum(p.numel() for p in info[stage]["params"].values())
    for key, per_file in elements.items():
        assert sum(per_file.values()) == total, key
        for count in per_file.values():
            assert count < total, key  # ~ total / 2 (a shard, less its padding)
            assert count <= total // 2 + 16, key


def test_weights_are_written_once(runs):
    """DCP keeps one copy of the parameters every rank holds: each has one chunk, and the files
    hold nothing but the entries of the metadata (no unreferenced duplicates)."""
    root, info, _ = runs
    for stage in (0, 1, 2):
        path = root / f"stage{stage}"
        metadata = FileSystemReader(str(path)).read_metadata()
        for name in info[stage]["params"]:
            meta = metadata.state_dict_metadata["model." + name]
            assert len(meta.chunks) == 1
        count = defaultdict(int)
        for index in metadata.storage_data:
            count[index.fqn] += 1
        for name in info[stage]["params"]:
            assert count["model." + name] == 1
        written = sum(f.stat().st_size for f in path.glob("*.distcp"))
        referenced = sum(s.length for s in metadata.storage_data.values())
        assert written == referenced


def test_stage3_weights_are_written_sharded(runs):
    """In stage 3 each rank writes the chunks of the weights its shard holds, into its own file:
    they cover each parameter once, and a chunk lies within one rank's piece."""
    root, info, _ = runs
    path = root / "stage3"
    metadata = FileSystemReader(str(path)).read_metadata()
    pieces = info[3]["pieces"]
    rank_file: dict[int, str] = {}
    for name, param in info[3]["params"].items():
        meta = metadata.state_dict_metadata["model." + name]
        assert tuple(meta.size) == tuple(param.shape)
        strides = torch.empty(param.shape).stride()
        covered = 0
        for chunk in meta.chunks:
            start = sum(o * s for o, s in zip(chunk.offsets, strides, strict=True))
            numel = math.prod(chunk.sizes)
            (rank,) = [
                r
                for (n, offset, count), r in pieces.items()
                if n == name and offset <= start and start + numel <= offset + count
            ]
            (storage,) = [
                s
                for index, s in metadata.storage_data.items()
                if index.fqn == "model." + name and list(index.offset) == list(chunk.offsets)
            ]
            assert rank_file.setdefault(rank, storage.relative_path) == storage.relative_path
            covered += numel
        assert covered == param.numel(), name
        assert len(meta.chunks) > 1 or param.dim() == 1  # the 2-D weights span ranks
    assert len(set(rank_file.values())) == 2
    written = sum(f.stat().st_size for f in path.glob("*.distcp"))
    assert written == sum(s.length for s in metadata.storage_data.values())


@pytest.mark.parametrize("checkpoint", ["stage1", "world1", "stage3", "world1-stage3"])
def test_export_to_safetensors(runs, tmp_path, checkpoint):
    root, info, _ = runs
    out = export_safetensors(root / checkpoint, tmp_path / "model.safetensors", {"step": "2"})
    weights = load_file(str(out))
    model, zero = build(2, offload=True, seed=1)
    load_zero(root / checkpoint, model, zero)
    assert set(weights) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    if checkpoint in ("stage1", "stage3"):
        for name, tensor in info[int(checkpoint[-1])]["params"].items():
            assert torch.equal(weights[name], tensor), name
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"format": "memfit", "step": "2"}


def test_stage3_parameters_of_any_shape(runs, tmp_path):
    """3-D, empty, 0-d and 1-D parameters saved in stage 3 by 2 processes load at 3 (stages 3
    and 0), at 1 (offload params) and export, all with the values saved."""
    root, _, resumed = runs
    expected = named(Odd(seed=0))
    model, zero = build(3, offload="params", model=Odd(seed=1))
    load_zero(root / "odd", model, zero)
    weights = load_file(str(export_safetensors(root / "odd", tmp_path / "odd.safetensors")))
    for values in (resumed[("odd", 3)], resumed[("odd", 0)], named(model, zero), weights):
        assert set(values) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(values[name], tensor), name


def test_save_checkpoint_exports_the_weights_from_the_sharded_state(tmp_path, reference):
    """weights_from_sharded: model.safetensors comes from trainer/ (stage 3 parameters hold no
    values), with the usual metadata, and meta.json records its size."""
    model, zero = build(3, offload="params")
    train(model, zero, range(BEFORE))
    common = {
        "step": BEFORE, "model": model, "model_config": PRESETS["tiny"], "trainer_state": {},
        "config_toml": "", "tokenizer": "byte", "weights_from_sharded": True,
    }  # fmt: skip
    final = save_checkpoint(
        tmp_path, write_sharded=lambda directory: save_zero(directory, model, zero), **common
    )
    assert "model.safetensors" in read_meta(final)["sizes"]
    weights = load_file(str(final / "model.safetensors"))
    for name, tensor in reference["at_checkpoint"].items():
        torch.testing.assert_close(weights[name], tensor, **TOL)
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "memfit", "step": str(BEFORE)}
    with pytest.raises(ValueError, match="needs write_sharded"):
        save_checkpoint(tmp_path, **common)


# -- range_boxes -----------------------------------------------------------------------------


def check_boxes(shape: tuple[int, ...], start: int, numel: int) -> None:
    """The boxes, taken from a tensor of its element indices in their order, are the range."""
    boxes = range_boxes(shape, start, numel)
    indices = torch.arange(math.prod(shape)).view(shape)
    taken = []
    for offsets, sizes in boxes:
        assert len(offsets) == len(sizes) == len(shape)
        box = indices[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        assert list(box.shape) == sizes and box.numel() > 0
        taken.append(box.reshape(-1))
    got = torch.cat(taken) if taken else torch.empty(0, dtype=torch.long)
    assert torch.equal(got, torch.arange(start, start + numel)), (shape, start, numel, boxes)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_range_boxes_examples():
    # 2-D: the rest of the first row, the whole rows, the start of the last row
    assert range_boxes((4, 5), 3, 14) == [([0, 3], [1, 2]), ([1, 0], [2, 5]), ([3, 0], [1, 2])]
    assert range_boxes((4, 5), 5, 10) == [([1, 0], [2, 5])]  # whole rows: one box
    assert range_boxes((4, 5), 6, 3) == [([1, 1], [1, 3])]  # within a row
    assert range_boxes((4, 5), 0, 20) == [([0, 0], [4, 5])]
    assert range_boxes((9,), 2, 4) == [([2], [4])]
    assert range_boxes((), 0, 1) == [([], [])]  # a 0-d tensor's element
    assert range_boxes((4, 5), 7, 0) == []
    assert range_boxes((0, 5), 0, 0) == []
    with pytest.raises(ValueError, match="not within a tensor of shape"):
        range_boxes((4, 5), 15, 6)


def test_range_boxes_random_ranges():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        total = math.prod(shape)
        start = rng.choice([0, rng.randint(0, total), total])
        numel = rng.choice([0, total - start, rng.randint(0, total - start)])
        check_boxes(shape, start, numel)
    for shape in [(3, 0, 2), (0,), (2, 2, 2, 2)]:  # empty tensors; every range of a 4-D one
        for start in range(math.prod(shape) + 1):
            for numel in range(math.prod(shape) - start + 1):
                check_boxes(shape, start, numel)


def test_checkpoint_before_the_first_step(tmp_path, reference):
    """No optimizer state yet: loading leaves none, and training goes on like the reference."""
    model, zero = build(2, offload=True)
    save_zero(tmp_path / "step0", model, zero)
    model, zero = build(1, offload=True, seed=1)
    assert load_zero(tmp_path / "step0", model, zero) == {}
    assert not zero.optimizer.state
    losses = train(model, zero, range(BEFORE + AFTER))
    torch.testing.assert_close(losses, reference["losses"], **TOL)


def test_loaded_state_tensors_are_what_adamw_creates(runs):
    """The state tensors load_zero creates have the dtype and device AdamW would have made."""
    root, _, _ = runs
    model, zero = build(0, offload=True, seed=1)
    load_zero(root / "stage2", model, zero)
    fresh_model, fresh = build(0, offload=True)
    train(fresh_model, fresh, range(1))
    for param, fresh_param in zip(
        zero.optimizer.param_groups[0]["params"],
        fresh.optimizer.param_groups[0]["params"],
        strict=True,
    ):
        state, expected = zero.optimizer.state[param], fresh.optimizer.state[fresh_param]
        assert set(state) == set(expected)
        for key, value in expected.items():
            assert (state[key].dtype, state[key].device, state[key].shape) == (
                value.dtype,
                value.device,
                value.shape,
            ), key


def test_a_checkpoint_of_another_model_or_grouping_is_refused(runs):
    root, _, _ = runs
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))
    zero = ZeroOptimizer(parameter_groups(model, 0.1), factory(LR), stage=1, offload=True)
    with pytest.raises(ValueError, match="does not fit the model"):
        load_zero(root / "stage1", model, zero)
    model = make_model(seed=1)
    before = named(model)
    zero = ZeroOptimizer([{"params": list(model.parameters())}], factory(LR), stage=1, offload=True)
    with pytest.raises(ValueError, match="groups the parameters for the optimizer differently"):
        load_zero(root / "stage1", model, zero)
    for name, tensor in named(model).items():  # refused before anything was loaded
        assert torch.equal(tensor, before[name])


def test_sgd_momentum_resumes_in_another_stage(tmp_path):
    """A per-element state other than AdamW's (SGD's momentum_buffer, no step), stage 1 to 0."""

    def sgd(lr):
        return lambda groups: torch.optim.SGD(groups, lr=lr, momentum=0.9, foreach=True)

    def zero_sgd(stage, seed=0, lr=LR):
        model = make_model(seed)
        zero = ZeroOptimizer(
            parameter_groups(model, 0.1), sgd(lr), stage=stage, bucket_numel=BUCKET, offload=True
        )
        return model, zero

    model, zero = zero_sgd(1)
    expected = train(model, zero, range(BEFORE + AFTER))
    model, zero = zero_sgd(1)
    train(model, zero, range(BEFORE))
    save_zero(tmp_path / "sgd", model, zero)
    model, zero = zero_sgd(0, seed=1, lr=1.0)
    load_zero(tmp_path / "sgd", model, zero)
    assert {key for state in zero.optimizer.state.values() for key in state} == {"momentum_buffer"}
    torch.testing.assert_close(train(model, zero, range(BEFORE, BEFORE + AFTER)), expected[BEFORE:])


# -- GPU -------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def nccl(rank: int, world_size: int, store: Path) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )


@pytest.mark.parametrize(
    ("stage", "offload"),
    [(stage, offload) for stage in (0, 1, 2, 3) for offload in (False, True)] + [(3, "params")],
)
@pytest.mark.timeout(120)
@pytest.mark.gpu
@needs_cuda
def test_gpu_resume_continues_like_the_uninterrupted_run(tmp_path, stage, offload):
    """On one GPU (NCCL, fused AdamW on the device; or offload, no process group): saving,
    loading into other weights and learning rate, and going on equals not stopping."""
    if not offload:
        nccl(0, 1, tmp_path / "store")
    try:
        model, zero = build(stage, offload, device="cuda")
        expected = train(model, zero, range(BEFORE + AFTER))
        final, states = named(model, zero), list(zero.optimizer.state.values())
        model, zero = build(stage, offload, device="cuda")
        train(model, zero, range(BEFORE))
        save_zero(tmp_path / "checkpoint", model, zero)
        model, zero = build(stage, offload, seed=1, lr=1.0, device="cuda")
        load_zero(tmp_path / "checkpoint", model, zero)
        losses = train(model, zero, range(BEFORE, BEFORE + AFTER))
        resumed = named(model, zero)  # stage 3 gathers: before the process group goes
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.testing.assert_close(losses, expected[BEFORE:], **TOL)
    for name, tensor in resumed.items():
        torch.testing.assert_close(tensor, final[name], **TOL)
    for state, expected_state in zip(zero.optimizer.state.values(), states, strict=True):
        for key, value in expected_state.items():
            assert (state[key].dtype, state[key].device) == (value.dtype, value.device), key


def gpu_save_worker(rank: int, world_size: int, store: str, root: str, stage: int) -> None:
    nccl(rank, world_size, Path(store))
    model, zero = build(stage, device=f"cuda:{rank}")
    train(model, zero, range(BEFORE))
    save_zero(Path(root) / "checkpoint", model, zero, extra={"rank": rank})
    dist.destroy_process_group()


@pytest.mark.parametrize(("saved", "resumed", "offload"), [(2, 1, True), (3, 3, "params")])
@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.gpu
def test_gpu_checkpoint_of_2_processes_resumes_on_one(tmp_path, saved, resumed, offload):
    """Stages 2 and 3 on 2 GPUs (NCCL, chunks on cuda:0 and cuda:1), resumed on one GPU with
    offload and no process group, equal one uninterrupted single-GPU run."""
    args = (2, str(tmp_path / "store"), str(tmp_path), saved)
    mp.spawn(gpu_save_worker, args=args, nprocs=2)
    model, zero = build(resumed, offload=offload, device="cuda")
    expected = train(model, zero, range(BEFORE + AFTER))
    final = named(model, zero)
    model, zero = build(resumed, offload=offload, seed=1, lr=1.0, device="cuda")
    assert load_zero(tmp_path / "checkpoint", model, zero) == {"rank": 0}
    torch.testing.assert_close(
        train(model, zero, range(BEFORE, BEFORE + AFTER)), expected[BEFORE:], **TOL
    )
    for name, tensor in named(model, zero).items():
        torch.testing.assert_close(tensor, final[name], **TOL)
    weights = load_file(str(export_safetensors(tmp_path / "checkpoint", tmp_path / "w.st")))
    model, zero = build(resumed, offload=offload, seed=1, device="cuda")
    load_zero(tmp_path / "checkpoint", model, zero)
    for name, tensor in named(model, zero).items():
        assert torch.equal(weights[name], tensor.cpu()), name
