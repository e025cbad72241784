"""`ortpa serve` on a stage folder (`ortpa split`): each stage a Ray actor in a local Ray instance the server starts.

The reference is the same folder's unsplit model served by the main server (same tokenizer, greedy): completions
of prompts of different lengths, batched in one request, must be the same text. SIGTERM then ends the server and
its stage actors with it. Slow (about a minute on 2 cores: the server starts Ray and two stage actors); the Engine
on a stage folder over Ray is in the default tier (tests/runtime/test_pipeline_ray.py).
"""

from __future__ import annotations

import signal

import pytest

from ortpa.stages import split_model
from serve.conftest import _openai
from serve.helpers import MODEL_NAME, serve

pytestmark = pytest.mark.slow

PROMPTS = ["hello world", "the paged latent cache hello world the paged latent cache hello", "w20 w30 w40 w50 w60"]


@pytest.fixture(scope="module")
def staged(model_folder, tmp_path_factory):
    folder = split_model(model_folder / "model.onnx", tmp_path_factory.mktemp("staged") / "stages", 2).folder
    assert (folder / "tokenizer.json").is_file() and not (folder / "genai_config.json").exists()
    with serve(folder, "--num-blocks", "64", startup_s=180.0) as s:
        yield s


def test_a_stage_folder_serves_the_unsplit_model_s_completions(staged, client):
    reference = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=10, temperature=0)
    got = _openai(staged).completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=10, temperature=0)
    assert [c.text for c in got.choices] == [c.text for c in reference.choices]
    assert got.usage.completion_tokens == reference.usage.completion_tokens


def test_sigterm_stops_the_server_and_its_stages(staged):
    staged.proc.send_signal(signal.SIGTERM)
    assert staged.proc.wait(60) == 0
    assert "Traceback" not in staged.output()
