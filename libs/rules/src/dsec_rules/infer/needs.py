"""From findings and the catalogue to needs: the grants a spec must hold for this code to run."""

from __future__ import annotations

import posixpath
import re
from collections import defaultdict
from collections.abc import Iterable

from dsec_core.spec import Rate
from pydantic import BaseModel, ConfigDict, Field

from dsec_rules.infer.catalogue import Catalogue, ToolSemantics
from dsec_rules.infer.findings import CodeFindings, Finding, ParseFailure, Unresolved

SECRET_NAME = re.compile(
    r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|AUTH|APPID|_SID$|DATABASE_URL)",
    re.IGNORECASE,
)
"""Env var names treated as secrets (so they must be injected from Vault)."""

SYSTEM_ENV = frozenset(
    {
        "HOME",
        "PATH",
        "USER",
        "LOGNAME",
        "LANG",
        "LC_ALL",
        "PWD",
        "TMPDIR",
        "SHELL",
        "TERM",
        "HOSTNAME",
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "TZ",
        "NO_COLOR",
    }
)
"""Env vars the runtime sets itself; reading them needs no grant."""


IMPLICIT_READ_PREFIXES = (
    "/usr/",
    "/lib/",
    "/lib64/",
    "/bin/",
    "/sbin/",
    "/proc/self/",
    "/dev/null",
    "/dev/zero",
    "/dev/urandom",
    "/dev/random",
    "/etc/ssl/",
    "/etc/ca-certificates/",
)
"""What every sandbox can read without a grant (interpreter, libraries, CA roots, devices).

This mirrors what the node agent's Landlock base ruleset grants; reads there never need a spec
entry. The code directory (``workdir``) is always readable too.
"""


def implicitly_readable(path: str, workdir: str) -> bool:
    """Whether reading ``path`` needs no ``read_allowed`` entry."""
    inside = path == workdir or path.startswith(workdir.rstrip("/") + "/")
    return (
        inside
        or (path + "/").startswith(IMPLICIT_READ_PREFIXES)
        or path.startswith(IMPLICIT_READ_PREFIXES)
    )


class _Need(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    sources: tuple[str, ...] = Field(default=(), description="file:line (or tool name) evidence")
    tools: tuple[str, ...] = Field(default=(), description="Tools this need is attributed to")


class EgressNeed(_Need):
    """The code connects to ``host:port``."""

    host: str
    port: int
    rate_limit: Rate | None = None


class EnvNeed(_Need):
    """The code (or a tool's client library) reads an environment variable."""

    name: str
    secret: bool
    has_default: bool = False


class PathNeed(_Need):
    """The code reads or writes under ``path`` (as written: absolute or workdir-relative)."""

    path: str
    write: bool

    def grant(self, workdir: str) -> str:
        """The directory to grant: the parent for a file name (``x.json``), else the path."""
        path = self.path if self.path.startswith("/") else posixpath.join(workdir, self.path)
        path = posixpath.normpath(path)
        leaf = posixpath.basename(path)
        if self.write and "." in leaf.lstrip("."):
            return posixpath.dirname(path) or "/"
        return path


class CommandNeed(_Need):
    """The code runs a program."""

    argv0: str


class ToolNeed(BaseModel):
    """A registered tool and what the catalogue knows about it.

    A tool implemented in the bundle (``local``) gets its needs from its own code; the catalogue
    then only contributes its rate limit and latency. A prebuilt tool (a catalogue class or a
    ``load_tools`` name) gets its needs from the catalogue.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    framework: str
    where: str
    local: bool
    semantics: ToolSemantics | None = None

    @property
    def prebuilt(self) -> ToolSemantics | None:
        """The catalogue entry when the tool's needs come from the catalogue."""
        return None if self.local else self.semantics


class InferredNeeds(BaseModel):
    """Everything a code bundle needs, with the evidence for each need."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    files: tuple[str, ...] = ()
    egress: tuple[EgressNeed, ...] = ()
    env: tuple[EnvNeed, ...] = ()
    paths: tuple[PathNeed, ...] = ()
    commands: tuple[CommandNeed, ...] = ()
    tools: tuple[ToolNeed, ...] = ()
    unresolved: tuple[Unresolved, ...] = ()
    parse_failures: tuple[ParseFailure, ...] = ()


def infer_needs(findings: CodeFindings, catalogue: Catalogue) -> InferredNeeds:
    """Combine findings with tool semantics into de-duplicated needs (pure)."""
    tools = [
        ToolNeed(
            name=t.name,
            framework=t.framework,
            where=t.where,
            local=t.target is not None and t.framework != "catalogue",
            semantics=catalogue.lookup(t.name),
        )
        for t in findings.tools
    ]
    owners = _attribution(findings)
    return InferredNeeds(
        files=findings.files,
        egress=_egress(findings, tools, owners),
        env=_env(findings, tools, owners),
        paths=_paths(findings, tools, owners),
        commands=_commands(findings, tools, owners),
        tools=tuple(tools),
        unresolved=findings.unresolved,
        parse_failures=findings.parse_failures,
    )


class _Owners:
    """Which tools a finding's enclosing function serves (through the call graph)."""

    def __init__(self, reach: dict[str, set[str]]) -> None:
        self._reach = reach

    def of(self, finding: Finding) -> tuple[str, ...]:
        return tuple(sorted(self._reach.get(finding.scope, set())))


def _attribution(findings: CodeFindings) -> _Owners:
    graph = {scope: set(called) for scope, called in findings.calls}
    scopes = set(graph) | {f.scope for f in _all_findings(findings)}
    reach: dict[str, set[str]] = defaultdict(set)
    for tool in findings.tools:
        if not tool.target:
            continue
        todo = [s for s in scopes if _owned_by(s, tool.target)]
        seen: set[str] = set()
        while todo:
            scope = todo.pop()
            if scope in seen:
                continue
            seen.add(scope)
            reach[scope].add(tool.name)
            for name in graph.get(scope, ()):
                todo.extend(s for s in scopes if _owned_by(s, name) and s not in seen)
    return _Owners(reach)


def _owned_by(scope: str, name: str) -> bool:
    # `web_search` owns scope "web_search"; class `SearchTool` owns "SearchTool._run".
    parts = scope.split(".")
    return parts[0] == name or parts[-1] == name


def _all_findings(findings: CodeFindings) -> Iterable[Finding]:
    yield from findings.http
    yield from findings.sockets
    yield from findings.env
    yield from findings.subprocesses
    yield from findings.file_access


def _merge_sources(*groups: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(s for group in groups for s in group))


def _egress(
    findings: CodeFindings, tools: list[ToolNeed], owners: _Owners
) -> tuple[EgressNeed, ...]:
    sources: dict[tuple[str, int], list[str]] = defaultdict(list)
    by: dict[tuple[str, int], set[str]] = defaultdict(set)
    for call in findings.http:
        sources[(call.host, call.port)].append(f"{call.where} {call.client}({call.url})")
        by[(call.host, call.port)].update(owners.of(call))
    for sock in findings.sockets:
        sources[(sock.host, sock.port)].append(
            f"{sock.where} connect(({sock.host!r}, {sock.port}))"
        )
        by[(sock.host, sock.port)].update(owners.of(sock))
    for tool in tools:
        for dest in tool.prebuilt.egress if tool.prebuilt else ():
            for port in dest.ports:
                sources[(dest.domain, port)].append(f"{tool.where} tool {tool.name} (catalogue)")
                by[(dest.domain, port)].add(tool.name)
    limits = {
        t.name: t.semantics.rate_limit for t in tools if t.semantics and t.semantics.rate_limit
    }
    out = []
    for key in sorted(sources):
        rates = [limits[name] for name in by[key] if name in limits]
        rate = min(rates, key=lambda r: r.per_second) if rates else None
        out.append(
            EgressNeed(
                host=key[0],
                port=key[1],
                sources=_merge_sources(sources[key]),
                tools=tuple(sorted(by[key])),
                rate_limit=rate,
            )
        )
    return tuple(out)


def _env(findings: CodeFindings, tools: list[ToolNeed], owners: _Owners) -> tuple[EnvNeed, ...]:
    sources: dict[str, list[str]] = defaultdict(list)
    by: dict[str, set[str]] = defaultdict(set)
    defaults: dict[str, bool] = {}
    catalogue_secrets: set[str] = set()
    for read in findings.env:
        if read.name in SYSTEM_ENV:
            continue
        sources[read.name].append(read.where)
        by[read.name].update(owners.of(read))
        defaults[read.name] = defaults.get(read.name, True) and read.has_default
    for tool in tools:
        for name in tool.prebuilt.secrets if tool.prebuilt else ():
            sources[name].append(f"{tool.where} tool {tool.name} (catalogue)")
            by[name].add(tool.name)
            catalogue_secrets.add(name)
            defaults.setdefault(name, False)
    return tuple(
        EnvNeed(
            name=name,
            secret=name in catalogue_secrets or bool(SECRET_NAME.search(name)),
            has_default=defaults[name],
            sources=_merge_sources(sources[name]),
            tools=tuple(sorted(by[name])),
        )
        for name in sorted(sources)
    )


def _paths(findings: CodeFindings, tools: list[ToolNeed], owners: _Owners) -> tuple[PathNeed, ...]:
    sources: dict[tuple[str, bool], list[str]] = defaultdict(list)
    by: dict[tuple[str, bool], set[str]] = defaultdict(set)
    for access in findings.file_access:
        key = (access.path, access.write)
        sources[key].append(access.where)
        by[key].update(owners.of(access))
    for tool in tools:
        for path in tool.prebuilt.write if tool.prebuilt else ():
            sources[(path, True)].append(f"{tool.where} tool {tool.name} (catalogue)")
            by[(path, True)].add(tool.name)
    return tuple(
        PathNeed(
            path=path,
            write=write,
            sources=_merge_sources(sources[(path, write)]),
            tools=tuple(sorted(by[(path, write)])),
        )
        for path, write in sorted(sources)
    )


def _commands(
    findings: CodeFindings, tools: list[ToolNeed], owners: _Owners
) -> tuple[CommandNeed, ...]:
    sources: dict[str, list[str]] = defaultdict(list)
    by: dict[str, set[str]] = defaultdict(set)
    for call in findings.subprocesses:
        sources[call.argv[0]].append(f"{call.where} {' '.join(call.argv)}")
        by[call.argv[0]].update(owners.of(call))
    for tool in tools:
        for program in tool.prebuilt.subprocess if tool.prebuilt else ():
            sources[program].append(f"{tool.where} tool {tool.name} (catalogue)")
            by[program].add(tool.name)
    return tuple(
        CommandNeed(
            argv0=name, sources=_merge_sources(sources[name]), tools=tuple(sorted(by[name]))
        )
        for name in sorted(sources)
    )
