"""Hostile model files: every command and API entry point refuses them cleanly and touches nothing.

For each hostile file (truncated, corrupted, not ONNX, external data escaping the model's folder or running
past its file, absurd declared sizes, wrong ir_version / opsets) and each way ortpa reads a model
(``ortpa convert / validate / generate / parity`` and ``convert``, ``convert_file``, ``validate_model``,
``InferenceSession``, ``PagedSession``, ``Engine``):

* the CLI exits 1 with one line ``ortpa CMD: error: <file>: <reason>`` and no traceback; the API raises
  :class:`~ortpa.errors.InvalidModel` naming the file;
* every file under the test's folder is byte-identical afterwards and nothing was added: not the output of a
  failed convert, not a temp file;
* the secret file outside the model's folder is never opened (observed on ``open``/``os.open``) and its
  sentinel bytes appear in no output.

Generated cases (hypothesis, seeded by the ``ci`` profile): truncations at any offset and random byte flips,
through the loader and through the CLI. ``ORTPA_SLOW=1`` runs the ``slow`` profile; ``ORTPA_HOSTILE_CLI_EXAMPLES``
sets how many generated files go through each CLI command (default 8).
"""

from __future__ import annotations

import builtins
import hashlib
import io
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ortpa
from ortpa.cli import main
from ortpa.conversion import convert_file
from ortpa.errors import InvalidModel, OrtpaError
from ortpa.model.file import read_model
from ortpa.runtime.engine import Engine
from ortpa.runtime.session import InferenceSession, PagedSession
from ortpa.testing.toy_lm import build_toy_lm

FIXTURES = Path(__file__).parent / "fixtures"
DENSE = FIXTURES / "llama_sdpa_op18.onnx"
SENTINEL = b"ORTPA-SECRET-SENTINEL-7f3a"
CLI_EXAMPLES = int(os.environ.get("ORTPA_HOSTILE_CLI_EXAMPLES", "8"))


# ------------------------------------------------------------------------------------------ base models
@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, onnx.ModelProto]:
    """``dense`` (a convert / parity-original input) and ``paged`` (the toy paged LM: validate, run)."""
    paged_converted = tmp_path_factory.mktemp("bases") / "converted.onnx"
    convert_file(DENSE, paged_converted)
    return {
        "dense": onnx.load(DENSE),
        "paged": build_toy_lm(),
        "converted": onnx.load(paged_converted),
    }


def _save_external(proto: onnx.ModelProto, folder: Path, name: str = "model.onnx") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)  # onnx.save_model moves the data of the proto it is given out to the file
    onnx.save_model(
        copy,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=name + ".data",
        size_threshold=1024,
    )
    return path


def _biggest_external(proto: onnx.ModelProto) -> onnx.TensorProto:
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    return max(external, key=lambda t: int(np.prod(t.dims)))


def _set_entry(tensor: onnx.TensorProto, key: str, value: str | None) -> None:
    kept = [(e.key, e.value) for e in tensor.external_data if e.key != key]
    del tensor.external_data[:]
    for k, v in kept + ([(key, value)] if value is not None else []):
        tensor.external_data.add(key=k, value=v)


# ------------------------------------------------------------------------------------------ hostile cases
@dataclass(frozen=True)
class Hostile:
    """A builder writing one hostile file into a folder; ``reason`` must appear in the error message.

    ``runtime_only``: the file is a well-formed model ONNX Runtime cannot load (ir_version / opset version):
    ``validate`` is a static check and may accept it; every command that loads it in ORT must refuse it.
    """

    name: str
    build: Callable[[Path, onnx.ModelProto, Path], Path]
    reason: str
    runtime_only: bool = False


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _tamper_external(mutate: Callable[[onnx.TensorProto, Path], None]) -> Callable:
    def build(d: Path, base: onnx.ModelProto, secret: Path) -> Path:
        path = _save_external(base, d / "m")
        proto = onnx.load(path, load_external_data=False)
        mutate(_biggest_external(proto), d / "m")
        onnx.save(proto, path)
        return path

    return build


def _tamper(mutate: Callable[[onnx.ModelProto], None]) -> Callable:
    def build(d: Path, base: onnx.ModelProto, secret: Path) -> Path:
        proto = onnx.ModelProto()
        proto.CopyFrom(base)
        mutate(proto)
        return _write(d / "model.onnx", proto.SerializeToString())

    return build


def _truncate(fraction: float) -> Callable:
    def build(d: Path, base: onnx.ModelProto, secret: Path) -> Path:
        data = base.SerializeToString()
        return _write(d / "model.onnx", data[: max(1, int(len(data) * fraction))])

    return build


def _symlink_out(t: onnx.TensorProto, folder: Path) -> None:
    os.symlink(folder.parent / "secret.bin", folder / "weights.bin")
    _set_entry(t, "location", "weights.bin")
    _set_entry(t, "offset", None)


def _fifo(t: onnx.TensorProto, folder: Path) -> None:
    os.mkfifo(folder / "pipe.bin")  # reading it would block forever
    _set_entry(t, "location", "pipe.bin")


def _huge_external(t: onnx.TensorProto, folder: Path) -> None:
    del t.dims[:]
    t.dims.extend([2**40, 64])
    _set_entry(t, "length", None)


def _inline_initializer(proto: onnx.ModelProto) -> onnx.TensorProto:
    return max(proto.graph.initializer, key=lambda t: len(t.raw_data))


def _set_dims(dims: list[int]) -> Callable[[onnx.ModelProto], None]:
    def mutate(proto: onnx.ModelProto) -> None:
        t = _inline_initializer(proto)
        del t.dims[:]
        t.dims.extend(dims)

    return mutate


def _set_opset(domain: str, version: int | None) -> Callable[[onnx.ModelProto], None]:
    def mutate(proto: onnx.ModelProto) -> None:
        kept = [(o.domain, o.version) for o in proto.opset_import if o.domain != domain]
        del proto.opset_import[:]
        for dom, ver in kept + ([(domain, version)] if version is not None else []):
            proto.opset_import.add(domain=dom, version=ver)

    return mutate


def _set_ir(version: int) -> Callable[[onnx.ModelProto], None]:
    def mutate(proto: onnx.ModelProto) -> None:
        proto.ir_version = version

    return mutate


def _bad_dtype(proto: onnx.ModelProto) -> None:
    _inline_initializer(proto).data_type = 999


FILE_CASES = [
    Hostile("missing", lambda d, b, s: d / "nope.onnx", "no such file"),
    Hostile("empty", lambda d, b, s: _write(d / "model.onnx", b""), "empty file"),
    Hostile("directory", lambda d, b, s: (d / "dir.onnx").mkdir() or d / "dir.onnx", "directory"),
    Hostile("text", lambda d, b, s: _write(d / "model.onnx", b"hello, I am not a model\n" * 20), "not an ONNX model"),
    Hostile(
        "garbage",
        lambda d, b, s: _write(d / "model.onnx", random.Random(7).randbytes(4096)),
        "not an ONNX model",
    ),
    *[Hostile(f"truncated-{f}", _truncate(f), "not an ONNX model") for f in (0.0, 0.01, 0.5, 0.999)],
]
EXTERNAL_CASES = [
    Hostile("ext-dotdot", _tamper_external(lambda t, f: _set_entry(t, "location", "../secret.bin")), "'..'"),
    Hostile(
        "ext-inner-dotdot", _tamper_external(lambda t, f: _set_entry(t, "location", "x/../model.onnx.data")), "'..'"
    ),
    Hostile(
        "ext-absolute",
        _tamper_external(lambda t, f: _set_entry(t, "location", str(f.parent / "secret.bin"))),
        "absolute",
    ),
    Hostile("ext-etc-passwd", _tamper_external(lambda t, f: _set_entry(t, "location", "/etc/passwd")), "absolute"),
    Hostile("ext-symlink-out", _tamper_external(_symlink_out), "outside the model's folder"),
    Hostile("ext-missing", _tamper_external(lambda t, f: _set_entry(t, "location", "nope.bin")), "not found"),
    Hostile("ext-fifo", _tamper_external(_fifo), "not a regular file"),
    Hostile("ext-offset-past-eof", _tamper_external(lambda t, f: _set_entry(t, "offset", str(10**9))), "past the end"),
    Hostile("ext-length-past-eof", _tamper_external(lambda t, f: _set_entry(t, "length", str(10**9))), "length"),
    Hostile("ext-negative-offset", _tamper_external(lambda t, f: _set_entry(t, "offset", "-5")), "non-negative"),
    Hostile("ext-huge-dims", _tamper_external(_huge_external), "past the end"),
]
SIZE_CASES = [
    Hostile("inline-huge-dims", _tamper(_set_dims([2**40, 64])), "raw_data"),
    Hostile("inline-overflow-dims", _tamper(_set_dims([2**31, 2**31, 2**31])), "more than any machine holds"),
    Hostile("inline-negative-dim", _tamper(_set_dims([-1, 64])), "negative dimension"),
    Hostile("inline-bad-dtype", _tamper(_bad_dtype), "element type"),
]
OPSET_CASES = [
    Hostile("no-opset-import", _tamper(lambda p: p.ClearField("opset_import")), "opset_import"),
    Hostile("no-ir-version", _tamper(_set_ir(0)), "ir_version"),
    Hostile("no-graph", _tamper(lambda p: p.ClearField("graph")), "no graph"),
    Hostile("opset-0", _tamper(_set_opset("", 0)), "version 0"),
    Hostile("opset-too-old", _tamper(_set_opset("", 1)), "opset 1"),
    Hostile("opset-too-new", _tamper(_set_opset("", 27)), "opset 27", runtime_only=True),
    Hostile("ir-version-too-new", _tamper(_set_ir(99)), "IR version", runtime_only=True),
]
PAGED_OPSET_CASES = [  # only meaningful for a model with com.microsoft nodes
    Hostile("no-com-microsoft-import", _tamper(_set_opset("com.microsoft", None)), "com.microsoft"),
    Hostile("com-microsoft-v2", _tamper(_set_opset("com.microsoft", 2)), "com.microsoft", runtime_only=True),
]
COMMON = FILE_CASES + EXTERNAL_CASES + SIZE_CASES + OPSET_CASES
ALL = COMMON + PAGED_OPSET_CASES


# ------------------------------------------------------------------------------------------ observation
def _snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (symlinks not followed): content hash, 'dir', 'fifo' or the link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link->" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_fifo():
                out[rel] = "fifo"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


class OpenSpy:
    """Records every path opened through Python while active (builtins.open, io.open, os.open)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened: list[str] = []
        real_open, real_os_open = builtins.open, os.open

        def spy_open(file, *args, **kwargs):
            if isinstance(file, (str, bytes, os.PathLike)):
                self.opened.append(os.path.realpath(os.fsdecode(file)))
            return real_open(file, *args, **kwargs)

        def spy_os_open(path, *args, **kwargs):
            self.opened.append(os.path.realpath(os.fsdecode(path)))
            return real_os_open(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", spy_open)
        monkeypatch.setattr(io, "open", spy_open)
        monkeypatch.setattr(os, "open", spy_os_open)


@dataclass
class Scene:
    root: Path
    model: Path
    secret: Path
    before: dict[str, str]


def _scene(tmp_path: Path, case: Hostile, base: onnx.ModelProto) -> Scene:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SENTINEL * 64 + b"\0" * 1_000_000)  # big enough for any offset a case declares
    model = case.build(tmp_path, base, secret)
    return Scene(tmp_path, model, secret, _snapshot(tmp_path))


def _assert_untouched(scene: Scene, spy: OpenSpy | None = None) -> None:
    assert _snapshot(scene.root) == scene.before, "files were changed, added or removed"
    if spy is not None:
        assert os.path.realpath(scene.secret) not in spy.opened, "the secret outside the folder was opened"


def _assert_cli_error(code: int, out: str, err: str, scene: Scene, command: str) -> None:
    assert code == 1, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ortpa {command}: error: "), err
    assert SENTINEL.decode() not in out + err


# ------------------------------------------------------------------------------------------ CLI
def _cli_convert(scene: Scene, paged: Path) -> list[str]:
    return ["convert", str(scene.model), str(scene.root / "out" / "paged.onnx"), "--quiet"]


def _cli_validate(scene: Scene, paged: Path) -> list[str]:
    return ["validate", str(scene.model)]


def _cli_generate(scene: Scene, paged: Path) -> list[str]:
    return ["generate", str(scene.model), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--num-blocks", "8"]


def _cli_parity_original(scene: Scene, paged: Path) -> list[str]:
    return ["parity", str(scene.model), str(paged), "--prompt-ids", "1,2", "--max-new-tokens", "1"]


def _cli_parity_converted(scene: Scene, paged: Path) -> list[str]:
    return ["parity", str(DENSE), str(scene.model), "--prompt-ids", "1,2", "--max-new-tokens", "1"]


# (command, argv builder, which base the hostile file is made from)
CLI = [
    ("convert", _cli_convert, "dense"),
    ("validate", _cli_validate, "paged"),
    ("generate", _cli_generate, "paged"),
    ("parity", _cli_parity_original, "dense"),
    ("parity", _cli_parity_converted, "converted"),
]
CLI_IDS = ["convert", "validate", "generate", "parity-original", "parity-converted"]


def _cases_for(kind: str) -> list[Hostile]:
    return ALL if kind != "dense" else COMMON


CLI_PARAMS = [
    pytest.param(command, argv, kind, case, id=f"{cid}-{case.name}")
    for (command, argv, kind), cid in zip(CLI, CLI_IDS, strict=True)
    for case in _cases_for(kind)
]


@pytest.fixture(scope="module")
def converted_path(bases, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("converted") / "paged.onnx"
    onnx.save(bases["converted"], path)
    return path


@pytest.mark.parametrize("command, argv, kind, case", CLI_PARAMS)
def test_cli_refuses_hostile_file(command, argv, kind, case, bases, converted_path, tmp_path, capsys, monkeypatch):
    scene = _scene(tmp_path, case, bases[kind])
    spy = OpenSpy(monkeypatch)
    code = main(argv(scene, converted_path))
    monkeypatch.undo()
    out, err = capsys.readouterr()
    _assert_untouched(scene, spy)
    if case.runtime_only and command == "validate":  # static check: may accept; never crash
        assert code in (0, 1) and "Traceback" not in err
        return
    _assert_cli_error(code, out, err, scene, command)
    assert str(scene.model) in err and case.reason in err, err


# ------------------------------------------------------------------------------------------ Python API
def _api_convert(scene: Scene) -> None:
    ortpa.convert(str(scene.model))


def _api_convert_file(scene: Scene) -> None:
    convert_file(scene.model, scene.root / "out" / "paged.onnx")


def _api_validate(scene: Scene) -> None:
    ortpa.validate(str(scene.model))


def _api_session(scene: Scene) -> None:
    InferenceSession(str(scene.model), providers=["CPUExecutionProvider"])


def _api_paged_session(scene: Scene) -> None:
    PagedSession(str(scene.model), num_blocks=4, providers=["CPUExecutionProvider"])


def _api_engine(scene: Scene) -> None:
    Engine(str(scene.model), num_blocks=4, providers=["CPUExecutionProvider"])


API = [
    ("convert", _api_convert, "dense"),
    ("convert_file", _api_convert_file, "dense"),
    ("validate_model", _api_validate, "paged"),
    ("InferenceSession", _api_session, "paged"),
    ("PagedSession", _api_paged_session, "paged"),
    ("Engine", _api_engine, "paged"),
]
API_PARAMS = [
    pytest.param(call, kind, case, id=f"{name}-{case.name}") for name, call, kind in API for case in _cases_for(kind)
]


@pytest.mark.parametrize("call, kind, case", API_PARAMS)
def test_api_refuses_hostile_file(call, kind, case, bases, tmp_path, monkeypatch):
    scene = _scene(tmp_path, case, bases[kind])
    spy = OpenSpy(monkeypatch)
    if case.runtime_only and call is _api_validate:
        try:
            call(scene)
        except InvalidModel:
            pass
    else:
        with pytest.raises(InvalidModel) as info:
            call(scene)
        message = str(info.value)
        assert "\n" not in message and str(scene.model) in message and case.reason in message, message
        assert SENTINEL.decode() not in message
    monkeypatch.undo()
    _assert_untouched(scene, spy)


# ------------------------------------------------------------------------------------------ controls
def test_good_external_data_model_loads_everywhere(bases, tmp_path, monkeypatch, capsys):
    """The same models, untampered, with external data and an inside symlink: accepted (the refusals above are
    about the hostility, not about external data)."""
    dense = _save_external(bases["dense"], tmp_path / "dense")
    paged = _save_external(bases["paged"], tmp_path / "paged")
    # an external file reached through a symlink that stays inside the folder is fine
    (tmp_path / "paged" / "model.onnx.data").rename(tmp_path / "paged" / "real.data")
    os.symlink("real.data", tmp_path / "paged" / "model.onnx.data")
    before = _snapshot(tmp_path)
    out = tmp_path / "out" / "paged.onnx"
    assert main(["convert", str(dense), str(out), "--quiet"]) == 0
    assert main(["validate", str(paged)]) == 0
    assert main(["generate", str(paged), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--num-blocks", "8"]) == 0
    loaded = read_model(paged)
    assert loaded.external and all(t.data_location == onnx.TensorProto.DEFAULT for t in loaded.proto.graph.initializer)
    reference = InferenceSession(bases["paged"], providers=["CPUExecutionProvider"])
    assert [i.name for i in InferenceSession(str(paged)).get_inputs()] == [i.name for i in reference.get_inputs()]
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("out")} == before
    # an input with external data gives an output with external data (ortpa.rewriter.model_store)
    # (and the genai_config.json every conversion writes beside its model: ortpa.deploy)
    assert sorted(k for k in after if k.startswith("out")) == [
        "out",
        "out/genai_config.json",
        "out/paged.onnx",
        "out/paged.onnx.data",
    ]


def test_external_data_is_refused_without_a_folder(bases, tmp_path):
    """Bytes and ModelProtos have no folder: an external reference would resolve against the working directory."""
    path = _save_external(bases["paged"], tmp_path)
    header = onnx.load(path, load_external_data=False)
    for model, label in ((header, "<ModelProto>"), (header.SerializeToString(), "<bytes>")):
        with pytest.raises(InvalidModel, match="cannot be resolved without the model's folder") as info:
            InferenceSession(model)
        assert info.value.path == label
        with pytest.raises(InvalidModel, match="cannot be resolved without the model's folder"):
            ortpa.convert(header)
        # validation is static: it never follows the reference, so it has nothing to refuse
        assert ortpa.validate(model).ok


def test_convert_into_a_directory_is_a_clean_error(tmp_path, capsys):
    (tmp_path / "out.onnx").mkdir()
    before = _snapshot(tmp_path)
    assert main(["convert", str(DENSE), str(tmp_path / "out.onnx"), "--quiet"]) == 1
    _, err = capsys.readouterr()
    assert "Traceback" not in err and "out.onnx" in err and len(err.strip().splitlines()) == 1
    assert _snapshot(tmp_path) == before


def _swap_matmul_weight_dims(proto: onnx.ModelProto) -> None:
    """A weight whose dims no longer fit its MatMul (same byte count): only ONNX Runtime's shape inference can
    tell, at session creation."""
    weight = next(t for t in proto.graph.initializer if t.name == "lm_head")
    rows, cols = weight.dims
    del weight.dims[:]
    weight.dims.extend([rows * 2, cols // 2])


def test_corruption_only_onnx_runtime_sees_is_one_clean_line(bases, converted_path, tmp_path, capsys, monkeypatch):
    # on the portable path: ONNX Runtime infers shapes through the lowered op and refuses the file when the session
    # opens; ortpa's native custom op declares no shape inference, so there the mismatch shows at the first run
    # (docs/native.md, "How the nodes bind")
    monkeypatch.setenv("ORTPA_PAGED_ATTENTION", "portable")
    case = Hostile("matmul-dims", _tamper(_swap_matmul_weight_dims), "ONNX Runtime rejected")
    scene = _scene(tmp_path, case, bases["paged"])
    read_model(scene.model)  # well-formed: ortpa's own checks pass it on
    for argv in (_cli_generate, _cli_parity_converted):
        code = main(argv(scene, converted_path))
        out, err = capsys.readouterr()
        _assert_cli_error(code, out, err, scene, argv(scene, converted_path)[0])
        assert str(scene.model) in err and case.reason in err, err
    _assert_untouched(scene)


# ------------------------------------------------------------------------------------------ generated
def _paged_bytes() -> bytes:
    return build_toy_lm().SerializeToString()


PAGED_BYTES = _paged_bytes()
DENSE_BYTES = DENSE.read_bytes()


def _flip(data: bytes, positions: list[int], values: list[int]) -> bytes:
    out = bytearray(data)
    for p, v in zip(positions, values, strict=False):
        out[p % len(out)] ^= v or 1
    return bytes(out)


TRUNCATIONS = st.integers(min_value=0, max_value=len(PAGED_BYTES) - 1)
FLIPS = st.tuples(
    st.lists(st.integers(min_value=0, max_value=len(PAGED_BYTES) - 1), min_size=1, max_size=8),
    st.lists(st.integers(min_value=1, max_value=255), min_size=8, max_size=8),
)
COUNTS = {"truncated": 0, "flipped": 0}


def _load_all_ways(data: bytes, folder: Path) -> str:
    """read_model, validate and InferenceSession on one generated file: 'ok' or 'refused'; never anything else
    than InvalidModel (ortpa's checks) or, for corruption only ONNX Runtime can judge, ORT's own error."""
    path = folder / "gen.onnx"
    path.write_bytes(data)
    before = _snapshot(folder)
    outcome = "ok"
    for call in (read_model, ortpa.validate, InferenceSession):
        try:
            call(str(path))
        except OrtpaError:
            outcome = "refused"
        except Exception as exc:  # ONNX Runtime refusing a structurally valid but corrupted graph
            assert type(exc).__module__.startswith("onnxruntime"), f"{call.__name__}: {type(exc).__name__}: {exc}"
            outcome = "refused"
    assert _snapshot(folder) == before
    return outcome


@given(cut=TRUNCATIONS)
def test_generated_truncations_are_refused(cut, tmp_path_factory):
    folder = tmp_path_factory.mktemp("trunc")
    data = PAGED_BYTES[:cut]
    with pytest.raises(InvalidModel) as info:  # a prefix of this model is never a whole model
        read_model(_write(folder / "gen.onnx", data))
    assert str(folder / "gen.onnx") in str(info.value)
    _load_all_ways(data, folder)
    COUNTS["truncated"] += 1


@given(flips=FLIPS)
def test_generated_byte_flips_never_crash(flips, tmp_path_factory):
    _load_all_ways(_flip(PAGED_BYTES, *flips), tmp_path_factory.mktemp("flip"))
    COUNTS["flipped"] += 1


@settings(max_examples=CLI_EXAMPLES, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(min_value=0.0, max_value=0.9999), flips=FLIPS, which=st.sampled_from(CLI_IDS))
def test_generated_files_through_the_cli(cut, flips, which, bases, converted_path, tmp_path_factory, capsys):
    """A truncated and a byte-flipped file through one CLI command: exit 0 or 1, one-line error, nothing
    written but the requested output, inputs unchanged."""
    _, argv, kind = CLI[CLI_IDS.index(which)]
    base = bases[kind].SerializeToString()
    for data in (base[: int(len(base) * cut)], _flip(base, *flips)):
        folder = tmp_path_factory.mktemp("gencli")
        model = _write(folder / "model.onnx", data)
        scene = Scene(folder, model, folder / "secret.bin", _snapshot(folder))
        code = main(argv(scene, converted_path))
        _, err = capsys.readouterr()
        assert code in (0, 1) and "Traceback" not in err, err
        after = _snapshot(folder)
        if code == 1:
            assert len([line for line in err.splitlines() if line.strip()]) == 1, err
            assert after == scene.before
        else:
            extra = {k for k in after if k not in scene.before}
            written = {"out", "out/paged.onnx", "out/genai_config.json"}
            assert extra <= written and all(after[k] == v for k, v in scene.before.items())
