import json
import shlex

import pytest
import torch

from memfit.cli.main import main


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_train_lowers_the_loss_and_generates(tmp_path, capsys):
    """`memfit train` with nothing but a run directory: the built-in default (preset tiny on the
    synthetic corpus) must visibly learn; then `memfit generate` continues a prompt."""
    run = tmp_path / "default"
    assert main(["train", "--out", str(run)]) == 0
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    first, last = metrics[0]["loss"], sum(m["loss"] for m in metrics[-5:]) / 5
    assert first > 5.0  # ln(258) at initialization
    assert last < 1.5, f"loss went from {first:.3f} to {last:.3f}"
    assert all(m["tokens_per_s"] > 0 and m["mem_peak_bytes"] > 0 for m in metrics)
    capsys.readouterr()

    assert (
        main(
            [
                "generate",
                str(run),
                "--prompt",
                "mia has",
                "--max-new-tokens",
                "40",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert text.startswith("mia has") and "tok/s" in text

    # a file of prompts through the paged engine: plain lines and JSONL, results as JSONL
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('mia has\n{"prompt": "tom finds"}\n\nthe week\n')
    out = tmp_path / "out.jsonl"
    command = ["generate", str(run), "--prompts", str(prompts), "--output", str(out)]
    assert main([*command, "--max-new-tokens", "12", "--temperature", "0"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["mia has", "tom finds", "the week"]
    # greedy: the engine continues "mia has" as the single-prompt path did
    assert text.startswith("mia has" + records[0]["completion"])
    summary = capsys.readouterr().out
    assert "3 requests" in summary and "KV blocks peak" in summary and "preemptions" in summary


def test_config_file_flags_and_set_precedence(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[train]\nsteps = 3\nmicro_batch = 2\nlr = 0.01\n[data]\nseq_len = 32\n")
    run = tmp_path / "r"
    args = [
        "train",
        "--config",
        str(config),
        "--steps",
        "2",
        "--set",
        "train.micro_batch=1",
        "--out",
        str(run),
    ]
    assert main(args) == 0
    metrics = read_metrics(run)
    assert len(metrics) == 2 and metrics[0]["tokens"] == 32  # flags beat the file, --set beats both
    assert (run / "checkpoints" / "step_0000002" / "config.toml").read_text().count(
        "micro_batch = 1"
    ) == 1


@pytest.mark.parametrize("blocks", [None, 2])
def test_a_saved_config_toml_loads_back_as_the_same_config(tmp_path, blocks):
    """A checkpoint's config.toml is a --config file: an optional setting left unset (None) is
    left out, and `--set ...=all` clears one a file gave."""
    from memfit.config import build_config, to_toml

    flags = {"train": {"checkpointing": "full", "checkpoint_blocks": blocks}}
    config = build_config(flags=flags)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config))
    assert build_config(str(path)) == config
    cleared = build_config(str(path), sets=["train.checkpoint_blocks=all"])
    assert cleared.train.checkpoint_blocks is None


def test_resume_continues_the_run(tmp_path):
    run = tmp_path / "r"
    common = ["train", "--set", "data.seq_len=32", "--micro-batch", "2", "--out", str(run)]
    assert main([*common, "--steps", "4", "--save-every", "2"]) == 0
    assert main([*common, "--steps", "6", "--resume"]) == 0
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "--set", "train.stepz=3"], "did you mean 'train.steps'"),
        (["train", "--model", "llama-7b"], "unknown model 'llama-7b'"),
        (["train", "--zero", "2", "--steps", "1"], "torchrun"),
        (["train", "--config", "missing.toml"], "does not exist"),
        (["generate", "no/such/run"], "no checkpoint found"),
    ],
)
def test_bad_input_exits_with_a_clear_message(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err.replace("\n", " ")


def test_plan_prints_a_breakdown_and_json(capsys):
    assert main(["plan", "--model", "llama-1b", "--micro-batch", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] and set(result["breakdown"]) >= {
        "params",
        "grads",
        "optimizer_states",
        "activations",
    }
    assert result["peak_bytes"] == sum(result["breakdown"].values())
    assert main(["plan", "--model", "llama-1b", "--micro-batch", "4"]) == 0
    assert "peak allocated" in capsys.readouterr().out


def test_fp32_parts_from_the_command_line(tmp_path, capsys):
    """`memfit plan --fp32-parts` prices them; `memfit train --fp32-parts` runs them (the run's
    configuration records them); a malformed list exits 2 saying what it takes."""
    assert main(["plan", "--micro-batch", "4", "--fp32-parts", "last,head", "--json"]) == 0
    fp32 = json.loads(capsys.readouterr().out)
    assert main(["plan", "--micro-batch", "4", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert fp32["strategy"]["fp32_parts"] == "last:1,head"
    assert fp32["step_time"]["total_s"] > plain["step_time"]["total_s"]
    run = tmp_path / "r"
    common = ["train", "--steps", "1", "--seq-len", "32", "--micro-batch", "1", "--out", str(run)]
    assert main([*common, "--precision", "bf16", "--fp32-parts", "head,first:1"]) == 0
    saved = (run / "checkpoints" / "step_0000001" / "config.toml").read_text()
    assert 'fp32_parts = "head,first:1"' in saved
    assert main([*common, "--fp32-parts", "embed"]) == 2
    assert "first N blocks unrounded" in capsys.readouterr().err.replace("\n", " ")
    for command in (["plan", "--recommend"], ["train", "--auto"]):
        assert main([*command, "--fp32-parts", "head"]) == 2
        assert "takes no --fp32-parts" in capsys.readouterr().err.replace("\n", " ")


def test_plan_that_does_not_fit_says_what_would(capsys):
    assert (
        main(["plan", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--checkpointing", "full"])
        == 1
    )
    out = capsys.readouterr().out.replace("\n", " ")
    assert "does not fit" in out and "--offload optimizer" in out


def test_plan_unknown_gpu_lists_the_catalog(capsys):
    assert main(["plan", "--gpu", "h100"]) == 2
    assert "h100-sxm" in capsys.readouterr().err


def test_plan_recommend(capsys):
    assert main(["plan", "--model", "llama-1b", "--gpu", "a100-80gb", "--recommend", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found and found[0]["fits"] and found[0]["tokens_per_s"] >= found[-1]["tokens_per_s"]
    assert found[0]["why"].startswith("the fastest predicted")
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "a10g", "--recommend"]) == 1
    assert "fits" in capsys.readouterr().out


def test_plan_recommend_on_several_gpus_ranks_zero_stages(capsys):
    """--recommend --gpus N searches ZeRO stages and offload too, and the command it prints
    launches N processes with the stage it chose."""
    assert main(["plan", "--model", "llama-1b", "--recommend", "--gpus", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (rich wraps the table and lines)
    assert "llama-1b on 4 x h100-sxm" in out
    assert "why each is there: 1. full: the fastest predicted" in out
    assert "2. full:" in out and "slower than the first" in out
    assert "run the first: torchrun --nproc_per_node 4 -m memfit train --model llama-1b" in out
    assert main(["plan", "--model", "llama-1b", "--gpus", "4", "--zero", "3", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["fits"] and planned["step_time"]["communication_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU --auto has a GPU to plan for")
def test_train_auto_without_a_known_gpu_says_so(capsys):
    assert main(["train", "--auto", "--steps", "1", "--device", "cpu"]) == 2
    assert "--auto plans for the present GPU" in capsys.readouterr().err


@pytest.mark.parametrize("where", [[], ["--engine-in-thread"]])
def test_serve_answers_over_http(monkeypatch, where):
    """`memfit serve tiny`: the parsed flags reach the LLM and the engine (in a process of its
    own, or a thread), and the app it hands to uvicorn answers (uvicorn.run replaced by a
    client of the app)."""
    uvicorn = pytest.importorskip("uvicorn")
    from fastapi.testclient import TestClient

    answers = {}

    def run(app, host, port):
        client = TestClient(app)
        answers["health"] = client.get("/health").text
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "return_token_ids": True}
        answers["tokens"] = client.post("/v1/completions", json=body).json()["choices"][0]
        answers["context"] = client.get("/v1/models").json()["data"][0]["max_model_len"]
        answers["where"] = (host, port)

    monkeypatch.setattr(uvicorn, "run", run)
    args = ["serve", "tiny", "--device", "cpu", "--port", "9001", "--max-model-len", "64",
            "--max-step-tokens", "16", *where]  # fmt: skip
    assert main(args) == 0
    assert answers["health"] == "ok" and answers["where"] == ("127.0.0.1", 9001)
    assert len(answers["tokens"]["token_ids"]) == 3 and answers["context"] == 64


def test_serve_with_two_http_processes_answers_and_stops_on_ctrl_c(tmp_path):
    """`memfit serve tiny --api-servers 2` as a user starts it: requests are answered, and
    SIGINT stops the HTTP processes and the engine process."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "memfit.cli.main", "serve", "tiny", "--device", "cpu",
               "--port", str(port), "--max-model-len", "64", "--api-servers", "2"]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "return_token_ids": True}
        for _ in range(6):
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert len(response.json()["choices"][0]["token_ids"]) == 3
        for _ in range(4):  # whichever process answers, /metrics counts both
            metrics = httpx.get(f"{url}/metrics").text
            assert "memfit_generated_tokens_total 18.0" in metrics
            assert "memfit_kv_blocks_total 8191.0" in metrics
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) in (0, 130)  # (uvicorn re-raises the signal it caught)
    finally:
        if server.poll() is None:
            server.kill()
    text = " ".join(log.read_text().split())  # (rich wraps the log's lines)
    assert "2 HTTP processes" in text and text.count("Finished server process") == 2
    assert "Traceback" not in text


@pytest.mark.parametrize("world_size", ["1", "4"])
def test_train_auto_under_torchrun_plans_for_every_gpu(monkeypatch, world_size):
    """--auto on each rank of a torchrun launch of N processes: the planner's fastest strategy
    on N GPUs, its ZeRO stage and offload set in [distributed], a step of all the ranks
    keeping the configuration's tokens."""
    from rich.console import Console

    from memfit.cli.train import choose_strategy
    from memfit.config import build_config
    from memfit.models import PRESETS
    from memfit.planner import GPUS
    from memfit.planner.search import rank_strategies

    monkeypatch.setattr("memfit.planner.detect_gpu", lambda: GPUS["h100-sxm"])
    monkeypatch.setenv("WORLD_SIZE", world_size)
    gpus = int(world_size)
    flags = {"model": {"name": "llama-1b"}, "train": {"micro_batch": 8, "grad_accum": 4}}
    config = build_config(flags=flags)
    chosen = choose_strategy(config, Console(record=True, width=200))
    tokens = 8 * 4 * config.data.seq_len * gpus
    best = rank_strategies(
        PRESETS["llama-1b"], GPUS["h100-sxm"], seq_len=config.data.seq_len, gpus=gpus,
        tokens_per_step=tokens,
    )[0].strategy  # fmt: skip
    assert (chosen.distributed.zero, chosen.distributed.offload) == (best.zero, best.offload)
    train = chosen.train
    assert (train.micro_batch, train.grad_accum) == (best.micro_batch, best.grad_accum)
    assert train.micro_batch * train.grad_accum * gpus * config.data.seq_len == tokens


def test_plan_recommend_names_the_model_as_given(tmp_path, capsys):
    """The command `--recommend` prints runs the model it planned: a config.json's path as given
    (not the name inside it, which `memfit train --model` would not find)."""
    config = {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
        "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 8192,
        "_name_or_path": "HuggingFaceTB/SmolLM2-135M",
    }  # fmt: skip
    path = tmp_path / "my model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    assert main(["plan", "--model", str(path), "--recommend", "--seq-len", "1024"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    command = out.split("full: run the first: ")[1].split(" LoRA r16:")[0]
    argv = shlex.split(command)
    assert argv[argv.index("--model") + 1] == str(path)
