"""The catalogue of tool semantics (``catalogue.yaml`` next to this module)."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from dsec_core.spec import Rate, load_document, normalize_domain
from pydantic import BaseModel, ConfigDict, Field, field_validator


class ToolEgress(BaseModel):
    """A destination a tool's client library connects to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    domain: str
    ports: tuple[int, ...] = (443,)

    @field_validator("domain")
    @classmethod
    def _domain(cls, value: str) -> str:
        return normalize_domain(value)


class ToolSemantics(BaseModel):
    """What a tool does and needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    aliases: tuple[str, ...] = ()
    function: str
    category: str
    egress: tuple[ToolEgress, ...] = ()
    ports: tuple[int, ...] = Field(
        default=(), description="Ports to a destination chosen at run time"
    )
    internal: bool = Field(default=False, description="The destination is inside the network")
    secrets: tuple[str, ...] = Field(default=(), description="Env vars the client library reads")
    subprocess: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    rate_limit: Rate | None = None
    latency_ms: int = Field(ge=0)
    fallback: tuple[str, ...] = Field(
        default=(),
        description="Tools to try, in order, when this one is failing (the spec's "
        "tools.<name>.fallback overrides it; docs/tools.md)",
    )


class Catalogue(BaseModel):
    """All known tools, looked up by any of their names."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int
    tools: tuple[ToolSemantics, ...]

    def lookup(self, name: str) -> ToolSemantics | None:
        """The tool called ``name`` (or one of its aliases), ignoring case and punctuation."""
        return self._index().get(_key(name))

    def class_names(self) -> frozenset[str]:
        """Aliases that look like class names (instantiating one registers the tool)."""
        return frozenset(a for t in self.tools for a in t.aliases if a[:1].isupper())

    def _index(self) -> dict[str, ToolSemantics]:
        return _index(self)


@cache
def _index(catalogue: Catalogue) -> dict[str, ToolSemantics]:
    index: dict[str, ToolSemantics] = {}
    for tool in catalogue.tools:
        for name in (tool.name, *tool.aliases):
            index.setdefault(_key(name), tool)
    return index


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


@cache
def load_catalogue() -> Catalogue:
    """The packaged catalogue (parsed once).

    Raises:
        ValueError: the packaged file is invalid (a packaging bug; the message locates it).
    """
    text = resources.files("dsec_rules.infer").joinpath("catalogue.yaml").read_text("utf-8")
    result = load_document(text, "catalogue.yaml", Catalogue)
    if result.value is None:
        raise ValueError("\n".join(e.format() for e in result.errors))
    return result.value
