"""A stage folder's stages run one after the other: :class:`StageRunner` (one stage: its session, its paged cache
for its own layers) and :class:`StageChain` (all of them in this process, in order).

A chain step feeds every stage the same shared inputs (``input_ids``, the step's index tensors: one block table
for all), each stage the previous one's boundary values, and returns the last stage's logits. :class:`StageChain`
has the surface of :class:`~ortpa.runtime.session.PagedSession` that :class:`~ortpa.runtime.engine.Engine` and
:func:`ortpa.parity.greedy.paged_greedy` use (``run``, ``copy_blocks``, ``num_blocks``, ``block_size``), so a split
is proven, and run in one process, by the same loops as the unsplit model; :mod:`ortpa.runtime.pipeline` puts
each :class:`StageRunner` in its own Ray actor instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ortpa.runtime.session import PagedSession
from ortpa.runtime.stage_folder import StageManifest, StageSpec, check_stage_files, read_stage_folder

__all__ = ["StageChain", "StageRunner"]


class StageRunner:
    """One stage: its :class:`PagedSession` (its layers' caches, bound in place) and its boundary outputs."""

    def __init__(
        self,
        folder: str | os.PathLike,
        spec: StageSpec,
        *,
        num_blocks: int,
        block_size: int,
        providers: Sequence[Any] | None = None,
        sess_options: ort.SessionOptions | None = None,
        check_hashes: bool = True,
        threads: int | None = None,
        paged_attention: str | None = None,
    ) -> None:
        folder = Path(folder)
        check_stage_files(folder, spec, hashes=check_hashes)
        if threads is not None:  # SessionOptions do not pickle: a Ray actor is given the thread count
            sess_options = sess_options or ort.SessionOptions()
            sess_options.intra_op_num_threads = threads
        self.spec = spec
        self.session = PagedSession(
            folder / spec.model,
            num_blocks=num_blocks,
            block_size=block_size,
            providers=providers,
            sess_options=sess_options,
            paged_attention=paged_attention,
        )
        self._wanted = [t.name for t in spec.boundary_out] or ["logits"]

    def step(self, feeds: Mapping[str, Any], received: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run this stage's layers on one step: the shared ``feeds`` and the previous stage's ``received``."""
        return self.session.run({**feeds, **received}, self._wanted)

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        self.session.copy_blocks(pairs)

    def cache_bytes(self) -> int:
        return sum(self.session.cache(n).nbytes for n in self.session.cache_names)


class StageChain:
    """Every stage of a folder in this process, run in order: a :class:`PagedSession` look-alike."""

    def __init__(
        self,
        folder: str | os.PathLike | StageManifest,
        *,
        num_blocks: int,
        block_size: int = 16,
        providers: Sequence[Any] | None = None,
        sess_options: ort.SessionOptions | None = None,
        paged_attention: str | None = None,
    ) -> None:
        manifest = folder if isinstance(folder, StageManifest) else read_stage_folder(folder)
        assert manifest.folder is not None
        self.manifest = manifest
        self.runners = [
            StageRunner(
                manifest.folder,
                spec,
                num_blocks=num_blocks,
                block_size=block_size,
                providers=providers,
                sess_options=sess_options,
                paged_attention=paged_attention,
            )
            for spec in manifest.stages
        ]
        self.num_blocks = num_blocks
        self.block_size = self.runners[0].session.block_size
        self.session = self.runners[0].session.session  # the shared inputs are declared by every stage

    def run(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        received: dict[str, np.ndarray] = {}
        for runner in self.runners:
            received = runner.step(feeds, received)
        return received

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        pairs = list(pairs)
        for runner in self.runners:
            runner.copy_blocks(pairs)
