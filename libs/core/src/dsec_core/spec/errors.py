"""Located diagnostics: what is wrong, where in the YAML, and what would be valid.

A :class:`SpecError` is a frozen pydantic model so the very same objects that ``dsec spec check``
prints can travel inside the ``spec.rejected`` event.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError


class Severity(StrEnum):
    """How bad a diagnostic is: errors reject the spec, warnings do not."""

    ERROR = "error"
    WARNING = "warning"


class SpecError(BaseModel):
    """One diagnostic, located at a line and column of the spec file (both 1-based)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str = Field(description="File name as the user gave it")
    line: int = Field(ge=1, description="1-based line")
    column: int = Field(ge=1, description="1-based column")
    path: str = Field(description="Field path, e.g. security_policy.network.egress[0].ports")
    message: str = Field(description="What is wrong")
    hint: str | None = Field(default=None, description="What would be valid, or how to fix it")
    severity: Severity = Severity.ERROR
    rule_id: str = Field(description="Stable id of the check, e.g. unknown-field, ORG-NET-001")

    @classmethod
    def whole_file(
        cls, file: str, message: str, rule_id: str, hint: str | None = None, path: str = ""
    ) -> SpecError:
        """A diagnostic about the spec as a whole (its bundle, its submitter, its budget),
        located at its first line."""
        return cls(
            file=file, line=1, column=1, path=path, message=message, hint=hint, rule_id=rule_id
        )

    def format(self) -> str:
        """Render as ``FILE:LINE:COL: severity[rule]: path: message`` plus an indented hint."""
        where = f"{self.path}: " if self.path else ""
        head = (
            f"{self.file}:{self.line}:{self.column}: {self.severity.value}[{self.rule_id}]: "
            f"{where}{self.message}"
        )
        if self.hint:
            hint = self.hint.replace("\n", "\n        ")
            return f"{head}\n    hint: {hint}"
        return head


def format_path(path: tuple[str | int, ...]) -> str:
    """Render a field path the way users read it: ``a.b[0].c``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def sort_key(error: SpecError) -> tuple[int, int, str]:
    """Order diagnostics the way a compiler prints them: by position."""
    return (error.line, error.column, error.message)


INVALID = "dsec_invalid"
"""Error type of every check raised with :func:`invalid` (pydantic's ``type`` field)."""


def invalid(
    message: str, hint: str | None = None, loc: tuple[str | int, ...] = ()
) -> PydanticCustomError:
    """Build the error a spec validator raises, carrying a hint and an optional sub-location.

    ``loc`` is relative to the model or field being validated; the locator appends it so that a
    model-level check (e.g. "exactly one of domain or cidr") can still point at one field.
    Pydantic only keeps the context of ``PydanticCustomError``, hence this instead of ValueError.
    """
    return PydanticCustomError(INVALID, "{message}", {"message": message, "hint": hint, "loc": loc})
