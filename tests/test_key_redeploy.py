"""Keys that survive redeploys: re-created containers, replicas and rotations keep
`dsec audit verify` clean (real NATS, real OpenBao).

Each test gets a private NATS server (its own stream, so verify sees only its events) and its
own key path in the session's OpenBao.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from dsec_core import identity, keysource
from dsec_core.bus import ensure_stream, replay
from dsec_core.events import SpecRejected
from dsec_core.service import Service
from dsec_core.settings import Settings
from dsec_core.signing import Signer
from dsec_core.trust import Gate, KeyRing, Refusal
from dsec_testing import trust
from dsec_testing.stack import StackFixture, VaultInfo
from nacl.signing import SigningKey
from nats.js import JetStreamContext

pytestmark = pytest.mark.integration


@pytest.fixture
def operator_home(tmp_path: Path) -> Path:
    return tmp_path / "operator"


@pytest.fixture
def private_nats(operator_home: Path) -> Iterator[str]:
    fixture = StackFixture(operator_home)
    try:
        yield fixture.nats_url
    finally:
        fixture.close()


@pytest.fixture
async def js(private_nats: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(private_nats)
    js = nc.jetstream()
    await ensure_stream(js)
    yield js
    await nc.close()


@pytest.fixture
def anchor(operator_home: Path) -> str:
    return bytes(trust.stack_root(operator_home).verify_key).hex()


@pytest.fixture
def prefix() -> str:
    """This test's own key path in the session's OpenBao."""
    return f"dsec-test/{uuid.uuid4().hex[:12]}/keys"


@pytest.fixture
def operator_env(operator_home: Path, private_nats: str, vault: VaultInfo, prefix: str) -> dict:
    """The operator's CLI: its root key, its Vault token, the test's key path."""
    return {
        "DSEC_HOME": str(operator_home),
        "DSEC_NATS_URL": private_nats,
        "DSEC_VAULT_ADDR": vault.addr,
        "DSEC_VAULT_TOKEN": vault.token,
        "DSEC_VAULT_KEY_PREFIX": prefix,
        "DSEC_KEY_SOURCE": "vault",
    }


def _container(
    home: Path, url: str, anchor: str, vault: VaultInfo, prefix: str, token: str | None = None
) -> Settings:
    """A fresh container of a service: an empty home, the key from Vault."""
    home.mkdir(parents=True)
    return Settings(
        home=home,
        nats_url=url,
        trust_root=anchor,
        key_source="vault",
        vault_addr=vault.addr,
        vault_token=token or vault.token,
        vault_key_prefix=prefix,
        key_check_s=0.2,
        stream_check_s=60,
    )


def _reject(n: int) -> SpecRejected:
    return SpecRejected(errors=[{"msg": f"test {n}"}])


async def _emit(svc: Service, tag: str, count: int = 2) -> list[int]:
    assert svc.publisher is not None
    seqs = []
    for i in range(count):
        published = await svc.publisher.publish(_reject(i), aggregate_id=f"sbx_{tag}_{i}")
        seqs.append(published.stream_seq)
    return seqs


def _verify(dsec_cli: Any, url: str, anchor: str, tmp_path: Path) -> tuple[int, dict]:
    env = {"DSEC_NATS_URL": url, "DSEC_HOME": str(tmp_path / "cli"), "DSEC_TRUST_ROOT": anchor}
    result = dsec_cli("audit", "verify", "--json", env=env)
    return result.exit_code, result.last_json()


def _issue_to_vault(dsec_cli: Any, env: dict, *extra: str) -> Any:
    result = dsec_cli("admin", "issue-service", "policy", "--to-vault", *extra, env=env)
    assert result.exit_code == 0, result.output
    return result


async def _admitted(
    js: JetStreamContext, nc: Any, anchor: str, gate: Gate | None = None
) -> dict[int, Any]:
    """What a consumer's gate answers for every message in the stream (envelope or Refusal)."""
    gate = gate or Gate(KeyRing(nc, js, bytes.fromhex(anchor)), js, None)
    return {seq: await gate.admit(data, stream_seq=seq) async for seq, data in replay(js)}


async def test_recreated_container_reads_its_key_from_vault(
    js, private_nats, operator_env, anchor, vault, prefix, dsec_cli, tmp_path, caplog
) -> None:
    caplog.set_level(logging.DEBUG)
    issued = _issue_to_vault(dsec_cli, operator_env)
    first = Service("policy", _container(tmp_path / "c1", private_nats, anchor, vault, prefix))
    await first.start()
    await _emit(first, "before")
    assert first.publisher is not None
    key_id = first.publisher.signer.key_id
    await first.stop()
    # The container is re-created: nothing of the first home survives.
    again = Service("policy", _container(tmp_path / "c2", private_nats, anchor, vault, prefix))
    await again.start()
    await _emit(again, "after")
    assert again.publisher is not None
    assert (again.publisher.signer.producer, again.publisher.signer.key_id) == ("policy", key_id)
    await again.stop()
    assert list((tmp_path / "c2").rglob("*.key")) == []  # no key file of its own making
    code, result = _verify(dsec_cli, private_nats, anchor, tmp_path)
    assert code == 0, result
    assert result["ok"] and result["injected"] == [], result
    assert result["producers"] == ["policy"] and result["chains"] == 2
    # The seed never leaves Vault: not in the log, not in what the operator's CLI printed.
    seed = bytes(keysource.vault_keys(Settings(**_vault_only(operator_env))).read("policy").key)
    async for _, data in replay(js):
        assert seed not in data and seed.hex().encode() not in data
    assert seed.hex() not in issued.output
    assert seed.hex() not in caplog.text and str(seed)[2:-1] not in caplog.text


def _vault_only(env: dict) -> dict:
    return {
        "vault_addr": env["DSEC_VAULT_ADDR"],
        "vault_token": env["DSEC_VAULT_TOKEN"],
        "vault_key_prefix": env["DSEC_VAULT_KEY_PREFIX"],
    }


async def test_two_replicas_share_one_key_and_both_chains_verify(
    js, private_nats, operator_env, anchor, vault, prefix, dsec_cli, tmp_path
) -> None:
    token_file = tmp_path / "policy.token"
    _issue_to_vault(dsec_cli, operator_env, "--token-file", str(token_file))
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    homes = [tmp_path / f"r{i}" for i in range(2)]
    replicas = [
        Service("policy", _container(home, private_nats, anchor, vault, prefix, token))
        for home in homes
    ]
    await asyncio.gather(*(r.start() for r in replicas))
    try:
        await asyncio.gather(*(_emit(r, f"r{i}", 3) for i, r in enumerate(replicas)))
        signers = [r.publisher.signer for r in replicas if r.publisher is not None]
        assert signers[0].key_id == signers[1].key_id and signers[0].chain != signers[1].chain
        nc = replicas[0].nc
        verdicts = await _admitted(js, nc, anchor)
        refused = {s: v for s, v in verdicts.items() if isinstance(v, Refusal)}
        assert refused == {}
        chains = {v.chain for v in verdicts.values() if not isinstance(v, Refusal)}
        assert chains == {s.chain for s in signers}
    finally:
        await asyncio.gather(*(r.stop() for r in replicas))
    code, result = _verify(dsec_cli, private_nats, anchor, tmp_path)
    assert code == 0, result
    assert result["ok"] and result["injected"] == [] and result["chains"] == 2
    assert result["events"] == 2 * (1 + 3)  # each replica: its registration and three events


async def test_each_service_token_reads_only_its_own_key(
    operator_env, anchor, vault, prefix, dsec_cli, tmp_path
) -> None:
    out = tmp_path / "deploy"
    issued = dsec_cli("admin", "issue-services", str(out), "--to-vault", env=operator_env)
    assert issued.exit_code == 0, issued.output
    assert not (out / "keys").exists()  # the keys went to Vault only
    tokens = {p.stem: p.read_text().strip() for p in (out / "tokens").iterdir()}
    assert sorted(tokens) == sorted(identity.SERVICE_ROLES)
    for role, token in tokens.items():
        keys = keysource.VaultKeys(vault.addr, token, prefix=prefix)
        mine = keys.read(keysource.vault_name(role, "node-1"))  # issue-services' default node
        identity.check(mine.cert, bytes.fromhex(anchor))
        assert mine.cert.subject == role
        other = "builder" if role != "builder" else "policy"
        with pytest.raises(keysource.KeySourceError, match="permission denied") as denied:
            keys.read(other)
        assert other in str(denied.value) and token not in str(denied.value)
    # Issuing again keeps the keys replicas already use.
    again = _issue_to_vault(dsec_cli, operator_env)
    assert keysource.VaultKeys(vault.addr, vault.token, prefix=prefix).read("policy").key_id in (
        again.output
    )


async def test_rotation_of_file_keys_while_the_service_runs(
    js, private_nats, operator_home, anchor, dsec_cli, tmp_path
) -> None:
    """The embedded stack's way: the service reads HOME/keys, the operator rotates there."""
    env = {"DSEC_HOME": str(operator_home), "DSEC_NATS_URL": private_nats}
    issued = dsec_cli("admin", "issue-service", "policy", "--home", str(operator_home), env=env)
    assert issued.exit_code == 0, issued.output
    settings = Settings(home=operator_home, nats_url=private_nats, key_check_s=0.2)
    svc = Service("policy", settings)
    await svc.start()
    try:
        assert svc.publisher is not None
        old = svc.publisher.signer.key_id
        before = await _emit(svc, "before")
        rotated = await asyncio.to_thread(
            dsec_cli, "audit", "keys", "rotate", "policy", "--grace", "1", "--json", env=env
        )
        assert rotated.exit_code == 0, rotated.output
        new = rotated.last_json()["new_key_id"]
        assert new != old and svc.publisher.signer.key_id == new
        after = await _emit(svc, "after")
        verdicts = await _admitted(js, svc.nc, anchor)
    finally:
        await svc.stop()
    assert all(not isinstance(verdicts[s], Refusal) for s in [*before, *after])
    code, result = _verify(dsec_cli, private_nats, anchor, tmp_path)
    assert code == 0 and result["injected"] == [], result


async def test_rotation_while_replicas_run(
    js, private_nats, operator_env, anchor, vault, prefix, dsec_cli, tmp_path
) -> None:
    _issue_to_vault(dsec_cli, operator_env)
    replicas = [
        Service("policy", _container(tmp_path / f"r{i}", private_nats, anchor, vault, prefix))
        for i in range(2)
    ]
    await asyncio.gather(*(r.start() for r in replicas))
    try:
        assert replicas[0].publisher is not None
        old_signer = replicas[0].publisher.signer
        before = await _emit(replicas[0], "before")
        # A consumer that knows the old key, and follows its revocation live.
        consumer = Gate(KeyRing(replicas[1].nc, js, bytes.fromhex(anchor)), js, None)
        await consumer.keys.start()
        assert not any(
            isinstance(v, Refusal) for v in (await _admitted(js, None, anchor, consumer)).values()
        )
        rotated = await asyncio.to_thread(
            dsec_cli, "audit", "keys", "rotate", "policy", "--grace", "1.5", "--json",
            env=operator_env,
        )  # fmt: skip
        assert rotated.exit_code == 0, rotated.output
        outcome = rotated.last_json()
        assert outcome["old_key_id"] == old_signer.key_id and outcome["old_revoked"]
        new_key = outcome["new_key_id"]
        # Both replicas switched during the grace period, before the revocation.
        assert [r.publisher.signer.key_id for r in replicas if r.publisher] == [new_key] * 2
        after = await asyncio.gather(*(_emit(r, f"after{i}") for i, r in enumerate(replicas)))
        # A replica left behind on the old key: what it signs now is refused.
        stale = Signer("policy", old_signer._key)
        late = stale.seal(_reject(9), aggregate_id="sbx_late")
        late_seq = (await js.publish(late.subject, late.wire)).seq
        # Events of the old key stored before its revocation still count, for a consumer
        # that followed the revocation live as for one that starts now.
        followed = await _admitted(js, None, anchor, consumer)
        verdicts = await _admitted(js, replicas[0].nc, anchor)
        await consumer.keys.stop()
    finally:
        await asyncio.gather(*(r.stop() for r in replicas))
    for answers in (followed, verdicts):
        for seq in [*before, *after[0], *after[1]]:
            assert not isinstance(answers[seq], Refusal), (seq, answers[seq])
        assert isinstance(answers[late_seq], Refusal) and answers[late_seq].reason == "revoked-key"
    # The registration of the new key carries the old key's endorsement.
    registration = next(
        v
        for v in verdicts.values()
        if not isinstance(v, Refusal)
        and v.type == "audit.key_registered"
        and v.payload["key_id"] == new_key
        and v.payload["endorsement"]
    )
    old_signer_key = old_signer._key.verify_key
    old_signer_key.verify(
        bytes.fromhex(registration.payload["public_key"]),
        bytes.fromhex(registration.payload["endorsement"]),
    )
    code, result = _verify(dsec_cli, private_nats, anchor, tmp_path)
    assert code == 0, result
    assert [i["seq"] for i in result["injected"]] == [late_seq]
    assert result["injected"][0]["reason"].startswith("revoked-key")
    listed = dsec_cli("audit", "keys", "--json", env=operator_env).last_json()
    rows = {row["key_id"]: row for row in listed}
    assert rows[new_key]["endorsed"] and rows[new_key]["revoked_at_seq"] is None
    assert not rows[old_signer.key_id]["endorsed"] and rows[old_signer.key_id]["revoked_at_seq"]


def test_missing_key_names_the_command_that_issues_it(
    private_nats, anchor, vault, prefix, tmp_path
) -> None:
    home = tmp_path / "recreated"
    (home / "keys").mkdir(parents=True)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DSEC_")},
        "DSEC_HOME": str(home),
        "DSEC_NATS_URL": private_nats,
        "DSEC_TRUST_ROOT": anchor,
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "dsec_policy"], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2, proc.stderr
    assert "no certified key for 'policy'" in proc.stderr
    assert f"dsec admin issue-service policy --home {home}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list((home / "keys").iterdir()) == []  # it never made a key of its own
    assert time.monotonic() - started < 20
    vault_env = {
        **env,
        "DSEC_KEY_SOURCE": "vault",
        "DSEC_VAULT_ADDR": vault.addr,
        "DSEC_VAULT_TOKEN": vault.token,
        "DSEC_VAULT_KEY_PREFIX": prefix,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "dsec_policy"],
        env=vault_env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"secret/{prefix}/policy" in proc.stderr
    assert "dsec admin issue-service policy --to-vault" in proc.stderr


def test_a_malformed_or_mismatched_vault_key_is_refused_without_quoting_it(
    operator_home, vault, prefix
) -> None:
    root = trust.stack_root(operator_home)
    keys = keysource.VaultKeys(vault.addr, vault.token, prefix=prefix)
    cert = identity.issue(
        root, bytes(SigningKey.generate().verify_key), subject="policy", role="policy"
    )
    secret_like = "ab" * 15 + "zz"  # 32 characters that are not hex: must not be echoed
    vault.client().secrets.kv.v2.create_or_update_secret(
        path=keys.path("policy"),
        secret={"seed": secret_like, "certificate": cert.model_dump(mode="json")},
        mount_point="secret",
    )
    with pytest.raises(keysource.KeySourceError, match="not a DSec key") as bad:
        keys.read("policy")
    assert secret_like not in str(bad.value) and "ab" * 15 not in str(bad.value)
    other = SigningKey.generate()
    keys.write("policy", other, cert)  # a seed the certificate does not certify
    with pytest.raises(keysource.KeySourceError, match="certifies another key") as mismatch:
        keys.read("policy")
    assert bytes(other).hex() not in str(mismatch.value)


async def test_each_node_agent_reads_the_key_of_its_own_node(
    js, private_nats, operator_env, anchor, vault, prefix, dsec_cli, tmp_path
) -> None:
    for node in ("n1", "n2"):
        issued = dsec_cli(
            "admin", "issue-service", "nodeagent", "--node", node, "--to-vault", env=operator_env
        )
        assert issued.exit_code == 0, issued.output
    loaded = {}
    for node in ("n1", "n2"):
        settings = _container(tmp_path / node, private_nats, anchor, vault, prefix)
        loaded[node] = keysource.load_service_key(
            settings.model_copy(update={"node_id": node}), "nodeagent"
        )
    assert loaded["n1"].cert.node_id == "n1" and loaded["n2"].cert.node_id == "n2"
    assert loaded["n1"].key_id != loaded["n2"].key_id
    missing = _container(tmp_path / "n3", private_nats, anchor, vault, prefix)
    with pytest.raises(keysource.KeyMissing) as error:
        keysource.load_service_key(missing.model_copy(update={"node_id": "n3"}), "nodeagent")
    assert "dsec admin issue-service nodeagent --node n3 --to-vault" in str(error.value)


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, path.read_text(errors="replace")
        assert time.monotonic() < deadline, f"no {text!r} in:\n{path.read_text()}"
        time.sleep(0.05)


def test_a_service_process_takes_a_rotated_key_on_sighup(
    private_nats, operator_env, anchor, vault, prefix, dsec_cli, tmp_path
) -> None:
    """The real process: starts from Vault with an empty home, switches keys on SIGHUP."""
    token_file = tmp_path / "policy.token"
    _issue_to_vault(dsec_cli, operator_env, "--token-file", str(token_file))
    home = tmp_path / "container"
    home.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DSEC_")},
        "DSEC_HOME": str(home),
        "DSEC_NATS_URL": private_nats,
        "DSEC_TRUST_ROOT": anchor,
        "DSEC_KEY_SOURCE": "vault",
        "DSEC_VAULT_ADDR": vault.addr,
        "DSEC_VAULT_TOKEN": token_file.read_text().strip(),
        "DSEC_VAULT_KEY_PREFIX": prefix,
        "DSEC_KEY_CHECK_S": "600",  # only the signal makes it look again
    }
    log = tmp_path / "policy.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsec_policy"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        _wait_for(log, "ready; metrics", proc)
        rotated = dsec_cli(
            "audit", "keys", "rotate", "policy", "--no-revoke-old", "--json", env=operator_env
        )
        assert rotated.exit_code == 0, rotated.output
        new_key = rotated.last_json()["new_key_id"]
        assert f"signing with key {new_key}" not in log.read_text()
        proc.send_signal(signal.SIGHUP)
        _wait_for(log, f"signing with key {new_key} now", proc)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert list(home.rglob("*.key")) == []
