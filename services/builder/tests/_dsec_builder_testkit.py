"""Helpers for the builder's tests: real wheel files and the sandbox interpreter."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import zipfile
from collections import Counter
from pathlib import Path

from aiohttp import web

from dsec_builder.builder import default_interpreter
from dsec_builder.models import LockedPackage


def make_wheel(directory: Path, name: str, version: str, body: str) -> Path:
    """Write a minimal valid pure-Python wheel whose module ``name`` holds ``body``."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": body.encode(),
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        ).encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: dsec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


def locked(wheel: Path, base_url: str) -> LockedPackage:
    """The lock entry of a wheel served at ``base_url``."""
    name, version = wheel.name.split("-")[:2]
    data = wheel.read_bytes()
    return LockedPackage(
        name=name,
        version=version,
        filename=wheel.name,
        url=f"{base_url}/{wheel.name}",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
    )


def run_in_sandbox_python(site_packages: Path, code: str) -> str:
    """Run ``code`` with the sandbox interpreter and only ``site_packages`` added; its stdout."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(site_packages),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    result = subprocess.run(
        [str(default_interpreter()), "-s", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.strip()


class WheelIndex:
    """A package index on a free loopback port: serves wheel files and counts each download."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = ""
        self.hits: Counter[str] = Counter()
        self.overrides: dict[str, bytes] = {}

    def add(self, name: str, version: str, value: str) -> LockedPackage:
        """Publish a wheel whose module ``name`` has ``VALUE = value``; its lock entry."""
        wheel = make_wheel(self.root, name, version, f"VALUE = {value!r}\n")
        return locked(wheel, self.url)

    def serve_wrong_bytes(self, filename: str, data: bytes) -> None:
        """From now on answer ``filename`` with ``data`` (a compromised mirror)."""
        self.overrides[filename] = data

    async def handle(self, request: web.Request) -> web.StreamResponse:
        filename = request.match_info["filename"]
        self.hits[filename] += 1
        if filename in self.overrides:
            return web.Response(body=self.overrides[filename])
        path = self.root / filename
        if not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)
