"""Deployment metadata (token ids, tokenizer, configs) is the same whatever form the input was given in: a folder,
the model file inside it, or the file of an ``onnx/`` layout inside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ortpa.cli import main
from ortpa.conversion import convert_file
from ortpa.model.ref import locate_model
from ortpa.testing.byte_tokenizer import write_byte_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLAMA = FIXTURES / "llama_sdpa_op18.onnx"


def _source_folder(root: Path, rel: str) -> Path:
    """A model folder as a user has it: the dense model at ``rel``, configs whose token ids differ from each other
    (so which file each id came from is visible), a tokenizer."""
    folder = root / "src"
    (folder / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(LLAMA, folder / rel)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2, "bos_token_id": 1}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "pad_token_id": 3}))
    write_byte_tokenizer(folder / "tokenizer.json", 64)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return folder


@pytest.mark.parametrize("rel", ["model.onnx", "onnx/model.onnx"])
def test_a_file_input_keeps_the_folders_token_ids_and_tokenizer(tmp_path, rel):
    folder = _source_folder(tmp_path, rel)
    by_folder = convert_file(folder, tmp_path / "a" / "model.onnx", verify=False)
    by_file = convert_file(folder / rel, tmp_path / "b" / "model.onnx", verify=False)
    assert by_file.metadata_folder == folder and by_file.eos_token_id
    assert sorted(by_file.copied) == sorted(by_folder.copied)
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"} <= set(by_file.copied)
    for name in by_file.copied:  # byte for byte what the source folder holds
        assert (tmp_path / "b" / name).read_bytes() == (folder / name).read_bytes(), name
    config_a = json.loads(by_folder.genai_config.read_text())["model"]
    config_b = json.loads(by_file.genai_config.read_text())["model"]
    ids = {k: config_b.get(k) for k in ("eos_token_id", "bos_token_id", "pad_token_id")}
    assert ids == {"eos_token_id": [2, 7], "bos_token_id": 1, "pad_token_id": 3}  # generation_config wins over config
    assert {k: config_a.get(k) for k in ids} == ids


def test_a_file_with_nothing_beside_it_has_no_folder(tmp_path):
    bare = tmp_path / "bare" / "model.onnx"
    bare.parent.mkdir()
    shutil.copyfile(LLAMA, bare)
    assert locate_model(bare).folder is None
    (bare.parent / "notes.txt").write_text("not a config")
    assert locate_model(bare).folder is None
    (bare.parent / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert locate_model(bare).folder == bare.parent


def test_the_cli_notes_a_missing_eos_only_when_there_is_none(tmp_path, capsys):
    folder = _source_folder(tmp_path, "model.onnx")
    assert main(["convert", str(folder / "model.onnx"), str(tmp_path / "o1" / "model.onnx"), "--no-verify"]) == 0
    err = capsys.readouterr().err
    assert "no eos_token_id found" not in err and "beside the input" not in err, err
    # configs beside the file that name no EOS: the note names the folder it read, not "nothing beside the input"
    for name in ("config.json", "generation_config.json"):
        (folder / name).write_text(json.dumps({"model_type": "llama"}))
    assert main(["convert", str(folder / "model.onnx"), str(tmp_path / "o2" / "model.onnx"), "--no-verify"]) == 0
    err = capsys.readouterr().err
    assert "no eos_token_id found" in err and str(folder) in err and "beside the input" not in err, err
