"""Moved to :mod:`ortpa.ops.validate.model` (re-exported by :mod:`ortpa.ops.validate`); this alias keeps old
imports working and imports only in that direction, so there is no cycle. Import from ``ortpa.ops.validate``."""

from __future__ import annotations

from ortpa.ops.validate.model import (
    SCHEMA_RULES,
    NodeReport,
    ValidationReport,
    check_schema,
    load_model,
    validate,
    validate_backends,
    validate_model,
)

__all__ = [
    "SCHEMA_RULES",
    "NodeReport",
    "ValidationReport",
    "check_schema",
    "load_model",
    "validate",
    "validate_backends",
    "validate_model",
]
