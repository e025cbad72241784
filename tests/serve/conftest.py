"""Fixtures of the serve tests: a converted model folder to serve (Llama fixture, random weights, a tokenizer and a
chat template) and a live ``ortpa serve`` subprocess on 127.0.0.1, torn down by its fixture whatever the tests did."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest

from serve.helpers import CHAT_TEMPLATE, CONTEXT, EOS, SOURCE, Server, serve, write_tokenizer


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Path:
    """The Llama fixture converted once per session (a conversion costs seconds); the served folders link it."""
    import ortpa

    path = tmp_path_factory.mktemp("converted") / "model.onnx"
    onnx.save(ortpa.convert(onnx.load(str(SOURCE))), str(path))
    return path


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory, converted) -> Path:
    folder = tmp_path_factory.mktemp("served")
    os.link(converted, folder / "model.onnx")
    write_tokenizer(folder / "tokenizer.json")
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": CONTEXT}))
    return folder


@pytest.fixture(scope="session")
def tokenizer(model_folder):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_folder / "tokenizer.json"))


@pytest.fixture(scope="session")
def server(model_folder) -> Iterator[Server]:
    """The main server, shared by the API and bad-input modules (a start costs seconds on a busy box)."""
    with serve(model_folder, "--num-blocks", "128") as s:
        yield s


def _openai(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=server.api, api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="session")
def client(server):
    return _openai(server)


@pytest.fixture(scope="session")
def structured_folder(tmp_path_factory, converted) -> Path:
    from serve.structured_fixtures import write_structured_folder

    return write_structured_folder(tmp_path_factory.mktemp("structured"), converted)


@pytest.fixture(scope="session")
def structured_server(structured_folder) -> Iterator[Server]:
    """A server whose tokenizer can spell JSON and whose template takes tools (structured output, tool calls)."""
    with serve(structured_folder, "--num-blocks", "256") as s:
        yield s


@pytest.fixture(scope="session")
def structured_client(structured_server):
    return _openai(structured_server)
