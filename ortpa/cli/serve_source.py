"""What ``ortpa serve MODEL`` serves: MODEL itself when it is already converted (paged), else its conversion,
made once into a cache folder and reused on the next start.

MODEL may be a Hugging Face repo id (``ORG/NAME``, resolved in the local hub cache only: nothing is downloaded),
a checkpoint folder (exported first), or a dense ONNX model (a file or a folder holding one). The cache folder is
keyed by the source's revision and the conversion's options:

* a snapshot of the hub cache: its commit hash (the snapshot folder's name);
* any other folder or file: a hash of every file's relative path, size and modification time, and of the
  contents of the small ones (configs, tokenizer), so an edited or replaced file makes a new conversion;
* the conversion options and ortpa's version.

The conversion (``ortpa convert``: export if needed, convert, verify against the original) writes into a
temporary folder beside the cache entry, which is renamed into place only once complete: an interrupted start
leaves a temporary folder that no later start uses (the next start removes it when its process is gone).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from ortpa.errors import ConversionError, InvalidModel

__all__ = ["DEFAULT_CACHE", "cache_key", "is_converted", "serving_source"]

DEFAULT_CACHE = Path("~/.cache/ortpa/serve")  # or $ORTPA_CACHE_DIR, or --cache-dir
_SMALL = 1 << 20  # files up to this size are hashed by content too
_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-")


def is_converted(path: Path) -> bool:
    """Whether the ONNX model at ``path`` is a converted (paged) model: it takes a ``block_table``."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return any(i.name == "block_table" for i in graph.input)


def _folder_fingerprint(root: Path) -> dict:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    out = {}
    for p in files:
        st = p.stat()
        entry = [st.st_size, st.st_mtime_ns]
        if st.st_size <= _SMALL:
            entry.append(hashlib.sha256(p.read_bytes()).hexdigest())
        out[str(p.relative_to(root)) if p != root else p.name] = entry
    return out


def cache_key(source: Path, options: list[str]) -> str:
    """The cache entry's key for converting ``source`` with ``options`` (module docstring)."""
    import ortpa

    real = source.resolve()
    snapshot = real if real.is_dir() else real.parent
    revision: object
    if snapshot.parent.name == "snapshots" and snapshot.parent.parent.name.startswith("models--"):
        revision = {"repo": snapshot.parent.parent.name, "commit": snapshot.name}
    else:
        revision = {"path": str(real), "files": _folder_fingerprint(real)}
    text = json.dumps({"revision": revision, "options": options, "ortpa": ortpa.__version__}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _source(model: str, revision: str | None) -> tuple[Path, bool]:
    """The path to convert (a dense ONNX file or a checkpoint folder), and whether it is already converted."""
    from ortpa.model.ref import NoOnnxFile, locate_model

    try:
        ref = locate_model(model, revision)
    except NoOnnxFile as exc:
        if not (exc.folder / "config.json").is_file():
            raise
        return exc.folder, False
    if ref.path.is_file() and is_converted(ref.path):
        return ref.path, True
    # a folder (or snapshot) is converted as a folder, so its tokenizer and config files come along
    given = Path(model)
    return (ref.folder if ref.folder is not None and (ref.repo_id or given.is_dir()) else ref.path), False


def _remove_stale(cache: Path, name: str) -> None:
    """Temporary folders of interrupted conversions of ``name`` whose process is gone."""
    for tmp in cache.glob(f".{name}.tmp-*"):
        m = _TMP.match(tmp.name)
        if m is None or m["name"] != name:
            continue
        pid = int(m["pid"])
        try:
            os.kill(pid, 0)
            alive = pid != os.getpid()
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            shutil.rmtree(tmp, ignore_errors=True)


def serving_source(
    model: str, revision: str | None, *, cache_dir: str | os.PathLike | None, quiet: bool, options: list[str]
) -> str:
    """The converted model ``ortpa serve`` opens for ``model``: itself, or its cache entry (made if missing)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a repo id resolves in the local cache; nothing is fetched
    from ortpa.runtime.stage_folder import is_stage_folder

    if is_stage_folder(model):  # a stage folder is served as it is (docs/distributed.md)
        return model
    source, converted = _source(model, revision)
    if converted:
        return model if revision is None else str(source)
    cache = Path(os.path.expanduser(cache_dir or os.environ.get("ORTPA_CACHE_DIR") or DEFAULT_CACHE))
    label = model.replace("/", "--") if not Path(model).exists() else Path(model).resolve().name
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", label)[-60:] or "model"
    name = f"{stem}-{cache_key(source, options)}"
    final = cache / name
    say = (lambda *_: None) if quiet else (lambda text: print(f"ortpa serve: {text}", file=sys.stderr, flush=True))
    if (final / "model.onnx").is_file():
        say(f"using the conversion of {model} cached in {final}")
        return str(final)
    cache.mkdir(parents=True, exist_ok=True)
    _remove_stale(cache, name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-{os.getpid()}-", dir=cache))
    tmp.chmod(0o755)  # mkdtemp's 0700 would become the entry's
    say(f"{model} is not a converted model: converting it once into {final} (reused on the next start)")
    try:
        _convert(source, tmp / "model.onnx", quiet=quiet, options=options)
        try:
            os.rename(tmp, final)  # atomic: the entry is complete or absent
        except OSError:
            if not (final / "model.onnx").is_file():  # not a concurrent start that finished first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def _convert(source: Path, out: Path, *, quiet: bool, options: list[str]) -> None:
    """``ortpa convert SOURCE OUT`` (export first for a checkpoint; verified), in this process: the one place
    serving calls the conversion."""
    from ortpa.cli import main

    argv = ["convert", str(source), str(out), *options] + (["--quiet"] if quiet else [])
    with contextlib.redirect_stdout(sys.stderr):  # its summary line is progress here, not output
        code = main(argv)
    if code == 130:
        raise KeyboardInterrupt
    if code != 0:
        raise ConversionError(f"converting {source} for serving failed (exit {code}; the reason is printed above)")
    if not out.is_file():
        raise InvalidModel(str(out), "the conversion reported success but wrote no model")
