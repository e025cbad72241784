"""The greedy loop a user writes over a ``--portable`` file (``examples/portable_greedy.py``, the same code as
``docs/converted_model.md``): plain ONNX Runtime, no ortpa, tokens equal to ortpa's own ``generate``."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

import ortpa
from ortpa.deploy import MIN_ONNXRUNTIME_KEY, min_onnxruntime
from ortpa.runtime.engine import Engine
from ortpa.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
EXAMPLE = ROOT / "examples" / "portable_greedy.py"
# a short and a long prompt in one batch: a ragged prefill step, then ragged decodes
PROMPTS = [[1, 2, 3], list(range(7, 27))]
NEW_TOKENS = 8


def _example():
    spec = importlib.util.spec_from_file_location("portable_greedy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loop_section(text: str) -> str:
    return text.split("# --- loop: begin\n", 1)[1].split("# --- loop: end", 1)[0].strip("\n")


@pytest.fixture(scope="module", params=["llama_sdpa_op18", "dsv3_sdpa_op18"], ids=["gqa", "mla"])
def portable(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param) / "model.onnx"
    ortpa.convert_file(FIXTURES / f"{request.param}.onnx", out, portable=True, verify=False)
    return out


def test_the_documented_loop_is_the_example() -> None:
    doc = (ROOT / "docs" / "converted_model.md").read_text()
    section = doc.split("## A greedy loop in plain ONNX Runtime", 1)[1]
    block = re.search(r"```python\n(.*?)\n```", section, re.S).group(1)
    assert block == _loop_section(EXAMPLE.read_text())


def test_the_example_imports_no_ortpa() -> None:
    source = EXAMPLE.read_text()
    assert not re.search(r"^\s*(import|from)\s+ortpa\b", source, re.M)


def test_the_loop_gives_ortpa_generate_tokens(portable: Path) -> None:
    loop = _example()
    session = loop.open_portable(portable)
    got = loop.greedy(session, PROMPTS, NEW_TOKENS)
    want = Engine(portable, num_blocks=16).generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert got == want
    assert len({tuple(t) for t in got}) == len(PROMPTS)  # the two prompts diverge: a real check of batching


def test_the_file_names_its_oldest_runtime_and_the_loop_refuses_older(portable: Path, monkeypatch) -> None:
    proto = onnx.load(str(portable), load_external_data=False)
    opset = {o.domain: o.version for o in proto.opset_import}[""]
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta[MIN_ONNXRUNTIME_KEY] == min_onnxruntime(opset)
    loop = _example()
    need = tuple(map(int, meta[MIN_ONNXRUNTIME_KEY].split(".")))
    older = f"{need[0]}.{need[1] - 1}.9"
    monkeypatch.setattr(loop.ort, "__version__", older)
    with pytest.raises(RuntimeError, match=rf"needs onnxruntime >= {meta[MIN_ONNXRUNTIME_KEY]}, found {older}"):
        loop.open_portable(portable)
    monkeypatch.setattr(loop.ort, "__version__", meta[MIN_ONNXRUNTIME_KEY] + ".0")
    loop.open_portable(portable)


def test_min_onnxruntime_follows_the_opset() -> None:
    """A newer opset never lowers the floor, and this runtime meets what any of its own opsets needs."""
    floors = [tuple(map(int, min_onnxruntime(o).split("."))) for o in range(18, 27)]
    assert floors == sorted(floors)
    have = tuple(map(int, ort.__version__.split(".")[:2]))
    assert all(f <= have for f in floors)
