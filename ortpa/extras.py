"""The optional extras (``pip install 'ortpa[NAME]'``) as data: which packages each brings, and one check.

Checked with ``importlib.util.find_spec``, which finds a package without importing it: a guard that imported a
module of ortpa's instead would pass whenever that module imports the extra lazily, and the missing package would
surface later as a traceback.
"""

from __future__ import annotations

import importlib.util

from ortpa.errors import MissingExtra

__all__ = ["EXTRAS", "extra_providing", "require_extra"]

# pyproject.toml's [project.optional-dependencies], by import name
EXTRAS: dict[str, tuple[str, ...]] = {
    "export": ("torch", "transformers", "tokenizers", "safetensors"),
    "serve": ("fastapi", "uvicorn", "prometheus_client", "jinja2", "tokenizers", "llguidance"),
    "pipeline": ("ray",),
    "text": ("tokenizers",),
    "test": ("pytest", "hypothesis", "openai", "jsonschema"),
}


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent that fails to import, or a module stubbed out as None
        return False


def require_extra(extra: str, what: str) -> None:
    """:class:`~ortpa.errors.MissingExtra` naming ``what`` needs the extra when any of its packages is missing."""
    missing = [p for p in EXTRAS[extra] if not _installed(p)]
    if missing:
        raise MissingExtra(what, extra, missing)


def extra_providing(module_name: str | None) -> str | None:
    """The extra that installs the top-level package of ``module_name`` (``ModuleNotFoundError.name``), if any."""
    top = (module_name or "").split(".")[0]
    # the narrowest extra first: tokenizers alone is the text extra's
    return next((e for e in sorted(EXTRAS, key=lambda e: len(EXTRAS[e])) if top in EXTRAS[e]), None)
