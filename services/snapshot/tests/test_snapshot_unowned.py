"""A snapshot whose tenant is known nowhere (no ``tenant`` label: ``dsec snapshot create --dir``
on a machine with no user identity; its sandbox unknown to the log) is the ``default`` tenant's,
for a delete and for a restore alike.

Before (found by an adversarial review, 2026-12-07): a delete took it for ``default``'s, but a
restore let every tenant use it, so another tenant's rollback or ``run --snapshot NAME`` wrote
its code (and whatever secrets sat in it) into that tenant's sandbox."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from dsec_core.settings import Settings
from dsec_snapstore import SnapshotInputs, SnapshotStore
from dsec_snapstore.adapters.objectstore import S3ObjectStore
from dsec_snapstore.adapters.vault import VaultKeyStore
from dsec_snapstore.requests import Refused, SnapshotRequests
from nacl.signing import SigningKey

from dsec_snapshot.deletes import SnapshotDeletes

pytestmark = pytest.mark.integration


class _Gate:
    async def tenant_of(self, sandbox_id: str) -> str | None:
        return None  # a sandbox the log does not know (or whose submission aged out)


async def test_a_snapshot_of_no_known_tenant_is_the_default_tenants_alone(
    s3: Any, vault: Any, tmp_path: Path
) -> None:
    objects = S3ObjectStore(
        s3.endpoint, s3.access_key, s3.secret_key, s3.bucket, prefix=f"t-{uuid.uuid4().hex}/"
    )
    store = SnapshotStore(
        objects,
        signing_key=SigningKey.generate(),
        keys=VaultKeyStore(vault.addr, vault.token),
        cache_dir=tmp_path / "cache",
    )
    code = tmp_path / "data"
    code.mkdir()
    (code / "model.cfg").write_text("api_key=default-tenant-only\n")
    store.create("baseline", SnapshotInputs(code_dir=code, labels={}))  # (no tenant label)
    requests = SnapshotRequests(
        Settings(home=tmp_path / "home"), js=lambda: None, gate=lambda: _Gate()
    )
    requests._store = store
    try:
        assert await SnapshotDeletes(requests)._delete_one("baseline", "alpha") is False
        refusal = await requests.foreign_snapshot("baseline", "alpha")
        assert refusal is not None and "another tenant" in refusal
        alpha_code = tmp_path / "alpha-code"
        with pytest.raises(Refused, match="another tenant"):
            await requests.restore_for_start("sbx_alpha", "baseline", "alpha", alpha_code, 1 << 20)
        assert not (alpha_code / "model.cfg").exists()
        # its tenant may use it; a name that is not there is no one's (the restore says so)
        assert await requests.foreign_snapshot("baseline", "default") is None
        assert await requests.foreign_snapshot("no-such-snapshot", "alpha") is None
    finally:
        store.close()
