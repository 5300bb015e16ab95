"""uv as the resolver and installer engine (the pinned binary shipped by the ``uv`` wheel)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec_builder.models import Target

DEFAULT_INDEX_URL = "https://pypi.org/simple"

# Settings a user's uv configuration could change behind our back; we pass ours explicitly.
_SCRUBBED_ENV = (
    "UV_INDEX_URL",
    "UV_EXTRA_INDEX_URL",
    "UV_INDEX",
    "UV_DEFAULT_INDEX",
    "UV_FIND_LINKS",
    "UV_NO_INDEX",
    "UV_RESOLUTION",
    "UV_PRERELEASE",
    "UV_CONSTRAINT",
    "UV_OVERRIDE",
    "UV_PYTHON",
    "UV_OFFLINE",
)


def uv_binary() -> Path:
    """The uv executable of the pinned ``uv`` package installed with the builder."""
    from uv import find_uv_bin  # the wheel's helper; imported lazily, it probes the filesystem

    return Path(find_uv_bin())


@dataclass(frozen=True)
class UvRun:
    """Outcome of one uv invocation."""

    returncode: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def unsatisfiable(self) -> bool:
        """True when uv proved the requirements have no solution (a verdict, not a failure)."""
        return self.returncode != 0 and "No solution found" in self.stderr


class UvTimeoutError(TimeoutError):
    """uv did not finish within its time limit; its process group was killed."""


class Uv:
    """Runs ``uv pip compile`` and ``uv pip install`` with explicit, reproducible settings.

    Args:
        cache_dir: uv's cache (metadata, unpacked wheels); shared by resolves and installs.
        index_url: The package index to resolve against.
        binary: The uv executable; defaults to the pinned one.
        timeout_s: Limit of one invocation.
        http_retries: uv's retries of failed index requests (``None``: uv's default).
    """

    def __init__(
        self,
        cache_dir: Path,
        index_url: str = DEFAULT_INDEX_URL,
        binary: Path | None = None,
        timeout_s: float = 180.0,
        http_retries: int | None = None,
    ) -> None:
        self.cache_dir = cache_dir
        self.http_retries = http_retries
        self.index_url = index_url
        self.binary = binary or uv_binary()
        self.timeout_s = timeout_s

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        env.update({"NO_COLOR": "1", "UV_NO_PROGRESS": "1"})
        if self.http_retries is not None:
            env["UV_HTTP_RETRIES"] = str(self.http_retries)
        return env

    async def compile(
        self,
        requirements: str,
        target: Target,
        *,
        lowest_direct: bool = False,
        timeout_s: float | None = None,
    ) -> UvRun:
        """Resolve ``requirements`` (requirements.txt text) to a PEP 751 lock on stdout.

        Only metadata is fetched (no wheels are downloaded), from uv's cache when fresh.
        """
        args = [
            "pip",
            "compile",
            "-",
            "--python-version",
            target.python_version,
            "--python-platform",
            target.platform,
            "--format",
            "pylock.toml",
            "--no-header",
            "--index-url",
            self.index_url,
        ]
        if lowest_direct:
            args += ["--resolution", "lowest-direct"]
        return await self._run(args, stdin=requirements, timeout_s=timeout_s)

    async def install(
        self,
        artifacts: Sequence[Path],
        target_dir: Path,
        python: Path,
        *,
        allow_index: bool = False,
    ) -> UvRun:
        """Install verified local artifacts (no dependency resolution) into ``target_dir``.

        Args:
            artifacts: Wheel (or source archive) files, already hash-verified.
            target_dir: Becomes the environment's site-packages.
            python: The sandbox interpreter the environment is for.
            allow_index: Let uv reach the index for build backends (only needed for sdists).
        """
        args = [
            "pip",
            "install",
            "--target",
            str(target_dir),
            "--python",
            str(python),
            "--no-deps",
        ]
        args += ["--index-url", self.index_url] if allow_index else ["--no-index"]
        args += [str(path) for path in artifacts]
        return await self._run(args, stdin=None, timeout_s=None)

    async def _run(self, args: list[str], stdin: str | None, timeout_s: float | None) -> UvRun:
        command = [
            str(self.binary),
            *args,
            "--no-config",
            "--color",
            "never",
            "--cache-dir",
            str(self.cache_dir),
        ]
        started = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self._env(),
            start_new_session=True,  # so a timeout or cancellation kills uv and its children
        )
        try:
            out, err = await asyncio.wait_for(
                process.communicate(stdin.encode() if stdin is not None else None),
                timeout_s or self.timeout_s,
            )
        except TimeoutError:
            _kill_group(process)
            await process.wait()
            limit = timeout_s or self.timeout_s
            raise UvTimeoutError(f"uv {' '.join(args[:2])} exceeded {limit}s") from None
        except asyncio.CancelledError:
            _kill_group(process)
            with contextlib.suppress(Exception):
                await asyncio.shield(process.wait())
            raise
        return UvRun(
            returncode=process.returncode if process.returncode is not None else -1,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            duration_s=time.monotonic() - started,
        )


def _kill_group(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
