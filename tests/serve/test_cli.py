"""``ortpa serve`` on the command line: listed, its options checked, a model it cannot serve refused clearly."""

from __future__ import annotations

import shutil

import pytest

from ortpa.cli import main


def test_listed_with_its_options(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for option in (
        "--host",
        "--port",
        "--served-model-name",
        "--provider",
        "--num-blocks",
        "--kv-memory",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-queue",
        "--api-key",
        "--max-body-bytes",
        "--max-prompt-bytes",
        "--max-n",
        "--max-concurrent-per-key",
    ):
        assert option in out, option


@pytest.mark.parametrize(
    "bad",
    [
        ["--num-blocks", "0"],
        ["--num-blocks", "8", "--kv-memory", "1"],
        ["--port", "x"],
        ["--port", "70000"],
        ["--max-queue", "-1"],
        ["--max-num-batched-tokens", "0"],
        ["--kv-memory", "0"],
        ["--max-model-len", "0"],
        ["--max-body-bytes", "0"],
        ["--max-prompt-bytes", "-5"],
        ["--max-n", "0"],
        ["--max-concurrent-per-key", "x"],
    ],
)
def test_usage_errors_exit_2(model_folder, bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(model_folder), *bad])
    assert exit_.value.code == 2


def test_a_model_without_tokenizer_is_refused_in_one_line(model_folder, tmp_path, capsys):
    shutil.copy(model_folder / "model.onnx", tmp_path / "model.onnx")
    assert main(["serve", str(tmp_path), "--num-blocks", "8", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "needs a tokenizer.json" in err[-1] and str(tmp_path) in err[-1], err


def test_max_model_len_past_the_models_context_is_refused(model_folder, capsys):
    code = main(["serve", str(model_folder), "--num-blocks", "8", "--port", "0", "--max-model-len", "999"])
    err = capsys.readouterr().err.strip().splitlines()
    # exit 1: the value is valid as a number, not for this model (docs/cli.md's exit codes)
    assert code == 1 and "--max-model-len" in err[-1] and "256" in err[-1] and "999" in err[-1], (code, err)
    assert err[-1].count("ortpa serve") == 1, err


def test_the_step_budget_reaches_the_model(model_folder, monkeypatch, capsys):
    from ortpa.errors import OrtpaError
    from ortpa.serve.model import ServingModel

    seen = {}

    def load(model, **kwargs):
        seen.update(kwargs)
        raise OrtpaError("stopped after load's arguments were seen")

    monkeypatch.setattr(ServingModel, "load", staticmethod(load))
    assert main(["serve", str(model_folder), "--max-num-batched-tokens", "77", "--port", "0"]) == 1
    assert seen["max_num_batched_tokens"] == 77
