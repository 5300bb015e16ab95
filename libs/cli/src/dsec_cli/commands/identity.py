"""``dsec login`` / ``dsec whoami`` / ``dsec admin``: who this CLI signs as, and issuing keys.

A user's key counts only with a certificate from the operator root that binds it to a user and
a tenant. ``dsec admin issue-user`` (the operator) writes a credential file; ``dsec login
--credential FILE`` (the user) installs it. On the operator's own machine ``dsec login --user
NAME --tenant T`` issues and installs one in one step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from dsec_core.settings import Settings

from dsec_cli.common import EXIT_BAD_INPUT, console, fail, operator_root, print_json, safe_text

admin_app = typer.Typer(help="Operator tasks: issue credentials and service keys.")

_NAME_HELP = "lowercase letters, digits and '-' (a DNS label)"


def _check_name(value: str, what: str) -> str:
    import re

    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", value):
        fail(f"{what} {value!r} is not valid: {_NAME_HELP}", EXIT_BAD_INPUT)
    if what == "tenant":
        from dsec_core.identity import reserved_tenant

        if (why := reserved_tenant(value)) is not None:
            fail(f"{why}; choose another name", EXIT_BAD_INPUT)
    return value


def _show(cert: object, as_json: bool) -> None:
    from dsec_core.identity import Certificate

    assert isinstance(cert, Certificate)
    if as_json:
        print_json(
            {
                "producer": cert.subject,
                "role": cert.role,
                "tenant": cert.tenant,
                "key_id": cert.key_id,
                "issued_at": cert.issued_at,
                "expires_at": cert.expires_at,
            }
        )
    else:
        console.print(
            f"{safe_text(cert.subject)} (role {cert.role}, tenant "
            f"{safe_text(cert.tenant or '-')}, key {cert.key_id}, issued "
            f"{cert.issued_at:%Y-%m-%d %H:%M} UTC)",
            highlight=False,
        )


def login(
    credential: Annotated[
        Path | None, typer.Option(help="A credential file from `dsec admin issue-user`")
    ] = None,
    user: Annotated[str | None, typer.Option(help="Operator only: log in as this user")] = None,
    tenant: Annotated[str, typer.Option(help="Operator only: the user's tenant")] = "default",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """Install the identity this CLI signs with: a key bound to a user and a tenant.

    With --credential, the file your operator issued; on the operator's machine, --user and
    --tenant issue one with the stack's root key. Exit 2 on an unusable credential.
    """
    from dsec_core import identity

    paths = identity.TrustPaths(Settings().home)
    if credential is not None:
        try:
            key, cert = identity.load_credential(credential.read_text())
        except OSError as exc:
            fail(f"cannot read {credential}: {exc.strerror}", EXIT_BAD_INPUT)
        except identity.CertificateError as exc:
            fail(f"{credential}: {exc}", EXIT_BAD_INPUT)
        anchor = identity.read_anchor(paths, Settings().trust_root)
        carried = identity.credential_anchor(credential.read_text())
        if anchor is None and carried is not None:
            # First login on this machine: trust the root the operator's credential names.
            paths.anchor.parent.mkdir(parents=True, exist_ok=True)
            paths.anchor.write_text(carried.hex() + "\n")
            anchor = carried
        if anchor is not None:
            try:
                identity.check(cert, anchor)
            except identity.CertificateError as exc:
                fail(f"{credential}: not valid for this DSec ({exc})", EXIT_BAD_INPUT)
    else:
        name = _check_name(user or os.environ.get("USER") or "operator", "user")
        key, cert = identity.issue_user(operator_root(), name, _check_name(tenant, "tenant"))
    identity.save_identity(paths, key, cert)
    _show(cert, as_json)


def whoami(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """Show the identity this CLI signs with (exit 2 when there is none)."""
    from dsec_core import identity

    paths = identity.TrustPaths(Settings().home)
    try:
        _, cert = identity.load_user(paths)
    except (OSError, identity.CertificateError):
        fail("no identity on this machine: run `dsec login`", EXIT_BAD_INPUT)
    _show(cert, as_json)


@admin_app.command("issue-user")
def issue_user(
    user: Annotated[str, typer.Argument(help="The user's name")],
    tenant: Annotated[str, typer.Option(help="The tenant the user acts for")],
    out: Annotated[Path, typer.Option(help="Where to write the credential (mode 0600)")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """Issue a credential (key + root-signed certificate) for a user of one tenant."""
    from dsec_core import identity

    key, cert = identity.issue_user(
        operator_root(), _check_name(user, "user"), _check_name(tenant, "tenant")
    )
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror} (an existing file is never overwritten)", 2)
    with os.fdopen(fd, "w") as f:
        f.write(identity.credential_json(key, cert, bytes(operator_root().verify_key)))
    if as_json:
        print_json(
            {"path": str(out), "subject": cert.subject, "tenant": tenant, "key_id": cert.key_id}
        )
        return
    console.print(
        f"wrote {safe_text(out)} for {safe_text(cert.subject)} (tenant {safe_text(tenant)}); "
        "give it to the user, who runs `dsec login --credential FILE`",
        highlight=False,
    )


@admin_app.command("issue-service")
def issue_service(
    role: Annotated[str, typer.Argument(help="policy, builder, snapshot, scheduler, nodeagent")],
    home: Annotated[
        Path | None, typer.Option(help="The DSEC_HOME of the service (its keys/ dir)")
    ] = None,
    node: Annotated[str | None, typer.Option(help="Node agents: the node it owns")] = None,
    to_vault: Annotated[
        bool,
        typer.Option(
            "--to-vault",
            help="Store the key in Vault/OpenBao (KV v2 DSEC_VAULT_KEY_MOUNT/"
            "DSEC_VAULT_KEY_PREFIX/ROLE) for services run with DSEC_KEY_SOURCE=vault",
        ),
    ] = False,
    token_file: Annotated[
        Path | None,
        typer.Option(help="With --to-vault: write a Vault token that reads only this key (0600)"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """Certify a service's key for another machine (a node agent joining, replicas).

    With --home the key and certificate go to HOME/keys; with --to-vault into Vault, where every
    replica and re-created container of the service reads the same key. A key already there and
    still certified for the same role and node is kept (rotate it with `dsec audit keys rotate`).
    """
    from dsec_core import identity

    if role not in identity.SERVICE_ROLES:
        fail(f"{role!r} is not a service; valid: {', '.join(identity.SERVICE_ROLES)}", 2)
    if role == "nodeagent" and not node:
        fail("a node agent's certificate names its node: add --node NODE_ID", EXIT_BAD_INPUT)
    if home is None and not to_vault:
        fail("say where the key goes: --home DIR or --to-vault", EXIT_BAD_INPUT)
    if token_file is not None and not to_vault:
        fail("--token-file goes with --to-vault", EXIT_BAD_INPUT)
    root = operator_root()
    if to_vault:
        key_id = _issue_to_vault(root, role, node, token_file, quiet=as_json)
    else:
        assert home is not None
        paths = identity.TrustPaths(home)
        key_id = identity.ensure_service_identity(paths, root, role, node_id=node).key_id
    if home is not None:
        anchor = home / "trust" / "root.pub"
        anchor.parent.mkdir(parents=True, exist_ok=True)
        anchor.write_text(bytes(root.verify_key).hex() + "\n")
    if as_json:
        print_json(
            {
                "role": role,
                "key_id": key_id,
                "vault": to_vault,
                "home": None if home is None else str(home),
                "token_file": None if token_file is None else str(token_file),
            }
        )
        return
    where = "in Vault" if to_vault else f"under {safe_text(home)}"
    console.print(f"certified {role} key {key_id} {where}", highlight=False)


def _issue_to_vault(
    root: Any, role: str, node: str | None, token_file: Path | None, *, quiet: bool = False
) -> str:
    """Keep the certified key Vault holds for ``role`` or store a new one; grant a token."""
    from dsec_core import identity, keysource
    from nacl.signing import SigningKey

    keys = keysource.vault_keys(Settings(key_source="vault"))
    name = keysource.vault_name(role, node)
    try:
        current: keysource.ServiceKey | None = keys.read(name)
    except keysource.KeyMissing:
        current = None
    except keysource.KeySourceError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    if current is not None:
        try:
            identity.check(current.cert, bytes(root.verify_key))
        except identity.CertificateError:
            current = None
    wanted = (role, role, node)
    if current is None or (current.cert.subject, current.cert.role, current.cert.node_id) != wanted:
        key = SigningKey.generate()
        cert = identity.issue(
            root, bytes(key.verify_key), subject=role, role=cast(identity.Role, role), node_id=node
        )
        try:
            keys.write(name, key, cert)
        except keysource.KeySourceError as exc:
            fail(str(exc), EXIT_BAD_INPUT)
        key_id = cert.key_id
    else:
        key_id = current.key_id
    if token_file is not None:
        try:
            token = keys.grant(name)
        except keysource.KeySourceError as exc:
            fail(str(exc), EXIT_BAD_INPUT)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        if quiet:
            return key_id
        console.print(
            f"wrote {safe_text(token_file)}: a Vault token (policy {keys.policy_name(name)}) that "
            f"reads only {safe_text(keys.where(name))}; give it to the service as "
            "DSEC_VAULT_TOKEN with DSEC_KEY_SOURCE=vault",
            highlight=False,
        )
    return key_id


@admin_app.command("issue-services")
def issue_services(
    out: Annotated[Path, typer.Argument(help="Directory for the keys (created, mode 0700)")],
    node: Annotated[str, typer.Option(help="The node the node agent's certificate names")] = (
        "node-1"
    ),
    to_vault: Annotated[
        bool,
        typer.Option(
            "--to-vault",
            help="Store the keys in Vault/OpenBao instead; write OUT/tokens/<service>.token, "
            "each reading only its service's key",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """Certify a key for every service of a deployment (compose, Kubernetes).

    Writes OUT/keys/<service>.key and .cert.json (mount each service's two files into its
    $DSEC_HOME/keys) and OUT/trust.env with DSEC_TRUST_ROOT (give it to every service and CLI).
    With --to-vault the keys go to Vault (services run with DSEC_KEY_SOURCE=vault and their
    token) and only the tokens are written. The root key itself stays with the operator
    ($DSEC_HOME/trust/root.key here).
    """
    from dsec_core import identity

    trust = identity.TrustPaths(Settings().home)
    if not trust.root_key.exists():  # bootstrapping a deployment: this machine is the operator's
        identity.ensure_root(trust)
        if not as_json:
            console.print(
                f"created the operator root key {safe_text(trust.root_key)} (keep it safe)"
            )
    root = operator_root()
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths = identity.TrustPaths(out)
    if to_vault:
        (out / "tokens").mkdir(exist_ok=True, mode=0o700)
    key_ids: dict[str, str] = {}
    for role in identity.SERVICE_ROLES:
        node_id = node if role == "nodeagent" else None
        if to_vault:
            token = out / "tokens" / f"{role}.token"
            key_id = _issue_to_vault(root, role, node_id, token, quiet=as_json)
        else:
            key_id = identity.ensure_service_identity(paths, root, role, node_id=node_id).key_id
        key_ids[role] = key_id
        if not as_json:
            console.print(f"{role}: key {key_id}", highlight=False)
    env = out / "trust.env"
    env.write_text(f"DSEC_TRUST_ROOT={bytes(root.verify_key).hex()}\n")
    written = "tokens" if to_vault else "keys"
    if as_json:
        print_json({"out": str(out), "vault": to_vault, "keys": key_ids, "trust_env": str(env)})
        return
    console.print(f"wrote {safe_text(out)}/{written} and {safe_text(env)}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``dsec login``, ``dsec whoami`` and ``dsec admin``."""
    app.command("login")(login)
    app.command("whoami")(whoami)
    app.add_typer(admin_app, name="admin")
