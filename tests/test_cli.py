"""The `ortpa` CLI: every command with good and bad input, exit codes 0 / 1 / 2 and clear messages."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from ortpa.cli import main
from ortpa.errors import InvalidParameter
from ortpa.tolerances import precision_kl_bound

FIXTURES = Path(__file__).parent / "fixtures"
DENSE = FIXTURES / "dsv3_sdpa_op18.onnx"


@pytest.fixture(scope="module")
def paged(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "paged.onnx"
    assert main(["convert", str(DENSE), str(out), "--quiet"]) == 0
    return out


def _no_attention_model(path: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for command in ("demo", "convert", "validate", "generate", "parity", "export", "bench"):
        assert command in text


def test_no_command_and_unknown_option_are_usage_errors(capsys):
    assert main([]) == 2
    with pytest.raises(SystemExit) as info:
        main(["convert", "--no-such-option"])
    assert info.value.code == 2


def test_convert_writes_a_valid_model_and_leaves_the_input_alone(paged, capsys, tmp_path):
    before = DENSE.read_bytes()
    out = tmp_path / "again.onnx"
    assert main(["convert", str(DENSE), str(out), "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["paged_attention_nodes"] == 2 and out.is_file()
    assert DENSE.read_bytes() == before
    assert main(["validate", str(paged), "--backend", "cuda"]) == 0


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: d / "missing.onnx", "cannot read"),
        (lambda d: (d / "junk.onnx").write_bytes(b"not a model") and d / "junk.onnx", "cannot read"),
        (lambda d: _no_attention_model(d / "relu.onnx"), "nothing was converted"),
    ],
    ids=["missing", "not-onnx", "nothing-to-convert"],
)
def test_convert_bad_input_exits_1_and_writes_nothing(make, expected, tmp_path, capsys):
    src = make(tmp_path)
    out = tmp_path / "out.onnx"
    assert main(["convert", str(src), str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "ortpa convert: error:" in err and "Traceback" not in err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp leftovers


def test_validate_invalid_and_missing(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing.onnx")]) == 1
    assert "error" in capsys.readouterr().err
    # a PagedAttention node with num_heads not a multiple of kv_num_heads
    model = onnx.load(DENSE)  # any valid file; then a hand-made invalid node model
    del model
    q = helper.make_tensor_value_info("q", TensorProto.FLOAT16, [3, 64])
    kc = helper.make_tensor_value_info("kc", TensorProto.FLOAT16, [4, 16, 3, 16])
    idx = [
        helper.make_tensor_value_info("cu", TensorProto.INT32, [2]),
        helper.make_tensor_value_info("past", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("bt", TensorProto.INT32, [1, 2]),
    ]
    node = helper.make_node(
        "PagedAttention",
        ["q", "q", "q", "kc", "kc", "cu", "past", "bt"],
        ["o"],
        domain="com.microsoft",
        num_heads=4,
        kv_num_heads=3,
    )
    graph = helper.make_graph(
        [node], "g", [q, kc, *idx], [helper.make_tensor_value_info("o", TensorProto.FLOAT16, None)]
    )
    bad = tmp_path / "bad.onnx"
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]),
        bad,
    )
    assert main(["validate", str(bad), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["nodes"][0]["errors"]


def test_generate_json_in_prompt_order(paged, capsys):
    args = ["generate", str(paged), "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-new-tokens", "3"]
    assert main([*args, "--json"]) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    assert [len(o) for o in outputs] == [3, 3]
    # each prompt alone gives the same tokens (greedy, continuous batching must not change outputs)
    assert main(["generate", str(paged), "--prompt-ids", "4,5", "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"] == [outputs[1]]


@pytest.mark.parametrize("ids", ["1,x", "", "-3,4"])
def test_generate_invalid_prompt_ids_is_a_usage_error(paged, ids, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", str(paged), f"--prompt-ids={ids}", "--max-new-tokens", "2"])
    assert info.value.code == 2
    assert "token id" in capsys.readouterr().err


def test_generate_too_few_blocks_and_dense_model(paged, capsys):
    long_prompt = ",".join(str(i % 200) for i in range(100))
    code = main(["generate", str(paged), "--prompt-ids", long_prompt, "--max-new-tokens", "2", "--num-blocks", "2"])
    assert code == 1
    err = capsys.readouterr().err
    assert "ortpa generate: error:" in err and "Traceback" not in err
    assert main(["generate", str(DENSE), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 1
    assert "missing" in capsys.readouterr().err


def test_parity_good_and_mismatched(paged, capsys, tmp_path):
    assert main(["parity", str(DENSE), str(paged), "--max-new-tokens", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    structure, precision = result["structure"], result["precision"]
    assert result["ok"] and structure["twin"] and structure["max_relative_error"] < structure["tolerance"]
    assert precision["tokens_agree"] == precision["tokens_checked"] and precision["dtype"] == "float16"
    assert 0 < precision["kl_max"] < precision["kl_bound"] == precision_kl_bound("float16")  # the one rule
    other = tmp_path / "other.onnx"  # a converted model of a different network must fail parity
    assert main(["convert", str(FIXTURES / "kimi_sdpa_op18.onnx"), str(other), "--quiet"]) == 0
    code = main(["parity", str(DENSE), str(other), "--max-new-tokens", "3"])
    out = capsys.readouterr()
    assert code == 1 and "NOT VERIFIED" in out.out and "structure (float32 twin)" in out.out


def test_parity_tolerance_follows_the_kv_cache_dtype(capsys, tmp_path):
    """int8 caches carry their quantization error into the logits: the precision rule judges them as int8, and
    the float32 twin (no quantization) still proves the structure."""
    q8 = tmp_path / "q8.onnx"
    assert main(["convert", str(DENSE), str(q8), "--kv-cache-dtype", "int8", "--quiet"]) == 0
    assert main(["parity", str(DENSE), str(q8), "--max-new-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    structure, precision = result["structure"], result["precision"]
    assert result["ok"] and structure["twin"] and structure["max_relative_error"] < structure["tolerance"]
    assert precision["dtype"] == "int8" and precision["kl_bound"] == precision_kl_bound("int8")
    assert precision_kl_bound("int8") > precision_kl_bound("float16")


def test_bench_unknown_module_is_reported(capsys):
    assert main(["bench", "--only", "no_such_benchmark", "--path", str(Path(__file__).parents[1] / "benchmarks")]) == 1
    err = capsys.readouterr().err
    assert "--only" in err and "no_such_benchmark" in err and "latent_vs_separate" in err


def test_bench_finds_its_modules_outside_a_checkout(tmp_path, monkeypatch):
    """From any folder (an installed package, no ./benchmarks) the built-in benchmarks are there; a folder's
    modules join them."""
    from ortpa.bench import builtin_benchmarks, run_benchmarks

    monkeypatch.chdir(tmp_path)
    assert {"convert", "decode_mla", "latent_vs_separate", "oracle"} <= set(builtin_benchmarks())
    extra = tmp_path / "mine"
    extra.mkdir()
    (extra / "tiny.py").write_text("def run(quick=False):\n    return [{'name': 'x', 'value': 1.0}]\n")
    assert run_benchmarks(extra, names=["tiny"]) == [{"benchmark": "tiny", "name": "x", "value": 1.0}]
    with pytest.raises(InvalidParameter, match="tiny"):  # ./benchmarks does not exist here: only built-ins
        run_benchmarks(names=["tiny"])


def test_bench_checkout_module_with_a_dataclass_runs(tmp_path):
    """A checkout benchmark is executed as a registered module: a dataclass in it (which looks its module up in
    sys.modules) works, as ``benchmarks/decode_dsv3_cuda.py``'s does."""
    from ortpa.bench import run_benchmarks

    (tmp_path / "shaped.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass\nclass Shape:\n    heads: int = 2\n\n"
        "def run(quick=False):\n    return [{'name': 'heads', 'value': float(Shape().heads)}]\n"
    )
    assert run_benchmarks(tmp_path, names=["shaped"]) == [{"benchmark": "shaped", "name": "heads", "value": 2.0}]


def test_bench_cuda_benchmark_without_a_device_says_not_available(capsys, monkeypatch):
    """No CUDA device: the GPU decode benchmark is a 'not available' row, the command exits 0."""
    import ortpa.runtime.device as device

    monkeypatch.setattr(device, "has_cuda", lambda: False)  # as on a machine without a GPU, wherever this runs
    checkout = Path(__file__).parents[1] / "benchmarks"
    assert main(["bench", "--quick", "--only", "decode_dsv3_cuda", "--path", str(checkout), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and "not available" in rows[0]["notes"], rows


def test_generate_takes_the_step_budget(paged, capsys, monkeypatch):
    import ortpa.runtime.engine as engine_module

    seen = []

    class Spy(engine_module.Engine):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("max_num_batched_tokens"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_module, "Engine", Spy)
    args = ["generate", str(paged), "--prompt-ids", ",".join(map(str, range(1, 12))), "--max-new-tokens", "3", "--json"]
    assert main([*args, "--max-num-batched-tokens", "4"]) == 0
    chunked = json.loads(capsys.readouterr().out)["outputs"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["outputs"] == chunked  # the prompt in chunks of 4: the same tokens
    assert seen == [4, None]  # the Engine's own default when not given


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_step_budgets_help_says_the_engines_default(command, capsys):
    from ortpa.runtime.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS

    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"default: the Engine's, {DEFAULT_MAX_NUM_BATCHED_TOKENS})" in help_text
