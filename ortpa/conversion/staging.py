"""Where a conversion's output is assembled, and the one move that publishes it.

Everything the output consists of (the model, its ``.data``, ``genai_config.json``, the tokenizer and config files)
is written into a private folder next to it, on the same file system. Then, when the output's folder did not exist
or was empty, that folder is renamed to it (one ``rename``: the deployment is complete or absent, by
construction). When the output goes into a folder that holds other files, the staged files are renamed into it
one by one, the model last, and an existing model of that name is removed before anything else: a crash in between
leaves no model, never an old model beside a new data file. Nothing is rewritten after the move.

Weights the rewrite computes are spilled to a scratch folder beside the staging folder (never published). Both are
removed on any exit, and so, on failure, are the folders this conversion created for the output.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ortpa.errors import ConversionError

__all__ = ["Staging", "staging"]


def _umask() -> int:
    mask = os.umask(0o022)  # read it the only way before Python 3.13's os.getumask: set, then restore at once
    os.umask(mask)
    return mask


@dataclass
class Staging:
    """The staging folder for ``out`` (see the module docstring): stage into :attr:`folder`, then :meth:`commit`."""

    out: Path
    folder: Path  # staged files, under their final names
    scratch: Path  # spilled computed weights, never published
    whole_folder: bool  # True: commit renames `folder` to out.parent
    made: list[Path] = field(default_factory=list)  # folders created for the output, deepest first
    committed: bool = False

    @property
    def model(self) -> Path:
        """Where the model is staged."""
        return self.folder / self.out.name

    def commit(self) -> None:
        """Publish the staged files (see the module docstring)."""
        target = self.out.parent
        try:
            if self.whole_folder:
                with contextlib.suppress(FileNotFoundError):
                    target.rmdir()  # empty when staging began (rename(2) replaces an empty folder; Windows does not)
                os.replace(self.folder, target)
            else:
                if self.out.exists() or self.out.is_symlink():
                    os.unlink(self.out)
                for staged in sorted(self.folder.iterdir()):
                    if staged.name != self.out.name:
                        os.replace(staged, target / staged.name)
                os.replace(self.model, self.out)
                self.folder.rmdir()  # empty now
        except OSError as exc:
            raise ConversionError(f"cannot write {self.out}: {exc.strerror or exc}") from exc
        self.committed = True


@contextlib.contextmanager
def staging(out_path: str | os.PathLike) -> Iterator[Staging]:
    """A :class:`Staging` for ``out_path``; its folders are removed on exit (a committed one is gone already)."""
    out = Path(os.path.abspath(out_path))
    if out.is_dir():  # found before the work, not after it
        raise ConversionError(f"cannot write {os.fspath(out_path)}: it is a directory")
    target = out.parent
    # an existing empty folder is replaced only where its parent may be written (else: staged inside it)
    empty = target.is_dir() and not any(target.iterdir()) and os.access(target.parent, os.W_OK)
    whole = not target.exists() or empty
    root = target.parent if whole else target
    made = [p for p in (root, *root.parents) if not p.exists()]
    try:
        root.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=root))
        scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".scratch", dir=root))
    except OSError as exc:
        raise ConversionError(f"cannot write {os.fspath(out_path)}: {exc.strerror or exc}") from exc
    if whole:  # the folder becomes the output's: a folder's usual mode, not mkdtemp's 0700
        os.chmod(folder, 0o777 & ~_umask())
    stage = Staging(out, folder, scratch, whole, made)
    try:
        yield stage
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not stage.committed:
            shutil.rmtree(folder, ignore_errors=True)
            for made_folder in made:
                with contextlib.suppress(OSError):
                    made_folder.rmdir()  # only when still empty
