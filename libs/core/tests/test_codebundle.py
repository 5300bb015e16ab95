"""The code bundle: what is selected, the manifest, deterministic archives, safe extraction."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import blake3
import pydantic
import pytest
import zstandard
from dsec_core.codebundle import (
    DEFAULT_MAX_SIZE,
    BundleError,
    build_bundle,
    extract_bundle,
    git_info,
    list_tree,
    open_real_dir,
    read_members,
    scan_tree,
)

pytestmark = pytest.mark.unit

GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}


def write(root: Path, rel: str, text: str = "x\n", mode: int = 0o644) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def git(root: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    proc = subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, text=True, env=env
    )
    return proc.stdout.strip()


def paths(root: Path, excludes: tuple[str, ...] = ()) -> list[str]:
    return [e.path for e in list_tree(root, excludes)]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    write(root, "agent.py", "print('hi')\n")
    write(root, "run.sh", "#!/bin/sh\n", 0o755)
    write(root, "pkg/util.py", "X = 1\n")
    write(root, "pkg/__pycache__/util.cpython-311.pyc", "bytecode")
    write(root, ".venv/lib/site.py", "venv")
    write(root, "node_modules/left-pad/index.js", "js")
    write(root, ".DS_Store", "mac")
    write(root, ".dsec/keys/snapshot.key", "secret")
    write(root, "data/big.bin", "0" * 1000)
    write(root, "logs/run.log", "log")
    write(root, "logs/keep.log", "keep")
    write(root, ".gitignore", "logs/*.log\n!logs/keep.log\n")
    write(root, "pkg/.gitignore", "generated.py\n")
    write(root, "pkg/generated.py", "gen")
    return root


def test_default_excludes_gitignore_and_patterns_outside_git(tree: Path) -> None:
    assert paths(tree, ("data/",)) == [
        ".gitignore",
        "agent.py",
        "logs/keep.log",
        "pkg/.gitignore",
        "pkg/util.py",
        "run.sh",
    ]


def test_git_tree_uses_git_ignore_rules_and_skips_dot_git(tree: Path) -> None:
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "init")
    write(tree, "untracked.py", "new")
    assert paths(tree, ("data/",)) == [
        ".gitignore",
        "agent.py",
        "logs/keep.log",
        "pkg/.gitignore",
        "pkg/util.py",
        "run.sh",
        "untracked.py",
    ]


def test_a_directory_the_enclosing_repo_ignores_is_bundled_as_plain_files(tmp_path: Path) -> None:
    # A sandbox's code copy lives under .dsec/ inside the user's checkout, which ignores it.
    repo = tmp_path / "checkout"
    code = repo / ".dsec" / "sandboxes" / "sbx_1" / "code"
    write(repo, ".gitignore", ".dsec/\n")
    write(code, "agent.py", "print(1)\n")
    write(code, "config.txt", "0.92\n")
    git(repo, "init", "-q")
    assert paths(code) == ["agent.py", "config.txt"]
    assert git_info(code) is None


def test_git_deleted_tracked_file_is_not_listed(tree: Path) -> None:
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "init")
    (tree / "agent.py").unlink()
    assert "agent.py" not in paths(tree)


def test_git_info_records_commit_path_and_dirty_state(tree: Path) -> None:
    git(tree, "init", "-q", "-b", "main")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "init")
    head = git(tree, "rev-parse", "HEAD")
    info = git_info(tree / "pkg")
    assert info is not None
    assert (info.commit, info.branch, info.path, info.dirty) == (head, "main", "pkg", False)
    write(tree, "pkg/util.py", "X = 2\n")
    info = git_info(tree / "pkg")
    assert info is not None and info.dirty


def test_git_info_is_none_outside_git(tree: Path) -> None:
    assert git_info(tree) is None


def test_git_config_of_the_tree_cannot_run_programs(tree: Path, tmp_path: Path) -> None:
    """An agent-written .git/config (fsmonitor, clean filter) must not execute on bundling."""
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "init")
    marker = tmp_path / "pwned"
    hook = write(tmp_path, "hook.sh", f"#!/bin/sh\ntouch {marker}\ncat\n", 0o755)
    git(tree, "config", "core.fsmonitor", str(hook))
    git(tree, "config", "filter.evil.clean", str(hook))
    write(tree, ".gitattributes", "*.py filter=evil\n")
    write(tree, "agent.py", "changed\n")
    build_bundle(tree)
    assert not marker.exists()


def test_manifest_hashes_sizes_modes(tree: Path) -> None:
    manifest = scan_tree(tree)
    files = manifest.by_path()
    assert files["run.sh"].mode == 0o755
    assert files["agent.py"].mode == 0o644
    assert files["agent.py"].blake3 == blake3.blake3(b"print('hi')\n").hexdigest()
    assert files["agent.py"].size == len("print('hi')\n")
    assert manifest.total_size == sum(f.size for f in manifest.files)


def test_a_manifest_reads_back_as_written_with_its_rows_in_field_order(tree: Path) -> None:
    """The rows are msgspec structs inside a pydantic model: written as the objects pydantic
    wrote for the model they replace (field order, ``target`` null for files), read back equal,
    and frozen."""
    from dsec_core.codebundle import CodeManifest, FileEntry

    (tree / "link").symlink_to("agent.py")
    manifest = scan_tree(tree)
    text = manifest.model_dump_json()
    rows = json.loads(text)["files"]
    assert [list(r) for r in rows] == [["path", "kind", "size", "mode", "blake3", "target"]] * len(
        rows
    )
    assert {r["path"]: r["target"] for r in rows}["link"] == "agent.py"
    again = CodeManifest.model_validate_json(text)
    assert again == manifest and again.tree_digest == manifest.tree_digest
    assert all(type(f) is FileEntry for f in again.files)
    assert CodeManifest.model_validate(manifest.model_dump()) == manifest
    assert CodeManifest(files=list(manifest.files)) == CodeManifest(files=manifest.files)
    with pytest.raises(AttributeError, match="immutable"):
        again.files[0].size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("row", "complaint"),
    [
        ({"mode": 0o4755}, "is recorded as"),
        ({"kind": "dir"}, "Invalid enum value 'dir' - at `$[0].kind`, valid: 'file', 'symlink'"),
        ({"size": "12"}, "Expected `int`, got `str` - at `$[0].size`"),
        ({"size": True}, "Expected `int`, got `bool`"),
        ({"owner": "root"}, "unknown field `owner`"),
        ({"blake3": None}, "Expected `str`, got `null`"),
    ],
)
def test_a_manifest_with_a_bad_row_is_refused_naming_the_row_and_field(
    row: dict[str, object], complaint: str
) -> None:
    from dsec_core.codebundle import CodeManifest

    good = {"path": "a", "kind": "file", "size": 1, "mode": 0o644, "blake3": "0" * 64}
    text = json.dumps({"files": [{**good, **row}]})
    with pytest.raises(pydantic.ValidationError) as caught:
        CodeManifest.model_validate_json(text)
    assert caught.value.errors()[0]["loc"] == ("files",)
    assert complaint in str(caught.value)


def test_symlinks_are_stored_as_links_never_followed(tree: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    write(outside, "secret.txt", "do not bundle")
    (tree / "ext").symlink_to(outside)
    (tree / "alias.py").symlink_to("agent.py")
    files = scan_tree(tree).by_path()
    assert files["ext"].kind == "symlink" and files["ext"].target == str(outside)
    assert files["alias.py"].target == "agent.py"
    assert not any(p.startswith("ext/") for p in files)


def test_archive_is_deterministic_whatever_mtimes(tree: Path) -> None:
    first = build_bundle(tree)
    for path in tree.rglob("*"):
        if not path.is_symlink():
            os.utime(path, (1_000_000, 1_000_000))
    second = build_bundle(tree)
    assert first.digest == second.digest
    assert first.read() == second.read()
    assert first.digest == blake3.blake3(first.read()).hexdigest()
    write(tree, "agent.py", "print('changed')\n")
    assert build_bundle(tree).digest != first.digest


def test_bundle_to_file_and_round_trip(tree: Path, tmp_path: Path) -> None:
    (tree / "alias.py").symlink_to("agent.py")
    out = tmp_path / "out" / "bundle.tar.zst"
    bundle = build_bundle(tree, out=out)
    assert bundle.data is None and bundle.path == out
    assert blake3.blake3(out.read_bytes()).hexdigest() == bundle.digest
    dest = tmp_path / "restored"
    written = extract_bundle(out, dest)
    assert sorted(written) == [f.path for f in bundle.manifest.files]
    assert scan_tree(dest).files == bundle.manifest.files
    assert os.readlink(dest / "alias.py") == "agent.py"
    assert (dest / "run.sh").stat().st_mode & 0o777 == 0o755


def test_bad_exclude_pattern_is_named(tree: Path) -> None:
    with pytest.raises(BundleError, match=r"exclude_patterns\[1\]"):
        list_tree(tree, ("ok/", "bad\0"))


def test_root_must_be_a_directory(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="not a directory"):
        build_bundle(tmp_path / "missing")


def make_archive(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return zstandard.ZstdCompressor().compress(raw.getvalue())


def reg(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def sym(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info, None


@pytest.mark.parametrize(
    ("archive", "message"),
    [
        (lambda: make_archive(reg("../escape")), "escaping path"),
        (lambda: make_archive(reg("/etc/cron.d/x")), "absolute or escaping"),
        (lambda: make_archive(sym("link", "/tmp"), reg("link/owned")), "link is a symlink"),
        (lambda: make_archive(reg("a"), reg("a")), "duplicate path"),
        (lambda: make_archive((_hardlink(), None)), "only files and symlinks"),
        (lambda: b"not an archive", "not a valid bundle archive"),
    ],
    ids=["dotdot", "absolute", "through-symlink", "duplicate", "hardlink", "garbage"],
)
def test_extract_refuses_hostile_archives_and_leaves_nothing(
    archive: object, message: str, tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    with pytest.raises(BundleError, match=message):
        extract_bundle(archive(), dest)  # type: ignore[operator]
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []


def _hardlink() -> tarfile.TarInfo:
    info = tarfile.TarInfo("hard")
    info.type = tarfile.LNKTYPE
    info.linkname = "/etc/passwd"
    return info


def test_extract_refuses_non_empty_destination(tree: Path, tmp_path: Path) -> None:
    bundle = build_bundle(tree)
    dest = tmp_path / "dest"
    write(dest, "existing.txt")
    with pytest.raises(BundleError, match="not an empty directory"):
        extract_bundle(bundle.read(), dest)
    assert [p.name for p in dest.iterdir()] == ["existing.txt"]


def test_negated_exclude_patterns_re_include(tree: Path) -> None:
    listed = paths(tree, ("data/*", "!data/big.bin", "*.py", "!agent.py"))
    assert "data/big.bin" in listed and "agent.py" in listed
    assert "pkg/util.py" not in listed


def test_combined_exclude_matcher_agrees_with_pathspec() -> None:
    import pathspec
    from dsec_core.codebundle import DEFAULT_EXCLUDES, _exclude_spec

    probes = [
        "a.py", "x/.venv/", ".venv/", "pkg/__pycache__/", "m.pyc", "deep/a/b.pyo", ".DS_Store",
        "a/.DS_Store", "proj.egg-info/", "a/proj.egg-info/", ".gitignore", "x.swp", "x.swpx",
        "node_modules/", "src/node_modules/", ".coverage", ".coverage.x", ".dsec/", "Thumbs.db",
    ]  # fmt: skip
    reference = pathspec.GitIgnoreSpec.from_lines([*DEFAULT_EXCLUDES, "build/", "*.log"])
    fast = _exclude_spec(("build/", "*.log"))
    for probe in [*probes, "build/", "a/build/", "x.log"]:
        assert fast.match(probe) == reference.match_file(probe), probe


def test_a_walk_decides_by_name_exactly_as_by_whole_path(tmp_path: Path) -> None:
    """Patterns without an inner slash are matched on each name once per listing; what is
    listed is what matching each whole path (and its directories) with pathspec keeps."""
    import pathspec
    from dsec_core.codebundle import DEFAULT_EXCLUDES

    root = tmp_path / "proj"
    names = ["mod.py", "mod.pyc", "x.log", "build", "keep.txt", ".DS_Store", "a.swp"]
    for d in ["", "pkg", "pkg/build", "pkg/sub", "pkg/__pycache__", "docs/x.log", "node_modules"]:
        for name in names:
            if name != "build" or not d:  # (pkg/build is a directory)
                write(root, f"{d}/{name}" if d else name, "x")
    for extra, gone in [
        (("*.log", "build/"), {"pkg/build/mod.py", "x.log", "pkg/sub/x.log"}),
        (("*.log", "pkg/sub/"), {"pkg/sub/mod.py", "docs/x.log/keep.txt"}),
    ]:
        reference = pathspec.GitIgnoreSpec.from_lines([*DEFAULT_EXCLUDES, *extra])
        expected = []
        for path in sorted(p.relative_to(root).as_posix() for p in root.rglob("*")):
            if (root / path).is_dir():
                continue
            parts = path.split("/")
            dirs = ["/".join(parts[:i]) + "/" for i in range(1, len(parts))]
            if not any(reference.match_file(p) for p in [*dirs, path]):
                expected.append(path)
        listed = paths(root, extra)
        assert listed == expected
        assert not gone & set(listed) and {"mod.py", "pkg/mod.py"} <= set(listed)


def test_no_git_is_run_for_a_tree_in_no_repository(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsec_core import codebundle

    def no_git(*args: object, **kw: object) -> None:
        raise AssertionError("git was started")

    monkeypatch.setattr(codebundle, "_git", no_git)
    assert "agent.py" in paths(tree) and git_info(tree) is None


# --- bounds and special files -------------------------------------------------------------------


def test_sparse_file_over_max_size_is_refused_naming_the_largest_files(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    write(root, "agent.py")
    with (root / "zeros.bin").open("wb") as fh:
        fh.truncate(2 * 2**30)  # 2 GiB apparent, nothing on disk, a few KB compressed
    with pytest.raises(
        BundleError,
        match=r"2\.0 GiB once extracted, over include_code\.max_size"
        r" 256\.0 MiB; largest files: zeros\.bin \(2\.0 GiB\), agent\.py",
    ):
        build_bundle(root, max_size=DEFAULT_MAX_SIZE)


def test_an_archive_over_the_bound_readers_fetch_is_not_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers fetch at most ``archive_bound(max_size)`` bytes; an archive the client would
    build past it (many files' headers, incompressible data) is refused where it is built, with
    what to do, and no file is left."""
    from dsec_core import codebundle

    root = tmp_path / "proj"
    write(root, "agent.py")
    (root / "noise.bin").write_bytes(os.urandom(64 * 1024))
    assert codebundle.archive_bound(2**20) == 2**20 + 2**20 // 64 + 16 * 2**20
    monkeypatch.setattr(codebundle, "archive_bound", lambda max_size: max_size // 64)
    out = tmp_path / "out" / "b.tar.zst"
    with pytest.raises(BundleError, match=r"raise max_size or exclude files"):
        build_bundle(root, max_size=2**20, out=out)
    assert not out.exists() and list(out.parent.iterdir()) == []


def _raw_archive(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(raw)


def _header(name: str, size: int, kind: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.GNU_FORMAT)


def _padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("a 1 MiB PAX header", "an extended header of"),
        ("a 1 MiB GNU long name", "an extended header of"),
        ("400 PAX headers in a row", "not a valid bundle archive"),
        ("a sparse member", "sparse"),
        ("a PAX sparse map that is no number", "not a valid bundle archive"),
        ("a path 200 levels deep", "deeper than 128 levels"),
        ("a path of 5,000 bytes", "a path over 4096 bytes"),
    ],
)
def test_what_tarfile_reads_before_a_member_is_bounded_and_refused(
    tmp_path: Path, case: str, needle: str
) -> None:
    """A few KB of archive made tarfile read gigabytes before any check of ours (an extended
    header is read whole, a sparse map expanded), or raised something else than a BundleError
    (a ValueError, a RecursionError): both the policy's scan and the node's extraction refuse
    these now, at once, with a BundleError."""
    end = _header("a.py", 1, tarfile.REGTYPE) + _padded(b"x") + b"\0" * 1024
    if case == "a 1 MiB PAX header":
        record = b"%d comment=%s\n" % (2**20 + 18, b"x" * 2**20)
        raw = _header("p", len(record), tarfile.XHDTYPE) + _padded(record) + end
    elif case == "a 1 MiB GNU long name":
        raw = _header("././@LongLink", 2**20, tarfile.GNUTYPE_LONGNAME) + b"a" * 2**20 + end
    elif case == "400 PAX headers in a row":
        record = b"13 path=a.py\n"
        one = _header("p", len(record), tarfile.XHDTYPE) + _padded(record)
        raw = one * 400 + end
    elif case == "a sparse member":
        raw = _header("s", 0, tarfile.GNUTYPE_SPARSE) + end
    elif case == "a PAX sparse map that is no number":
        record = b"21 GNU.sparse.map=x\n"
        raw = _header("p", len(record), tarfile.XHDTYPE) + _padded(record) + end
    elif case == "a path 200 levels deep":
        info = tarfile.TarInfo("/".join(["d"] * 200) + ".py")
        raw = info.tobuf(format=tarfile.PAX_FORMAT) + b"\0" * 1024
    else:
        info = tarfile.TarInfo("a" * 5000)
        raw = info.tobuf(format=tarfile.PAX_FORMAT) + b"\0" * 1024
    archive = _raw_archive(raw)
    assert len(archive) < 8192
    with pytest.raises(BundleError, match=needle):
        extract_bundle(archive, tmp_path / "out", max_size=2**30)
    with pytest.raises(BundleError, match=needle):
        list(read_members(archive, lambda rel, m: True, max_size=2**30))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("an unknown PAX field", "extended header field 'comment' refused"),
        ("a PAX field twice", "extended header field 'path' refused"),
        ("a link name on a regular file", "a link name on a non-link"),
        ("a name part over 255 bytes", "a name over 255 bytes"),
        ("a 128 MiB zstd window", "not a valid bundle archive"),
    ],
)
def test_what_no_bundle_holds_is_refused_by_the_scan_and_the_extraction(
    tmp_path: Path, case: str, needle: str
) -> None:
    """A third review: tarfile kept every member it read with all its PAX fields (2,000
    members of 9,000 three-letter fields: 1.5 GB, 34 s), read a GNU long link on a regular
    file, and a zstd frame could ask for a 128 MiB window. Fields are a bundle's own few, each
    once; nothing read is kept; the window is 8 MiB at most."""
    raw = io.BytesIO()
    level = 3
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("a.py")
        if case == "an unknown PAX field":
            info.pax_headers = {"comment": "x"}
        elif case == "a link name on a regular file":
            info.linkname = "elsewhere"
        elif case == "a name part over 255 bytes":
            info.name = "n" * 300 + ".py"
        tar.addfile(info, io.BytesIO(b""))
    data = raw.getvalue()
    if case == "a PAX field twice":
        record = b"13 path=a.py\n"
        data = (_header("p", 2 * len(record), tarfile.XHDTYPE) + _padded(record * 2)) + data
    if case == "a 128 MiB zstd window":  # a stream: no content size lets it shrink the window
        params = zstandard.ZstdCompressionParameters.from_level(level, window_log=27)
        out = io.BytesIO()
        compressor = zstandard.ZstdCompressor(compression_params=params)
        with compressor.stream_writer(out, closefd=False) as writer:
            writer.write(data)
        archive = out.getvalue()
        assert zstandard.get_frame_parameters(archive).window_size == 2**27
    else:
        archive = _raw_archive(data)
    with pytest.raises(BundleError, match=needle):
        extract_bundle(archive, tmp_path / "out", max_size=2**30)
    with pytest.raises(BundleError, match=needle):
        list(read_members(archive, lambda rel, m: True, max_size=2**30))


def test_a_tree_of_more_entries_than_readers_take_is_refused_before_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Directories count as entries where a bundle is read: the client counts them too, so a
    tree too large is refused before it is uploaded, not after."""
    from dsec_core import codebundle

    root = tmp_path / "proj"
    for rel in ("a/x.py", "a/b/y.py", "z.py"):
        write(root, rel)
    monkeypatch.setattr(codebundle, "MAX_MEMBERS", 4)
    with pytest.raises(BundleError, match="3 files and 2 directories, more than the 4 entries"):
        build_bundle(root)


def test_a_scan_past_its_deadline_ends() -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(tarfile.TarInfo("a.py"), io.BytesIO(b""))
    with pytest.raises(BundleError, match="took more than"):
        list(read_members(_raw_archive(raw.getvalue()), lambda r, m: True, deadline_s=-1))


def test_a_directory_named_again_counts_again(tmp_path: Path) -> None:
    """A million entries for one directory (a 43 KB archive) cost a minute of a shared scan
    thread, uncounted: each member counts."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for _ in range(300):
            info = tarfile.TarInfo("d")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
    archive = _raw_archive(raw.getvalue())
    with pytest.raises(BundleError, match="more than 200 entries"):
        list(read_members(archive, lambda rel, m: True, max_members=200))
    with pytest.raises(BundleError, match="more than 200 entries"):
        extract_bundle(archive, tmp_path / "out", max_members=200)


def test_directories_a_path_implies_count_as_entries(tmp_path: Path) -> None:
    """2,000 members 50 levels deep made 100,000 directories on the node while the bound on
    entries (an inode bound) counted 2,000: each directory a path implies counts now."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(30):
            info = tarfile.TarInfo(f"m{i}/" + "/".join(["d"] * 9) + "/x.py")
            tar.addfile(info, io.BytesIO(b""))
    archive = _raw_archive(raw.getvalue())
    with pytest.raises(BundleError, match="more than 200 entries"):
        extract_bundle(archive, tmp_path / "out", max_members=200)
    with pytest.raises(BundleError, match="more than 200 entries"):
        list(read_members(archive, lambda rel, m: True, max_members=200))
    # 30 members and their 300 directories fit a bound of 330, named directories once
    assert len(extract_bundle(archive, tmp_path / "ok", max_members=330)) == 30


def test_extraction_counts_bytes_written_not_the_manifest(tmp_path: Path) -> None:
    # 8 MiB of zeros compress to a few hundred bytes; a bound of 1 MiB stops the extraction.
    archive = make_archive(reg("ok.py", b"x"), reg("zeros.bin", bytes(8 * 2**20)))
    assert len(archive) < 4096
    dest = tmp_path / "dest"
    with pytest.raises(
        BundleError,
        match=r"'zeros\.bin': the bundle expands past "
        r"include_code\.max_size 1\.0 MiB",
    ):
        extract_bundle(archive, dest, max_size=2**20)
    assert list(tmp_path.iterdir()) == []


def test_extraction_refuses_a_header_over_the_bound_before_writing(tmp_path: Path) -> None:
    # The header's size is checked before the file is written; the bytes written are counted
    # too (test above), so neither a header nor a manifest can understate what lands on disk.
    info, _ = reg("big.bin", b"")
    info.size = 2 * 2**20
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    archive = zstandard.ZstdCompressor().compress(raw.getvalue())
    with pytest.raises(BundleError, match="expands past"):
        extract_bundle(archive, tmp_path / "dest", max_size=2**20)
    assert list(tmp_path.iterdir()) == []


def test_extraction_bounds_the_number_of_entries(tmp_path: Path) -> None:
    archive = make_archive(*(reg(f"f{i}") for i in range(11)))
    with pytest.raises(BundleError, match=r"'f10': more than 10 entries"):
        extract_bundle(archive, tmp_path / "dest", max_members=10)
    assert list(tmp_path.iterdir()) == []


def test_fifo_socket_are_left_out_and_listed(tmp_path: Path) -> None:
    import socket

    root = tmp_path / "proj"
    write(root, "agent.py")
    os.mkfifo(root / "pipe")
    (root / "sub").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "sub" / "s.sock"))
    try:
        bundle = build_bundle(root)
    finally:
        sock.close()
    assert [f.path for f in bundle.manifest.files] == ["agent.py"]
    assert bundle.skipped == ("pipe (fifo)", "sub/s.sock (socket)")


def test_open_real_dir_refuses_a_symlinked_component(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "out").symlink_to(outside)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(NotADirectoryError, match="a/out is a symlink"):
            open_real_dir(fd, "a/out/x", create=True)
        os.close(open_real_dir(fd, "a/b/c", create=True))
    finally:
        os.close(fd)
    assert list(outside.iterdir()) == []
    assert (root / "a" / "b" / "c").is_dir()


def test_declared_max_size_reads_the_spec_before_validation() -> None:
    from dsec_core.codebundle import MAX_SIZE_LIMIT, declared_max_size
    from dsec_core.spec.models import CODE_MAX_SIZE_DEFAULT, CODE_MAX_SIZE_LIMIT

    assert (DEFAULT_MAX_SIZE, MAX_SIZE_LIMIT) == (CODE_MAX_SIZE_DEFAULT, CODE_MAX_SIZE_LIMIT)
    assert declared_max_size("name: x\ninclude_code: {max_size: 200MiB}\n") == 200 * 2**20
    assert declared_max_size("include_code: {max_size: 64GiB}\n") == MAX_SIZE_LIMIT  # capped
    for unset in ("name: x\n", "include_code: {max_size: lots}\n", "[not, a, map]", ": :"):
        assert declared_max_size(unset) == DEFAULT_MAX_SIZE, unset


@pytest.mark.parametrize(
    ("kind", "mode"),
    [("file", 0o4755), ("file", 0o777), ("file", 0o100644), ("file", -1), ("symlink", 0o644)],
)
def test_a_manifest_entry_names_only_the_modes_a_tree_is_recorded_with(
    kind: str, mode: int
) -> None:
    """A setuid bit or a world-writable file in a (hostile) manifest would be handed to whoever
    restores it as root: refused when the manifest is read."""
    from dsec_core.codebundle import FileEntry

    with pytest.raises(ValueError, match="is recorded as"):
        FileEntry(path="a", kind=kind, size=1, mode=mode, blake3="0" * 64)  # type: ignore[arg-type]
    FileEntry(path="a", kind="file", size=1, mode=0o755, blake3="0" * 64)
    FileEntry(path="a", kind="symlink", size=1, mode=0o777, blake3="0" * 64, target="b")


def test_a_name_or_link_target_that_is_not_utf8_is_refused_naming_the_file(tmp_path: Path) -> None:
    from dsec_core.codebundle import BundleError, build_bundle, scan_tree

    root = tmp_path / "proj"
    root.mkdir()
    (root / "ok-é.py").write_text("x = 1\n")  # UTF-8 beyond ASCII: fine
    bad = os.path.join(os.fsencode(root), b"caf\xe9.py")  # Latin-1 bytes
    with open(bad, "wb") as fh:
        fh.write(b"x = 1\n")
    for make in (build_bundle, scan_tree):
        with pytest.raises(
            BundleError, match=re.escape("b'caf\\xe9.py': the file's name is not UTF-8")
        ):
            make(root)
    os.unlink(bad)
    assert [f.path for f in build_bundle(root).manifest.files] == ["ok-é.py"]
