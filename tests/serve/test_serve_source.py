"""``ortpa serve`` started from what the user has: a dense ONNX folder or ORG/NAME in the local hub cache is
converted once (verified) into a cache entry keyed by the source's revision, reused on the next start; an
interrupted conversion leaves nothing that a later start would use."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ortpa.cli import serve_source
from ortpa.cli.serve_source import is_converted, serving_source
from serve.helpers import CONTEXT, EOS, MODEL_NAME, SOURCE, request, serve, write_tokenizer

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _dense_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    shutil.copyfile(SOURCE, folder / "model.onnx")
    write_tokenizer(folder / "tokenizer.json")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": CONTEXT}))
    return folder


def _hub_cache(root: Path) -> Path:
    """A hub cache holding REPO at COMMIT (files as blobs, linked from the snapshot, as huggingface_hub lays them)."""
    repo = root / ("models--" + REPO.replace("/", "--"))
    src = _dense_folder(root / "src")
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in src.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.rmtree(src)
    return root


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def test_a_dense_folder_is_converted_once_then_reused(tmp_path, capsys):
    src = _dense_folder(tmp_path / "dense")
    cache = tmp_path / "cache"
    first = serving_source(str(src), None, cache_dir=cache, quiet=False, options=[])
    err = capsys.readouterr().err
    assert "converting it once" in err and "verified against the original" in err, err
    assert is_converted(Path(first) / "model.onnx") and (Path(first) / "tokenizer.json").is_file()
    assert _entries(cache) == [Path(first).name]  # no temporary folder left
    again = serving_source(str(src), None, cache_dir=cache, quiet=False, options=[])
    assert again == first and "using the conversion" in capsys.readouterr().err
    key = serve_source.cache_key(src, [])
    assert Path(first).name == f"dense-{key}"
    (src / "tokenizer.json").write_text((src / "tokenizer.json").read_text() + " ")  # the source changed
    assert serve_source.cache_key(src, []) not in (key, serve_source.cache_key(src, ["--logits", "all"]))
    assert serving_source(first, None, cache_dir=cache, quiet=True, options=[]) == first  # converted: as is


def test_an_interrupted_conversion_leaves_no_entry(tmp_path, monkeypatch, model_folder):
    src = _dense_folder(tmp_path / "dense")
    cache = tmp_path / "cache"

    def interrupted(source, out, **_):
        out.write_bytes(b"half a model")
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(serve_source, "_convert", interrupted)
        with pytest.raises(KeyboardInterrupt):
            serving_source(str(src), None, cache_dir=cache, quiet=True, options=[])
    assert _entries(cache) == []
    # a start killed outright leaves its temporary folder: never used, removed once its process is gone
    entry = cache / f"dense-{serve_source.cache_key(src, [])}"
    stale = cache / f".{entry.name}.tmp-999999999-x"
    stale.mkdir()
    (stale / "model.onnx").write_bytes(b"half a model")

    def converts(source, out, **_):  # the served fixture's conversion stands for this one's (the test is the cache's)
        shutil.copyfile(model_folder / "model.onnx", out)

    monkeypatch.setattr(serve_source, "_convert", converts)
    assert Path(serving_source(str(src), None, cache_dir=cache, quiet=True, options=[])) == entry
    assert entry.stat().st_mode & 0o777 == 0o755
    assert _entries(cache) == [entry.name] and is_converted(entry / "model.onnx")


@pytest.fixture(scope="module")
def hub_entry(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A hub cache holding REPO, and REPO converted by ``serving_source``: (hub, serve cache, entry)."""
    root = tmp_path_factory.mktemp("hub-serve")
    hub = _hub_cache(root / "hub")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HF_HUB_CACHE", str(hub))
        entry = Path(serving_source(REPO, None, cache_dir=root / "cache", quiet=True, options=[]))
    return hub, root / "cache", entry


def test_a_repo_id_resolves_in_the_local_hub_cache_only(hub_entry, monkeypatch):
    hub, cache, entry = hub_entry
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert entry.name.startswith("tiny-org--tiny-llama-") and is_converted(entry / "model.onnx")
    assert serving_source(REPO, COMMIT, cache_dir=cache, quiet=True, options=[]) == str(entry)
    from ortpa.errors import InvalidModel

    with pytest.raises(InvalidModel, match="hf download"):
        serving_source("tiny-org/absent", None, cache_dir=cache, quiet=True, options=[])


def test_serve_a_repo_id_with_max_model_len_and_no_access_log(hub_entry, tmp_path):
    hub, cache, _ = hub_entry
    extra = ("--cache-dir", str(cache), "--max-model-len", "40", "--no-access-log")
    with serve(tmp_path / "log", *extra, model=REPO, env={"HF_HUB_CACHE": str(hub)}) as server:
        status, _, raw = request("GET", server.api + "/models", None)
        assert json.loads(raw)["data"][0]["max_model_len"] == 40
        body = {"model": MODEL_NAME, "prompt": [5] * 30, "max_tokens": 11}
        status, _, raw = request("POST", server.api + "/completions", json.dumps(body).encode())
        error = json.loads(raw)["error"]
        assert status == 400 and "40" in error["message"] and error["code"] == "context_length_exceeded"
        status, _, raw = request("POST", server.api + "/completions", json.dumps(body | {"max_tokens": 10}).encode())
        assert status == 200, raw
        log = server.output()
        assert "using the conversion of tiny-org/tiny-llama cached in" in log, log  # the fixture converted it
        assert "POST /v1/completions" not in log, log


@pytest.mark.slow  # a checkpoint export (~25 s on 2 cores) on top of the conversion
def test_serve_a_checkpoint_repo_id_from_the_hub_cache(tmp_path):
    """``ortpa serve ORG/NAME`` where the local hub cache holds a transformers checkpoint (safetensors and
    config.json): exported, converted, served; greedy tokens equal PyTorch's on the checkpoint's weights."""
    import numpy as np
    import torch
    from support.configs import TINY_LLAMA

    from ortpa.export.hf import build_model
    from ortpa.tolerances import precision_ties

    src = tmp_path / "src"
    model = build_model(dict(TINY_LLAMA), seed=7)
    model.save_pretrained(src)
    write_tokenizer(src / "tokenizer.json")
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    repo = "tiny-org/tiny-llama-hf"
    snapshot = tmp_path / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / COMMIT
    shutil.copytree(src, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
    prompt = [5, 6, 7, 8, 9, 10]
    ties = precision_ties("float16")
    want: list[int] = []
    with torch.no_grad():
        for _ in range(6):
            row = model(torch.tensor([prompt + want])).logits[0, -1].numpy()
            token = int(row.argmax())
            if row[token] - float(np.sort(row)[-2]) <= ties.margin(row) or token == EOS:
                break  # past a near-tie of float16 either token is right: compare up to here
            want.append(token)
    assert want, "PyTorch's first greedy token is a near-tie: pick another prompt"
    extra = ("--cache-dir", str(tmp_path / "cache"), "--num-blocks", "64")
    with serve(tmp_path / "log", *extra, model=repo, env={"HF_HUB_CACHE": str(tmp_path / "hub")}, startup_s=600) as s:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": len(want), "temperature": 0, "logprobs": 0}
        status, _, raw = request("POST", s.api + "/completions", json.dumps(body).encode())
        assert status == 200, raw
        tokens = json.loads(raw)["choices"][0]["logprobs"]["tokens"]
        assert "converting it once" in s.output(), s.output()
    assert tokens == [write_tokenizer(tmp_path / "tok.json").id_to_token(t) for t in want], (tokens, want)
