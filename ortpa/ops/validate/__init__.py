"""ONNX Runtime's PagedAttention input checks, rule by rule, in the kernel's order and with its wording.

:func:`check_inputs` raises :class:`ortpa.errors.InvalidArgument` for the first broken rule, exactly as the
kernel stops at its first failing check, and otherwise returns the derived
:class:`~ortpa.ops.params.PagedAttentionParams`. The order (reference ``paged_attention_facts.md``):

* ``type.*``   type binding at graph resolution (required inputs, attribute names/types, T / T_CACHE / S /
  T_KV_SCALE), in ONNX Runtime's "Type Error: ..." / "Type parameter (T) ... bound to different types" style;
* ``ctor.*``   the kernel constructor (§1.0): head counts, qk_norm_epsilon, quant types, cache dtypes, layout,
  v_head_size, rotary_offset;
* ``1.1.*`` … ``1.8.*``  ``paged_attention_helper::CheckInputs`` (§1.1–§1.8), numbered as the reference
  numbers its steps (``1.2.latent.3`` is step 3 of the LATENT Q/K check; ``a``/``b`` split a step with two
  messages); ``1.9.*`` the packed-INT4 (uint8) deltas of §1.9;
* ``1.10.*``   the ``ComputeInternal`` checks decidable on the host (§1.10.1, §1.10.5, §1.10.9).

:data:`RULES` maps every id to a one-line description; ids are stable. Inputs may be arrays or shape/dtype
stand-ins (:class:`TensorInfo`) whose dimensions are ``None`` or strings when symbolic. A rule that needs an
unknown dimension never raises: it is appended to ``unchecked`` as ``(rule_id, reason)`` and the values it
would have derived stay ``None``.

The package is split by topic; this module re-exports its public API:

* :mod:`.rules`      the rule table :data:`RULES` (id -> description);
* :mod:`.checks`     :class:`TensorInfo`, shape reading and the rule recorder shared by every rule module;
* :mod:`.dtypes`     :func:`dtype_name` and ONNX Runtime's type spellings;
* :mod:`.signature`  graph resolution: :func:`check_signature` and :func:`check_types` (``type.*``);
* :mod:`.attrs`      attribute parsing and the kernel constructor (``ctor.*``);
* :mod:`.heads`      §1.1–§1.3 head counts, Q/K/V mode, v_head_size and scale;
* :mod:`.cache`      §1.4–§1.6 layout constraints, ``CheckKVCache``, sequence tensors and block table;
* :mod:`.extras`     §1.7 head_sink, QK norm, rotary caches, rotary_offset;
* :mod:`.quant`      §1.8.1–§1.8.8 and §1.9.1 quantization and cache dtypes;
* :mod:`.compute`    §1.8.9 and §1.10 attention_metadata and the host-decidable ``ComputeInternal`` checks;
* :mod:`.inputs`     :func:`check_inputs`, which runs them all in order.
"""

from __future__ import annotations

from typing import Any

from ortpa.ops.validate.checks import TensorInfo
from ortpa.ops.validate.dtypes import dtype_name
from ortpa.ops.validate.inputs import check_inputs
from ortpa.ops.validate.rules import RULES
from ortpa.ops.validate.signature import check_signature, check_types

__all__ = [
    "RULES",
    "TensorInfo",
    "check_inputs",
    "check_signature",
    "check_types",
    "dtype_name",
    "validate",
    "validate_model",
]


def validate_model(model: Any, backend: str | None = None, revision: str | None = None):
    """Validate every PagedAttention node of ``model``; see :func:`ortpa.ops.node_check.validate_model`."""
    from ortpa.ops.node_check import validate_model as _validate_model  # node_check imports this package

    return _validate_model(model, backend=backend, revision=revision)


validate = validate_model
