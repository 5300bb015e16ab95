"""The semantic layer: rules the sandbox's Python applies to its own calls, and their reports.

The in-sandbox half lives in ``sandbox_site/`` (standard library only, ``usercustomize.py`` in
the sandbox interpreter's user site directory); this package is the node agent's half.
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["compile_rules", "rules_from_plan", "rules_from_spec", "site_dir"]


@functools.cache
def site_dir() -> Path:
    """Directory holding the in-sandbox ``usercustomize.py`` (mounted read-only)."""
    return Path(__file__).resolve().parent / "sandbox_site"


def compile_rules(rules: object) -> dict[str, object]:
    """Validate rules (a :class:`SemanticRules` or its dict) into the JSON the sandbox reads.

    Raises:
        pydantic.ValidationError: naming the rule and field that is wrong.
    """
    from dsec_nodeagent.semantic.models import SemanticRules

    model = rules if isinstance(rules, SemanticRules) else SemanticRules.model_validate(rules)
    return model.model_dump(mode="json")


def __getattr__(name: str) -> object:
    if name in ("rules_from_spec", "rules_from_plan"):
        from dsec_nodeagent.semantic import compile as _compile

        return getattr(_compile, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
