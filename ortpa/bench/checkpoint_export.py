"""``ortpa convert HF_DIR OUT`` from checkpoints of growing size: peak private memory and seconds per GB (issue 37).

Each checkpoint is written by :func:`ortpa.testing.checkpoints.write_random_checkpoint` (random weights, sharded
safetensors, one shard in memory at a time): a Llama-style model (hidden 2048, 16 heads over 4 KV heads, intermediate
5632, vocab 32000, tied embeddings; ~0.2 GB of bfloat16 weights a layer) and a DeepSeek-V3-style MLA model with MoE
layers (hidden 1024, 8 heads, q LoRA 384, kv LoRA 256, 16 routed experts of 512 and one shared; layer 0 dense), in
bfloat16 and in FP8 with 128x128 block scales; ``llama-wide`` (asked for by name: hidden 6144, 48 heads over 8,
intermediate 16384, untied; ~0.78 GB of bfloat16 a layer) for a checkpoint larger than memory. Layers are added until
the folder reaches the size asked for (quick: 0.5 GB; full: 0.5 and 2 GB). The ``ortpa convert`` child (verification
included) is sampled every 20 ms for its anonymous RSS (private memory: memory-mapped weights the kernel can drop do not
count), against the target: the largest tensor + 1.5 GB.

Rows ``checkpoint/<family>-<dtype>/<size>``: ``peak_rss_anon`` (MB), ``convert_seconds``, ``seconds_per_gb`` (of
the checkpoint's bytes) and ``largest_tensor`` (MB, as exported).

Then, at the smallest size and in bfloat16, ``ortpa convert HF_DIR OUT --stages N`` (``stages``, default 2; 0: not
run; ``plain=False``: only these), the stage folder written during the export
(:mod:`ortpa.conversion.staged`), rows ``checkpoint-stages<N>/<family>-<dtype>/<size>``: ``peak_rss_anon``,
``convert_seconds``, ``peak_disk`` (MB allocated under the output's folder, staging included, sampled every 0.1 s)
against ``stage_files`` (MB of the published stage folder), and ``unsplit_files`` (files other than the stage folder
left in the output's folder: 0).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from ortpa.bench._timing import row as _row

__all__ = ["CONFIGS", "EXTRAS", "measure", "measure_stages", "run"]

EXTRAS = ("export",)
_MB = 1e6

LLAMA = dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
DSV3 = dict(model_type="deepseek_v3", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
            moe_intermediate_size=512, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384,
            kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, first_k_dense_replace=1,
            n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
            max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
# larger than this 2-core machine's 25 GB of memory at 26 GB (33 layers of ~0.78 GB of bfloat16): asked for by name
LLAMA_WIDE = dict(model_type="llama", vocab_size=32000, hidden_size=6144, intermediate_size=16384,
                  num_attention_heads=48, num_key_value_heads=8, max_position_embeddings=4096,
                  tie_word_embeddings=False)  # fmt: skip
CONFIGS = {"llama": LLAMA, "dsv3-moe": DSV3, "llama-wide": LLAMA_WIDE}
_DEFAULT_FAMILIES = ("llama", "dsv3-moe")
_SIZES_GB = (0.5, 2.0)


def _layers_for(config: dict, gigabytes: float, fp8: bool) -> int:
    """The layer count whose checkpoint reaches ``gigabytes`` (measured on 1 and 2 layers, then extrapolated)."""
    from ortpa.testing.checkpoints import checkpoint_bytes

    one, two = (checkpoint_bytes({**config, "num_hidden_layers": n}, fp8=fp8) for n in (2, 3))
    per_layer = two - one
    return max(2, 2 + round((gigabytes * 1e9 - one) / per_layer))


def measure(family: str, fp8: bool, gigabytes: float, root: Path) -> list[dict]:
    from ortpa.bench.convert import _peak_anon
    from ortpa.testing.checkpoints import write_random_checkpoint

    config = {**CONFIGS[family], "num_hidden_layers": _layers_for(CONFIGS[family], gigabytes, fp8)}
    folder = root / "ckpt"
    size = write_random_checkpoint(config, folder, fp8=fp8)
    largest = _largest_exported(config)
    child = (
        "import sys, time; from ortpa.cli import main; t0 = time.perf_counter(); "
        "rc = main(['convert', sys.argv[1], sys.argv[2], '--quiet']); print(time.perf_counter() - t0); sys.exit(rc)"
    )
    name = f"checkpoint/{family}-{'fp8' if fp8 else 'bf16'}/{gigabytes:g}GB"
    note = f"{config['num_hidden_layers']} layers, {size / 1e9:.2f} GB on disk"
    cmd = [sys.executable, "-c", child, str(folder), str(root / "out" / "model.onnx")]
    try:
        seconds, peak, out = _peak_anon(cmd, 7200)
    except RuntimeError as exc:  # a refused conversion (e.g. verification): said in the table, the others still run
        return [_row(name, "failed", 1, "", f"{note}: {str(exc).splitlines()[-1][-300:]}")]
    seconds = float(out.splitlines()[-1]) if out else seconds
    target = largest / _MB + 1500
    return [
        _row(name, "peak_rss_anon", peak, "MB", f"{note}; target <= {target:.0f} MB (largest tensor + 1.5 GB)"),
        _row(name, "convert_seconds", seconds, "s", f"{note}; export, rewrite, write, check, verify"),
        _row(name, "seconds_per_gb", seconds / (size / 1e9), "s/GB", note),
        _row(name, "largest_tensor", largest / _MB, "MB", "float16, as exported"),
    ]


def _allocated(folder: Path) -> int:
    """Bytes the file system holds for everything under ``folder`` (files vanishing mid-walk skipped)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def measure_stages(family: str, fp8: bool, gigabytes: float, root: Path, stages: int) -> list[dict]:
    """``ortpa convert HF_DIR OUT --stages N``: memory, time and disk (see the module docstring)."""
    from ortpa.bench.convert import _peak_anon
    from ortpa.testing.checkpoints import write_random_checkpoint

    config = {**CONFIGS[family], "num_hidden_layers": _layers_for(CONFIGS[family], gigabytes, fp8)}
    folder = root / "ckpt"
    size = write_random_checkpoint(config, folder, fp8=fp8)
    largest = _largest_exported(config)
    out = root / "out"
    out.mkdir()
    child = (
        "import sys, time; from ortpa.cli import main; t0 = time.perf_counter(); "
        f"rc = main(['convert', sys.argv[1], sys.argv[2], '--quiet', '--stages', '{stages}']); "
        "print(time.perf_counter() - t0); sys.exit(rc)"
    )
    name = f"checkpoint-stages{stages}/{family}-{'fp8' if fp8 else 'bf16'}/{gigabytes:g}GB"
    note = f"{config['num_hidden_layers']} layers, {size / 1e9:.2f} GB on disk"
    peak_disk = 0
    done = threading.Event()

    def sample_disk() -> None:
        nonlocal peak_disk
        while not done.is_set():
            peak_disk = max(peak_disk, _allocated(out))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample_disk, daemon=True)
    sampler.start()
    try:
        seconds, peak, printed = _peak_anon([sys.executable, "-c", child, str(folder), str(out / "model.onnx")], 7200)
    except RuntimeError as exc:
        return [_row(name, "failed", 1, "", f"{note}: {str(exc).splitlines()[-1][-300:]}")]
    finally:
        done.set()
        sampler.join()
    seconds = float(printed.splitlines()[-1]) if printed else seconds
    published = out / "model.onnx.stages"
    stage_bytes = sum(p.stat().st_size for p in published.iterdir() if p.name.startswith("stage_"))
    others = [p.name for p in out.iterdir() if p != published]
    target = largest / _MB + 1500
    return [
        _row(name, "peak_rss_anon", peak, "MB", f"{note}; target <= {target:.0f} MB (largest tensor + 1.5 GB)"),
        _row(name, "convert_seconds", seconds, "s", f"{note}; export into stages, rewrite, check, verify, proof"),
        _row(name, "peak_disk", peak_disk / _MB, "MB", "allocated under the output's folder, staging included"),
        _row(name, "stage_files", stage_bytes / _MB, "MB", "the published stage folder's models and data"),
        _row(name, "unsplit_files", len(others), "", ", ".join(others) or "none: no unsplit model written"),
    ]


def _largest_exported(config: dict) -> int:
    """The largest parameter of the model in float16 (what the export streams), in bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    return max(p.numel() * 2 for p in model.parameters())


def run(
    quick: bool = False,
    sizes: tuple[float, ...] | None = None,
    families: tuple[str, ...] | None = None,
    stored: tuple[str, ...] = ("bf16", "fp8"),
    stages: int = 2,
    plain: bool = True,
) -> list[dict]:
    rows: list[dict] = []
    chosen = sizes or (_SIZES_GB[:1] if quick else _SIZES_GB)
    for gigabytes in chosen if plain else ():
        for family in families or _DEFAULT_FAMILIES:
            for fp8 in [kind == "fp8" for kind in stored]:
                root = Path(tempfile.mkdtemp(prefix="ortpa-bench-checkpoint-"))
                try:
                    rows += measure(family, fp8, gigabytes, root)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
    if stages and "bf16" in stored:
        for family in families or _DEFAULT_FAMILIES:
            root = Path(tempfile.mkdtemp(prefix="ortpa-bench-checkpoint-"))
            try:
                rows += measure_stages(family, False, min(chosen), root, stages)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    return rows


if __name__ == "__main__":
    from ortpa.bench import format_table

    # python -m ortpa.bench.checkpoint_export [0.5GB 2GB] [llama dsv3-moe llama-wide] [bf16 fp8] [--quick]
    #     [--stages N] [--only-stages]
    # larger than memory: python -m ortpa.bench.checkpoint_export 26GB llama-wide bf16 --stages 4 --only-stages
    args = sys.argv[1:]
    staged = int(args[args.index("--stages") + 1]) if "--stages" in args else 2
    wanted = tuple(float(a.removesuffix("GB")) for a in args if a.endswith("GB"))
    families = tuple(a for a in args if a in CONFIGS) or None
    stored = tuple(a for a in args if a in ("bf16", "fp8")) or ("bf16", "fp8")
    print(
        format_table(
            run(
                quick="--quick" in args,
                sizes=wanted or None,
                families=families,
                stored=stored,
                stages=staged,
                plain="--only-stages" not in args,
            )
        )
    )
