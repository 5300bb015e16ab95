"""Reading code directories, bundles and org policy files from disk."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core.codebundle import build_bundle

from dsec_rules.adapters.code_files import (
    MAX_FILE_BYTES,
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


def test_bundle_sources_are_chosen_as_a_directorys_are(tmp_path: Path) -> None:
    """Skipped directories, files over 2 MiB, links and non-Python files are left out of a
    bundle's sources exactly as out of a directory's."""
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "agent.py").write_text("y = 2\n")
    (code / "pkg/tool.py").write_text("x = 1\n")
    (code / "notes.txt").write_text("n\n")
    (code / "big.py").write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    (code / "pkg/link.py").symlink_to("../agent.py")
    (code / "node_modules/m").mkdir(parents=True)
    (code / "node_modules/m/gen.py").write_text("z = 3\n")
    archive = build_bundle(code, exclude_patterns=["!node_modules/"]).read()
    assert read_bundle_sources(archive) == read_python_sources(code)
    assert list(read_bundle_sources(archive)) == ["agent.py", "pkg/tool.py"]


def test_bundle_sources_are_bounded_in_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared policy service holds a bundle's sources in memory: at most MAX_TOTAL_BYTES of
    them, whatever include_code.max_size the spec asks (up to 4 GiB)."""
    from dsec_rules.adapters import code_files

    code = tmp_path / "code"
    code.mkdir()
    for i in range(8):
        (code / f"m{i}.py").write_bytes(b"x = 1\n" + b"#" * 4096)
    monkeypatch.setattr(code_files, "MAX_TOTAL_BYTES", 3 * 4096)
    archive = build_bundle(code).read()
    with pytest.raises(CodeDirError, match="MiB of Python sources to analyze"):
        read_bundle_sources(archive, max_size=2**30)
    with pytest.raises(CodeDirError, match="MiB of Python sources to analyze"):
        read_python_sources(code)


def test_bundle_sources_refuse_what_an_extraction_refuses(tmp_path: Path) -> None:
    """Read without extracting, a bundle is still checked member by member: a file below a
    symlink, a duplicate, an escaping path, more bytes than max_size."""
    import io
    import tarfile

    import zstandard

    def archive(*members: tuple[str, bytes | str]) -> bytes:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, body in members:
                info = tarfile.TarInfo(name)
                if isinstance(body, str):
                    info.type, info.linkname = tarfile.SYMTYPE, body
                    tar.addfile(info)
                else:
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
        return zstandard.ZstdCompressor().compress(raw.getvalue())

    cases = {
        "parent lnk is a symlink": archive(("lnk", "/etc"), ("lnk/x.py", b"a")),
        "duplicate path": archive(("x.py", b"a"), ("x.py", b"b")),
        "escaping path": archive(
            ("../x.py", b"a"),
        ),
        "expands past": archive(("a.bin", b"0" * 4096), ("x.py", b"a")),
    }
    for needle, data in cases.items():
        with pytest.raises(CodeDirError, match=needle):
            read_bundle_sources(data, max_size=1024)
    before = set(Path("/tmp").iterdir())
    assert read_bundle_sources(
        archive(
            ("x.py", b"a"),
        )
    ) == {"x.py": b"a"}
    assert not [p for p in set(Path("/tmp").iterdir()) - before if "dsec" in p.name]


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
