"""Every subcommand refuses bad input with one `error:` line that names the value (exit code 2),
before the data or a model is built, and prints what came from the user literally (rich reads
"[train]" or "[/]" as markup unless told not to)."""

import json

import pytest
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from memfit.cli.main import main
from memfit.models import ModelConfig, build_model
from memfit.models.llama import to_hf_state_dict

HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The files the rows name, made once: bad model configs, a tokenizer larger than the tiny
    preset's 258 embeddings, a checkpoint holding NaN, a prompts file that is not UTF-8."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "list.json").write_text("[1, 2]")
    (root / "string.json").write_text(json.dumps(HF_CONFIG | {"hidden_size": "64"}))
    (root / "float.json").write_text(json.dumps(HF_CONFIG | {"hidden_size": 64.5}))
    (root / "broken.json").write_text('{"model_type": "llama",')
    vocab = {f"t{i}": i for i in range(299)} | {"</s>": 299}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(root / "big-tokenizer.json"))
    checkpoint = root / "nan-checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(HF_CONFIG))
    config = ModelConfig(
        vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=4,
        intermediate_size=48, max_seq_len=64,
    )  # fmt: skip
    model = build_model(config, device="cpu")
    tensors = {name: t.contiguous() for name, t in to_hf_state_dict(model).items()}
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(checkpoint / "model.safetensors"))
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (root / "a file").write_text("")
    (root / "x[").write_text("")  # so that x[/]y is a path under a file
    (root / "prompts.txt").write_text("hi\n")
    return root


# (argv, a part of the message); in both, {files} stands for the directory of `files` and {tmp}
# for the test's own. Each row runs in a fresh directory (a row that was not refused would
# leave its runs/ there).
ROWS = [
    # markup in what the user typed
    (["train", "--set", "trian.lr=1"], "unknown config section '[trian]'"),
    (["train", "--data", "x[/]y.txt"], "data.source = 'x[/]y.txt' does not exist"),
    (["train", "--data", "[bold]d.txt"], "'[bold]d.txt'"),
    (["train", "--tokenizer", "no/[red]tok.json"], "data.tokenizer = 'no/[red]tok.json'"),
    (["train", "--config", "[/]missing.toml"], "'[/]missing.toml' does not exist"),
    # model configs
    (["train", "--model", "{files}/list.json"], "holds a JSON list"),
    (
        ["train", "--model", "{files}/string.json"],
        "hidden_size must be a positive integer, got '64'",
    ),
    (["plan", "--model", "{files}/float.json"], "hidden_size must be a positive integer, got 64.5"),
    (["plan", "--model", "{files}/broken.json"], "is not valid JSON"),
    (["plan", "--model", "llama-7b"], "unknown model 'llama-7b'"),
    # train's numbers
    (["train", "--lr", "nan"], "train.lr = nan is not a finite number"),
    (["train", "--lr", "inf"], "train.lr = inf is not a finite number"),
    (["train", "--lr", "-1"], "train.lr must be > 0, got -1.0"),
    (["train", "--steps", "0"], "train.steps must be > 0, got 0"),
    (["train", "--micro-batch", "-2"], "train.micro_batch must be > 0, got -2"),
    (["train", "--grad-accum", "0"], "train.grad_accum must be > 0, got 0"),
    (["train", "--seq-len", "0"], "data.seq_len must be > 0, got 0"),
    (["train", "--seed", "-1"], "train.seed must be in [0, 2**64), got -1"),
    (["train", "--save-every", "-1"], "checkpoint.save_every must be >= 0 (0: at the end), got -1"),
    (["train", "--set", "train.beta2=1"], "train.beta2 must be in [0, 1), got 1.0"),
    (["train", "--set", "train.weight_decay=-0.1"], "train.weight_decay must be >= 0, got -0.1"),
    (["train", "--set", "loss_scale.init_scale=nan"], "loss_scale.init_scale = nan"),
    (["train", "--set", "distributed.timeout_s=0"], "distributed.timeout_s must be > 0, got 0.0"),
    (["train", "--set", "distributed.timeout_s=-5"], "distributed.timeout_s must be > 0, got -5.0"),
    (["train", "--set", "distributed.timeout_s=nan"], "distributed.timeout_s = nan"),
    (["train", "--set", "distributed.heartbeat_s=-1"], "distributed.heartbeat_s must be >= 0"),
    (["train", "--device", "foo"], "train.device = 'foo' is not a device"),
    (["train", "--device", "cuda:-1"], "train.device = 'cuda:-1' is not a device"),
    (["train", "--seq-len", "100000"], "--seq-len 100000 exceeds model 'tiny'"),
    (["train", "--steps", "x"], "invalid int value: 'x'"),  # argparse's own
    (["profile", "--profile-steps", "0"], "--profile-steps must be >= 1, got 0"),
    (["profile", "--png", "{tmp}/no/such/dir/t.png"], "'{tmp}/no/such/dir' is no directory"),
    # plan
    (["plan", "--host-cpus", "0"], "--host-cpus must be >= 1, got 0"),
    (["plan", "--host-cpus", "-4", "--offload", "optimizer"], "--host-cpus must be >= 1, got -4"),
    (["plan", "--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["plan", "--micro-batch", "0"], "--micro-batch must be >= 1, got 0"),
    (["plan", "--grad-accum", "-1"], "--grad-accum must be >= 1, got -1"),
    (
        ["plan", "--model", "tiny", "--seq-len", "100000"],
        "--seq-len 100000 exceeds model 'tiny': its max_seq_len is 512",
    ),
    (["plan", "--model", "tiny", "--recommend", "--seq-len", "600"], "--seq-len 600 exceeds"),
    (["plan", "--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["plan", "--gpu", "h100"], "unknown GPU 'h100'"),
    (["plan", "--serve", "--memory-fraction", "0"], "--memory-fraction must be in (0, 1], got 0.0"),
    (
        ["plan", "--serve", "--memory-fraction", "nan"],
        "--memory-fraction must be in (0, 1], got nan",
    ),
    (["plan", "--serve", "--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["plan", "--serve", "--max-running", "-1"], "--max-running must be >= 1, got -1"),
    # generate (the tiny preset: random weights, built in no time)
    (["generate", "tiny", "--device", "foo"], "--device 'foo' is not a device"),
    (["generate", "tiny", "--temperature", "nan"], "--temperature must be finite, got nan"),
    (["generate", "tiny", "--temperature", "inf"], "--temperature must be finite, got inf"),
    (["generate", "tiny", "--temperature", "-1"], "--temperature must be >= 0"),
    (["generate", "tiny", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["generate", "tiny", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["generate", "tiny", "--top-p", "nan"], "--top-p must be finite, got nan"),
    (["generate", "tiny", "--top-k", "-1"], "--top-k must be >= 0"),
    (["generate", "tiny", "--min-p", "2"], "--min-p must be in [0, 1]"),
    (["generate", "tiny", "--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["generate", "tiny", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["generate", "tiny", "--max-new-tokens", "-5"], "--max-new-tokens must be >= 1, got -5"),
    (["generate", "tiny", "--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["generate", "tiny", "--gpu-memory-fraction", "0"], "--gpu-memory-fraction must be in (0, 1]"),
    (["generate", "tiny", "--gpu-memory-fraction", "1.5"], "got 1.5"),
    (["generate", "tiny", "--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
    (["generate", "tiny", "--seed", str(2**64)], f"--seed must be in [-2**63, 2**64), got {2**64}"),
    (
        ["generate", "tiny", "--tokenizer", "{files}/big-tokenizer.json"],
        "has 300 tokens but model 'tiny' has only 258",
    ),
    (
        ["generate", "tiny", "--tokenizer", "no/such/tokenizer.json"],
        "'no/such/tokenizer.json' not found",
    ),
    (
        ["generate", "{files}/nan-checkpoint"],
        "'model.layers.0.mlp.up_proj.weight' in '{files}/nan-checkpoint/model.safetensors' holds "
        "NaN or inf",
    ),
    (["generate", "no/[/]such/run"], "no checkpoint found at 'no/[/]such/run'"),
    (
        ["generate", "tiny", "--prompts", "{files}/no[/]such.txt"],
        "'{files}/no[/]such.txt' does not exist",
    ),
    (["generate", "tiny", "--prompts", "{files}"], "is a directory"),
    (["generate", "tiny", "--prompts", "{files}/latin1.txt"], "is not UTF-8 text"),
    (
        ["generate", "tiny", "--prompts", "{files}/prompts.txt", "--output", "{tmp}/x[/]/o.jsonl"],
        "'{tmp}/x[/]/o.jsonl': '{tmp}/x[/]' is no directory",
    ),
    (
        ["generate", "tiny", "--prompts", "{files}/prompts.txt", "--output", "{files}"],
        "is a directory",
    ),
    # serve: refused before the engine is made
    (["serve", "tiny", "--port", "70000"], "--port must be in [1, 65535], got 70000"),
    (["serve", "tiny", "--port", "-1"], "--port must be in [1, 65535], got -1"),
    (["serve", "tiny", "--max-running", "0"], "--max-running must be >= 1, got 0"),
    (["serve", "tiny", "--max-waiting", "0"], "--max-waiting must be >= 1, got 0"),
    (["serve", "tiny", "--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["serve", "tiny", "--gpu-memory-fraction", "1.01"], "--gpu-memory-fraction must be in (0, 1]"),
    (["serve", "tiny", "--api-servers", "0"], "--api-servers must be >= 1, got 0"),
    (["serve", "tiny", "--stream-interval", "0"], "--stream-interval must be >= 1, got 0"),
    (["serve", "tiny", "--max-model-len", "-3"], "--max-model-len must be >= 1, got -3"),
    (["serve", "tiny", "--max-step-tokens", "0"], "--max-step-tokens must be >= 1, got 0"),
    (["serve", "tiny", "--device", "gpu"], "--device 'gpu' is not a device"),
    # the file system
    (["train", "--out", "{files}/a file"], "is a file, not a run directory"),
    (["train", "--out", "{files}/x[/]y"], "'{files}/x[/]y'"),
]


def _fill(text: str, files, tmp) -> str:
    return text.replace("{files}", str(files)).replace("{tmp}", str(tmp))


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:  # argparse's usage errors
        return exit.code


@pytest.mark.parametrize("argv,expected", ROWS, ids=[" ".join(argv) for argv, _ in ROWS])
def test_bad_input_is_refused_in_one_line_naming_it(
    argv, expected, files, tmp_path, monkeypatch, capsys
):
    """Exit code 2 and one `error:` line holding the offending value as typed; no row prints a
    traceback (argparse's own errors come after its usage line)."""
    monkeypatch.chdir(tmp_path)
    argv = [_fill(arg, files, tmp_path) for arg in argv]
    assert _run(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith(("error: ", "memfit")), err
    if not lines[-1].startswith("memfit"):
        assert len(lines) == 1, err
    assert _fill(expected, files, tmp_path) in lines[-1]


def test_user_text_is_printed_literally(files, tmp_path, monkeypatch, capsys):
    """A prompt, a completion and a model's name are text, not rich markup."""
    monkeypatch.chdir(tmp_path)
    prompt = "[bold]hi[/] [red]there"
    command = ["generate", "tiny", "--tokenizer", "byte", "--prompt", prompt]
    assert main([*command, "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith(prompt)

    named = tmp_path / "config.json"
    named.write_text(json.dumps(HF_CONFIG | {"_name_or_path": "[bold]my/[/]model"}))
    assert main(["plan", "--model", str(named)]) == 0
    assert "memfit plan [bold]my/[/]model (" in capsys.readouterr().out


@pytest.mark.parametrize(
    "error,message",
    [
        (
            PermissionError(13, "Permission denied", "/runs/[x]"),
            "error: Permission denied: '/runs/[x]'",
        ),
        (IsADirectoryError(21, "Is a directory", "out"), "error: Is a directory: 'out'"),
        (NotADirectoryError(20, "Not a directory", "a/b"), "error: Not a directory: 'a/b'"),
        (FileExistsError(17, "File exists", "c"), "error: File exists: 'c'"),
        (
            json.JSONDecodeError("Expecting value", "x", 0),
            "error: Expecting value: line 1 column 1",
        ),
    ],
)
def test_file_system_errors_are_one_line(error, message, monkeypatch, capsys):
    """OSErrors that a path given by the user causes, and bad JSON, are one `error:` line."""
    import memfit.cli.plan

    def fails(args, console):
        raise error

    monkeypatch.setattr(memfit.cli.plan, "run_plan", fails)
    assert main(["plan"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1, err


def test_an_unexpected_exception_keeps_its_traceback(monkeypatch):
    """Only what bad input causes becomes an `error:` line: a bug still raises."""
    import memfit.cli.plan

    def broken(args, console):
        raise TypeError("a bug")

    monkeypatch.setattr(memfit.cli.plan, "run_plan", broken)
    with pytest.raises(TypeError, match="a bug"):
        main(["plan"])
