"""The export tools people use, run on a random-weight Hugging Face folder: one place for the fixture script
(``scripts/make_fixtures_formats.py``) and the sweep's tool axis (``python -m ortpa.testing.sweep --tool T``).

The tools cannot share one environment, so each runs in its own venv, and this module is imported there: it
imports only the standard library at the top, and the tool's packages inside the function that runs it.

* ``genai``: onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder``, ``-p fp32 |
  fp16 | int4``, ``-e cpu``), in a venv with onnxruntime-genai (which pulls its ``onnxruntime``) and onnx-ir,
  torch / transformers 5 / onnx reached through a ``.pth`` file naming ortpa's site-packages.
* ``optimum``: ``optimum-cli export onnx --task text-generation-with-past``, in a venv with optimum-onnx and
  ``transformers<4.58`` (it pins it), torch and onnx through the same ``.pth`` (the venv's own transformers comes
  first).
* ``onnx_exporter``: transformers 5's ``OnnxExporter.export_for_generation`` (the decode model), in ortpa's own
  environment (the ``export`` extra).
* ``ortpa``: :func:`ortpa.export.hf.export_hf` (``torch.onnx.export(dynamo=True)``), ortpa's environment.

``scripts/make_tool_venvs.sh`` builds the two venvs (network for pip only); :func:`tool_python` finds them.
In a tool's venv, ``python -m ortpa.testing.export_tools TOOL CONFIG_JSON WORK [--precision P] ...`` builds the
folder from a config (the tool's own transformers reads it: configs in transformers 5's spelling are written in
the legacy one where that transformers is 4.x) and exports it, printing one JSON line (the model path, the
command, the versions). A config the tool's transformers cannot build (:func:`host_built`) is built here, with
ortpa's transformers 5, its ``config.json`` rewritten in the tool's spelling, and the tool only exports it
(``--prebuilt``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "TOOLS",
    "UNK",
    "Export",
    "build_hf_dir",
    "build_host_folder",
    "export",
    "export_in_venv",
    "host_built",
    "legacy_config",
    "tool_python",
    "write_legacy_config",
]

BOS, EOS, PAD, UNK = 1, 2, 0, 3
TOOLS = ("genai", "optimum", "onnx_exporter", "ortpa")
# the venv each tool runs in (None: the current interpreter), overridable by ORTPA_TOOL_PYTHON_<TOOL>
_VENVS = {"genai": "/tmp/ortpa-tool-genai", "optimum": "/tmp/ortpa-tool-optimum"}
# the packages whose versions an export records
PACKAGES = {
    "genai": ["onnxruntime-genai", "onnxruntime", "torch", "transformers", "onnx"],
    "optimum": ["optimum-onnx", "optimum", "onnxruntime", "torch", "transformers", "onnx"],
    "onnx_exporter": ["transformers", "torch", "onnxscript", "onnx"],
    "ortpa": ["torch", "transformers", "onnxscript", "onnx"],
}
_TORCH_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Export:
    """What a tool wrote: the dense model file, the folder a user hands to ``ortpa convert``, how it was made."""

    model: Path
    folder: Path
    command: list[str]
    extras: dict[str, Path]  # companion files a fixture keeps (suffix -> path)

    def to_dict(self) -> dict:
        return {
            "model": str(self.model),
            "folder": str(self.folder),
            "command": self.command,
            "extras": {k: str(v) for k, v in self.extras.items()},
        }


def tool_python(tool: str) -> str:
    """The interpreter ``tool`` runs in: ``$ORTPA_TOOL_PYTHON_<TOOL>``, else its venv under /tmp, else this one."""
    env = os.environ.get(f"ORTPA_TOOL_PYTHON_{tool.upper()}")
    if env:
        return env
    if tool in _VENVS:
        python = Path(_VENVS[tool]) / "bin" / "python"
        if not python.exists():
            raise FileNotFoundError(
                f"no venv for the {tool} tool: expected {python} (scripts/make_tool_venvs.sh builds it) or "
                f"ORTPA_TOOL_PYTHON_{tool.upper()} naming its python"
            )
        return str(python)
    return sys.executable


# ------------------------------------------------------------------------------------------------ HF folder
def legacy_config(cfg: dict) -> dict:
    """``cfg`` in transformers 4.x's spelling: ``rope_parameters`` as ``rope_theta`` / ``rope_scaling`` (and
    Gemma-3's per-layer-type dict as ``rope_local_base_freq``); transformers 5 reads this spelling too."""
    cfg = dict(cfg)
    rope = cfg.pop("rope_parameters", None)
    if not rope:
        return cfg
    if "rope_type" not in rope:  # per layer type (Gemma-3): the full layers' scaling, the sliding ones' base
        local = rope.get("sliding_attention") or {}
        if "rope_theta" in local:
            cfg["rope_local_base_freq"] = local["rope_theta"]
        rope = rope.get("full_attention") or {}
    rope = dict(rope)
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:  # transformers 5 saves it inside rope_parameters, 4.x reads it at the top
        cfg.setdefault("partial_rotary_factor", rope.pop("partial_rotary_factor"))
    kind = rope.pop("rope_type", "default")
    if kind != "default":  # 4.x's YaRN check wants rope_type; its Phi-3 LongRoPE exactly type and the two factors
        named = {"type": kind} if kind == "longrope" else {"rope_type": kind, "type": kind}
        cfg["rope_scaling"] = {**named, **rope}
    return cfg


def host_built(tool: str, cfg: dict) -> str | None:
    """Why ``tool``'s own transformers cannot build ``cfg`` from a config (then ortpa's transformers 5 saves the
    folder, in the tool's config spelling), or None. transformers 4.57's StableLM ``_init_weights`` zeroes every
    LayerNorm's bias, and the per-head q/k LayerNorms of ``qk_layernorm`` have none (``AttributeError``); loading
    a saved folder, whose weights are all present, initializes nothing."""
    if tool == "optimum" and cfg.get("model_type") == "stablelm" and cfg.get("qk_layernorm"):
        return "transformers 4.57 cannot initialize StableLM's bias-less per-head q/k LayerNorms"
    return None


def build_host_folder(cfg: dict, out: Path, *, seed: int = 0, dtype: str = "float32") -> None:
    """:func:`build_hf_dir` with this interpreter's transformers (5.x: a :func:`host_built` config), then its saved
    ``config.json`` rewritten in transformers 4.x's spelling (:func:`legacy_config`) for the tool to read."""
    build_hf_dir(cfg, out, seed=seed, dtype=dtype, legacy=True)


def _randomise(model, seed: int) -> None:
    """The weight draw of ``ortpa.export.build_model``: unit-scale activations, so greedy tokens are not ties."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5)


def _tokenizer(vocab: int):
    """A word-level tokenizer over ``vocab`` tokens, built offline (the genai builder copies one beside the model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": UNK}
    words.update({f"t{i}": i for i in range(4, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def build_hf_dir(
    cfg: dict,
    out: Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    legacy: bool = False,
) -> None:
    """Save a seeded random-weight causal LM (safetensors in ``dtype``) and a tokenizer to ``out``, with this
    environment's transformers (the legacy config spelling where it is 4.x). ``legacy``: write ``config.json`` in
    the legacy spelling whatever transformers saved it, as checkpoints on the Hub keep it (the genai builder reads
    Phi-3's LongRoPE from ``rope_scaling["type"]``, which transformers 5's ``rope_parameters`` lacks)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"checkpoint dtype {dtype!r}: expected one of {_TORCH_DTYPES}")
    cfg = dict(cfg) if int(transformers.__version__.split(".")[0]) >= 5 else legacy_config(cfg)
    for key, value in (("bos_token_id", BOS), ("eos_token_id", EOS), ("pad_token_id", PAD)):
        cfg.setdefault(key, value)  # the genai builder writes them into genai_config.json
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_config(config, **kwargs).float().eval()
    _randomise(model, seed)
    model.to(getattr(torch, dtype)).save_pretrained(str(out))
    _tokenizer(cfg["vocab_size"]).save_pretrained(str(out))
    if legacy:
        write_legacy_config(Path(out))


def write_legacy_config(folder: Path) -> None:
    """Rewrite ``folder/config.json`` in the legacy spelling (:func:`legacy_config`), as Hub checkpoints keep it."""
    saved = Path(folder) / "config.json"
    saved.write_text(json.dumps(legacy_config(json.loads(saved.read_text())), indent=2))


# ---------------------------------------------------------------------------------------------- the tools
def _run(cmd: list[str], log: Path) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}")


def _export_genai(hf: Path, work: Path, opts: dict) -> Export:
    out, cache = work / "out", work / "cache"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out)]
    cmd += ["-p", opts["precision"], "-e", opts.get("ep", "cpu"), "-c", str(cache)]
    if opts.get("paged"):
        cmd += ["--extra_options", "use_paged_attention=true"]
    _run(cmd, work / "builder.log")
    return Export(out / "model.onnx", out, cmd, {"genai_config.json": out / "genai_config.json"})


def _export_optimum(hf: Path, work: Path, opts: dict) -> Export:
    out = work / "out"
    cli = Path(sys.executable).with_name("optimum-cli")
    cmd = [str(cli), "export", "onnx", "--model", str(hf), "--task", "text-generation-with-past", str(out)]
    _run(cmd, work / "optimum.log")
    return Export(out / "model.onnx", out, cmd, {})


def _export_onnx_exporter(hf: Path, work: Path, opts: dict) -> Export:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.exporters import OnnxExporter
    from transformers.exporters.configs import OnnxConfig

    model = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True).float().eval()
    # The documented call: generate-style sample inputs (one prompt), a dynamic-shape export, multi-token decode
    # so that the decode model also prefills (on an empty cache).
    sample = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "attention_mask": torch.ones((1, 5), dtype=torch.long)}
    exported = OnnxExporter().export_for_generation(
        model, sample, OnnxConfig(dynamic=True, ort_fusions=None), multi_token_decode=True
    )
    out = work / "out"
    exported.save_pretrained(str(out))
    cmd = [
        "OnnxExporter().export_for_generation(model, {input_ids [1,5], attention_mask}, "
        "OnnxConfig(dynamic=True, ort_fusions=None), multi_token_decode=True).save_pretrained(out)  # decode.onnx"
    ]
    return Export(out / "decode.onnx", out, cmd, {})


def _export_ortpa(hf: Path, work: Path, opts: dict) -> Export:
    from ortpa.export.hf import export_hf

    path = work / "out" / "model.onnx"
    # random_weights=False: load the seeded folder, so the export has the folder's weights.
    export_hf(str(hf), path, random_weights=False, opset=18, attn_implementation=opts.get("attn", "sdpa"))
    return Export(path, path.parent, ["ortpa.export.export_hf(hf_dir, random_weights=False, opset=18)"], {})


_EXPORTERS = {
    "genai": _export_genai,
    "optimum": _export_optimum,
    "onnx_exporter": _export_onnx_exporter,
    "ortpa": _export_ortpa,
}


def export(tool: str, hf: Path, work: Path, opts: dict | None = None) -> Export:
    """Export the Hugging Face folder ``hf`` with ``tool``, in this interpreter, writing under ``work``.
    ``opts``: ``precision`` (genai: fp32 / fp16 / int4), ``ep`` and ``paged`` (genai), ``attn`` (ortpa)."""
    if tool not in _EXPORTERS:
        raise KeyError(f"unknown tool {tool!r}; expected one of {TOOLS}")
    return _EXPORTERS[tool](Path(hf), Path(work), dict(opts or {}))


def versions(packages: list[str]) -> dict[str, str]:
    """The installed version of each package (``not installed`` where absent), and Python's."""
    out = {"python": sys.version.split()[0]}
    for p in packages:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = "not installed"
    return out


def export_in_venv(
    tool: str,
    config: dict,
    work: Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    opts: dict | None = None,
    timeout: float = 1800,
) -> Export:
    """Build the folder of ``config`` and export it with ``tool``, in the tool's own interpreter
    (:func:`tool_python`): a failure raises ``RuntimeError`` with the tool's last lines."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(config))
    cmd = [tool_python(tool), "-m", "ortpa.testing.export_tools", tool, str(work / "config.json"), str(work)]
    cmd += ["--seed", str(seed), "--dtype", dtype, "--opts", json.dumps(opts or {})]
    if host_built(tool, config):
        build_host_folder(config, work / "hf", seed=seed, dtype=dtype)
        cmd.append("--prebuilt")
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # this ortpa, not an installed one
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    (work / "export.log").write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        last = tail[-1] if tail else ""  # the tool's own exception, first: reports keep a first line
        raise RuntimeError(f"the {tool} export failed (exit {proc.returncode}): {last}\n" + "\n".join(tail))
    done = json.loads(lines[-1])
    return Export(
        Path(done["model"]), Path(done["folder"]), done["command"], {k: Path(v) for k, v in done["extras"].items()}
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortpa.testing.export_tools", description=__doc__.splitlines()[0])
    ap.add_argument("tool", choices=TOOLS)
    ap.add_argument("config", help="a JSON file: the transformers config dict (with model_type)")
    ap.add_argument("work", help="the folder to write the checkpoint (hf/) and the export (out/) in")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=_TORCH_DTYPES, help="the checkpoint's stored dtype")
    ap.add_argument("--attn", default=None, help="attn_implementation of the saved model")
    ap.add_argument("--opts", default="{}", help="the tool's options as JSON (genai: precision)")
    ap.add_argument("--prebuilt", action="store_true", help="WORK/hf is already saved (host_built): export it only")
    ap.add_argument(
        "--build-only", action="store_true", help="save WORK/hf with this transformers in 4.x's spelling, no export"
    )
    args = ap.parse_args(argv)
    work = Path(args.work)
    config = json.loads(Path(args.config).read_text())
    if args.build_only:
        build_host_folder(config, work / "hf", seed=args.seed, dtype=args.dtype)
        return 0
    if not args.prebuilt:
        # the genai builder reads the legacy spelling (Phi-3 LongRoPE: rope_scaling["type"])
        legacy = args.tool == "genai"
        build_hf_dir(
            config, work / "hf", seed=args.seed, dtype=args.dtype, attn_implementation=args.attn, legacy=legacy
        )
    done = export(args.tool, work / "hf", work, json.loads(args.opts))
    print(json.dumps({**done.to_dict(), "versions": versions(PACKAGES[args.tool])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
