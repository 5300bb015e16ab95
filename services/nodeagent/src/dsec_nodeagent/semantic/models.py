"""Semantic rules as the node agent writes them, and decisions as the sandbox reports them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

On = Literal["open", "subprocess", "connect", "http"]
Action = Literal["allow", "redirect", "log", "deny"]


class RuleMatch(BaseModel):
    """What a rule matches; glob patterns (``fnmatch``). Every given field must match.

    Attributes:
        path: absolute path (``open``).
        argv: command words (``subprocess``), matched as one space-joined string; the first
            word also matches by its base name (``curl`` matches ``/usr/bin/curl``).
        host: host name or address (``connect``, ``http``).
        url: URL without its query string (``http``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str | None = None
    argv: tuple[str, ...] | None = None
    host: str | None = None
    url: str | None = None


_MATCH_KEYS = {
    "open": {"path"},
    "subprocess": {"argv"},
    "connect": {"host"},
    "http": {"url", "host"},
}


class SemanticRule(BaseModel):
    """One rule: on an operation, when ``match`` matches, take ``action``.

    Attributes:
        name: shown in every decision and in a deny's message.
        on: ``open``, ``subprocess``, ``connect`` or ``http``.
        match: what the rule applies to (fields allowed per ``on``: see :class:`RuleMatch`).
        action: ``allow``, ``redirect`` (to ``target``), ``log`` (allow and report) or ``deny``.
        target: replacement path (open), ``host:port`` (connect) or URL (http) for ``redirect``.
        message: extra text for the agent when denied.
        spec_line: the spec line that holds the rule (named in deny messages).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    on: On
    match: RuleMatch
    action: Action
    target: str | None = None
    message: str | None = None
    spec_line: int | None = None

    @model_validator(mode="after")
    def _consistent(self) -> SemanticRule:
        used = {k for k, v in self.match.model_dump().items() if v is not None}
        allowed = _MATCH_KEYS[self.on]
        if not used or not used <= allowed:
            keys = " or ".join(sorted(allowed))
            raise ValueError(f"rule {self.name!r}: an `on: {self.on}` rule matches on {keys}")
        if self.action == "redirect" and (self.on == "subprocess" or not self.target):
            raise ValueError(
                f"rule {self.name!r}: redirect needs a target and works for open, connect, http"
            )
        return self


class RateLimit(BaseModel):
    """A request budget for HTTP requests to matching hosts (counted per request, keep-alive
    included, per interpreter process; the eBPF layer counts connections).

    Attributes:
        name: shown in decisions (e.g. ``egress[0] api.websearch.com``).
        host: host glob.
        requests: requests allowed per ``period_s``.
        period_s: window length in seconds.
        spec_line: the spec line of the egress rule.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    host: str
    requests: int = Field(ge=1)
    period_s: int = Field(ge=1)
    spec_line: int | None = None


class SemanticRules(BaseModel):
    """The rules file: first matching rule wins; ``default`` applies when none matches."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rules: list[SemanticRule] = Field(default_factory=list)
    rate_limits: list[RateLimit] = Field(default_factory=list)
    default: Literal["allow", "log"] = "allow"
    spec_file: str = "sandbox.yaml"


class SemanticDecision(BaseModel):
    """One decision streamed from a sandbox (becomes ``policy.violation`` and a metric).

    Subjects are names the workload used (paths, hosts, URLs without query strings) — never
    file contents, headers or bodies.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    sandbox_id: str
    on: str
    action: str
    subject: str = Field(max_length=2048)
    rule: str | None = None
    spec_line: int | None = None
    pid: int | None = None
    time: float | None = None
    detail: str | None = Field(default=None, max_length=512)
