"""Models in the Hugging Face cache: by snapshot path, by repo id (offline), by repo id + revision.

Each test builds a cache in ``tmp_path`` exactly as ``huggingface_hub`` lays it out: ``models--ORG--NAME/``
with ``blobs/<hash>`` (the bytes), ``snapshots/<commit>/<file>`` (relative symlinks into ``blobs/``) and
``refs/main`` (the commit of ``main``). The model is a fixture saved with external data, so both the ``.onnx``
file and its weights are symlinks. Two revisions: an older one in the ``onnx/`` layout and ``main`` with
``model.onnx`` at the top; their ``config.json`` differ, so the copied file says which one was converted.
One conversion by repo id is verified (the verification finds the original through the cache); the others check
what they resolve and write, unverified (verification itself is tested in tests/test_verify.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import ortpa
from ortpa.cli import main
from ortpa.conversion import convert_file
from ortpa.errors import InvalidModel
from ortpa.model.ref import NoOnnxFile, find_onnx_file, resolve_model
from ortpa.rewriter.pipeline import convert

FIXTURES = Path(__file__).parent / "fixtures"
DENSE = FIXTURES / "llama_sdpa_op18.onnx"
REPO = "tiny-org/llama-onnx"
OLD, MAIN = "a" * 40, "b" * 40  # commit hashes of the two revisions
TOKENIZER = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}


# ------------------------------------------------------------------------------------------ the cache
@pytest.fixture(scope="module")
def dense_files(tmp_path_factory) -> dict[str, bytes]:
    """The fixture saved as ``model.onnx`` + ``model.onnx_data`` (every weight over 1 KiB external)."""
    folder = tmp_path_factory.mktemp("dense")
    onnx.save_model(onnx.load(DENSE), folder / "model.onnx", save_as_external_data=True, location="model.onnx_data")
    files = {name: (folder / name).read_bytes() for name in ("model.onnx", "model.onnx_data")}
    assert len(files["model.onnx_data"]) > 100_000  # the weights really are external
    return files


def _blob(repo: Path, data: bytes) -> Path:
    blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    return blob


def _link(snapshot: Path, rel: str, target: Path | str) -> None:
    """``snapshot/rel`` -> ``target`` as huggingface_hub writes it: a relative symlink (absolute if given so)."""
    link = snapshot / rel
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target if isinstance(target, str) else os.path.relpath(target, link.parent), link)


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], ref: str | None = None) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for rel, data in files.items():
        _link(snapshot, rel, _blob(repo, data))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def _companions(rev: str) -> dict[str, bytes]:
    return {
        "config.json": json.dumps({"model_type": "llama", "rev": rev}).encode(),
        "tokenizer.json": json.dumps(TOKENIZER).encode(),
        "tokenizer_config.json": b'{"model_max_length": 64}',
        "generation_config.json": b'{"do_sample": false}',
    }


@pytest.fixture
def cache(tmp_path, dense_files, monkeypatch) -> Path:
    """A hub cache holding REPO at two revisions, and HF_HUB_CACHE pointing at it."""
    cache = tmp_path / "hub"
    old = {f"onnx/{k}": v for k, v in dense_files.items()} | _companions("old")
    add_snapshot(cache, REPO, OLD, old)
    add_snapshot(cache, REPO, MAIN, dict(dense_files) | _companions("main"), ref="main")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HOME", raising=False)
    return cache


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``, links not followed: the link target, 'dir', or the content hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            key = str(p.relative_to(root))
            if p.is_symlink():
                out[key] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[key] = "dir"
            else:
                out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_same_model_as_fixture(path: Path) -> None:
    """The converted cached model has the fixture's converted weights and nodes (their order included)."""
    want, got = convert(DENSE), onnx.load(path)
    assert [n.op_type for n in got.graph.node] == [n.op_type for n in want.graph.node]
    assert sum(n.op_type == "PagedAttention" for n in got.graph.node) == 2
    w = {t.name: numpy_helper.to_array(t) for t in want.graph.initializer}
    g = {t.name: numpy_helper.to_array(t) for t in got.graph.initializer}
    assert w.keys() == g.keys()
    for name in w:
        np.testing.assert_array_equal(g[name], w[name], err_msg=name)


def assert_plain_output(folder: Path, rev: str) -> None:
    """No symlinks in the output folder; the revision's tokenizer and config files copied as regular files."""
    links = [p for p in folder.rglob("*") if p.is_symlink()]
    assert links == []
    assert json.loads((folder / "config.json").read_text())["rev"] == rev
    assert json.loads((folder / "tokenizer.json").read_text()) == TOKENIZER
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (folder / name).is_file()
    assert not (folder / "special_tokens_map.json").exists()  # the source has none: nothing invented


# ------------------------------------------------------------------------------------------ convert
def test_convert_by_snapshot_path(cache, tmp_path):
    before = tree(cache)
    snapshot = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN
    out = tmp_path / "out" / "model.onnx"
    convert_file(snapshot, out, verify=False)  # verification of a cached model: test_cli_convert_by_repo_id
    assert_same_model_as_fixture(out)
    assert_plain_output(out.parent, "main")
    assert tree(cache) == before


def test_convert_a_file_inside_a_snapshot_copies_the_snapshot_files(cache, tmp_path):
    snapshot = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / OLD
    out = tmp_path / "out" / "model.onnx"
    convert_file(snapshot / "onnx" / "model.onnx", out, verify=False)
    assert_same_model_as_fixture(out)
    assert_plain_output(out.parent, "old")


def test_cli_convert_by_repo_id(cache, tmp_path, capsys):
    before = tree(cache)
    out = tmp_path / "out" / "paged.onnx"
    assert main(["convert", REPO, str(out), "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["input"] == str(cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN / "model.onnx")
    assert sorted(result["copied"]) == sorted(_companions("main"))
    assert_same_model_as_fixture(out)
    assert_plain_output(out.parent, "main")
    assert tree(cache) == before


def test_cli_convert_by_repo_id_and_revision(cache, tmp_path, capsys):
    before = tree(cache)
    out = tmp_path / "out" / "paged.onnx"
    assert main(["convert", REPO, str(out), "--revision", OLD, "--quiet", "--no-verify"]) == 0
    assert_same_model_as_fixture(out)
    assert_plain_output(out.parent, "old")
    assert tree(cache) == before


def test_api_takes_repo_ids_and_revisions(cache, tmp_path):
    out = tmp_path / "paged.onnx"
    convert_file(REPO, out, revision=OLD, verify=False)
    assert json.loads((tmp_path / "config.json").read_text())["rev"] == "old"
    assert resolve_model(REPO) == cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN / "model.onnx"
    assert ortpa.resolve_model(REPO, revision="main") == resolve_model(REPO)
    assert resolve_model(REPO, revision=OLD).relative_to(cache).parts[-2:] == ("onnx", "model.onnx")
    # the paged model, itself in the cache, runs and validates by repo id
    # an input with external data gives an output with external data (ortpa.rewriter.model_store)
    files = {"model.onnx": out.read_bytes(), "paged.onnx.data": (tmp_path / "paged.onnx.data").read_bytes()}
    add_snapshot(cache, "tiny-org/paged", MAIN, files, ref="main")
    report = ortpa.validate("tiny-org/paged")
    assert report.ok and len(report.nodes) == 2
    engine = ortpa.Engine("tiny-org/paged", num_blocks=16, block_size=4)
    tokens = engine.generate([[1, 2, 3]], ortpa.SamplingParams(max_new_tokens=2))
    assert len(tokens[0]) == 2


def test_cli_parity_original_by_repo_id(cache, tmp_path, capsys):
    out = tmp_path / "paged.onnx"
    convert_file(DENSE, out, verify=False)  # the parity run below is the check
    args = ["parity", REPO, str(out), "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-new-tokens", "2"]
    assert main([*args, "--revision", OLD, "--json"]) == 0
    precision = json.loads(capsys.readouterr().out)["precision"]
    assert precision["tokens_agree"] == precision["tokens_checked"] == 2 * 2


# ------------------------------------------------------------------------------------------ the cache location
def test_hf_home_is_honoured(cache, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # cache = tmp_path / "hub"
    assert resolve_model(REPO).relative_to(cache).parts[2] == MAIN


def test_a_repo_not_in_the_cache_says_how_to_download_it(cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["convert", REPO, str(tmp_path / "out.onnx"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "not in the Hugging Face cache" in err and str(tmp_path / "empty-cache") in err
    assert f"hf download {REPO}" in err
    assert not (tmp_path / "out.onnx").exists() and not (tmp_path / "empty-cache").exists()


def test_a_revision_not_in_the_cache_lists_the_cached_ones(cache):
    with pytest.raises(InvalidModel) as info:
        resolve_model(REPO, revision="c" * 40)
    message = str(info.value)
    assert "\n" not in message
    assert OLD in message and MAIN in message and "main" in message
    assert f"hf download {REPO} --revision {'c' * 40}" in message


def test_revision_with_a_path_is_an_error(tmp_path):
    with pytest.raises(InvalidModel, match="revision 'main' applies to a Hugging Face repo id"):
        convert_file(DENSE, tmp_path / "out.onnx", revision="main")


def test_an_existing_path_wins_over_a_repo_id(cache, tmp_path, monkeypatch):
    local = tmp_path / "work" / REPO
    local.mkdir(parents=True)
    (local / "model.onnx").write_bytes(DENSE.read_bytes())
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model(REPO) == Path(REPO) / "model.onnx"


# ------------------------------------------------------------------------------------------ escapes
def _evil(cache: Path, tmp_path: Path, dense_files: dict[str, bytes], how: str) -> Path:
    """A repo whose model.onnx is a proper blob link, and whose external data escapes ``how``."""
    repo = cache / "models--evil--m"
    snapshot = repo / "snapshots" / MAIN
    _link(snapshot, "model.onnx", _blob(repo, dense_files["model.onnx"]))
    data = dense_files["model.onnx_data"]
    if how == "outside-the-repo":
        outside = tmp_path / "outside" / "weights.bin"
        outside.parent.mkdir()
        outside.write_bytes(data)
        _link(snapshot, "model.onnx_data", outside)
    elif how == "another-repos-blobs":
        _link(snapshot, "model.onnx_data", _blob(cache / "models--other--m", data))
    elif how == "etc":
        _link(snapshot, "model.onnx_data", "/etc/passwd")
    elif how == "in-the-repo-not-in-blobs":  # a real file the cache never writes there
        stash = repo / "stash" / "weights.bin"
        stash.parent.mkdir()
        stash.write_bytes(data)
        _link(snapshot, "model.onnx_data", stash)
    elif how == "out-and-back":  # lands in this repo's blobs, but through a link outside it
        hop = tmp_path / "hop"
        hop.mkdir()
        os.symlink(_blob(repo, data), hop / "weights.bin")
        _link(snapshot, "model.onnx_data", hop / "weights.bin")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    return snapshot


ESCAPES = ["outside-the-repo", "another-repos-blobs", "etc", "in-the-repo-not-in-blobs", "out-and-back"]


@pytest.mark.parametrize("how", ESCAPES)
def test_escapes_are_refused_by_the_api(cache, tmp_path, dense_files, how):
    snapshot = _evil(cache, tmp_path, dense_files, how)
    before = tree(tmp_path)
    entries = (
        lambda: convert_file("evil/m", tmp_path / "out.onnx"),
        lambda: convert_file(snapshot, tmp_path / "out2.onnx"),
    )
    for entry in entries:
        with pytest.raises(InvalidModel) as info:
            entry()
        message = str(info.value)
        assert "\n" not in message and "external data location 'model.onnx_data'" in message
        assert "outside its Hugging Face cache repository" in message
    with pytest.raises(InvalidModel, match="outside its Hugging Face cache repository"):
        ortpa.InferenceSession(snapshot)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("how", ESCAPES)
def test_escapes_are_refused_by_the_cli(cache, tmp_path, dense_files, how, capsys):
    _evil(cache, tmp_path, dense_files, how)
    before = tree(tmp_path)
    for argv in (["convert", "evil/m", str(tmp_path / "out.onnx"), "--quiet"], ["validate", "evil/m"]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err
        assert err.startswith(f"ortpa {argv[0]}: error: ") and "outside its Hugging Face cache repository" in err
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    "how, reason",
    [("fifo", "is not a regular file"), ("truncated", "run past the end of 'model.onnx_data'")],
)
def test_a_blob_is_still_checked_like_any_external_file(cache, tmp_path, dense_files, how, reason):
    repo = cache / "models--odd--m"
    snapshot = repo / "snapshots" / MAIN
    _link(snapshot, "model.onnx", _blob(repo, dense_files["model.onnx"]))
    blob = repo / "blobs" / "weights"
    if how == "fifo":  # reading would block forever
        os.mkfifo(blob)
    else:
        blob.write_bytes(dense_files["model.onnx_data"][:-100])
    _link(snapshot, "model.onnx_data", blob)
    with pytest.raises(InvalidModel, match=reason):
        convert_file(snapshot, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_a_model_outside_any_cache_keeps_the_folder_rule(tmp_path, dense_files):
    # the same links outside a models--*/snapshots/ layout: refused as before, by the model-folder rule
    folder = tmp_path / "plain"
    blobs = tmp_path / "blobs"
    _link(folder, "model.onnx", _blob(tmp_path, dense_files["model.onnx"]))
    _link(folder, "model.onnx_data", _blob(tmp_path, dense_files["model.onnx_data"]))
    assert blobs.is_dir()
    with pytest.raises(InvalidModel, match="outside the model's folder") as info:
        convert_file(folder, tmp_path / "out.onnx")
    assert "Hugging Face" not in str(info.value)


def test_a_companion_file_escaping_is_refused_before_any_work(cache, tmp_path):
    snapshot = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN
    os.symlink("/etc/passwd", snapshot / "special_tokens_map.json")
    with pytest.raises(InvalidModel, match=r"special_tokens_map\.json leads through /etc/passwd"):
        convert_file(REPO, tmp_path / "out.onnx")
    assert list(tmp_path.glob("out*")) == []


# ------------------------------------------------------------------------------------------ layouts
def _touch(folder: Path, *names: str) -> None:
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"x")


def test_layouts_in_order(tmp_path):
    _touch(tmp_path, "onnx/model_q4.onnx")
    assert find_onnx_file(tmp_path) == tmp_path / "onnx" / "model_q4.onnx"  # a single variant
    _touch(tmp_path, "onnx/model.onnx")
    assert find_onnx_file(tmp_path) == tmp_path / "onnx" / "model.onnx"
    _touch(tmp_path, "model.onnx")
    assert find_onnx_file(tmp_path) == tmp_path / "model.onnx"
    _touch(tmp_path, "decoder/dec.onnx")
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "decoder/dec.onnx"}}}))
    assert find_onnx_file(tmp_path) == tmp_path / "decoder" / "dec.onnx"


def test_several_variants_are_a_choice(tmp_path, capsys):
    _touch(tmp_path, "onnx/model_fp16.onnx", "onnx/model_q4.onnx")
    assert main(["validate", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "2 ONNX models: onnx/model_fp16.onnx, onnx/model_q4.onnx" in err
    assert f"pass the one to use as a path, e.g. {tmp_path / 'onnx' / 'model_fp16.onnx'}" in err


def test_genai_subfolders_are_a_choice(tmp_path):
    _touch(tmp_path, "cpu/int4/genai_config.json", "cuda/fp16/genai_config.json", "README.md")
    with pytest.raises(InvalidModel, match=r"onnxruntime-genai folders: cpu/int4, cuda/fp16; pass the one"):
        find_onnx_file(tmp_path)


@pytest.mark.parametrize(
    "config",
    [{"model": {"decoder": {"filename": "../model.onnx"}}}, {"model": {"decoder": {"filename": "/etc/passwd"}}}],
)
def test_genai_filename_cannot_escape(tmp_path, config):
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidModel, match=r"absolute or contains '\.\.'"):
        find_onnx_file(tmp_path)


def test_genai_config_without_a_decoder_is_invalid(tmp_path):
    (tmp_path / "genai_config.json").write_text('{"model": {}}')
    with pytest.raises(InvalidModel, match=r"expected a JSON object with model.decoder.filename"):
        find_onnx_file(tmp_path)


def test_a_folder_without_onnx_is_no_onnx_file(tmp_path, capsys):
    _touch(tmp_path, "config.json", "model.safetensors")
    with pytest.raises(NoOnnxFile, match="Hugging Face checkpoint") as info:
        find_onnx_file(tmp_path)
    assert info.value.folder == tmp_path and isinstance(info.value, InvalidModel)
    assert main(["convert", str(tmp_path), str(tmp_path / "out.onnx")]) == 1
    assert "no ONNX model in this folder" in capsys.readouterr().err
