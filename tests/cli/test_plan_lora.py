"""`memfit plan` with LoRA, QLoRA and a teacher: memfit train's flags, a run's --config, and
--recommend's goals."""

import json

import pytest

from memfit.cli.main import main
from memfit.models.config import PRESETS, to_hf_config


def test_recommend_lists_lora_and_qlora_where_full_fine_tuning_does_not_fit(capsys):
    """The issue's command: llama-3-8b on a 24 GB card. Full fine-tuning fits nowhere (exit 1,
    as --recommend exits when the goal asked for does not fit); LoRA and QLoRA are listed with
    their predicted speed and the command that runs them."""
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "rtx4090", "--recommend"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "nothing fits" in out and "tokens/s" in out
    assert "QLoRA nf4 r16: run the first: memfit train --model llama-3-8b" in out
    assert "LoRA r16: run the first:" in out
    assert "--lora-rank 16 --quantize-base nf4" in out


def test_recommend_json_keeps_the_goal_asked_for(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "rtx4090", "--recommend", "--json"]
    assert main([*argv, "--lora-rank", "8", "--quantize-base", "nf4"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found and {r["goal"] for r in found} == {"QLoRA nf4 r8"}
    speeds = [r["tokens_per_s"] for r in found]
    assert speeds == sorted(speeds, reverse=True) and all(r["fits"] for r in found)
    assert main(argv) == 1  # full fine-tuning asked for: the alternatives listed beside it
    goals = {r["goal"] for r in json.loads(capsys.readouterr().out)}
    assert goals == {"LoRA r16", "QLoRA nf4 r16"}


def test_plan_of_a_qlora_run(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "rtx4090", "--checkpointing", "full"]
    assert main([*argv, "--lora-rank", "16", "--quantize-base", "nf4", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["goal"] == "QLoRA nf4 r16" and planned["fits"]
    assert planned["trainable_params"] == 41943040  # benchmarks/results/lora.json's count
    assert planned["peak_bytes"] < 8 * 2**30
    assert main([*argv, "--lora-rank", "16", "--lora-targets", "q_proj,v_proj"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "LoRA r16 on q_proj,v_proj" in out and "adapter parameters" in out


def test_plan_with_a_teacher(capsys):
    argv = ["plan", "--model", "llama-3.2-1b", "--teacher", "llama-3-8b", "--lora-rank", "16"]
    assert main([*argv, "--teacher-quantize", "nf4", "--checkpointing", "full"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "teacher llama-3-8b nf4" in out and "params include the teacher llama-3-8b" in out
    assert ", teacher " in out  # the teacher's share of the step time


@pytest.fixture
def run_config(tmp_path):
    """A run's TOML with [lora] and [distill], its teacher a Hugging Face config.json directory."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps(to_hf_config(PRESETS["llama-3-8b"])))
    path = tmp_path / "run.toml"
    path.write_text(
        '[model]\nname = "llama-3.2-1b"\n[data]\nseq_len = 1024\n'
        '[train]\nmicro_batch = 2\ncheckpointing = "full"\n'
        '[lora]\nrank = 8\nquantize = "nf4"\ntargets = "q_proj,v_proj"\n'
        f'[distill]\nteacher = "{teacher}"\nteacher_quantize = "int8"\nkind = "jsd"\n'
    )
    return path


def test_plan_reads_a_runs_config(run_config, capsys):
    assert main(["plan", "--config", str(run_config), "--gpu", "rtx4090", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    strategy = planned["strategy"]
    assert planned["model"] == "llama-3.2-1b" and planned["goal"] == "QLoRA nf4 r8"
    assert (strategy["seq_len"], strategy["micro_batch"], strategy["checkpointing"]) == (
        1024,
        2,
        "full",
    )
    assert strategy["lora_targets"] == ["q_proj", "v_proj"]
    assert (strategy["teacher"], strategy["teacher_quantize"], strategy["distill_kind"]) == (
        "teacher",
        "int8",
        "jsd",
    )
    # flags override the file
    argv = ["plan", "--config", str(run_config), "--quantize-base", "none", "--micro-batch", "1"]
    assert main([*argv, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["goal"] == "LoRA r8" and planned["strategy"]["micro_batch"] == 1
    # --recommend plans the file's goal alone
    argv = ["plan", "--config", str(run_config), "--gpu", "rtx4090", "--recommend", "--json"]
    assert main(argv) == 0
    assert {r["goal"] for r in json.loads(capsys.readouterr().out)} == {"QLoRA nf4 r8"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--lora-rank", "16", "--zero", "3", "--gpus", "2"],
            "LoRA trains with ZeRO stage 0, 1 or 2, without offload (got --zero 3",
        ),
        (["--quantize-base", "nf4"], "quantizes the frozen base of a LoRA run: set lora_rank"),
        (["--lora-rank", "-1"], "--lora-rank must be >= 0 (0: no LoRA), got -1"),
        (["--lora-rank", "8", "--lora-targets", "q,v"], "LoRA targets 'q', 'v': choose among"),
        (
            ["--model", "llama-3-8b", "--teacher", "llama-1b"],
            "the teacher 'llama-1b' has a vocabulary of 32000",
        ),
        (["--teacher", "llama-8b"], "unknown model 'llama-8b'"),
        (
            ["--lora-rank", "8", "--optimizer", "adamw8bit", "--master-weights", "none"],
            "drop --master-weights none",
        ),
    ],
)
def test_bad_fine_tuning_flags_exit_with_a_clear_message(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    assert message in " ".join(capsys.readouterr().err.split())
