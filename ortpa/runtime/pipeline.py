"""A stage folder run as a pipeline: each stage a Ray actor holding its session and its layers' paged cache.

:class:`RayPipeline` has the surface of :class:`~ortpa.runtime.session.PagedSession` the
:class:`~ortpa.runtime.engine.Engine` drives (``run``, ``copy_blocks``, ``num_blocks``, ``block_size``), so the
engine's one scheduler and block manager serve every stage: the step's index tensors (one block table for all)
are put in Ray's object store once and read by every stage; stage ``k`` receives stage ``k - 1``'s boundary values
as an object reference, which Ray resolves from the producing stage's node straight into the consumer (the
driver never fetches a hidden state); only the logits come back to the driver.

Placement: one placement group, one bundle per stage (``{"GPU": 1}`` where the cluster has a GPU for every stage,
CUDA's provider then; ``{"CPU": 1}`` otherwise), ``PACK`` by default or ``SPREAD`` across nodes.

Faults: a stage whose process dies fails the step in flight (Ray reports the actor's death within seconds);
the pipeline restarts it (a fresh actor in the same bundle: its file, a fresh cache for its layers) and raises
:class:`~ortpa.errors.StageFailed`, upon which the engine ends every request that had state in the caches. An
error inside a stage that is still alive (an ONNX Runtime failure) is raised as it is.

Several steps in flight: :meth:`RayPipeline.submit` starts a step and returns at once, :meth:`RayPipeline.collect`
waits for its logits. The engine keeps one step per micro-batch group submitted (``Engine(micro_batches=)``, one
per stage by default): each actor runs the steps it is given in submission order, so while stage ``k`` runs
group ``g``'s step stage ``k - 1`` already runs group ``g + 1``'s (docs/distributed.md). With one step in flight
the stages run one after the other and each idles ``(N - 1) / N`` of the time (the bubble).
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ortpa.errors import StageFailed
from ortpa.extras import require_extra
from ortpa.runtime.model_io import ModelIO, cache_bytes_per_block, model_io, rotary_table_rows
from ortpa.runtime.stage_chain import StageRunner
from ortpa.runtime.stage_folder import StageManifest, StageSpec

__all__ = ["FolderFacts", "RayPipeline", "StageActor", "folder_facts"]

STEP_TIMEOUT_S = 600.0  # a step that takes longer is a hung stage (a dead one is reported within seconds)
PING_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class FolderFacts:
    """What the engine reads from a model, read from a stage folder's stage files (graphs only)."""

    io: ModelIO
    bytes_per_block: int
    max_model_len: int | None
    all_rows: bool


def folder_facts(manifest: StageManifest, block_size: int) -> FolderFacts:
    assert manifest.folder is not None
    headers = [onnx.load(str(manifest.stage_path(s.index)), load_external_data=False) for s in manifest.stages]
    last = headers[-1]
    caches = set(manifest.stages[-1].cache_inputs)
    boundary = {t.name for t in manifest.stages[-1].boundary_in}
    io = model_io(_without(last, boundary), caches)
    per_block = sum(
        cache_bytes_per_block(h, set(s.cache_inputs), block_size) for h, s in zip(headers, manifest.stages, strict=True)
    )
    rows = [r for r in (rotary_table_rows(h) for h in headers) if r is not None]
    all_rows = any(p.key == "ortpa.logits" and p.value == "all" for p in last.metadata_props)
    return FolderFacts(io, per_block, min(rows) if rows else None, all_rows)


def _without(header: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """A copy of ``header``'s interface without the boundary inputs (what model_io reads)."""
    out = onnx.ModelProto()
    out.graph.name = header.graph.name
    out.graph.input.extend(i for i in header.graph.input if i.name not in names)
    out.graph.output.extend(header.graph.output)
    return out


class StageActor:
    """The body of one stage's Ray actor: a :class:`StageRunner` and where it runs."""

    def __init__(
        self,
        folder: str,
        spec: StageSpec,
        num_blocks: int,
        block_size: int,
        providers,
        check_hashes: bool,
        threads: int | None = None,
        paged_attention: str | None = None,
    ):
        self.runner = StageRunner(
            folder,
            spec,
            num_blocks=num_blocks,
            block_size=block_size,
            providers=providers,
            check_hashes=check_hashes,
            threads=threads,
            paged_attention=paged_attention,
        )
        self.started = time.time()
        self.busy_s = 0.0  # time spent running steps (the bench's pipeline bubble)
        # the wall-clock spans of the last steps (time.time(): comparable between processes of one machine), so a
        # test can see two stages computing at once
        self.spans: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)

    def ready(self) -> dict:
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "started": self.started}

    def step(self, feeds: Mapping[str, Any], received: Mapping[str, Any]) -> dict[str, np.ndarray]:
        t0, wall = time.perf_counter(), time.time()
        try:
            return self.runner.step(feeds, received)
        finally:
            self.busy_s += time.perf_counter() - t0
            self.spans.append((wall, time.time()))

    def step_forward(self, feeds: Mapping[str, Any], received: Mapping[str, Any], rest: list) -> Any:
        """Run this stage, then hand the result to the next stage's actor directly (``rest``: the later stages'
        handles): the alternative to the driver chaining object references, measured by ``ortpa bench``."""
        out = self.step(feeds, received)
        return rest[0].step_forward.remote(feeds, out, rest[1:]) if rest else out

    def busy(self) -> float:
        return self.busy_s

    def step_spans(self) -> list[tuple[float, float]]:
        return list(self.spans)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(pairs)

    def memory(self) -> dict:
        """This process's resident and private bytes (``/proc/self/smaps_rollup``), and its cache's bytes."""
        fields: dict[str, int] = {}
        try:
            with open("/proc/self/smaps_rollup") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 2 and parts[1].isdigit():
                        fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
        except OSError:
            pass
        private = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
        return {"rss": fields.get("Rss", 0), "private": private, "cache": self.runner.cache_bytes()}


def _ray():
    require_extra("pipeline", "running a stage folder on Ray")
    import ray

    return ray


def _package_root() -> str:
    """The folder holding the ``ortpa`` this driver imports: workers of a local cluster import the same code."""
    return str(Path(__file__).resolve().parents[2])


class RayPipeline:
    """The stages of a folder as Ray actors; see the module docstring."""

    def __init__(
        self,
        manifest: StageManifest,
        *,
        num_blocks: int,
        block_size: int,
        providers: Sequence[Any] | None = None,
        ray_address: str | None = None,
        placement: str = "pack",
        num_cpus: int | None = None,
        check_hashes: bool = True,
        threads: int | None = None,
        paged_attention: str | None = None,
    ) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert manifest.folder is not None
        self.manifest = manifest
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._owns_ray = False
        if not ray.is_initialized():
            # Ray's own convention: RAY_ADDRESS names the cluster to join when no address is given
            ray_address = ray_address or os.environ.get("RAY_ADDRESS") or None
            if ray_address is not None:
                ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
            else:  # a local cluster, small: a logical CPU per stage (each actor takes one).
                # address="local": a new instance even where a `ray start` cluster runs on this machine (plain
                # ray.init() would join that one, and refuse num_cpus)
                n = num_cpus if num_cpus is not None else len(manifest.stages)
                ray.init(address="local", num_cpus=n, include_dashboard=False, log_to_driver=False)
            self._owns_ray = True
        n = len(manifest.stages)
        gpu = ray.cluster_resources().get("GPU", 0) >= n
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        if providers is None:
            providers = ["CUDAExecutionProvider"] if gpu else ["CPUExecutionProvider"]
        self._providers = list(providers)
        strategy = {"pack": "PACK", "spread": "SPREAD", "strict-spread": "STRICT_SPREAD"}[placement]
        self._group = placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
        ray.get(self._group.ready(), timeout=120)
        self._remote = ray.remote(StageActor)
        self._strategy = PlacementGroupSchedulingStrategy
        self._bundle = bundle
        self._check_hashes = check_hashes
        self._threads = threads  # ONNX Runtime's intra-op threads in each stage (default: its own choice)
        self._paged_attention = paged_attention
        self.actors = [self._start(i) for i in range(n)]
        self.placed = ray.get([a.ready.remote() for a in self.actors])  # a bad file fails here, naming it

    def _start(self, index: int):
        python_path = os.pathsep.join(p for p in (_package_root(), os.environ.get("PYTHONPATH", "")) if p)
        return self._remote.options(
            num_cpus=self._bundle["CPU"],
            num_gpus=self._bundle.get("GPU", 0),
            max_restarts=0,  # restarted here, so that the engine knows the stage's cache is new
            scheduling_strategy=self._strategy(placement_group=self._group, placement_group_bundle_index=index),
            runtime_env={"env_vars": {"PYTHONPATH": python_path}},
        ).remote(
            str(self.manifest.folder),
            self.manifest.stages[index],
            self.num_blocks,
            self.block_size,
            self._providers,
            self._check_hashes,
            self._threads,
            self._paged_attention,
        )

    @property
    def num_stages(self) -> int:
        return len(self.actors)

    # -- the PagedSession surface, and steps in flight ---------------------------------------------------
    def run(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        return self.collect(self.submit(feeds))

    def submit(self, feeds: Mapping[str, Any]) -> Any:
        """Start one step on every stage, chained by object reference; returns at once (the last stage's result,
        for :meth:`collect`). Each actor runs its steps in submission order, so steps submitted one after the
        other flow through the stages one behind the other."""
        ray = _ray()
        shared = ray.put(dict(feeds))
        ref: Any = {}
        for actor in self.actors:
            ref = actor.step.remote(shared, ref)
        return ref

    def collect(self, handle: Any) -> dict[str, np.ndarray]:
        """Wait for a step :meth:`submit` started: its logits, or :class:`StageFailed` once the dead stage is
        restarted (every step in flight then ran on it: the caller drops them without collecting)."""
        ray = _ray()
        try:
            return ray.get(handle, timeout=STEP_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise self._recover(exc) from None
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, ray.exceptions.RayActorError):
                raise self._recover(exc.cause) from None
            raise exc.cause from None  # an error inside a living stage: as one process would raise it

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        pairs = list(pairs)
        if pairs:
            for actor in self.actors:  # ordered before the next step: one caller's tasks run in submission order
                actor.copy_blocks.remote(pairs)

    # -- faults, memory, shutdown ----------------------------------------------------------------------
    def _dead_stages(self) -> list[int]:
        ray = _ray()
        dead = []
        for i, actor in enumerate(self.actors):
            try:
                ray.get(actor.ready.remote(), timeout=PING_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(i)
        return dead

    def _recover(self, exc: BaseException) -> StageFailed:
        """Restart every stage that died (or hangs): a fresh actor, a fresh cache for its layers."""
        ray = _ray()
        dead = self._dead_stages() or list(range(len(self.actors)))
        hung = isinstance(exc, ray.exceptions.GetTimeoutError)
        reason = f"no answer within {STEP_TIMEOUT_S:.0f} s" if hung else "its process died"
        restarted = True
        for i in dead:
            ray.kill(self.actors[i], no_restart=True)
            self.actors[i] = self._start(i)
        try:
            placed = ray.get([self.actors[i].ready.remote() for i in dead], timeout=120)
            for i, where in zip(dead, placed, strict=True):
                self.placed[i] = where
        except Exception:  # the stage cannot come back (its node is gone): the next step says so again
            restarted = False
        return StageFailed(dead[0], reason, restarted)

    def memory(self) -> list[dict]:
        ray = _ray()
        return ray.get([a.memory.remote() for a in self.actors])

    def close(self) -> None:
        if not _ray_loaded():
            return
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self._group)
        if self._owns_ray:
            ray.shutdown()


def _ray_loaded() -> bool:
    import sys

    return "ray" in sys.modules


def open_stages(
    folder: str | os.PathLike,
    *,
    num_blocks: int | None,
    budget: int,
    block_size: int,
    providers: Sequence[Any] | None,
    sess_options: Any,
    executor: str,
    ray_address: str | None,
    placement: str,
    paged_attention: str | None = None,
) -> tuple[Any, FolderFacts]:
    """The executor of a stage folder for :class:`~ortpa.runtime.engine.Engine`: ``"ray"`` (a Ray actor per
    stage) or ``"local"`` (every stage in this process, :class:`~ortpa.runtime.stage_chain.StageChain`). A byte
    ``budget`` is divided by the bytes one block costs over every stage's caches (the engine's one pool)."""
    from ortpa.errors import InvalidParameter, InvalidRequest
    from ortpa.runtime.stage_chain import StageChain
    from ortpa.runtime.stage_folder import read_stage_folder

    manifest = read_stage_folder(folder)
    facts = folder_facts(manifest, block_size)
    if num_blocks is None:
        num_blocks = budget // max(1, facts.bytes_per_block)
    if num_blocks < 1:
        raise InvalidRequest(f"Engine: the KV pool must hold at least 1 block, found num_blocks={num_blocks}")
    if executor == "local":
        chain = StageChain(
            manifest,
            num_blocks=num_blocks,
            block_size=block_size,
            providers=providers,
            sess_options=sess_options,
            paged_attention=paged_attention,
        )
        return chain, facts
    if executor != "ray":
        raise InvalidParameter("Engine", "stages", "'ray' or 'local'", executor)
    if placement not in ("pack", "spread", "strict-spread"):
        raise InvalidParameter("Engine", "placement", "'pack', 'spread' or 'strict-spread'", placement)
    threads = getattr(sess_options, "intra_op_num_threads", 0) or None  # SessionOptions do not pickle
    pipeline = RayPipeline(
        manifest,
        num_blocks=num_blocks,
        block_size=block_size,
        providers=providers,
        ray_address=ray_address,
        placement=placement,
        threads=threads,
        paged_attention=paged_attention,
    )
    return pipeline, facts
