"""onnxruntime-genai's own paged models as ortpa input: they run on CPU, which genai itself cannot do.

The fixture ``tests/fixtures/genai_paged/genai_llama_paged_fp16.onnx`` was made by genai's builder
(``-p fp16 -e cuda --extra_options use_paged_attention=true``, ``scripts/make_fixtures_formats.py genai``); the
dense fp16 build of the same weights is ``tests/fixtures/formats/genai_llama_fp16.onnx``. Every run of the paged
model must give the dense build's greedy tokens, each prompt run alone by ONNX Runtime.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.genai_env import find_genai_python, run_genai_driver

from ortpa.cli import main
from ortpa.deploy import finish_deployment
from ortpa.parity.greedy import dense_greedy, open_dense, paged_greedy
from ortpa.runtime.engine import Engine
from ortpa.runtime.sampling import SamplingParams
from ortpa.runtime.session import InferenceSession, PagedSession

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PAGED = FIXTURES / "genai_paged" / "genai_llama_paged_fp16.onnx"
DENSE = FIXTURES / "formats" / "genai_llama_fp16.onnx"
NEW_TOKENS = 6
PROMPT_LENGTHS = (3, 17, 40, 9)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [[int(t) for t in rng.integers(3, 256, n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    dense = open_dense(DENSE)
    return dense_greedy(dense.session, prompts, NEW_TOKENS, interface=dense.interface).tokens


def test_the_fixture_is_genais_paged_cuda_build():
    info = json.loads(PAGED.with_suffix(".json").read_text())
    assert "use_paged_attention=true" in info["command"] and info["command"][info["command"].index("-e") + 1] == "cuda"
    proto = onnx.load(str(PAGED), load_external_data=False)
    assert sum(n.op_type == "PagedAttention" for n in proto.graph.node) == info["num_layers"]
    config = json.loads(PAGED.with_suffix(".genai_config.json").read_text())
    assert config["engine"]["dynamic_batching"]["block_size"] >= 16


def test_validate_generate_and_parity_cli(prompts, reference, capsys):
    assert main(["validate", str(PAGED)]) == 0
    capsys.readouterr()
    ids = [x for p in prompts for x in ("--prompt-ids", ",".join(map(str, p)))]
    assert main(["generate", str(PAGED), *ids, "--max-new-tokens", str(NEW_TOKENS), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"] == reference  # batched = the dense build alone
    assert main(["parity", str(DENSE), str(PAGED), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    precision = result["precision"]
    assert result["ok"] and precision["tokens_agree"] == precision["tokens_checked"], result


def test_sessions_and_engine_on_cpu(prompts, reference):
    session = InferenceSession(PAGED, providers=["CPUExecutionProvider"])
    # ONNX Runtime has no CPU kernel: ortpa's native kernel runs the nodes (the portable op where it is absent)
    assert set(session.implementations.values()) <= {"native-cpu", "portable"} and session.implementations
    paged = PagedSession(PAGED, num_blocks=64, block_size=16, providers=["CPUExecutionProvider"])
    assert paged_greedy(paged, prompts, NEW_TOKENS).tokens == reference
    engine = Engine(PAGED, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=2, providers=["CPUExecutionProvider"])
    assert engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS)) == reference


def test_genai_engine_runs_its_own_model_once_lowered(tmp_path, prompts, reference):
    """genai's CUDA build, lowered by ortpa (``finish_deployment(portable=True)``), in genai's Engine on CPU."""
    folder = tmp_path / "deploy"
    folder.mkdir()
    shutil.copyfile(PAGED, folder / "model.onnx")
    source = tmp_path / "src"
    source.mkdir()
    shutil.copyfile(PAGED.with_suffix(".genai_config.json"), source / "genai_config.json")
    done = finish_deployment(folder / "model.onnx", portable=True, source_folder=source)
    assert done.portable is not None and done.portable.nodes == 2
    request = {
        "folder": str(folder),
        "scenarios": [{"name": "together", "prompts": prompts, "max_new_tokens": NEW_TOKENS, "stagger": 0}],
    }
    result = run_genai_driver(find_genai_python(), request)
    assert result["scenarios"]["together"]["tokens"] == reference
