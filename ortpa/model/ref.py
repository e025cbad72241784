"""Where a model is: an ``.onnx`` file, a model folder, or a Hugging Face repo id found in the local cache.

Every command and API entry point that takes a model path also takes

* a folder (a Hugging Face snapshot ``.../models--ORG--NAME/snapshots/REV`` included): the ONNX file is found
  by the usual layouts, in this order: ``genai_config.json``'s ``model.decoder.filename`` (onnxruntime-genai),
  ``model.onnx``, ``onnx/model.onnx``, a single ``onnx/model_*.onnx``; several candidates are an error listing
  them (pass the chosen file's path);
* a repo id ``ORG/NAME`` (``revision`` a branch, tag or commit; default ``main``), resolved **offline** with
  ``huggingface_hub.snapshot_download(local_files_only=True)`` in ``HF_HUB_CACHE`` (else ``HF_HOME/hub``,
  else ``~/.cache/huggingface/hub``), read when called, not at import. Nothing is ever downloaded: a repo not
  in the cache is an error saying how to download it. An existing local path always wins over a repo id.

A folder with no ONNX file at all raises :class:`NoOnnxFile` (a Hugging Face *checkpoint* folder, config.json
and safetensors, must be exported first). The external data of a model in the cache is checked by the loader
(:func:`ortpa.model.tensors.resolve_contained`); :func:`companion_files` applies the same rule to the
tokenizer and config files ``convert`` copies beside its output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortpa.errors import InvalidModel
from ortpa.model.tensors import hf_cache_repo, resolve_contained

__all__ = [
    "COMPANION_FILES",
    "ModelRef",
    "NoOnnxFile",
    "companion_files",
    "copy_companion_files",
    "find_onnx_file",
    "hub_cache_dir",
    "is_repo_id",
    "locate_model",
    "resolve_any",
    "resolve_model",
]

# tokenizer and config files a runtime needs beside the model; convert copies those the source has
COMPANION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",  # SentencePiece (Llama 2, Mistral, Gemma): what a slow tokenizer and genai's fallback read
    "vocab.json",  # byte-level BPE tokenizers saved without tokenizer.json (GPT-2 style)
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",  # where transformers 5 saves a chat template (ortpa serve reads it)
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "genai_config.json",
)

# what could be a repo id and not a path: ORG/NAME, one slash, no leading dot; the Hub's own rule decides the rest
_REPO_ID_SHAPE = re.compile(r"[A-Za-z0-9][^/]*/[A-Za-z0-9][^/]*")
_LAYOUTS = "genai_config.json, model.onnx, onnx/model.onnx, onnx/model_*.onnx"


class NoOnnxFile(InvalidModel):
    """A folder with no ONNX model in any known layout (e.g. a Hugging Face checkpoint: export it first)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.folder = Path(path)


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: the ONNX ``path``; the ``folder`` whose tokenizer/config files go with it (``None`` for
    a plain file outside a Hugging Face snapshot whose folder holds none of :data:`COMPANION_FILES`); the
    ``repo_id`` and ``revision`` it came from, if any."""

    path: Path
    folder: Path | None = None
    repo_id: str | None = None
    revision: str | None = None


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment as it is now. huggingface_hub's ``constants.HF_HUB_CACHE``
    is read once at its import, so a cache set later in the process (a test, an embedding application) would be
    missed; this follows the same variables in the same order."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expanduser(os.path.expandvars(os.environ[var])))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(os.path.expanduser(os.path.expandvars(home))) / "hub"


def is_repo_id(ref: Any) -> bool:
    """``ref`` names a Hugging Face repo: a string ``ORG/NAME`` that is not an existing path nor an .onnx name."""
    if not (isinstance(ref, str) and _REPO_ID_SHAPE.fullmatch(ref) and not ref.endswith(".onnx")):
        return False
    if os.path.lexists(ref):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(ref)
    except HFValidationError:
        return False
    return True


def resolve_model(ref: str | os.PathLike, revision: str | None = None) -> Path:
    """The ONNX file that ``ref`` (a file, a folder or a repo id in the local cache) names; see the module."""
    return locate_model(ref, revision).path


def resolve_any(model: Any, revision: str | None = None) -> Any:
    """:func:`resolve_model` for a path or repo id; anything else (bytes, protos, a plain file path) unchanged,
    so the loader's messages keep naming what the caller passed."""
    if isinstance(model, ModelRef):
        return model.path
    if isinstance(model, (str, os.PathLike)):
        ref = locate_model(model, revision)
        return model if ref.path == Path(model) else ref.path
    if revision is not None:
        raise InvalidModel(repr(model)[:80], f"revision {revision!r} given, but the model is not a repo id")
    return model


def locate_model(ref: str | os.PathLike | ModelRef, revision: str | None = None) -> ModelRef:
    """Resolve ``ref`` to a :class:`ModelRef`; :class:`InvalidModel` (one line) when it cannot be."""
    if isinstance(ref, ModelRef):
        return ref
    if is_repo_id(ref):
        folder = _snapshot(str(ref), revision)
        return ModelRef(find_onnx_file(folder), folder, str(ref), revision)
    if revision is not None:
        raise InvalidModel(os.fspath(ref), f"revision {revision!r} applies to a Hugging Face repo id, not a path")
    path = Path(ref)
    if path.is_dir() and path.suffix != ".onnx":  # a folder named *.onnx was meant as the file: the loader says so
        return ModelRef(find_onnx_file(path), path)
    # a missing or odd file is the loader's to report, with its usual message
    return ModelRef(path, _snapshot_root(path) or _file_folder(path))


def _file_folder(path: Path) -> Path | None:
    """The folder whose tokenizer and config files go with a model given as a file: the folder that, given as the
    input, names this file (its own, or the one above an ``onnx/`` layout), when that folder holds any of
    :data:`COMPANION_FILES`; so converting ``DIR/model.onnx`` keeps the same token ids and tokenizer as ``DIR``."""
    if not path.is_file():
        return None
    parent = path.parent
    if _has_companions(parent):
        return parent
    in_layout = path.name == "model.onnx" or (path.name.startswith("model_") and path.suffix == ".onnx")
    if parent.name == "onnx" and in_layout and _has_companions(parent.parent):
        return parent.parent
    return None


def _has_companions(folder: Path) -> bool:
    return any(os.path.lexists(folder / name) for name in COMPANION_FILES)


def _snapshot_root(path: Path) -> Path | None:
    """For a file inside a Hugging Face snapshot, the snapshot folder (its config files live there)."""
    parent = os.path.dirname(os.path.abspath(path))
    repo = hf_cache_repo(os.path.realpath(parent))
    if repo is None:
        return None
    rel = Path(os.path.relpath(os.path.realpath(parent), repo)).parts  # snapshots / REV / ...
    return Path(repo, *rel[:2])


# ------------------------------------------------------------------------------------------ the cache
def _snapshot(repo_id: str, revision: str | None) -> Path:
    cache = hub_cache_dir()
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    get = f"`hf download {repo_id}" + (f" --revision {revision}`" if revision else "`")
    if not repo_dir.is_dir():
        raise InvalidModel(
            repo_id,
            f"not a local path, and not in the Hugging Face cache {cache} (ortpa never downloads); "
            f"download it with {get}, or set HF_HUB_CACHE to the cache that holds it",
        )
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except (OSError, ValueError) as exc:  # LocalEntryNotFoundError, IncompleteSnapshotError, HFValidationError
        cached = sorted({p.name for p in (*repo_dir.glob("refs/*"), *repo_dir.glob("snapshots/*"))})
        detail = "not in the cache" if isinstance(exc, FileNotFoundError) else str(exc).splitlines()[0]
        raise InvalidModel(
            repo_id,
            f"revision {revision or 'main'!r}: {detail} ({repo_dir}; cached: {', '.join(cached) or 'none'}); "
            f"download it with {get}",
        ) from None
    return Path(folder)


# ------------------------------------------------------------------------------------------ the layouts
def find_onnx_file(folder: Path) -> Path:
    """The model file of ``folder`` by the usual layouts (module docstring); :class:`NoOnnxFile` if it has none,
    :class:`InvalidModel` listing the choices if several fit."""
    label = os.fspath(folder)
    genai = folder / "genai_config.json"
    if genai.is_file():
        return _checked(folder, _genai_decoder(genai), os.fspath(genai))
    for rel in ("model.onnx", os.path.join("onnx", "model.onnx")):
        if (folder / rel).is_file():
            return _checked(folder, rel, label)
    variants = _relative(folder, "onnx/model_*.onnx")
    if len(variants) == 1:
        return _checked(folder, variants[0], label)
    if variants:
        raise InvalidModel(label, _choose(folder, f"{len(variants)} ONNX models", variants))
    others = _relative(folder, "*.onnx", "*/*.onnx")
    if others:
        raise InvalidModel(label, _choose(folder, f"none of {_LAYOUTS}, but", others))
    genai_dirs = sorted(p.rsplit("/", 1)[0] for p in _relative(folder, "*/genai_config.json", "*/*/genai_config.json"))
    if genai_dirs:
        raise InvalidModel(label, _choose(folder, "no ONNX model at the top; onnxruntime-genai folders", genai_dirs))
    hint = ""
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        hint = "; it is a Hugging Face checkpoint (config.json + safetensors): export it to ONNX first"
    raise NoOnnxFile(label, f"no ONNX model in this folder (looked for {_LAYOUTS}){hint}")


def _relative(folder: Path, *patterns: str) -> list[str]:
    return sorted({p.relative_to(folder).as_posix() for pattern in patterns for p in folder.glob(pattern)})


def _choose(folder: Path, what: str, choices: list[str]) -> str:
    return f"{what}: {', '.join(choices)}; pass the one to use as a path, e.g. {folder / choices[0]}"


def _genai_decoder(genai: Path) -> str:
    try:
        name = json.loads(genai.read_text(encoding="utf-8"))["model"]["decoder"]["filename"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise InvalidModel(
            os.fspath(genai), f"expected a JSON object with model.decoder.filename, found {type(exc).__name__}"
        ) from None
    if not isinstance(name, str) or not name:
        raise InvalidModel(os.fspath(genai), f"model.decoder.filename must be a file name, found {name!r}")
    return name


def _checked(folder: Path, rel: str, label: str) -> Path:
    """``folder / rel`` if it stays where the loader allows external data (the same rule), else InvalidModel."""
    if os.path.isabs(rel) or ".." in re.split(r"[\\/]", rel) or "\0" in rel:
        raise InvalidModel(label, f"model file {rel!r} is absolute or contains '..'; expected a file in {folder}")
    _, escape = resolve_contained(os.path.realpath(folder), rel)
    if escape is not None:
        raise InvalidModel(label, f"model file {rel!r} {escape}")
    path = folder / rel
    if not path.is_file():
        raise InvalidModel(label, f"model file {rel!r} not found in {folder}")
    return path


# ------------------------------------------------------------------------------------------ companions
def companion_files(source: Path) -> list[tuple[str, str]]:
    """The :data:`COMPANION_FILES` that ``source`` has, as (name, real path), checked before any work: each must
    stay where the loader allows external data (a symlink into a Hugging Face repository's ``blobs/`` is fine)
    and be a regular file; :class:`InvalidModel` otherwise."""
    real_source = os.path.realpath(source)
    found = []
    for name in COMPANION_FILES:
        src = source / name
        if not os.path.lexists(src):
            continue
        target, escape = resolve_contained(real_source, name)
        if escape is not None:
            raise InvalidModel(os.fspath(src), f"{name} {escape}; not copied")
        try:
            st = os.stat(target)
        except OSError:
            continue  # a dangling link: nothing to copy
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the copy forever
            raise InvalidModel(os.fspath(src), f"{name} is not a regular file; not copied")
        found.append((name, target))
    return found


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it before Python 3.13's os.getumask: set, then restore at once
    os.umask(mask)
    return mask


def copy_companion_files(files: list[tuple[str, str]], dest_dir: Path) -> list[str]:
    """Copy :func:`companion_files`' result into ``dest_dir`` as regular files (a symlink already at the
    destination is replaced, not written through); the names copied."""
    copied = []
    for name, target in files:
        dest = dest_dir / name
        if os.path.exists(dest) and os.path.samefile(target, dest):
            continue
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=dest_dir)
        os.close(fd)
        try:
            shutil.copyfile(target, tmp)
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 is for the temp name only: a plain file, as open() makes
            os.replace(tmp, dest)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        copied.append(name)
    return copied
