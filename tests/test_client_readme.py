"""The README's "Using DSec from Python" example, run as a user runs it: the block itself,
extracted from README.md by its marker (doc and test cannot drift), in a directory holding a
``dsec.yaml`` and its code, against the real stack and services."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.kernel, pytest.mark.slow]

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- readme-client-example"

SPEC = """\
version: "1.2"
name: readme-client
base: dsec/python311:latest
entrypoint: [python, -S, -u, agent.py]  # -S: it prints within ms of its start
workdir: /workspace
resources: {cpu: 1, memory: 128MiB, pids: 32}
timeout: 5m
"""

# Started without `site` (-S, above): it prints before the README's exec round trip ends (with
# site, a loaded machine's interpreter start could outlast the exec, and the stop came first).
AGENT = """\
import time
print("hello from " + "the sandbox")
time.sleep(300)
"""


def readme_example() -> str:
    """The first ```python block after the marker in README.md."""
    text = README.read_text()
    at = text.index(MARKER)
    found = re.search(r"```python\n(.*?)```", text[at:], re.S)
    assert found is not None, "no python block after the README marker"
    return found.group(1)


def test_the_readme_example_is_short() -> None:
    lines = [ln for ln in readme_example().splitlines() if ln.strip()]
    assert "from dsec_client import DSec" in readme_example()
    assert len(lines) <= 16, lines


def test_readme_example_runs_against_the_stack(
    services, stack_env: dict[str, str], tmp_path: Path
) -> None:
    services.start("policy", "builder", "nodeagent")
    (tmp_path / "dsec.yaml").write_text(SPEC)
    (tmp_path / "agent.py").write_text(AGENT)
    done = subprocess.run(
        [sys.executable, "-c", readme_example()],
        cwd=tmp_path,
        env={**os.environ, **stack_env},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    assert out[0].startswith("0 Python 3."), out
    assert "hello from the sandbox" in done.stdout
    events = [line.split() for line in out if re.match(r"^\d+ [a-z_]+\.[a-z_]+ ", line)]
    types = [e[1] for e in events]
    assert types[0] == "spec.submitted" and types[-1] == "sandbox.exited", types
    assert types.index("spec.validated") < types.index("sandbox.ready")
    assert "sandbox.stop_requested" in types
    producers = dict((e[1], e[2]) for e in events)
    assert producers["spec.validated"] == "policy"
    assert producers["sandbox.exited"] == "nodeagent"
    seqs = [int(e[0]) for e in events]
    assert seqs == sorted(seqs)
