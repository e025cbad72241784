"""``genai_config.json`` for a converted model: the folder onnxruntime-genai's continuous-batching Engine serves.

Built from, in order of trust: the source's own ``genai_config.json`` (token ids, search defaults, context length,
model type), else its Hugging Face ``config.json`` / ``generation_config.json``, else what the written graph says
(layers, heads, head size and vocabulary from the cache inputs and the ``logits`` output). The paged parts always
come from the written graph: the decoder's inputs and outputs under their paged names, one ``paged_kv`` state group
over every layer, and the head count and head size genai allocates each key and value cache with
(``[num_blocks, block_size, num_key_value_heads, head_size]``; a split-latent file's caches are half the latent
width each, see :mod:`ortpa.deploy.portable_file`).

``engine.dynamic_batching`` turns genai's continuous batching on: ``block_size``; for a portable (CPU / any EP)
file ``num_blocks`` sized from a stated byte budget (genai cannot size a CPU pool itself: ``std::bad_alloc`` or
"budget too small"), never more than ``max_batch_size`` full-context sequences need; for a native file (the
CUDA kernel) ``gpu_utilization_factor``; ``max_batch_size`` and ``max_scheduled_tokens`` (a small value gives
chunked prefill). Provider options: ``cuda`` for the native file, none (CPU) for a portable one.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from ortpa.errors import ConversionError
from ortpa.runtime.model_io import cache_bytes_per_block, rotary_table_rows
from ortpa.runtime.session import find_cache_aliases

__all__ = ["DEFAULT_KV_BUDGET_BYTES", "GENAI_MODEL_TYPES", "GenaiOptions", "build_genai_config", "write_genai_config"]

DEFAULT_KV_BUDGET_BYTES = 256 << 20  # the KV pool a portable file's genai_config.json asks for (as ortpa's Engine)
# model types onnxruntime-genai 0.18 runs as a plain decoder-only LLM; any other family (DeepSeek, MiniCPM3, ...)
# is written as "llama": for a paged model genai's model type only picks that decoder loop, the graph does the rest
GENAI_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "phi", "phi3", "phimoe", "gemma", "gemma2", "granite", "olmo", "nemotron"}
)
_CACHE_NAME = re.compile(r"past_key_values\.(\d+)\.(key|value)$")


@dataclass(frozen=True)
class GenaiOptions:
    """The ``engine.dynamic_batching`` section and its pool size (see the module docstring)."""

    block_size: int = 16
    max_batch_size: int = 16
    max_scheduled_tokens: int = 256
    kv_budget_bytes: int = DEFAULT_KV_BUDGET_BYTES  # portable files: num_blocks = budget // bytes per block
    num_blocks: int | None = None  # portable files: overrides the budget
    gpu_utilization_factor: float = 0.6  # native (CUDA) files

    def check(self) -> None:
        """genai's own rules (its builder mirrors ORT's CheckInputs): one line naming the bad value."""
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ConversionError(f"genai block_size: expected a power of two >= 16, found {self.block_size}")
        if not 1 <= self.max_batch_size <= 256:
            raise ConversionError(f"genai max_batch_size: expected 1..256, found {self.max_batch_size}")
        if self.max_scheduled_tokens < 1:
            raise ConversionError(f"genai max_scheduled_tokens: expected >= 1, found {self.max_scheduled_tokens}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConversionError(f"genai num_blocks: expected >= 1, found {self.num_blocks}")
        if not 0 < self.gpu_utilization_factor <= 1:
            raise ConversionError(
                f"genai gpu_utilization_factor: expected a value in (0, 1], found {self.gpu_utilization_factor}"
            )


def _read_json(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConversionError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class _GraphFacts:
    layers: list[int]
    key_names: bool
    value_names: bool
    num_heads: int | None
    kv_heads: int
    head_size: int
    vocab: int | None
    inputs: list[str]
    rotary_rows: int | None
    bytes_per_block: int


def _graph_facts(proto: onnx.ModelProto, block_size: int, portable: dict | None) -> _GraphFacts:
    caches: dict[int, dict[str, onnx.ValueInfoProto]] = {}
    others = []
    for vi in proto.graph.input:
        m = _CACHE_NAME.match(vi.name)
        if m:
            caches.setdefault(int(m.group(1)), {})[m.group(2)] = vi
        else:
            others.append(vi.name)
    if not caches:
        raise ConversionError("genai_config: expected cache inputs past_key_values.{i}.key in the written model")
    first = caches[min(caches)]["key"].type.tensor_type.shape.dim
    if len(first) != 4 or not (first[2].HasField("dim_value") and first[3].HasField("dim_value")):
        raise ConversionError("genai_config: expected cache inputs [num_blocks, block_size, kv_heads, head_size]")
    num_heads = portable.get("num_heads") if portable else None
    if num_heads is None:
        for node in proto.graph.node:
            if node.op_type == "PagedAttention":
                num_heads = next((a.i for a in node.attribute if a.name == "num_heads"), None)
                break
    logits = next((o for o in proto.graph.output if o.name == "logits"), None)
    vocab = None
    if logits is not None:
        dims = logits.type.tensor_type.shape.dim
        vocab = dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None
    names = {a.input_name for a in find_cache_aliases(proto)}
    return _GraphFacts(
        layers=sorted(caches),
        key_names=all("key" in c for c in caches.values()),
        value_names=all("value" in c for c in caches.values()),
        num_heads=num_heads,
        kv_heads=first[2].dim_value,
        head_size=first[3].dim_value,
        vocab=vocab,
        inputs=others,
        rotary_rows=rotary_table_rows(proto),
        bytes_per_block=cache_bytes_per_block(proto, names, block_size) if names else 0,
    )


def _ids(value: Any) -> int | list[int] | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return value[0] if len(value) == 1 else value
    return None


def build_genai_config(
    proto: onnx.ModelProto,
    filename: str,
    *,
    portable: bool,
    source_folder: Path | None = None,
    options: GenaiOptions | None = None,
    portable_meta: dict | None = None,
) -> dict:
    """The genai_config.json object for the written paged model ``proto`` (graph only; weights not needed)."""
    options = options or GenaiOptions()
    options.check()
    src_genai = _read_json(source_folder / "genai_config.json") if source_folder else {}
    hf = _read_json(source_folder / "config.json") if source_folder else {}
    gen = _read_json(source_folder / "generation_config.json") if source_folder else {}
    hf_text = hf.get("text_config", hf) if isinstance(hf.get("text_config"), dict) else hf
    src_model = src_genai.get("model", {}) if isinstance(src_genai.get("model"), dict) else {}
    src_decoder = src_model.get("decoder", {}) if isinstance(src_model.get("decoder"), dict) else {}
    facts = _graph_facts(proto, options.block_size, portable_meta)

    def first(*values):
        return next((v for v in values if v is not None), None)

    num_heads = first(facts.num_heads, src_decoder.get("num_attention_heads"), hf_text.get("num_attention_heads"))
    hidden = first(src_decoder.get("hidden_size"), hf_text.get("hidden_size"))
    if hidden is None and num_heads is not None:
        hidden = num_heads * facts.head_size
    meta = {p.key: p.value for p in proto.metadata_props}
    context = first(
        src_model.get("context_length"),
        hf_text.get("max_position_embeddings"),
        int(meta["max_position_embeddings"]) if meta.get("max_position_embeddings", "").isdigit() else None,
        facts.rotary_rows,
        4096,
    )
    if facts.rotary_rows is not None:
        context = min(int(context), facts.rotary_rows)
    model_type = src_model.get("type") or hf_text.get("model_type") or "llama"
    if model_type not in GENAI_MODEL_TYPES:
        model_type = "llama"
    eos = first(_ids(src_model.get("eos_token_id")), _ids(gen.get("eos_token_id")), _ids(hf_text.get("eos_token_id")))
    bos = first(_ids(src_model.get("bos_token_id")), _ids(gen.get("bos_token_id")), _ids(hf_text.get("bos_token_id")))
    pad = first(_ids(src_model.get("pad_token_id")), _ids(gen.get("pad_token_id")), _ids(hf_text.get("pad_token_id")))
    if isinstance(pad, list):
        pad = pad[0]
    if pad is None:  # genai requires one; an EOS id is what HF generation pads with when none is set
        pad = eos[0] if isinstance(eos, list) else eos
    vocab = first(facts.vocab, src_model.get("vocab_size"), hf_text.get("vocab_size"))

    inputs: dict[str, str] = {"input_ids": "input_ids"}
    for name in ("block_table", "cumulative_sequence_lengths", "past_sequence_lengths", "attention_metadata"):
        if name in facts.inputs:
            inputs[name] = name
    if "position_ids" in facts.inputs:
        inputs["position_ids"] = "position_ids"
    inputs["past_key_names"] = "past_key_values.%d.key"
    outputs = {"logits": "logits", "present_key_names": "present.%d.key"}
    if facts.value_names:
        inputs["past_value_names"] = "past_key_values.%d.value"
        outputs["present_value_names"] = "present.%d.value"

    decoder = {
        "session_options": {
            "log_id": "onnxruntime-genai",
            "provider_options": [] if portable else [{"cuda": {}}],
        },
        "filename": filename,
        "head_size": facts.head_size,
        "hidden_size": hidden,
        "inputs": inputs,
        "outputs": outputs,
        "num_attention_heads": num_heads,
        "num_hidden_layers": len(facts.layers),
        "num_key_value_heads": facts.kv_heads,
        "state_groups": [{"kind": "paged_kv", "layer_ids": facts.layers}],
    }
    model: dict[str, Any] = {
        "bos_token_id": bos,
        "context_length": int(context),
        "decoder": decoder,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "type": model_type,
        "vocab_size": vocab,
    }
    model = {k: v for k, v in model.items() if v is not None}

    src_search = src_genai.get("search", {}) if isinstance(src_genai.get("search"), dict) else {}
    search = {
        "diversity_penalty": 0.0,
        "do_sample": bool(gen.get("do_sample", False)),
        "early_stopping": True,
        "length_penalty": 1.0,
        "max_length": int(context),
        "min_length": 0,
        "no_repeat_ngram_size": 0,
        "num_beams": 1,
        "num_return_sequences": 1,
        "past_present_share_buffer": True,
        "repetition_penalty": 1.0,
        "temperature": float(gen.get("temperature", 1.0)),
        "top_k": int(gen.get("top_k", 50) or 50),
        "top_p": float(gen.get("top_p", 1.0)),
    }
    for key in ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "length_penalty"):
        if key in src_search:
            search[key] = src_search[key]
    search["max_length"] = min(int(src_search.get("max_length", context)), int(context))
    search["num_beams"] = 1  # the Engine decodes one beam per request
    search["past_present_share_buffer"] = True

    batching: dict[str, Any] = {"block_size": options.block_size, "max_batch_size": options.max_batch_size}
    if portable:
        batching["num_blocks"] = _num_blocks(options, facts, int(context))
    else:
        batching["gpu_utilization_factor"] = options.gpu_utilization_factor
    batching["max_scheduled_tokens"] = options.max_scheduled_tokens
    return {"model": model, "search": search, "engine": {"dynamic_batching": batching}}


def _num_blocks(options: GenaiOptions, facts: _GraphFacts, context: int) -> int:
    if options.num_blocks is not None:
        return options.num_blocks
    per_block = max(1, facts.bytes_per_block)
    enough = options.max_batch_size * math.ceil(context / options.block_size)  # every slot at full context
    blocks = min(options.kv_budget_bytes // per_block, enough)
    if blocks < 1:
        raise ConversionError(
            f"genai kv budget: {options.kv_budget_bytes} bytes hold no block of {per_block} bytes; "
            "expected a budget of at least one block"
        )
    return int(blocks)


def write_genai_config(
    model_path: str | os.PathLike,
    *,
    portable: bool,
    source_folder: Path | None = None,
    options: GenaiOptions | None = None,
    portable_meta: dict | None = None,
) -> Path:
    """Write ``genai_config.json`` beside ``model_path`` (atomically, replacing a copied dense one); its path."""
    model_path = Path(model_path)
    proto = onnx.load(str(model_path), load_external_data=False)
    config = build_genai_config(
        proto,
        model_path.name,
        portable=portable,
        source_folder=source_folder,
        options=options,
        portable_meta=portable_meta,
    )
    dest = model_path.parent / "genai_config.json"
    fd, tmp = tempfile.mkstemp(prefix=".genai_config.json.", suffix=".tmp", dir=model_path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=4)
            f.write("\n")
        os.chmod(tmp, os.stat(model_path).st_mode & 0o666)  # as readable as the model, not mkstemp's 0600
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest
