"""Errors a newcomer met (issue 27): each says what happened and what to do, with the exit code of its meaning.

Exit codes (ortpa.cli._common, README's synopsis): 0 done, 1 invalid model or input, 2 usage, 3 this machine lacks
what the command needs (an extra, a free port), 130 interrupted.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from ortpa.cli import main
from ortpa.cli._common import EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from ortpa.errors import InvalidParameter

FIXTURES = Path(__file__).parent / "fixtures"
DENSE = FIXTURES / "dsv3_sdpa_op18.onnx"
LLAMA = FIXTURES / "llama_sdpa_op18.onnx"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    """A native and a --portable conversion of the small MLA fixture (unverified: other tests prove them)."""
    folder = tmp_path_factory.mktemp("errors")
    out = {"paged": folder / "paged.onnx", "portable": folder / "portable" / "model.onnx"}
    assert main(["convert", str(DENSE), str(out["paged"]), "--quiet", "--no-verify"]) == EXIT_OK
    assert main(["convert", str(DENSE), str(out["portable"]), "--quiet", "--no-verify", "--portable"]) == EXIT_OK
    return out


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_exit_codes_are_distinct():
    assert len({EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_INTERRUPTED}) == 5


@pytest.mark.parametrize("command", ["export", "convert"])
def test_missing_export_extra_is_one_line_and_exit_3(command, tmp_path, monkeypatch, capsys):
    """Without torch/transformers: no traceback, the extra to install, exit 3 (the machine, not the model)."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails, find_spec says absent
    checkpoint = tmp_path / "hf"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main([command, str(checkpoint), str(tmp_path / "out.onnx")]) == EXIT_UNAVAILABLE
    line = _one_line(capsys.readouterr().err)
    assert "transformers" in line and "pip install 'ortpa[export]'" in line
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("kind", ["paged", "portable"])
def test_converting_a_paged_model_says_it_is_already_paged(kind, converted, tmp_path, capsys):
    assert main(["convert", str(converted[kind]), str(tmp_path / "again.onnx"), "--quiet"]) == EXIT_INVALID
    line = _one_line(capsys.readouterr().err)
    assert "already a paged model" in line and "not static" not in line
    assert ("--portable" in line) == (kind == "portable")


def test_parity_with_the_models_swapped_or_both_paged(converted, capsys):
    paged = str(converted["paged"])
    assert main(["parity", paged, paged]) == EXIT_INVALID
    line = _one_line(capsys.readouterr().err)
    assert "already a paged model" in line and "InsertedPrecisionFreeCast" not in line
    assert main(["parity", str(DENSE), str(DENSE)]) == EXIT_INVALID
    assert "convert it first" in _one_line(capsys.readouterr().err)


def test_parity_quiet_prints_only_the_verdict(converted, capsys):
    assert main(["parity", str(DENSE), str(converted["paged"]), "--quiet", "--max-new-tokens", "2"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.strip().splitlines() == [out.strip()] and out.startswith("VERIFIED"), out


def test_serve_on_a_busy_port_fails_at_once_with_exit_3(tmp_path, capsys):
    """Refused before the model loads (the model here does not even exist) and before any 'serving on' line."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", str(tmp_path / "none.onnx"), "--port", str(port)])
    assert code == EXIT_UNAVAILABLE
    line = _one_line(capsys.readouterr().err)
    assert f"127.0.0.1:{port} is already in use" in line and "another --port" in line


def test_generate_names_a_missing_model_before_its_tokenizer(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nosuch"), "--prompt", "hi"]) == EXIT_INVALID
    line = _one_line(capsys.readouterr().err)
    assert "no such file or folder" in line and "tokenizer" not in line


def test_generate_on_a_dense_model_says_convert_it_first(capsys):
    assert main(["generate", str(DENSE), "--prompt-ids", "1,2"]) == EXIT_INVALID
    assert "convert it first" in _one_line(capsys.readouterr().err)


def test_validate_a_portable_or_dense_file_is_not_ok(converted, capsys):
    """Nothing to check is said, with exit 1; never 'no PagedAttention nodes' followed by OK."""
    assert main(["validate", str(converted["portable"])]) == EXIT_INVALID
    captured = capsys.readouterr()
    assert "--portable" in _one_line(captured.err) and "OK" not in captured.out
    assert main(["validate", str(DENSE)]) == EXIT_INVALID
    assert "convert it first" in _one_line(capsys.readouterr().err)


def test_companion_files_are_copied_readable(tmp_path):
    """Copied beside the output with the mode a plain file gets (umask applied), not mkstemp's 0600."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "model.onnx").write_bytes(DENSE.read_bytes())
    (source / "tokenizer.json").write_text("{}")
    (source / "config.json").write_text("{}")
    out = tmp_path / "out" / "model.onnx"
    old = os.umask(0o022)
    try:
        assert main(["convert", str(source), str(out), "--quiet", "--no-verify"]) == EXIT_OK
    finally:
        os.umask(old)
    for name in ("tokenizer.json", "config.json"):
        assert stat.S_IMODE((out.parent / name).stat().st_mode) == 0o644, name


def test_paged_session_refuses_a_2d_input_ids_in_its_own_words(converted):
    from ortpa.runtime.kv import PagedKVCache
    from ortpa.runtime.session import PagedSession

    session = PagedSession(converted["paged"], num_blocks=8, block_size=16, providers=["CPUExecutionProvider"])
    kv = PagedKVCache(num_blocks=8, block_size=16)
    kv.add_sequence(0)
    feeds = kv.plan_step([(0, 3)]).model_feeds(
        np.array([1, 2, 3], np.int64), attention_metadata=True, position_ids=False
    )
    feeds["input_ids"] = feeds["input_ids"].reshape(1, 3)
    with pytest.raises(InvalidParameter, match=r"input_ids: expected a rank-1 array"):
        session.run(feeds)


def test_llama_conversion_does_not_say_mla(tmp_path, capsys):
    assert main(["convert", str(LLAMA), str(tmp_path / "p.onnx"), "--no-verify"]) == EXIT_OK
    err = capsys.readouterr().err
    assert "matching attention layers" in err and "MLA" not in err


def test_bench_serve_without_the_serve_extra_is_a_row(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert main(["bench", "--quick", "--only", "serve", "--path", str(tmp_path), "--json"]) == EXIT_OK
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and "not available" in rows[0]["notes"] and "ortpa[serve]" in rows[0]["notes"], rows


def test_interrupt_exits_130(monkeypatch, capsys):
    import ortpa.cli.validate as validate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "run", interrupted)
    assert main(["validate", str(DENSE)]) == EXIT_INTERRUPTED
    assert "interrupted" in capsys.readouterr().err
