"""What static analysis finds in agent code: each finding carries the file and line it came from."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Finding(BaseModel):
    """Base of every finding: where in the code it is, and in which function."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str
    line: int
    scope: str = Field(default="", description="Enclosing function or Class.method, '' at top")

    @property
    def where(self) -> str:
        """``file:line`` for messages."""
        return f"{self.file}:{self.line}"


class HttpCall(Finding):
    """A request to a literal URL (requests, httpx, urllib, aiohttp)."""

    url: str
    host: str
    port: int
    client: str = Field(description="The call as written, e.g. requests.get")


class SocketConnect(Finding):
    """A socket connect to a literal address."""

    host: str
    port: int


class EnvRead(Finding):
    """An environment variable the code reads."""

    name: str
    has_default: bool = False


class SubprocessCall(Finding):
    """A command the code runs (literal part of argv)."""

    argv: tuple[str, ...]


class FileAccess(Finding):
    """A literal path the code opens; ``write`` when the mode or call writes."""

    path: str
    write: bool


class ToolRegistration(Finding):
    """A tool the agent registers, and the function or class implementing it when known."""

    name: str
    framework: str = Field(description="agent, langchain, llamaindex, crewai, autogen, catalogue")
    target: str | None = Field(default=None, description="Function or class name implementing it")


class Unresolved(Finding):
    """A call whose destination could not be read statically (dynamic URL, path, command)."""

    kind: Literal["http", "socket", "env", "subprocess", "file"]
    detail: str


class ParseFailure(BaseModel):
    """A file that is not valid Python."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str
    line: int
    column: int
    message: str


class CodeFindings(BaseModel):
    """Everything found in a code bundle, plus the call graph used to attribute calls to tools."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    files: tuple[str, ...] = ()
    http: tuple[HttpCall, ...] = ()
    sockets: tuple[SocketConnect, ...] = ()
    env: tuple[EnvRead, ...] = ()
    subprocesses: tuple[SubprocessCall, ...] = ()
    file_access: tuple[FileAccess, ...] = ()
    tools: tuple[ToolRegistration, ...] = ()
    unresolved: tuple[Unresolved, ...] = ()
    parse_failures: tuple[ParseFailure, ...] = ()
    calls: tuple[tuple[str, tuple[str, ...]], ...] = Field(
        default=(), description="(function, names it calls) pairs"
    )
