"""Keep idle services small: load heavy third-party modules on first use, not at import.

Every service must idle under 120 MB RSS. Two libraries cost far more memory at import than
their use at idle justifies:

- ``minio``'s package ``__init__`` imports ``MinioAdmin``, whose ``minio.crypto`` loads
  argon2-cffi and pycryptodome (with pycparser): about 10 MiB in every process that talks S3,
  for an admin API DSec never calls. :func:`defer_minio_admin_crypto` (called when ``dsec_core``
  is imported) answers the import of ``minio.crypto`` with a stand-in; its ``encrypt`` and
  ``decrypt`` (and any other name) load the real module on first use, so MinioAdmin still
  works if anyone calls it.
- ``hvac`` (with ``requests``) is needed only when a sandbox asks for a secret or a key:
  :class:`DeferredModule` stands for a module and imports it on its first attribute read.
- ``nats-py``'s transport module imports ``aiohttp`` (a fifth of a second, and megabytes) for
  its WebSocket transport alone; DSec connects over TCP. :func:`defer_nats_websocket` (called
  when ``dsec_core`` is imported) gives that one module a stand-in that loads the real
  ``aiohttp`` on first use (a ``ws://`` server); every other ``import aiohttp`` gets the real
  one. Every CLI command that talks to the bus starts that much sooner.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from typing import Any

_lock = threading.RLock()


class DeferredModule:
    """Stands for module ``name`` and imports it on the first attribute read.

    Nothing goes into ``sys.modules`` before that, so the import system never sees a
    half-made module (the standard library's ``LazyLoader`` does that: an ``import
    name.sub`` elsewhere then loads ``name.sub`` twice, and an ``except`` naming one copy's
    exception class misses the other's). Attribute reads only: use ``deferred.sub.Class``
    where ``name/__init__`` imports ``sub``.
    """

    __slots__ = ("_module", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: types.ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = importlib.import_module(self._name)  # thread-safe: the import lock
            self._module = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<deferred module {self._name!r}>"


class _StandInLoader(importlib.abc.Loader):
    """Makes ``minio.crypto`` a small module whose names load the real one when first used."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = "Stand-in: the real minio.crypto loads on first use (dsec_core)."
        module._dsec_stand_in = True  # type: ignore[attr-defined]
        module.encrypt = _stand_in_encrypt  # type: ignore[attr-defined]
        module.decrypt = _stand_in_decrypt  # type: ignore[attr-defined]
        module.__getattr__ = _stand_in_getattr  # type: ignore[method-assign]


class _DeferMinioCrypto(importlib.abc.MetaPathFinder):
    """Answers the import of ``minio.crypto`` with the stand-in until the real one is wanted."""

    real_wanted = False

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "minio.crypto" or self.real_wanted:
            return None
        return importlib.util.spec_from_loader(fullname, _StandInLoader(), origin="dsec_core")


_finder = _DeferMinioCrypto()


def _load_real_minio_crypto() -> types.ModuleType:
    with _lock:
        current = sys.modules.get("minio.crypto")
        if current is not None and not getattr(current, "_dsec_stand_in", False):
            return current
        _finder.real_wanted = True
        sys.modules.pop("minio.crypto", None)
        try:
            return importlib.import_module("minio.crypto")  # binds minio.crypto to the real one
        except BaseException:
            if current is not None:
                sys.modules["minio.crypto"] = current
            raise


def _stand_in_encrypt(payload: bytes, password: str) -> bytes:
    result: bytes = _load_real_minio_crypto().encrypt(payload, password)
    return result


def _stand_in_decrypt(response: Any, secret_key: str) -> bytes:
    result: bytes = _load_real_minio_crypto().decrypt(response, secret_key)
    return result


def _stand_in_getattr(name: str) -> Any:
    if name.startswith("__"):  # the import system probes __path__, __spec__...: not ours
        raise AttributeError(name)
    return getattr(_load_real_minio_crypto(), name)


def defer_minio_admin_crypto() -> None:
    """Answer ``minio.crypto``'s import with the stand-in, unless minio is already loaded."""
    with _lock:
        if "minio" in sys.modules or _finder in sys.meta_path or _finder.real_wanted:
            return
        sys.meta_path.insert(0, _finder)


class _NatsTransportLoader(importlib.abc.Loader):
    """Runs ``nats.aio.transport`` with a stand-in ``aiohttp`` in ``sys.modules``, removed
    right after: the module keeps the stand-in; nobody else sees it."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        created: types.ModuleType | None = self._real.create_module(spec)
        return created

    def exec_module(self, module: types.ModuleType) -> None:
        with _lock:
            if "aiohttp" in sys.modules:  # loaded already: nothing to save
                self._real.exec_module(module)
                return
            stand_in = types.ModuleType("aiohttp", "Stand-in: aiohttp loads on first use.")
            stand_in._dsec_stand_in = True  # type: ignore[attr-defined]
            stand_in.__getattr__ = _real_aiohttp_attr  # type: ignore[method-assign]
            sys.modules["aiohttp"] = stand_in
            try:
                self._real.exec_module(module)
            finally:
                if sys.modules.get("aiohttp") is stand_in:
                    del sys.modules["aiohttp"]

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename...: the real loader's
        return getattr(self._real, name)


def _real_aiohttp_attr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module("aiohttp"), name)


class _DeferNatsWebsocket(importlib.abc.MetaPathFinder):
    """Finds ``nats.aio.transport`` as the path finder does, with :class:`_NatsTransportLoader`
    around its loader."""

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "nats.aio.transport":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _NatsTransportLoader(spec.loader)
        return spec


_nats_finder = _DeferNatsWebsocket()


def defer_nats_websocket() -> None:
    """Give ``nats.aio.transport`` its stand-in ``aiohttp``, unless it is loaded already."""
    with _lock:
        if "nats.aio.transport" in sys.modules or _nats_finder in sys.meta_path:
            return
        sys.meta_path.insert(0, _nats_finder)
