"""The snapshot library against real SeaweedFS and OpenBao: dedup, diff, verify, tamper, restore."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import stat
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from dsec_core import identity
from nacl.signing import SigningKey

from dsec_snapstore import SnapshotInputs, SnapshotStore
from dsec_snapstore.adapters.objectstore import S3ObjectStore
from dsec_snapstore.adapters.vault import VaultKeyStore
from dsec_snapstore.domain import PeriodicPolicy, RetentionPolicy
from dsec_snapstore.errors import (
    InvalidInput,
    SnapshotExists,
    SnapshotNotFound,
    StoreBusy,
    VerificationFailed,
)
from dsec_snapstore.manifest import GpuDevice, GpuRecord, SignedManifest, manifest_key
from dsec_snapstore.packcache import OWN
from dsec_snapstore.results import CreateResult

if TYPE_CHECKING:
    from dsec_testing.stack import S3Info, VaultInfo

pytestmark = pytest.mark.integration

SECRET = "hunter2-very-secret"


@pytest.fixture
def objects(s3: S3Info) -> S3ObjectStore:
    return S3ObjectStore(
        s3.endpoint, s3.access_key, s3.secret_key, s3.bucket, prefix=f"t-{uuid.uuid4().hex}/"
    )


@pytest.fixture
def store(objects: S3ObjectStore, vault: VaultInfo, tmp_path: Path) -> Iterator[SnapshotStore]:
    keys = VaultKeyStore(vault.addr, vault.token)
    with SnapshotStore(
        objects, signing_key=SigningKey.generate(), keys=keys, cache_dir=tmp_path / "cache"
    ) as s:
        yield s


@pytest.fixture
def code(tmp_path: Path) -> Path:
    root = tmp_path / "code"
    (root / "pkg").mkdir(parents=True)
    (root / "agent.py").write_text("import pkg\n\ndef score():\n    return 0.92\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "tools.py").write_text("TOOLS = ['web_search']\n")
    (root / "data.bin").write_bytes(random.Random(7).randbytes(700_000))  # fixed CDC cuts
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "alias.py").symlink_to("agent.py")
    (root / ".venv").mkdir()
    (root / ".venv" / "site.py").write_text("excluded")
    hour_ago = (datetime.now(UTC) - timedelta(hours=1)).timestamp()
    for path in root.rglob("*"):
        if not path.is_symlink():  # written long before the snapshot, as code usually is
            os.utime(path, (hour_ago, hour_ago))
    return root


def inputs(code: Path, **kw: object) -> SnapshotInputs:
    return SnapshotInputs(code_dir=code, kernel={"osrelease": "6.1"}, **kw)  # type: ignore[arg-type]


def test_second_snapshot_uploads_only_new_chunks(store: SnapshotStore, code: Path) -> None:
    first = store.create("s1", inputs(code))
    assert first.chunks_uploaded == first.chunks_total > 0
    (code / "pkg" / "tools.py").write_text("TOOLS = ['web_search', 'calc']\n")
    second = store.create("s2", inputs(code))
    assert second.manifest.parent == "s1"
    assert second.files_rehashed == 1
    assert second.chunks_uploaded == 1
    assert second.bytes_uploaded < 200
    assert ".venv/site.py" not in second.manifest.code.by_path()
    assert [s.name for s in store.list_snapshots()] == ["s1", "s2"]


def test_of_two_creates_of_one_name_at_once_the_second_to_finish_is_refused(
    store: SnapshotStore, objects: S3ObjectStore, code: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both find the name free when they start (a request delivered again while the first still
    runs, or two nodes); the manifest is written only if absent (S3's conditional write), so
    the one that finishes second is refused, and what is stored is what the first reported."""
    other = SnapshotStore(objects, signing_key=store._signing_key)  # another node agent's
    done: list[CreateResult] = []
    real = SnapshotStore._store_packs

    def slow(self: SnapshotStore, packer: object) -> None:
        real(self, packer)  # type: ignore[arg-type]
        if self is store and not done:  # the other create starts and ends meanwhile
            (code / "other.py").write_text("OTHER = 1\n")
            done.append(other.create("race", inputs(code)))

    monkeypatch.setattr(SnapshotStore, "_store_packs", slow)
    with pytest.raises(SnapshotExists, match="'race' exists already"):
        store.create("race", inputs(code))
    assert store.load("race").id == done[0].manifest.id
    assert "other.py" in store.load("race").code.by_path()
    other.close()


def test_names_are_unique_and_validated(store: SnapshotStore, code: Path) -> None:
    store.create("s1", inputs(code))
    with pytest.raises(SnapshotExists, match="'s1' exists"):
        store.create("s1", inputs(code))
    with pytest.raises(InvalidInput, match="not valid"):
        store.create("../x", inputs(code))
    with pytest.raises(InvalidInput, match="not a directory"):
        store.create("s9", inputs(code / "missing"))
    with pytest.raises(SnapshotNotFound, match="'nope'"):
        store.verify("nope")


def test_a_file_name_that_is_not_utf8_is_refused_by_name_and_a_rollback_removes_it(
    store: SnapshotStore, code: Path, tmp_path: Path
) -> None:
    """A sandbox's file named with raw bytes (``b'bad\\xff'``) cannot go into a manifest (JSON,
    UTF-8). Found by an adversarial review: a snapshot failed at signing with an encoder's
    error naming no file. It is refused before anything is read or stored, naming the file;
    a rollback of a tree holding one removes it like any file the snapshot lacks."""
    store.create("clean", inputs(code))
    bad = os.path.join(os.fsencode(code), b"pkg", b"bad\xff.py")
    with open(bad, "wb") as fh:
        fh.write(b"x = 1\n")
    with pytest.raises(
        InvalidInput, match=re.escape("b'pkg/bad\\xff.py': the file's name is not UTF-8")
    ):
        store.create("dirty", inputs(code))
    assert [s.name for s in store.list_snapshots()] == ["clean"]
    os.unlink(bad)
    link = os.path.join(os.fsencode(code), b"pkg", b"link.py")
    os.symlink(b"target-\xfe", link)
    with pytest.raises(InvalidInput, match=re.escape("link target is not UTF-8 (b'target-\\xfe')")):
        store.create("dirty", inputs(code))
    with open(bad, "wb") as fh:
        fh.write(b"x = 1\n")
    back = store.restore("clean", code, sync=True)
    assert not os.path.lexists(bad) and not os.path.lexists(link) and back.files_written == 0
    assert store.create("dirty", inputs(code)).chunks_uploaded == 0  # (the clean tree again)


def test_diff_shows_files_lines_env_and_kernel(store: SnapshotStore, code: Path) -> None:
    store.create("a", inputs(code, env={"MODE": "train", "KEY": SECRET}))
    (code / "agent.py").write_text("import pkg\n\ndef score():\n    return 0.87\n")
    (code / "new.py").write_text("x = 1\n")
    (code / "run.sh").unlink()
    store.create("b", SnapshotInputs(code_dir=code, env={"MODE": "eval", "KEY": SECRET},
                                     kernel={"osrelease": "6.2"}))  # fmt: skip
    d = store.diff("a", "b")
    assert [f.path for f in d.code.added] == ["new.py"]
    assert [f.path for f in d.code.removed] == ["run.sh"]
    (change,) = d.code.changed
    assert change.path == "agent.py" and change.diff is not None
    assert "-    return 0.92" in change.diff and "+    return 0.87" in change.diff
    assert d.env.changed == ("MODE",)
    assert d.kernel.changed == {"osrelease": ("6.1", "6.2")}


def test_secrets_never_reach_the_object_store(
    store: SnapshotStore, objects: S3ObjectStore, code: Path
) -> None:
    result = store.create(
        "s", inputs(code, env={"API_KEY": SECRET}, audit_segment=b"GET /admin " + SECRET.encode())
    )
    for key in objects.list(""):
        assert SECRET.encode() not in objects.get(key), key
    assert result.manifest.env is not None and "API_KEY" in result.manifest.env.hashes
    assert store.read_audit_segment("s") == b"GET /admin " + SECRET.encode()


def test_verify_passes_then_names_a_tampered_chunk(
    store: SnapshotStore, objects: S3ObjectStore, code: Path
) -> None:
    result = store.create("s", inputs(code))
    assert store.verify("s").ok
    tools = result.manifest.code.by_path()["pkg/tools.py"]
    loc = store.index.lookup(tools.blake3)
    assert loc is not None
    body = bytearray(objects.get(loc.pack))  # one byte of its frame in the pack flipped
    body[loc.offset + loc.length - 2] ^= 0x55
    objects.put(loc.pack, bytes(body))
    report = store.verify("s")
    assert not report.ok
    # The altered frame (a group frame of small files) is named, with the file whose bytes
    # no longer match; nothing else is.
    in_frame = {
        f.path
        for f in result.manifest.code.files
        if (other := store.index.lookup(f.blake3)) and other.offset == loc.offset
    }
    assert "pkg/tools.py" in in_frame and report.problems
    for problem in report.problems:
        assert f"{loc.pack}@{loc.offset}:" in problem
        assert any(f"used by {path}" in problem for path in in_frame)
    # This node keeps a checked copy of each pack it stored: its restore is the snapshot's
    # exact bytes, read from that copy (verify, above, checked what S3 holds).
    store.restore("s", code.parent / "here")
    assert (code.parent / "here" / "pkg" / "tools.py").read_bytes() == (
        code / "pkg" / "tools.py"
    ).read_bytes()
    # A node without a copy reads the altered pack: refused, naming it; nothing left behind.
    with (
        other_node(store, objects, code.parent / "node-2") as there,
        pytest.raises(VerificationFailed, match=loc.pack),
    ):
        there.restore("s", code.parent / "out")
    assert not (code.parent / "out").exists()


def other_node(store: SnapshotStore, objects: S3ObjectStore, cache: Path) -> SnapshotStore:
    """The same object store seen from another node: its own (empty) cache, trusting the
    key that signed ``store``'s snapshots."""
    from nacl.signing import VerifyKey

    return SnapshotStore(
        objects,
        signing_key=SigningKey.generate(),
        keys=store.keys,
        cache_dir=cache,
        trusted_keys=[VerifyKey(store.public_key)],
    )


def store_reads() -> float:
    """Pack reads the object store served so far (the metric a node exports)."""
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value("dsec_snapshot_pack_reads_total", {"source": "store"})
    return value or 0.0


def test_a_restore_and_a_rollback_on_the_node_that_took_the_snapshot_read_no_pack_from_s3(
    store: SnapshotStore, objects: S3ObjectStore, code: Path, tmp_path: Path
) -> None:
    (code / "data.bin").write_bytes(os.urandom(300_000))
    store.create("s", inputs(code))
    before = store_reads()
    store.restore("s", tmp_path / "out")
    (tmp_path / "out" / "agent.py").write_text("changed\n")
    back = store.restore("s", tmp_path / "out", sync=True)
    assert back.files_written == 1
    assert store_reads() == before  # every pack came from this node's copies
    assert (tmp_path / "out" / "data.bin").read_bytes() == (code / "data.bin").read_bytes()
    # Another node reads them from S3 once, then from the copies its restore kept.
    with other_node(store, objects, tmp_path / "node-2") as there:
        there.restore("s", tmp_path / "there-1")
        read_once = store_reads()
        assert read_once > before
        there.restore("s", tmp_path / "there-2")
        assert store_reads() == read_once
        assert (tmp_path / "there-2" / "data.bin").read_bytes() == (code / "data.bin").read_bytes()


def test_a_nodes_copy_altered_on_its_disk_is_dropped_and_the_pack_read_from_s3(
    store: SnapshotStore, code: Path, tmp_path: Path
) -> None:
    (code / "data.bin").write_bytes(os.urandom(300_000))
    store.create("s", inputs(code))
    assert store.pack_cache is not None
    assert store.pack_cache.flush(10)  # (written behind the create)
    copies = sorted(store.pack_cache.directory.iterdir())
    assert copies and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in copies)
    assert stat.S_IMODE(store.pack_cache.directory.stat().st_mode) == 0o700
    altered = {}
    for path in copies:  # every copy altered in its first frame
        body = bytearray(path.read_bytes())
        body[10] ^= 0x55
        path.write_bytes(bytes(body))
        altered[path] = bytes(body)
    before = store_reads()
    store.restore("s", tmp_path / "out")
    for path in (code / "agent.py", code / "pkg" / "tools.py", code / "data.bin"):
        assert (tmp_path / "out" / path.relative_to(code)).read_bytes() == path.read_bytes()
    assert store_reads() == before + len(copies)  # each pack read again from S3
    assert store.pack_cache.flush(10)  # ... and what S3 sent, checked, kept instead
    for path, bad in altered.items():
        assert not path.exists() or path.read_bytes() != bad


def test_verify_names_a_missing_chunk_and_a_tampered_audit_blob(
    store: SnapshotStore, objects: S3ObjectStore, code: Path
) -> None:
    result = store.create("s", inputs(code, audit_segment=b"audit"))
    data = result.manifest.code.by_path()["data.bin"]
    first_chunk = result.manifest.chunks_of(data)[0]
    loc = store.index.lookup(first_chunk)
    assert loc is not None
    objects.delete_many([loc.pack])
    assert result.manifest.audit is not None
    objects.put(result.manifest.audit.object_key, b"forged")
    problems = store.verify("s").problems
    assert any(
        f"{loc.pack}: missing (holds chunk {first_chunk}) (used by data.bin)" in p for p in problems
    )
    assert any("(audit segment): content does not match" in p for p in problems)


def test_altered_manifest_fails_signature_check(
    store: SnapshotStore, objects: S3ObjectStore, code: Path
) -> None:
    store.create("s", inputs(code))
    doc = json.loads(objects.get(manifest_key("s")))
    (agent,) = [f for f in doc["manifest"]["code"]["files"] if f["path"] == "agent.py"]
    agent["mode"] = 0o755
    objects.put(manifest_key("s"), json.dumps(doc).encode())
    report = store.verify("s")
    assert report.problems == (
        "manifest snapshots/s.json: signature does not match its content (altered)",
    )
    with pytest.raises(VerificationFailed, match="signature"):
        store.restore("s", code.parent / "out")
    objects.put(manifest_key("s"), b"{not json")
    assert "not a valid manifest" in store.verify("s").problems[0]


def test_a_cold_node_checks_the_manifest_as_stored_and_refuses_it_altered_in_place(
    store: SnapshotStore, objects: S3ObjectStore, code: Path
) -> None:
    """A node that never read the snapshot checks the signature over the manifest's stored
    bytes and parses those very bytes: it restores the snapshot, with the digest the create
    reported. The same document altered by one byte in place (its layout kept), copied under
    another name, or given another member is refused, as before."""
    created = store.create("s", inputs(code))
    with other_node(store, objects, code.parent / "node-2") as there:
        restored = there.restore("s", code.parent / "out")
        with pytest.raises(SnapshotNotFound, match="'nope'"):
            there.restore("nope", code.parent / "none")  # (the index read meanwhile)
    assert restored.manifest == created.manifest
    assert restored.manifest_digest == created.manifest_digest
    assert (code.parent / "out" / "data.bin").read_bytes() == (code / "data.bin").read_bytes()
    raw = objects.get(manifest_key("s"))
    assert raw.count(b'"mode":420') > 1
    signature = raw[raw.rindex(b',"signature":') + 1 : -1]
    cases = {
        "s": (raw.replace(b'"mode":420', b'"mode":493', 1), "signature does not match"),
        "t": (raw, "records name 's', not 't'"),
        "u": (raw[:-1] + b',"note":"x"}', "not a valid manifest"),
        # Nested too deep for a decoder, and a first `manifest` member that is no UTF-8 (a
        # reader that skips it unchecked must not take the document where the GC refuses it).
        "v": (b'{"manifest":' + b"[" * 3000 + b"]" * 3000 + b"," + signature + b"}", "not a valid"),
        "w": (b'{"manifest":{"x":"\xff"},' + raw[1:], "not a valid manifest"),
    }
    for name, (doc, problem) in cases.items():
        objects.put(manifest_key(name), doc)
        with (
            other_node(store, objects, code.parent / f"node-{name}") as there,
            pytest.raises(VerificationFailed, match=problem),
        ):
            assert problem in " ".join(there.verify(name).problems)
            there.restore(name, code.parent / f"out-{name}")
        assert not (code.parent / f"out-{name}").exists()


def test_the_manifest_kept_after_a_create_is_the_one_stored(
    store: SnapshotStore, objects: S3ObjectStore, code: Path
) -> None:
    """A snapshot taken by a store is not parsed again when it reads it back: what it keeps
    must be exactly what a reader parses from S3."""
    result = store.create("s", inputs(code))
    stored = SignedManifest.model_validate_json(objects.get(manifest_key("s"))).manifest
    assert stored == result.manifest
    assert store.load("s") == stored


def test_packs_go_with_an_unsigned_payload_and_the_manifest_signed(
    store: SnapshotStore, objects: S3ObjectStore, code: Path
) -> None:
    """Packs and index documents, checked by their BLAKE3 on every read, are sent without a
    SHA-256 of the body (as over TLS); the manifest and the `ls` row keep it."""
    trace = io.StringIO()
    objects._client.trace_on(trace)
    try:
        store.create("s", inputs(code))
    finally:
        objects._client.trace_off()
    sent: dict[str, set[str]] = {}
    for request in trace.getvalue().split("---------START-HTTP---------")[1:]:
        line, _, rest = request.strip().partition("\n")
        method, path, _ = line.split(" ")
        if method != "PUT":
            continue
        kind = path.split("/")[3]  # /bucket/prefix/<kind>/...
        (payload,) = re.findall(r"(?im)^x-amz-content-sha256: (\S+)$", rest)
        sent.setdefault(kind, set()).add("unsigned" if payload == "UNSIGNED-PAYLOAD" else payload)
    assert sent["packs"] == sent["pack-index"] == {"unsigned"}
    for kind in ("snapshots", "snapshot-index"):
        assert len(sent[kind]) == 1 and re.fullmatch("[0-9a-f]{64}", next(iter(sent[kind])))
    assert store.verify("s").ok
    store.restore("s", code.parent / "out")
    assert (code.parent / "out" / "data.bin").read_bytes() == (code / "data.bin").read_bytes()
    big = random.Random(3).randbytes((5 << 20) + 7)  # past the client's part size: multipart
    objects.put("packs/big", big, checked_on_read=True)
    assert objects.get("packs/big") == big


def test_a_stat_cache_kept_in_memory_is_dropped_with_its_file(
    store: SnapshotStore, code: Path, tmp_path: Path
) -> None:
    first = store.create("s1", inputs(code))
    assert store.create("s2", inputs(code)).files_rehashed == 0
    (cache_file,) = (tmp_path / "cache").glob("*.msgpack")
    cache_file.unlink()  # removed by someone else: what was kept of it is not used
    assert store.create("s3", inputs(code)).files_rehashed == first.files_rehashed > 0
    cache_file.write_bytes(b"damaged")  # replaced by another file: read, found bad, not used
    assert store.create("s4", inputs(code)).files_rehashed == first.files_rehashed


def test_snapshot_signed_by_another_key_is_untrusted(
    objects: S3ObjectStore, store: SnapshotStore, code: Path, tmp_path: Path
) -> None:
    store.create("s", inputs(code))
    with SnapshotStore(objects, signing_key=SigningKey.generate()) as stranger:
        (problem,) = stranger.verify("s").problems
    assert "signed by untrusted key" in problem


@pytest.mark.parametrize(("role", "trusted"), [("nodeagent", True), ("policy", False)])
def test_a_key_the_root_certified_for_taking_snapshots_is_trusted_elsewhere(
    objects: S3ObjectStore, code: Path, role: str, trusted: bool
) -> None:
    """A node agent signs with its own key: a reader on another machine (its own key) trusts
    the manifest because the operator root certified that key for a role that takes
    snapshots; a certificate for any other role is not enough."""
    root = SigningKey.generate()
    key = SigningKey.generate()
    cert = identity.issue(root, bytes(key.verify_key), subject=role, role=role, node_id="n1")  # type: ignore[arg-type]
    with SnapshotStore(objects, signing_key=key, certificate=cert) as node:
        node.create("s", inputs(code))
    anchor = bytes(root.verify_key)
    with SnapshotStore(objects, signing_key=SigningKey.generate(), anchor=anchor) as reader:
        problems = reader.verify("s").problems
    if trusted:
        assert problems == ()
    else:
        assert "signed by untrusted key" in problems[0]
    with SnapshotStore(objects, signing_key=SigningKey.generate()) as no_anchor:
        assert "signed by untrusted key" in no_anchor.verify("s").problems[0]


def test_a_manifest_checked_once_is_refused_once_its_signers_certificate_expires(
    objects: S3ObjectStore, code: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store remembers the manifests it checked (a repeat load skips the signature check),
    but only while the certificate of the key that signed one is valid: after it expires the
    manifest is checked again, and refused."""
    root, key = SigningKey.generate(), SigningKey.generate()
    expires = datetime.now(UTC) + timedelta(hours=1)
    cert = identity.issue(
        root,
        bytes(key.verify_key),
        subject="nodeagent",
        role="nodeagent",  # type: ignore[arg-type]
        node_id="n1",
        expires_at=expires,
    )
    with SnapshotStore(objects, signing_key=key, certificate=cert) as node:
        node.create("s", inputs(code))
    anchor = bytes(root.verify_key)
    with SnapshotStore(objects, signing_key=SigningKey.generate(), anchor=anchor) as reader:
        assert reader.load("s").name == "s"  # checked, and remembered
        assert reader.load("s").name == "s"  # from memory

        class _AnHourLater(datetime):
            @classmethod
            def now(cls, tz: object = None) -> datetime:  # type: ignore[override]
                return expires + timedelta(seconds=1)

        monkeypatch.setattr("dsec_snapstore.store.datetime", _AnHourLater)
        monkeypatch.setattr("dsec_core.identity.datetime", _AnHourLater)
        with pytest.raises(VerificationFailed, match="untrusted key"):
            reader.load("s")


@pytest.fixture(params=["c", "python"])
def writer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which path writes a fresh restore's files: the C writer (dsec_snapstore._placefiles,
    built by `./taskw setup`) or, as where no compiler was found, Python's place()."""
    from dsec_snapstore import store as store_module

    assert store_module._write_new is not None, (
        "dsec-snapstore's C extension (dsec_snapstore._placefiles) is not built: `./taskw "
        "setup` needs a C compiler (gcc) and the interpreter's headers"
    )
    if request.param == "python":
        monkeypatch.setattr(store_module, "_write_new", None)
    mode: str = request.param
    return mode


def test_restore_materializes_the_tree(store: SnapshotStore, code: Path, writer: str) -> None:
    store.create("s", inputs(code))
    dest = code.parent / "restored"
    result = store.restore("s", dest)
    assert result.files_written == 6
    assert (dest / "agent.py").read_text() == (code / "agent.py").read_text()
    assert (dest / "data.bin").read_bytes() == (code / "data.bin").read_bytes()
    assert os.readlink(dest / "alias.py") == "agent.py"
    assert (dest / "run.sh").stat().st_mode & 0o777 == 0o755
    assert not (dest / ".venv").exists()
    with pytest.raises(InvalidInput, match="not an empty directory"):
        store.restore("s", dest)


def test_a_restore_that_fails_leaves_nothing_while_other_tasks_were_writing(
    store: SnapshotStore, objects: S3ObjectStore, tmp_path: Path, writer: str
) -> None:
    """A (hostile, signed) manifest names a path twice: the task writing its second copy fails
    while the tasks of the other packs still write; every one of them stops before the staging
    tree is removed, so nothing of it is left."""
    tree = tmp_path / "many"
    rng = random.Random(11)
    for d in range(4):
        (tree / f"d{d}").mkdir(parents=True)
        for i in range(150):
            (tree / f"d{d}" / f"f{i}.bin").write_bytes(rng.randbytes(30_000 + i))
    store.create("s", inputs(tree))
    manifest = store.load("s")
    files = manifest.code.files
    twice = manifest.model_copy(
        update={
            "name": "twice",
            "code": manifest.code.model_copy(update={"files": (*files, files[0])}),
        }
    )
    doc, _ = store._signed_document(twice)
    objects.put(manifest_key("twice"), doc)
    with pytest.raises(FileExistsError):
        store.restore("twice", tmp_path / "dest")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "many"]


def test_restored_files_get_their_recorded_mode_under_any_umask(
    store: SnapshotStore, code: Path, writer: str
) -> None:
    store.create("s", inputs(code))
    old = os.umask(0o077)  # files are created with their mode only when the umask keeps it
    try:
        store.restore("s", code.parent / "private")
    finally:
        os.umask(old)
    store.restore("s", code.parent / "usual")
    for dest in (code.parent / "private", code.parent / "usual"):
        assert (dest / "run.sh").stat().st_mode & 0o777 == 0o755
        assert (dest / "agent.py").stat().st_mode & 0o777 == 0o644


def test_rollback_syncs_in_place_and_keeps_excluded_files(store: SnapshotStore, code: Path) -> None:
    store.create("good", inputs(code))
    (code / "agent.py").write_text("broken\n")
    (code / "stray.py").write_text("x\n")
    (code / "pkg" / "tools.py").unlink()
    result = store.restore("good", code, sync=True)
    assert (result.files_written, result.files_removed) == (2, 1)
    assert store.verify_code_dir("good", code).ok
    assert (code / ".venv" / "site.py").read_text() == "excluded"


def test_a_rollback_never_writes_through_a_parent_swapped_for_a_link(
    store: SnapshotStore, code: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sandbox running in its code dir swaps a directory for a symlink to elsewhere right
    after the rollback checked the parents: nothing is written or removed there."""
    from dsec_snapstore import store as store_module

    store.create("good", inputs(code))
    (code / "pkg" / "tools.py").write_text("TOOLS = []\n")
    (code / "pkg" / "stray.py").write_text("x = 1\n")  # not in the snapshot: removed
    outside = code.parent / "outside"
    outside.mkdir()
    (outside / "stray.py").write_text("not the tree's\n")
    checked = store_module._targets

    def racing(root: Path, entries: list[Any]) -> list[Any]:
        out = checked(root, entries)
        (code / "pkg").rename(code / "pkg.moved")
        (code / "pkg").symlink_to(outside)
        return out

    monkeypatch.setattr(store_module, "_targets", racing)
    with pytest.raises(InvalidInput, match="changed while the rollback ran"):
        store.restore("good", code, sync=True)
    assert sorted(p.name for p in outside.iterdir()) == ["stray.py"]
    assert (outside / "stray.py").read_text() == "not the tree's\n"


def test_a_rollback_never_removes_through_a_parent_swapped_for_a_link(
    store: SnapshotStore, code: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.create("good", inputs(code))
    (code / "pkg" / "stray.py").write_text("x = 1\n")  # not in the snapshot: to be removed
    outside = code.parent / "outside"
    outside.mkdir()
    (outside / "stray.py").write_text("not the tree's\n")
    written = SnapshotStore._write_files

    def racing(self: SnapshotStore, *args: Any, **kwargs: Any) -> int:
        size: int = written(self, *args, **kwargs)
        (code / "pkg").rename(code / "pkg.moved")
        (code / "pkg").symlink_to(outside)
        return size

    monkeypatch.setattr(SnapshotStore, "_write_files", racing)
    result = store.restore("good", code, sync=True)
    assert result.files_removed == 1  # (it was in the tree when the tree was listed)
    assert (outside / "stray.py").read_text() == "not the tree's\n"
    assert (code / "pkg.moved" / "stray.py").exists()  # moved away by the sandbox itself


def test_rollback_honours_the_snapshots_own_exclude_patterns(
    store: SnapshotStore, code: Path
) -> None:
    (code / "model.ckpt").write_text("weights v1")
    store.create("good", inputs(code, exclude_patterns=("*.ckpt",)))
    (code / "model.ckpt").write_text("weights v2")  # excluded: neither restored nor removed
    (code / "run.ckpt").write_text("new, excluded too")
    (code / "agent.py").write_text("broken\n")
    result = store.restore("good", code, sync=True)
    assert (result.files_written, result.files_removed) == (1, 0)
    assert (code / "model.ckpt").read_text() == "weights v2" and (code / "run.ckpt").exists()
    assert store.verify_code_dir("good", code).ok


def test_code_check_lists_each_file_and_its_lines(store: SnapshotStore, code: Path) -> None:
    store.create("s", inputs(code))
    (code / "agent.py").write_text("import pkg\n\ndef score():\n    return 0.5\n")
    (code / "pkg" / "tools.py").unlink()
    (code / "extra.txt").write_text("?")
    check = store.verify_code_dir("s", code)
    lines = check.describe()
    assert "missing: pkg/tools.py" in lines
    assert "not in snapshot: extra.txt" in lines
    assert "changed: agent.py (content 41 -> 40 bytes)" in lines
    assert "-    return 0.92" in lines and "+    return 0.5" in lines
    with pytest.raises(VerificationFailed, match="does not match snapshot 's'"):
        store.require_code_match("s", code)


def test_gpu_model_check_uses_recorded_inventory(store: SnapshotStore, code: Path) -> None:
    a100 = GpuRecord(
        present=True,
        devices=(GpuDevice(index=0, name="NVIDIA A100", uuid="GPU-0", memory_total=1),),
    )
    store.create("s", inputs(code, gpu=a100))
    assert not store.check_gpu("s", a100).compatibility_mode
    assert store.check_gpu("s", GpuRecord(present=False, reason="none")).compatibility_mode


def test_delete_gc_and_retention(store: SnapshotStore, objects: S3ObjectStore, code: Path) -> None:
    s1 = store.create("s1", inputs(code, audit_segment=b"a")).manifest
    (code / "data.bin").write_bytes(os.urandom(1000))
    s2 = store.create("s2", inputs(code)).manifest
    expired = store.apply_retention(RetentionPolicy(keep_last=1))
    assert expired == ["s1"]
    assert [s.name for s in store.list_snapshots()] == ["s2"]
    report = store.gc(grace=timedelta(0))
    assert s1.audit is not None
    assert report.chunks_removed == len(s1.all_chunks() - s2.all_chunks())
    assert s1.audit.object_key in report.deleted
    assert store.verify("s2").ok
    assert not any(k.startswith("snapshot-audit/") for k in objects.list(""))


def test_gc_stops_when_a_manifest_is_unreadable(
    store: SnapshotStore, objects: S3ObjectStore, code: Path
) -> None:
    store.create("s", inputs(code))
    objects.put(manifest_key("s"), b"garbage")
    with pytest.raises(Exception, match=r"gc stopped: cannot read snapshots/s\.json"):
        store.gc(grace=timedelta(0))
    assert objects.list("packs/")


def test_periodic_snapshots_take_when_due_and_retain(store: SnapshotStore, code: Path) -> None:
    policy = PeriodicPolicy(interval=timedelta(hours=1), retention=RetentionPolicy(keep_last=2))
    t0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
    src = inputs(code, sandbox_id="sbx_1")
    taken = [store.run_periodic(policy, src, now=t0 + timedelta(minutes=m)) for m in (0, 30, 60)]
    assert [t.manifest.name if t else None for t in taken] == [
        "auto-20261130T100000Z",
        None,
        "auto-20261130T110000Z",
    ]
    store.run_periodic(policy, src, now=t0 + timedelta(hours=2))
    assert [s.name for s in store.list_snapshots()] == [
        "auto-20261130T110000Z",
        "auto-20261130T120000Z",
    ]


def test_a_store_without_a_cache_directory_writes_no_stat_cache(
    objects: S3ObjectStore, code: Path
) -> None:
    """Without a cache directory nothing is cached, and nothing is written anywhere: the stat
    cache once "saved" itself over ``/dev/null`` (an atomic rename onto the null device)."""
    with SnapshotStore(objects, signing_key=SigningKey.generate()) as store:
        first = store.create("s", inputs(code))
        second = store.create("t", inputs(code))
    assert second.files_rehashed == first.files_rehashed > 0  # no cache: all hashed again
    st = os.lstat(os.devnull)
    assert stat.S_ISCHR(st.st_mode)


def test_on_real_s3_a_gc_and_a_create_of_two_processes_exclude_each_other(
    store: SnapshotStore, objects: S3ObjectStore, code: Path
) -> None:
    """The store's locks (dsec_snapstore.locks) on SeaweedFS: its listing, its last-modified
    times and its deletes, as the two sides of a race see them."""
    store.create("before", inputs(code))
    other = S3ObjectStore.__new__(S3ObjectStore)
    other.__dict__.update(objects.__dict__)  # another client of the same bucket and prefix
    with SnapshotStore(
        other, signing_key=SigningKey.generate(), create_wait_s=0.2, gc_wait_s=0.2
    ) as elsewhere:
        with store.locks.exclusive(5.0) as held:  # a GC here
            with pytest.raises(StoreBusy, match=re.escape(held)):
                elsewhere.create("during", inputs(code))
            assert list(objects.list("locks/")) == [held]  # the create's own lock removed
        with store.locks.shared(5.0) as creating, pytest.raises(StoreBusy, match=creating):
            elsewhere.gc(grace=timedelta(0))  # a create here
        assert elsewhere.gc(grace=timedelta(0)).chunks_removed == 0  # free again; all live
    store.create("after", inputs(code))
    assert objects.list("locks/") == {} and store.verify("after").ok


def test_a_create_refused_early_does_not_wait_out_a_running_gc(
    store: SnapshotStore, objects: S3ObjectStore, code: Path
) -> None:
    """A create whose name is taken (or whose exclude pattern is bad) is refused at once,
    even while a GC holds the store: its wait for the lock is given up, not sat out."""
    store.create("taken", inputs(code))
    other = S3ObjectStore.__new__(S3ObjectStore)
    other.__dict__.update(objects.__dict__)  # another client of the same bucket and prefix
    with (
        SnapshotStore(other, signing_key=SigningKey.generate(), create_wait_s=120.0) as elsewhere,
        store.locks.exclusive(5.0) as held,
    ):  # a GC here, for as long as it takes
        started = time.monotonic()
        with pytest.raises(SnapshotExists):
            elsewhere.create("taken", inputs(code))
        with pytest.raises(InvalidInput, match="exclude_patterns"):
            elsewhere.create("fresh", inputs(code, exclude_patterns=["a\nb"]))
        # answered long before the 120 s a create waits for a GC (the old behaviour)
        assert time.monotonic() - started < 30
        assert list(objects.list("locks/")) == [held]  # no lock of the refused creates left
    assert objects.list("locks/") == {}


def _claim_huge(body: bytearray, offset: int) -> None:
    """Rewrite the zstd frame at ``offset`` so its header claims 4 TiB of content (same frame
    length: the 2-byte size field becomes an 8-byte one over the first block's bytes)."""
    assert body[offset : offset + 4] == b"\x28\xb5\x2f\xfd"
    body[offset + 4 : offset + 13] = bytes([0xE0]) + (1 << 42).to_bytes(8, "little")


def test_a_frame_claiming_terabytes_is_altered_whether_in_s3_or_in_a_nodes_copy(
    store: SnapshotStore, objects: S3ObjectStore, code: Path, tmp_path: Path
) -> None:
    (code / "data.bin").write_bytes(os.urandom(300_000))
    result = store.create("s", inputs(code))
    assert store.pack_cache is not None and store.pack_cache.flush(10)
    data = result.manifest.code.by_path()["data.bin"]
    loc = store.index.lookup(result.manifest.chunks_of(data)[0])  # (cut in one or two chunks)
    assert loc is not None
    own = store.pack_cache.directory / (loc.pack.removeprefix("packs/") + OWN)
    body = bytearray(own.read_bytes())
    _claim_huge(body, loc.offset)
    # a copy read from S3 of that pack, so altered: refused before anything is allocated
    # (this node's own whole copy, altered, is refused as a whole: its hash is not its name)
    own.unlink()
    copy = own.with_name(loc.pack.removeprefix("packs/"))
    copy.write_bytes(bytes(body))
    with other_node(store, objects, store.pack_cache.directory.parent.parent) as again:
        assert again.pack_cache is not None
        again.restore("s", tmp_path / "out")  # dropped, read again from S3
        assert (tmp_path / "out" / "data.bin").read_bytes() == (code / "data.bin").read_bytes()
        assert again.pack_cache.flush(10)  # the copy now holds what S3 sent, checked
    assert copy.read_bytes() != bytes(body) and objects.get(loc.pack).startswith(copy.read_bytes())
    # the same in S3: verify names it (no MemoryError), a restore refuses it
    objects.put(loc.pack, bytes(body))
    report = store.verify("s")
    assert not report.ok
    assert any(
        f"{loc.pack}@{loc.offset}:" in p and "not a zstd frame" in p for p in report.problems
    )
    with (
        other_node(store, objects, tmp_path / "node-2") as there,
        pytest.raises(VerificationFailed, match=loc.pack),
    ):
        there.restore("s", tmp_path / "out-2")


async def test_a_node_keeps_copies_of_packs_and_the_snapshot_service_none(
    s3: S3Info, tmp_path: Path
) -> None:
    from dsec_core.settings import Settings

    from dsec_snapstore.requests import SnapshotRequests

    def no_bus() -> Any:  # (opening the store needs none)
        raise AssertionError("the bus is not used here")

    settings = Settings(home=tmp_path / "home", **s3.settings())
    node = SnapshotRequests(
        settings, no_bus, no_bus, node_id="node-1", cache_dir=tmp_path / "node", signer="nodeagent"
    )
    service = SnapshotRequests(
        settings, no_bus, no_bus, cache_dir=tmp_path / "svc", signer="snapshot"
    )
    await node.start()
    await service.start()
    try:
        assert node.store.pack_cache is not None
        assert node.store.pack_cache.limit == settings.snapshot_pack_cache_mb << 20
        assert service.store.pack_cache is None
    finally:
        await node.close()
        await service.close()


def _many_files(root: Path, count: int = 200) -> None:
    for n in range(count):
        (root / f"m{n:03}.py").write_text(f"VALUE = {n}\n" + "# pad\n" * (n % 40))


def test_the_packs_this_node_made_are_checked_whole_not_chunk_by_chunk(
    store: SnapshotStore, code: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dsec_snapstore.store as store_module

    _many_files(code)
    result = store.create("s", inputs(code))
    assert store.pack_cache is not None and store.pack_cache.flush(10)
    owns = [p for p in store.pack_cache.directory.iterdir() if p.name.endswith(OWN)]
    assert owns
    hashed: list[int] = []
    real = store_module.blake3.blake3

    def counting(data: bytes = b"", *args: Any, **kwargs: Any) -> Any:
        hashed.append(len(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(store_module.blake3, "blake3", counting)
    store.restore("s", tmp_path / "out")
    monkeypatch.undo()
    for entry in result.manifest.code.files:
        assert (tmp_path / "out" / entry.path).read_bytes() == (code / entry.path).read_bytes()
    # one hash per pack read whole (its name) and the manifest's, none per chunk (200+ files)
    packs = sorted(n for n in hashed if n > 100_000)
    assert len(packs) == len(owns) and len(hashed) <= len(owns) + 3


def test_an_index_that_misplaces_a_chunk_in_a_pack_this_node_made_is_refused(
    store: SnapshotStore, code: Path, tmp_path: Path
) -> None:
    _many_files(code, 50)
    result = store.create("s", inputs(code))
    assert store.pack_cache is not None and store.pack_cache.flush(10)
    a = result.manifest.code.by_path()["m001.py"].blake3
    b = result.manifest.code.by_path()["m002.py"].blake3
    la, lb = store.index.lookup(a), store.index.lookup(b)
    assert la is not None and lb is not None and la.pack == lb.pack
    lookup = store.index.lookup
    # what an S3 attacker's index document could say: a's bytes are where b's are
    store.index.lookup = lambda c: lb if c == a else lookup(c)  # type: ignore[method-assign]
    with pytest.raises(VerificationFailed, match=a):
        store.restore("s", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # this node's genuine copy stays (the lie was the index's), and serves the true index
    own = store.pack_cache.directory / (la.pack.removeprefix("packs/") + OWN)
    assert own.exists()
    store.index.lookup = lookup  # type: ignore[method-assign]
    store.restore("s", tmp_path / "out")
    assert (tmp_path / "out" / "m001.py").read_bytes() == (code / "m001.py").read_bytes()


def test_snapshots_of_two_trees_are_taken_at_once_and_of_one_tree_in_turn(
    store: SnapshotStore, code: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's creates (``SnapshotRequests.create``): before, one at a time for the whole node,
    so a neighbour's snapshot waited for every create already under way. Now two sandboxes'
    trees are snapshotted at once (both stored whole and correct, their shared chunks included),
    while two creates of one tree still take turns (its stat cache is one file)."""
    import shutil
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from dsec_core.settings import Settings

    from dsec_snapstore.requests import SnapshotRequests

    def no_bus() -> Any:
        raise AssertionError("the bus is not used here")

    requests = SnapshotRequests(Settings(home=tmp_path / "home"), no_bus, no_bus, node_id="n")
    requests._store = store
    other = tmp_path / "other"
    shutil.copytree(code, other, symlinks=True)
    (other / "agent.py").write_text("def score():\n    return 0.5\n")

    inside: list[Path] = []
    overlapped: list[bool] = []
    guard = threading.Lock()
    barrier = [threading.Barrier(2, timeout=10)]
    real_create = store.create

    def create(name: str, given: SnapshotInputs, **kw: Any) -> CreateResult:
        with guard:
            inside.append(Path(given.code_dir))
            overlapped.append(len(inside) > 1)
        try:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier[0].wait()  # (the same tree's second create never meets the first)
            return real_create(name, given, **kw)
        finally:
            with guard:
                inside.remove(Path(given.code_dir))

    monkeypatch.setattr(store, "create", create)
    with ThreadPoolExecutor(2) as pool:
        results = list(
            pool.map(
                lambda job: requests.create(job[0], inputs(job[1]), job[1]),
                [("a", code), ("b", other)],
            )
        )
    assert overlapped == [False, True]  # the second tree's create began inside the first's
    for name, tree, result in zip(("a", "b"), (code, other), results, strict=True):
        assert result.manifest.name == name and store.verify(name).ok
        out = tmp_path / f"out-{name}"
        store.restore(name, out)
        assert (out / "data.bin").read_bytes() == (tree / "data.bin").read_bytes()
        assert (out / "agent.py").read_text() == (tree / "agent.py").read_text()

    overlapped.clear()
    barrier[0] = threading.Barrier(2, timeout=1)
    (code / "pkg" / "tools.py").write_text("TOOLS = []\n")
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda name: requests.create(name, inputs(code), code), ["a-2", "a-3"]))
    assert overlapped == [False, False]  # one tree: in turn
    assert len(requests._trees) == 0  # no lock kept for a tree no one snapshots
