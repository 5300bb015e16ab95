"""``dsec env ls`` / ``dsec env gc`` as a user runs them, on a node's environment store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dsec_builder.adapters.store import EnvironmentStore
from dsec_cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.unit


def _dsec(home: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"DSEC_HOME": str(home)})
    return result.exit_code, result.output


def _environment(store: EnvironmentStore, lock_hash: str, packages: int) -> Path:
    staging = store.new_staging(lock_hash)
    (staging / "site-packages").mkdir()
    (staging / "site-packages" / "mod.py").write_text("VALUE = 1\n")
    manifest = {
        "lock_hash": lock_hash,
        "fingerprint": "f" * 64,
        "packages": [{"name": f"p{i}"} for i in range(packages)],
    }
    return store.commit(staging, lock_hash, manifest)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A node with environments ``aaaa…`` (used first) and ``bbbb…`` (used last)."""
    store = EnvironmentStore(tmp_path / "builder" / "envs")
    _environment(store, "a" * 64, packages=1)
    _environment(store, "b" * 64, packages=2)
    store.touch("b" * 64)
    return tmp_path


def test_env_ls_lists_environments_most_recently_used_first(home: Path) -> None:
    code, out = _dsec(home, "env", "ls", "--json")

    assert code == 0
    listed = json.loads(out)["environments"]
    assert [(e["lock_hash"][:4], e["packages"]) for e in listed] == [("bbbb", 2), ("aaaa", 1)]
    assert listed[0]["path"] == str(home / "builder" / "envs" / ("b" * 64) / "site-packages")
    assert listed[0]["size_bytes"] > 0
    code, out = _dsec(home, "env", "ls")
    assert code == 0 and "bbbbbbbbbbbbbbbb" in out and "aaaaaaaaaaaaaaaa" in out


def test_env_gc_keeps_the_most_recently_used(home: Path) -> None:
    code, out = _dsec(home, "env", "gc", "--keep", "1", "--dry-run", "--json")
    assert code == 0
    assert [e["lock_hash"] for e in json.loads(out)["removed"]] == ["a" * 64]
    assert (home / "builder" / "envs" / ("a" * 64)).is_dir()  # a dry run removes nothing

    code, out = _dsec(home, "env", "gc", "--keep", "1")

    assert code == 0 and "removed aaaaaaaaaaaaaaaa" in out
    assert not (home / "builder" / "envs" / ("a" * 64)).exists()
    code, out = _dsec(home, "env", "ls", "--json")
    assert [e["lock_hash"] for e in json.loads(out)["environments"]] == ["b" * 64]


def test_env_gc_rejects_a_negative_keep(home: Path) -> None:
    code, out = _dsec(home, "env", "gc", "--keep", "-1")
    assert code == 2 and "--keep" in out


def test_env_ls_on_an_empty_node(tmp_path: Path) -> None:
    assert _dsec(tmp_path, "env", "ls", "--json") == (0, '{"environments":[]}\n')
    assert _dsec(tmp_path, "env", "ls") == (0, "no environments on this node\n")
