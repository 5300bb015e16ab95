"""Runtime context against real OpenBao, SeaweedFS and NATS (``dsec_testing`` fixtures)."""

from __future__ import annotations

import asyncio
import io
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import blake3
import hvac
import hvac.exceptions
import nats
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _dsec_sandbox_testkit import managed, read_json_output, run_to_end, snippet_config
from dsec_core import natsperms
from dsec_core.spec.plan import MountPlan, SecretInjection

from dsec_nodeagent.context import (
    ConfigMaps,
    ContextError,
    ContextInjector,
    S3Materializer,
    VaultSecrets,
    crypto,
)
from dsec_nodeagent.context.vault import transit_hmac_digest
from dsec_nodeagent.sandbox import ExitReason

TRANSIT_KEY = "dsec-data"


def _secret(name: str, path: str, key: str = "value", ttl_s: int = 600) -> SecretInjection:
    return SecretInjection(
        env_var=name, vault_mount="secret", vault_path=path, key=key, ttl_s=ttl_s
    )


def _s3_mount(
    path: str, bucket: str, prefix: str, *, encrypted: bool = False, cache_ttl_s: int | None = None
) -> MountPlan:
    return MountPlan(
        path=path,
        scheme="s3",
        bucket=bucket,
        prefix=prefix,
        mode="ro-encrypted" if encrypted else "ro",
        encrypted=encrypted,
        cache_ttl_s=cache_ttl_s,
    )


@pytest.fixture
def vault_secrets(vault: Any) -> VaultSecrets:
    client: hvac.Client = vault.client()
    if "transit/" not in client.sys.list_mounted_secrets_engines()["data"]:
        client.sys.enable_secrets_engine("transit", path="transit")
    client.secrets.transit.create_key(name=TRANSIT_KEY)
    return VaultSecrets(vault.addr, vault.token)


@pytest.fixture
def injector(
    tmp_path: Path, vault_secrets: VaultSecrets, s3: Any, dsec_stack: Any
) -> ContextInjector:
    # Config maps are read as the node agent reads them: with its own NATS identity.
    auth = {
        "nkeys_seed": str(dsec_stack.nats_seed("nodeagent")),
        "inbox_prefix": natsperms.inbox_prefix("nodeagent"),
    }
    return ContextInjector(
        tmp_path / "sandboxes",
        vault=vault_secrets,
        s3=S3Materializer(s3.client(), tmp_path / "cache", unwrap=vault_secrets.unwrap),
        configmaps=ConfigMaps(dsec_stack.nats_plain_url, nats_options=auth),
    )


def _put(s3: Any, key: str, data: bytes) -> None:
    s3.client().put_object(s3.bucket, key, io.BytesIO(data), len(data))


def _accessor_alive(vault: Any, accessor: str) -> bool:
    try:
        vault.client().auth.token.lookup_accessor(accessor)
    except (hvac.exceptions.InvalidRequest, hvac.exceptions.Forbidden):
        return False
    return True


# ---------------------------------------------------------------- pure


@pytest.mark.unit
def test_sealed_objects_round_trip_and_tampering_is_detected() -> None:
    key = os.urandom(32)
    blob = crypto.seal(b"rows", key, "vault:v1:wrapped", "transit:k")
    assert crypto.open_sealed(blob, lambda kek, wrapped: key) == b"rows"
    tampered = blob[:-1] + bytes([blob[-1] ^ 1])
    with pytest.raises(crypto.DecryptionError, match="authentication failed"):
        crypto.open_sealed(tampered, lambda kek, wrapped: key)
    with pytest.raises(crypto.DecryptionError, match="DSECENC1"):
        crypto.open_sealed(b"plain text", lambda kek, wrapped: key)
    deep = b"[" * 100_000  # an object in the bucket whose header nests deeper than the stack
    forged = crypto.MAGIC + len(deep).to_bytes(4, "big") + deep
    with pytest.raises(crypto.DecryptionError, match="corrupt encryption header"):
        crypto.open_sealed(forged, lambda kek, wrapped: key)


@pytest.mark.unit
def test_transit_hmac_becomes_a_hex_digest_with_its_key_version() -> None:
    assert transit_hmac_digest("vault:v2:3q2+7w==") == "hmac-sha256:v2:deadbeef"
    with pytest.raises(ValueError, match="not a Transit HMAC"):
        transit_hmac_digest("sha256:abcd")


# ---------------------------------------------------------------- Vault


_PUBLIC_CONTEXTS = (
    "dsec 2026-01 runtime-context secret value",  # the context digests used before
    "dsec secret digest",
    "",
)


@pytest.mark.integration
async def test_the_digest_key_and_its_engine_are_created_on_first_use(vault: Any) -> None:
    mount = f"transit-{uuid.uuid4().hex[:8]}"
    secrets = VaultSecrets(vault.addr, vault.token, transit_mount=mount)
    first = await secrets.digest("hunter2", "vault://secret/x#value")
    assert first == await secrets.digest("hunter2", "vault://secret/x#value")
    assert f"{mount}/" in vault.client().sys.list_mounted_secrets_engines()["data"]
    key = vault.client().secrets.transit.read_key(name="dsec-digest", mount_point=mount)
    assert key["data"]["exportable"] is False
    vault.client().sys.disable_secrets_engine(path=mount)


@pytest.mark.integration
async def test_secret_digest_is_keyed_equal_across_sandboxes_and_not_guessable(
    injector: ContextInjector, vault: Any
) -> None:
    """Someone who reads the log learns that two sandboxes got the same secret, and which
    secret changed, but cannot test a guess: the digest is an HMAC under a key in Vault."""
    import hashlib

    import blake3

    path = f"default/agent-tools/{uuid.uuid4().hex}"  # the default tenant's secrets
    other = f"default/agent-tools/{uuid.uuid4().hex}"
    for where, value in ((path, "hunter2"), (other, "hunter3")):
        vault.client().secrets.kv.v2.create_or_update_secret(
            path=where, secret={"value": value}, mount_point="secret"
        )
    a = await injector.prepare("sbx-digest-a", [_secret("K", path)], [])
    b = await injector.prepare("sbx-digest-b", [_secret("K", path)], [])
    c = await injector.prepare("sbx-digest-c", [_secret("K", other)], [])
    try:
        digest = a.records[0].digest
        assert digest is not None and digest.startswith("hmac-sha256:v1:")
        assert b.records[0].digest == digest  # equality stays visible
        assert c.records[0].digest != digest
        raw = digest.rsplit(":", 1)[1]
        guesses = {blake3.blake3(b"hunter2").hexdigest(), hashlib.sha256(b"hunter2").hexdigest()}
        guesses |= {
            blake3.blake3(b"hunter2", derive_key_context=ctx).hexdigest()
            for ctx in _PUBLIC_CONTEXTS
        }
        assert raw not in guesses
        # The key stays in Vault: Transit will not export it.
        key = vault.client().secrets.transit.read_key(name="dsec-digest")["data"]
        assert key["exportable"] is False
    finally:
        for ctx in (a, b, c):
            await injector.release(ctx)


@pytest.mark.integration
async def test_secret_is_read_through_a_lease_that_is_revoked_on_release(
    injector: ContextInjector, vault: Any
) -> None:
    path = f"default/agent-tools/{uuid.uuid4().hex}"
    vault.client().secrets.kv.v2.create_or_update_secret(
        path=path, secret={"value": "tok-123"}, mount_point="secret"
    )
    ctx = await injector.prepare("sbx-secret", [_secret("TOOL_API_KEY", path, ttl_s=300)], [])
    assert ctx.secret_env["TOOL_API_KEY"].get_secret_value() == "tok-123"
    (record,) = ctx.records
    assert record.model_dump() == {
        "kind": "secret",
        "name": "TOOL_API_KEY",
        "source": f"vault://secret/{path}#value",
        "digest": record.digest,
        "lease_id": ctx.leases[0].accessor,
        "ttl_s": 300.0,
        "bytes": None,
    }
    assert "tok-123" not in record.model_dump_json()
    assert record.digest is not None and record.digest.startswith("hmac-sha256:v1:")
    assert await injector.vault.renew(ctx.leases[0]) == 300  # type: ignore[union-attr]
    accessor = ctx.leases[0].accessor
    assert _accessor_alive(vault, accessor)
    assert await injector.release(ctx) == []
    assert not _accessor_alive(vault, accessor)


@pytest.mark.integration
async def test_missing_secret_fails_naming_the_source_and_leaves_no_lease(
    injector: ContextInjector, vault: Any
) -> None:
    before = set(vault.client().auth.token.list_accessors()["data"]["keys"])
    with pytest.raises(ContextError) as info:
        await injector.prepare("sbx-missing", [_secret("K", "default/no/such/secret")], [])
    assert str(info.value) == (
        "vault://secret/default/no/such/secret#value: secret not found (KV v2 mount 'secret', "
        "path 'default/no/such/secret')"
    )
    after = set(vault.client().auth.token.list_accessors()["data"]["keys"])
    assert after <= before


@pytest.mark.integration
async def test_another_tenants_secret_is_refused_by_vault_itself_and_leaves_no_lease(
    injector: ContextInjector, vault: Any
) -> None:
    # A plan that slipped past validation: tenant "default" names tenant acme's secret. The
    # child token carries only dsec-tenant-default, so Vault refuses; nothing of the value leaks.
    path = f"acme/tools/{uuid.uuid4().hex}"
    vault.client().secrets.kv.v2.create_or_update_secret(
        path=path, secret={"value": "acme-private-9f2c"}, mount_point="secret"
    )
    before = set(vault.client().auth.token.list_accessors()["data"]["keys"])
    with pytest.raises(ContextError) as info:
        await injector.prepare("sbx-thief", [_secret("K", path)], [], tenant="default")
    assert str(info.value) == (
        f"vault://secret/{path}#value: permission denied: outside the secrets of tenant 'default' "
        "(allowed: vault://secret/default/)"
    )
    assert "acme-private-9f2c" not in repr(info.value)
    assert set(vault.client().auth.token.list_accessors()["data"]["keys"]) <= before
    policy = vault.client().sys.read_policy("dsec-tenant-default")["data"]["rules"]
    assert 'path "secret/data/default/*"' in policy and "acme" not in policy
    # The owner reads it with the same code path.
    ctx = await injector.prepare("sbx-acme", [_secret("K", path)], [], tenant="acme")
    assert ctx.secret_env["K"].get_secret_value() == "acme-private-9f2c"
    await injector.release(ctx)


@pytest.mark.integration
async def test_missing_field_lists_the_fields_but_no_values(
    injector: ContextInjector, vault: Any
) -> None:
    path = f"default/x/{uuid.uuid4().hex}"
    vault.client().secrets.kv.v2.create_or_update_secret(
        path=path, secret={"user": "u", "password": "p4ss"}, mount_point="secret"
    )
    with pytest.raises(ContextError) as info:
        await injector.prepare("sbx-field", [_secret("K", path, key="token")], [])
    assert "has no field 'token' (fields: password, user)" in str(info.value)
    assert "p4ss" not in str(info.value)


# ---------------------------------------------------------------- S3


@pytest.mark.integration
async def test_s3_prefix_is_materialized_and_the_cache_ttl_is_honoured(
    injector: ContextInjector, s3: Any
) -> None:
    prefix = f"datasets/{uuid.uuid4().hex}/"
    _put(s3, prefix + "a.txt", b"alpha")
    _put(s3, prefix + "sub/b.txt", b"beta")
    mount = _s3_mount("/workspace/data", s3.bucket, prefix, cache_ttl_s=300)
    first = await injector.prepare("sbx-s3-1", [], [mount])
    data_dir = first.mounts[0].source
    assert (data_dir / "a.txt").read_text() == "alpha"
    assert (data_dir / "sub" / "b.txt").read_text() == "beta"
    assert first.records[0].bytes == 9
    _put(s3, prefix + "a.txt", b"ALPHA-v2")  # within cache_ttl the node does not look again
    second = await injector.prepare("sbx-s3-2", [], [mount])
    assert (second.mounts[0].source / "a.txt").read_text() == "alpha"
    assert second.records[0].digest == first.records[0].digest
    fresh = await injector.prepare(
        "sbx-s3-3", [], [_s3_mount("/workspace/data", s3.bucket, prefix, cache_ttl_s=None)]
    )
    assert (fresh.mounts[0].source / "a.txt").read_text() == "ALPHA-v2"
    for ctx in (first, second, fresh):
        await injector.release(ctx)
    assert not data_dir.exists()


@pytest.mark.unit
async def test_sandboxes_starting_at_once_share_one_cached_prefix_intact(
    injector: ContextInjector, s3: Any
) -> None:
    """A node's launches run at once: sandboxes mounting one cached prefix as it is first
    fetched (or refreshed) each get every object whole. Before, their fetches shared the
    entry's temporary files and one's rename could take another's half-written file away."""
    prefix = f"datasets/{uuid.uuid4().hex}/"
    blobs = {f"part-{n}.bin": bytes([n]) * (256 << 10) for n in range(8)}
    for name, data in blobs.items():
        _put(s3, prefix + name, data)
    mount = _s3_mount("/workspace/data", s3.bucket, prefix, cache_ttl_s=300)
    contexts = await asyncio.gather(
        *(injector.prepare(f"sbx-s3-many-{n}", [], [mount]) for n in range(6))
    )
    for ctx in contexts:
        source = ctx.mounts[0].source
        assert {p.name: p.read_bytes() for p in source.iterdir()} == blobs
    assert len({ctx.records[0].digest for ctx in contexts}) == 1
    for ctx in contexts:
        await injector.release(ctx)


@pytest.mark.integration
async def test_ro_encrypted_objects_are_decrypted_with_a_vault_data_key(
    injector: ContextInjector, vault_secrets: VaultSecrets, s3: Any
) -> None:
    prefix = f"enc/{uuid.uuid4().hex}/"
    key, wrapped = vault_secrets.new_data_key(TRANSIT_KEY)
    _put(
        s3, prefix + "rows.csv", crypto.seal(b"id,v\n1,2\n", key, wrapped, f"transit:{TRANSIT_KEY}")
    )
    ctx = await injector.prepare(
        "sbx-enc", [], [_s3_mount("/workspace/data", s3.bucket, prefix, encrypted=True)]
    )
    assert (ctx.mounts[0].source / "rows.csv").read_bytes() == b"id,v\n1,2\n"
    # Every user reads context.injected: its digest of the plaintext is keyed, as a secret's
    # (before, a plain BLAKE3 over the file names and their plaintexts' BLAKE3 let anyone test
    # guesses of the decrypted data offline)
    digest = ctx.records[0].digest
    assert digest is not None and digest.startswith("hmac-sha256:v1:")
    plain = blake3.blake3(b"rows.csv\0" + blake3.blake3(b"id,v\n1,2\n").hexdigest().encode())
    assert digest.rsplit(":", 1)[1] != plain.hexdigest()
    await injector.release(ctx)
    again = await injector.prepare(
        "sbx-enc-again", [], [_s3_mount("/workspace/data", s3.bucket, prefix, encrypted=True)]
    )
    assert again.records[0].digest == digest  # (equality stays visible)
    await injector.release(again)
    _put(s3, prefix + "rows.csv", b"not encrypted")
    with pytest.raises(ContextError, match=r"rows.csv: cannot decrypt: not a DSec-encrypted"):
        await injector.prepare(
            "sbx-enc2", [], [_s3_mount("/workspace/data", s3.bucket, prefix, encrypted=True)]
        )


@pytest.mark.integration
async def test_missing_prefix_fails_and_undoes_earlier_steps(
    injector: ContextInjector, vault: Any, s3: Any, tmp_path: Path
) -> None:
    path = f"default/ok/{uuid.uuid4().hex}"
    vault.client().secrets.kv.v2.create_or_update_secret(
        path=path, secret={"value": "v"}, mount_point="secret"
    )
    with pytest.raises(ContextError) as info:
        await injector.prepare(
            "sbx-undo", [_secret("K", path)], [_s3_mount("/d", s3.bucket, "no/such/prefix/")]
        )
    assert str(info.value) == (
        f"s3://{s3.bucket}/no/such/prefix/: no objects under this prefix (missing or empty)"
    )
    assert not (tmp_path / "sandboxes" / "sbx-undo" / "context").exists()


class _Held:
    """Holds a step's thread at its start until the test lets it go (where a cancel lands)."""

    def __init__(self, step: Any) -> None:
        self.step = step
        self.entered, self.go, self.left = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        try:
            assert self.go.wait(30)
            return self.step(*args, **kwargs)
        finally:
            self.left.set()


async def _cancel_while_held(held: _Held, start: asyncio.Task[Any]) -> None:
    """Cancel ``start`` while its step's thread is held: the start ends at once (it does not
    wait for a step it cannot stop); then let the thread finish its step."""
    await asyncio.to_thread(held.entered.wait, 30)
    start.cancel()
    done, _ = await asyncio.wait({start}, timeout=10)
    assert start in done, "the cancelled start waited for its step's thread"
    with pytest.raises(asyncio.CancelledError):
        await start
    held.go.set()
    assert await asyncio.to_thread(held.left.wait, 30)


@pytest.mark.integration
async def test_a_start_cancelled_while_vault_makes_its_token_leaves_no_token(
    injector: ContextInjector, vault: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node agent's stop cancels a start whose secret read is under way in a thread: the
    start ends at once, and the child token that read creates is revoked once it exists.
    Before, the release ran at once and found no lease yet, and the token the thread then made
    lived on (renewable for 24x its TTL)."""
    path = f"default/cancel/{uuid.uuid4().hex}"
    vault.client().secrets.kv.v2.create_or_update_secret(
        path=path, secret={"value": "v"}, mount_point="secret"
    )
    assert injector.vault is not None
    held = _Held(injector.vault._create_lease)
    monkeypatch.setattr(injector.vault, "_create_lease", held)
    before = set(vault.client().auth.token.list_accessors()["data"]["keys"])
    start = asyncio.create_task(injector.prepare("sbx-cancel-v", [_secret("K", path)], []))
    await _cancel_while_held(held, start)
    await injector.close()  # the node agent's stop: waits for that release
    assert set(vault.client().auth.token.list_accessors()["data"]["keys"]) <= before


@pytest.mark.integration
async def test_a_start_cancelled_while_its_data_downloads_leaves_no_directory(
    injector: ContextInjector, s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start ends at once; what the download writes is removed once it has ended, and a
    next start of the same sandbox waits for that. Before, the release removed the context
    directory at the cancel while the download's thread went on, and recreated it writing the
    prefix's files: left on the node for good."""
    prefix = f"cancel/{uuid.uuid4().hex}/"
    _put(s3, prefix + "sub/b.txt", b"beta")
    assert injector.s3 is not None
    held = _Held(injector.s3._fetch_all)
    monkeypatch.setattr(injector.s3, "_fetch_all", held)
    mount = _s3_mount("/workspace/data", s3.bucket, prefix)
    start = asyncio.create_task(injector.prepare("sbx-cancel-s3", [], [mount]))
    await asyncio.to_thread(held.entered.wait, 30)
    start.cancel()
    done, _ = await asyncio.wait({start}, timeout=10)
    assert start in done, "the cancelled start waited for its step's thread"
    # The same sandbox started again meanwhile (its next attempt): it waits for that release,
    # which would otherwise remove the directory it writes.
    again = asyncio.create_task(injector.prepare("sbx-cancel-s3", [], [mount]))
    held.go.set()
    ctx = await asyncio.wait_for(again, 30)
    await injector.close()
    assert (ctx.mounts[0].source / "sub" / "b.txt").read_bytes() == b"beta"
    await injector.release(ctx)
    home = tmp_path / "sandboxes" / "sbx-cancel-s3"
    assert not home.exists() or not any(home.rglob("*"))


# ---------------------------------------------------------------- config maps


@pytest.mark.integration
async def test_configmap_key_is_mounted_read_only(injector: ContextInjector, nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket="dsec-configmaps")
        await kv.put("agent-configs.retrieval-v3", b"top_k: 5\n")
    finally:
        await nc.close()
    mount = MountPlan(
        path="/workspace/config",
        scheme="configmap",
        configmap="agent-configs",
        key="retrieval-v3",
        mode="ro",
        encrypted=False,
    )
    ctx = await injector.prepare("sbx-cm", [], [mount])
    file = ctx.mounts[0].source / "retrieval-v3"
    assert file.read_text() == "top_k: 5\n"
    assert oct(file.stat().st_mode & 0o777) == "0o444"
    assert ctx.records[0].source == "configmap://agent-configs/retrieval-v3"
    digest = ctx.records[0].digest  # keyed: a config value is not guessed offline from the log
    assert digest is not None and digest.startswith("hmac-sha256:v1:")
    assert digest.rsplit(":", 1)[1] != blake3.blake3(b"top_k: 5\n").hexdigest()
    await injector.release(ctx)
    # equal within a tenant only: another tenant holding a guess in a mount of its own learns
    # nothing from comparing digests in the log
    again = await injector.prepare("sbx-cm-2", [], [mount])
    other = await injector.prepare("sbx-cm-3", [], [mount], tenant="alpha")
    assert again.records[0].digest == digest
    assert other.records[0].digest not in (None, digest)
    for done in (again, other):
        await injector.release(done)
    missing = MountPlan(
        path="/c",
        scheme="configmap",
        configmap="agent-configs",
        key="nope",
        mode="ro",
        encrypted=False,
    )
    with pytest.raises(ContextError, match=r"no key 'agent-configs\.nope' in NATS KV bucket"):
        await injector.prepare("sbx-cm2", [], [missing])


# ---------------------------------------------------------------- the demo path


@pytest.mark.kernel
@pytest.mark.integration
async def test_agent_runs_with_its_secret_and_data_then_everything_is_released(
    injector: ContextInjector, vault: Any, s3: Any, tmp_path: Path
) -> None:
    path = f"default/agent-tools/{uuid.uuid4().hex}"
    vault.client().secrets.kv.v2.create_or_update_secret(
        path=path, secret={"value": "ws-key-42"}, mount_point="secret"
    )
    prefix = f"demo/{uuid.uuid4().hex}/"
    _put(s3, prefix + "input.txt", b"hello data")
    ctx = await injector.prepare(
        "demo",
        [_secret("TOOL_API_KEY", path, ttl_s=120)],
        [_s3_mount("/workspace/data", s3.bucket, prefix)],
    )
    code = (
        "import json, os\n"
        "data = open('/workspace/data/input.txt').read()\n"
        "open('/workspace/output/out.txt', 'w').write(data.upper())\n"
        "try:\n    open('/workspace/data/x', 'w')\n"
        "except OSError as e:\n    refused = e.strerror\n"
        "print(json.dumps({'key': os.environ['TOOL_API_KEY'][:3], 'refused': refused}))\n"
    )
    async with managed(tmp_path / "home") as manager:
        result = await run_to_end(
            manager,
            snippet_config(
                "demo",
                code,
                tmp_path,
                secret_env=ctx.secret_env,
                mounts=ctx.mounts,
                read_allowed=["/workspace/data"],
                metadata=ctx.metadata(),
            ),
        )
    accessor = ctx.leases[0].accessor
    await injector.release(ctx)
    assert result.reason is ExitReason.OK
    assert read_json_output(result) == {"key": "ws-", "refused": "Read-only file system"}
    assert (
        tmp_path / "home" / "sandboxes" / "demo" / "fs" / "workspace__output" / "out.txt"
    ).read_text() == "HELLO DATA"
    assert not _accessor_alive(vault, accessor)
    state_text = "".join(p.read_text() for p in (tmp_path / "home").rglob("*.json"))
    assert "ws-key-42" not in state_text


@pytest.mark.unit
def test_tenant_policy_reads_only_the_tenants_prefixes() -> None:
    from dsec_nodeagent.context.vault import tenant_policy_hcl, tenant_prefixes

    assert tenant_prefixes("acme") == ("secret/acme/",)
    # a reserved name reads nothing by convention (secret/dsec-state/: every tenant's state key)
    assert tenant_prefixes("dsec-state") == () and tenant_prefixes("dsec") == ()
    assert tenant_prefixes("acme", ["kv/acme-shared/", "secret/../x/", 'a/"b', "kv/*"]) == (
        "kv/acme-shared/",
    )
    hcl = tenant_policy_hcl(("secret/acme/", "kv/acme-shared/"))
    assert hcl == (
        'path "secret/data/acme/*" {\n  capabilities = ["read"]\n}\n'
        'path "kv/data/acme-shared/*" {\n  capabilities = ["read"]\n}\n'
    )
    assert tenant_policy_hcl(()) == "# no secrets\n"
