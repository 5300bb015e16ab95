"""Errors of the snapshot library; each message names the snapshot, object or file involved."""

from __future__ import annotations

from collections.abc import Sequence


class SnapshotError(Exception):
    """Base of every snapshot error."""


class InvalidInput(SnapshotError, ValueError):
    """A name, directory, pattern or policy given by the user is not valid (CLI exit 2)."""


class SnapshotNotFound(SnapshotError):
    """No snapshot of that name exists."""


class SnapshotExists(SnapshotError):
    """A snapshot of that name exists already (snapshots are immutable)."""


class StoreUnavailable(SnapshotError):
    """The object store or Vault cannot be reached or refused the request (CLI exit 3)."""


class StoreBusy(StoreUnavailable):
    """Another process holds a conflicting lock of the store (a GC, or the creates a GC waits
    for) past the wait allowed (CLI exit 3)."""


class VerificationFailed(SnapshotError):
    """A signature, object hash or code file does not match; ``problems`` names each one."""

    def __init__(self, subject: str, problems: Sequence[str]) -> None:
        self.subject = subject
        self.problems = list(problems)
        shown = "; ".join(self.problems[:5])
        more = f" (+{len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        super().__init__(f"{subject}: {shown}{more}")
