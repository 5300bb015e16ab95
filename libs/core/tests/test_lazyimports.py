"""Idle services do not load minio's admin crypto or hvac; both still work on first use."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_minio_admin_crypto_loads_on_first_use_and_still_round_trips() -> None:
    out = run(
        """
        import io, sys
        import dsec_core
        from minio import Minio, MinioAdmin
        assert "argon2" not in sys.modules and "Crypto" not in sys.modules, "loaded at import"
        import minio.crypto
        sealed = minio.crypto.encrypt(b"a payload", "a password")
        assert "argon2" in sys.modules

        class Response(io.BytesIO):  # what minio.crypto.decrypt reads: an urllib3-like body
            def stream(self, n=None): yield self.read()
            def release_conn(self): pass

        print(minio.crypto.decrypt(Response(sealed), "a password").decode())
        """
    )
    assert out == "a payload"


def test_hvac_loads_on_first_attribute_use() -> None:
    out = run(
        """
        import sys
        from dsec_nodeagent.context import vault
        assert "hvac" not in sys.modules and "requests" not in sys.modules
        client = vault.hvac.Client(url="http://127.0.0.1:9", timeout=1)
        assert issubclass(vault.hvac.exceptions.Forbidden, vault.hvac.exceptions.VaultError)
        import hvac, hvac.exceptions  # another module's plain imports get the same modules
        assert hvac.Client is vault.hvac.Client
        import hvac.utils
        try:  # what hvac raises is caught by the names the adapter and a plain import use
            hvac.utils.raise_for_error("get", "http://vault/v1/x", 404)
        except vault.hvac.exceptions.InvalidPath:
            pass
        assert hvac.exceptions.InvalidPath is vault.hvac.exceptions.InvalidPath
        print(type(client).__name__, vault.requests.exceptions.RequestException.__name__)
        """
    )
    assert out == "Client RequestException"


def test_a_module_imported_before_dsec_core_is_left_as_it_is() -> None:
    out = run(
        """
        import sys
        import minio
        import dsec_core.lazyimports as lazy
        lazy.defer_minio_admin_crypto()
        print(sys.modules["minio.crypto"].__file__.endswith("crypto.py"), "argon2" in sys.modules)
        """
    )
    assert out == "True True"


def test_nats_loads_aiohttp_only_for_a_websocket_and_others_get_the_real_one() -> None:
    """nats-py imports aiohttp for its WebSocket transport alone: connecting over TCP does not
    load it; the transport still finds it when asked, and a plain import is the real one."""
    out = run(
        """
        import sys
        import dsec_core
        import nats
        from nats.aio import transport
        assert "aiohttp" not in sys.modules, "loaded with nats"
        assert transport.aiohttp  # (nats-py checks this before a WebSocket transport)
        session_class = transport.aiohttp.ClientSession  # first use: the real aiohttp
        import aiohttp
        assert session_class is aiohttp.ClientSession
        assert not getattr(aiohttp, "_dsec_stand_in", False)
        from aiohttp import web  # a submodule, as the metrics endpoint imports it
        print(transport.aiohttp.WSMsgType.BINARY is aiohttp.WSMsgType.BINARY)
        """
    )
    assert out == "True"
