"""Distillation in training (`[distill]`, `--teacher`): with alpha 0 the run is the plain run;
with a teacher the loss falls and the teacher never changes; a quantized teacher works; a
teacher of another vocabulary is refused."""

import pytest
import torch

from memfit.config import build_config
from memfit.train.engine import Trainer


def make(tmp_path, name, *, steps=6, distill=None, seed=0):
    flags = {
        "data": {"seq_len": 64},
        "train": {"steps": steps, "micro_batch": 4, "warmup_steps": 2, "device": "cpu",
                  "precision": "fp32", "lr": 3e-3, "seed": seed},
        "checkpoint": {"out": str(tmp_path / name)},
        "distill": distill or {},
    }  # fmt: skip
    return Trainer(build_config(flags=flags))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny model trained for 20 steps (another seed): a memfit run directory."""
    root = tmp_path_factory.mktemp("teacher")
    trainer = make(root, "run", steps=20, seed=7)
    trainer.fit()
    return root / "run"


def test_alpha_zero_is_the_plain_run(tmp_path, teacher):
    plain = make(tmp_path, "plain")
    expected = [plain.train_step().loss for _ in range(4)]
    distilled = make(tmp_path, "distilled", distill={"teacher": str(teacher), "alpha": 0.0})
    got = [distilled.train_step().loss for _ in range(4)]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, quantize", [("kl", "none"), ("jsd", "none"), ("kl", "nf4")])
def test_the_student_learns_and_the_teacher_stays(tmp_path, teacher, kind, quantize):
    trainer = make(tmp_path, "student", steps=8, distill={
        "teacher": str(teacher), "alpha": 0.7, "temperature": 2.0, "kind": kind,
        "teacher_quantize": quantize,
    })  # fmt: skip
    teacher_model = trainer.loss_model.teacher
    before = {n: t.clone() for n, t in teacher_model.state_dict().items()}
    history = trainer.fit()
    assert history[-1].loss < history[0].loss
    for name, tensor in teacher_model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert not any(p.requires_grad for p in teacher_model.parameters())
    student = {id(p) for p in trainer.model.parameters()}
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == student  # the teacher's weights are none of the optimizer's


def test_a_teacher_of_another_vocabulary_is_refused(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=300, hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
        num_key_value_heads=2, intermediate_size=80,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary of 300 and the student"):
        make(tmp_path, "refused", distill={"teacher": str(tmp_path / "other")})
    with pytest.raises(ValueError, match="distill.alpha"):
        build_config(flags={"distill": {"alpha": 2.0}})
