"""``ortpa convert --portable``: onnxruntime-genai's own Engine runs the written folder, as written, on CPU.

For every family below the converted folder (portable file + genai_config.json, nothing edited) is run by genai's
continuous-batching Engine in genai's own venv (a subprocess: ``support/genai_env.py``), with four requests of 3 to
40 tokens (past the block size and the step's token budget) admitted together and staggered, ``max_batch_size``
2 (below the request count) and ``max_scheduled_tokens`` 16 (chunked prefill). Its greedy tokens must equal the
original dense model run alone by ONNX Runtime (``ortpa.parity.greedy.dense_greedy``) and ortpa's own Engine on
the same portable file. One genai subprocess per model runs all its scenarios; models are converted once per
session.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.genai_env import find_genai_python, run_genai_driver
from support.tolerances import precision_logit_bound

from ortpa.cli import main
from ortpa.conversion import convert_file
from ortpa.deploy import GenaiOptions, portable_info
from ortpa.parity.greedy import dense_greedy, open_dense
from ortpa.runtime.engine import Engine
from ortpa.runtime.sampling import SamplingParams

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FORMATS = FIXTURES / "formats"
NEW_TOKENS = 6
MAX_BATCH = 2
CHUNK = 16  # max_scheduled_tokens, and the block size: the 17- and 40-token prompts cross both
PROMPT_LENGTHS = (3, 17, 40, 9)


@dataclass(frozen=True)
class Case:
    onnx: Path
    genai_config: Path | None = None  # the source's own genai_config.json (genai's builder)
    hf_config: dict | None = None  # written as config.json beside the source (no genai_config.json)
    latent_width: int | None = None  # MLA: kv_lora_rank + qk_rope_head_dim, from the fixture's own config
    # int4 builds quantize activations to int8 in MatMulNBits: a prompt chunked differently may flip a near-tie,
    # so their tokens are checked against the original token by token within this margin (teacher forcing)
    near_tie_atol: float = 0.0


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _latent(name: str) -> int:
    cfg = _json(FIXTURES / f"{name}.json")["config"]
    return int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])


CASES = {
    **{
        f"genai_llama_{p}": Case(
            FORMATS / f"genai_llama_{p}.onnx",
            FORMATS / f"genai_llama_{p}.genai_config.json",
            near_tie_atol=precision_logit_bound("int8") if p == "int4" else 0.0,
        )
        for p in ("fp32", "fp16", "int4")
    },
    "optimum_llama": Case(FORMATS / "optimum_llama.onnx", hf_config=_json(FORMATS / "optimum_llama.json")["config"]),
    "onnxexporter_llama": Case(FORMATS / "onnxexporter_llama.onnx"),  # nothing beside it: all from the graph
    "dsv3_moe": Case(
        FIXTURES / "dsv3_moe_sdpa_op18.onnx",
        hf_config=_json(FIXTURES / "dsv3_moe_sdpa_op18.json")["config"],
        latent_width=_latent("dsv3_moe_sdpa_op18"),
    ),
    "minicpm3": Case(FIXTURES / "minicpm3_sdpa_op18.onnx", latent_width=_latent("minicpm3_sdpa_op18")),
    # softcap, a sliding window on layer 0 and QK RMSNorm in the lowered op. Gemma-2's config names no EOS, and
    # genai then ends a request at id 0, which this model generates: a checkpoint's config would name one
    "gemma2": Case(
        FIXTURES / "gemma2_eager_op18.onnx",
        hf_config={**_json(FIXTURES / "gemma2_eager_op18.json")["config"], "eos_token_id": 3},
    ),
    "qwen3": Case(FIXTURES / "qwen3_sdpa_op18.onnx", hf_config=_json(FIXTURES / "qwen3_sdpa_op18.json")["config"]),
}


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(18)
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="session")
def genai_python() -> str:
    return find_genai_python()


@pytest.fixture(scope="session")
def deployed(tmp_path_factory):
    """name -> the converted folder's model file (converted once per session)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            case = CASES[name]
            src = tmp_path_factory.mktemp(f"src_{name}")
            shutil.copyfile(case.onnx, src / "model.onnx")
            if case.genai_config is not None:
                shutil.copyfile(case.genai_config, src / "genai_config.json")
            if case.hf_config is not None:
                (src / "config.json").write_text(json.dumps(case.hf_config))
            out = tmp_path_factory.mktemp(f"out_{name}") / "model.onnx"
            convert_file(
                src, out, portable=True, genai=GenaiOptions(max_batch_size=MAX_BATCH, max_scheduled_tokens=CHUNK)
            )
            made[name] = out
        return made[name]

    return get


# the default tier runs one folder per source of genai_config.json's facts (genai's own config, a Hugging Face
# config.json, the graph alone) and the split-latent MLA folder; the other formats, in the slow tier, add ~20-45 s
# each on 2 cores for what those four already check in genai's Engine
IN_DEFAULT_TIER = {"genai_llama_fp32", "optimum_llama", "onnxexporter_llama", "dsv3_moe"}


@pytest.mark.parametrize(
    "name", [n if n in IN_DEFAULT_TIER else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CASES)]
)
def test_genai_engine_runs_the_portable_folder_as_written(name, deployed, genai_python):
    case = CASES[name]
    model = deployed(name)
    config = _json(model.parent / "genai_config.json")
    batching = config["engine"]["dynamic_batching"]
    prompts = _prompts(256)
    # the conditions this test claims: fewer slots than requests, chunked prefill, a CPU pool genai can allocate
    assert batching["max_batch_size"] < len(prompts) and batching["max_scheduled_tokens"] < max(PROMPT_LENGTHS)
    assert batching["num_blocks"] >= 1 and "gpu_utilization_factor" not in batching
    assert config["model"]["decoder"]["session_options"]["provider_options"] == []
    proto = onnx.load(str(model), load_external_data=False)
    assert not [n for n in proto.graph.node if n.op_type == "PagedAttention"]  # plain ONNX: any EP
    layers = config["model"]["decoder"]["num_hidden_layers"]
    assert config["model"]["decoder"]["state_groups"] == [{"kind": "paged_kv", "layer_ids": list(range(layers))}]

    info = portable_info(proto)
    assert info is not None and info.nodes == layers
    if case.latent_width is not None:
        # LATENT memory: one latent row per token, split over the key and the value cache genai allocates
        assert info.kv_cache_layout == "LATENT" and info.split_latent
        assert config["model"]["decoder"]["num_key_value_heads"] == 1
        assert 2 * config["model"]["decoder"]["head_size"] == case.latent_width

    dense = open_dense(case.onnx)
    reference = dense_greedy(dense.session, prompts, NEW_TOKENS, interface=dense.interface).tokens  # alone

    def check(tokens, who: str) -> None:
        if case.near_tie_atol == 0.0:
            assert tokens == reference, f"{name}: {who} gave {tokens}, the original alone {reference}"
            return
        # the original, fed these tokens: each must be its argmax up to the margin
        forced = dense_greedy(dense.session, prompts, NEW_TOKENS, follow=tokens, interface=dense.interface)
        for p, (toks, rows) in enumerate(zip(tokens, forced.logits, strict=True)):
            assert len(toks) == NEW_TOKENS, (who, p, toks)
            gaps = [float(row.max() - row[t]) for t, row in zip(toks, rows, strict=True)]
            assert max(gaps) <= case.near_tie_atol, f"{name}: {who}, prompt {p}: {toks} vs {reference[p]} ({gaps})"

    engine = Engine(model, num_blocks=64, max_num_batched_tokens=CHUNK, max_num_seqs=MAX_BATCH)
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    check(ours, "ortpa's Engine on the portable file")

    request = {
        "folder": str(model.parent),
        "scenarios": [
            {"name": "together", "prompts": prompts, "max_new_tokens": NEW_TOKENS, "stagger": 0},
            {"name": "staggered", "prompts": prompts, "max_new_tokens": NEW_TOKENS, "stagger": 2},
        ],
    }
    eos = config["model"].get("eos_token_id")
    assert not any(eos in tokens for tokens in reference), f"{name}: EOS {eos} generated; pick another for the test"
    result = run_genai_driver(genai_python, request)
    for scenario in ("together", "staggered"):
        check(result["scenarios"][scenario]["tokens"], f"genai's Engine ({scenario})")


def test_native_file_gets_a_cuda_genai_config(tmp_path):
    """Without --portable the op stays (CUDA, WebGPU) and genai_config.json asks for CUDA and a GPU share."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copyfile(FORMATS / "genai_llama_fp32.onnx", src / "model.onnx")
    shutil.copyfile(FORMATS / "genai_llama_fp32.genai_config.json", src / "genai_config.json")
    out = tmp_path / "out" / "model.onnx"
    assert main(["convert", str(src), str(out), "--quiet"]) == 0
    proto = onnx.load(str(out), load_external_data=False)
    assert sum(n.op_type == "PagedAttention" for n in proto.graph.node) == 2 and portable_info(proto) is None
    config = _json(out.parent / "genai_config.json")
    source = _json(src / "genai_config.json")
    decoder = config["model"]["decoder"]
    assert decoder["session_options"]["provider_options"] == [{"cuda": {}}]
    batching = config["engine"]["dynamic_batching"]
    assert batching["gpu_utilization_factor"] == 0.6 and "num_blocks" not in batching
    # the paged interface replaces the dense one the source's config described
    assert "attention_mask" not in decoder["inputs"] and decoder["inputs"]["block_table"] == "block_table"
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "context_length", "vocab_size"):
        assert config["model"][key] == source["model"][key], key
    for key in ("head_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "hidden_size"):
        assert decoder[key] == source["model"]["decoder"][key], key


def test_portable_with_an_option_it_cannot_honour_is_one_line(tmp_path, capsys):
    out = tmp_path / "out" / "model.onnx"
    code = main(["convert", str(FORMATS / "genai_llama_fp32.onnx"), str(out), "--portable", "--kv-cache-dtype",
                 "float8e4m3fn"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code != 0 and "--portable cannot honour --kv-cache-dtype float8e4m3fn" in err and "\n" not in err, err
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_bad_genai_options_are_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "out" / "model.onnx"
    code = main(["convert", str(FORMATS / "genai_llama_fp32.onnx"), str(out), "--portable", "--genai-block-size", "24"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "block_size: expected a power of two >= 16, found 24" in err and "\n" not in err, err
    assert not out.exists()


def test_genai_engine_with_convert_options(tmp_path, genai_python):
    """int8 caches, RoPE in the op, a position_ids input and logits for every token: genai's Engine still runs the
    folder as written, with ortpa's Engine's tokens on the same file (int8 is checked against the original in
    tests/rewriter/test_kv_quant.py)."""
    out = tmp_path / "model.onnx"
    convert_file(
        FIXTURES / "llama_sdpa_op18.onnx",
        out,
        portable=True,
        genai=GenaiOptions(max_batch_size=MAX_BATCH, max_scheduled_tokens=CHUNK),
        kv_cache_dtype="int8",
        rope_in_op=True,
        position_ids="input",
        logits="all",
    )
    config = _json(out.parent / "genai_config.json")
    assert config["model"]["decoder"]["inputs"]["position_ids"] == "position_ids"
    prompts = _prompts(256)
    ours = Engine(out, num_blocks=64, max_num_batched_tokens=CHUNK, max_num_seqs=MAX_BATCH).generate(
        prompts, SamplingParams(max_new_tokens=NEW_TOKENS)
    )
    request = {
        "folder": str(out.parent),
        "scenarios": [{"name": "staggered", "prompts": prompts, "max_new_tokens": NEW_TOKENS, "stagger": 2}],
    }
    assert run_genai_driver(genai_python, request)["scenarios"]["staggered"]["tokens"] == ours
