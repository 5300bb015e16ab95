"""Reading code directories, bundles and org policy files from disk."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core.codebundle import build_bundle

from dsec_rules.adapters.code_files import (
    CodeDirError,
    read_bundle_sources,
    read_python_sources,
)
from dsec_rules.adapters.org_policy_file import OrgPolicyError, load_org_policy
from dsec_rules.guardrails import default_org_policy

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def test_code_dir_reads_python_only_and_skips_caches(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/tool.py").write_text("x = 1\n")
    (tmp_path / "agent.py").write_text("y = 2\n")
    (tmp_path / "notes.md").write_text("no\n")
    (tmp_path / ".venv/lib").mkdir(parents=True)
    (tmp_path / ".venv/lib/dep.py").write_text("z = 3\n")
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen/big.py").write_text("w = 4\n")
    (tmp_path / "link.py").symlink_to("/etc/hostname")
    files = read_python_sources(tmp_path, exclude_patterns=("gen/*",))
    assert files == {"agent.py": b"y = 2\n", "pkg/tool.py": b"x = 1\n"}


def test_code_dir_must_exist(tmp_path: Path) -> None:
    with pytest.raises(CodeDirError, match="not a directory"):
        read_python_sources(tmp_path / "missing")


def test_bundle_sources_match_the_directory_and_leave_nothing_behind(tmp_path: Path) -> None:
    code = REPO / "examples/websearch-agent"
    bundle = build_bundle(code)
    before = set(Path(tmp_path).iterdir())
    assert read_bundle_sources(bundle.read()) == read_python_sources(code)
    assert set(Path(tmp_path).iterdir()) == before


def test_bad_bundle_is_a_clear_error() -> None:
    with pytest.raises(CodeDirError, match="invalid code bundle"):
        read_bundle_sources(b"not an archive")


def test_org_policy_file(tmp_path: Path) -> None:
    assert load_org_policy(None) == default_org_policy()
    good = tmp_path / "org.yaml"
    good.write_text('version: "1"\nrules:\n  - {id: ORG-X-1, kind: no-dns-passthrough}\n')
    assert [r.id for r in load_org_policy(good).rules] == ["ORG-X-1"]
    bad = tmp_path / "bad.yaml"
    bad.write_text('version: "1"\nrules:\n  - {id: ORG-X-1, kind: no-dns-pasthrough}\n')
    with pytest.raises(OrgPolicyError, match=r"bad\.yaml:3:"):
        load_org_policy(bad)
    with pytest.raises(OrgPolicyError, match="cannot read"):
        load_org_policy(tmp_path / "missing.yaml")
