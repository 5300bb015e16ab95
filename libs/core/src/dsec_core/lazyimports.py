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
- ``aiohttp`` (about 10 MiB with yarl, multidict and friends) is imported by nats-py's
  ``nats.aio.transport`` for its WebSocket transport alone; DSec speaks ``nats://`` and
  ``tls://``. :func:`defer_aiohttp_for_nats` (called when ``dsec_core`` is imported) lets that
  module load without it and hands it a :class:`DeferredModule` instead, so a ``ws://`` server
  still works, loading aiohttp then.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Callable
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
    """Runs nats-py's real ``nats.aio.transport`` with ``import aiohttp`` answered by
    ImportError (the module's own fallback), then gives it a deferred aiohttp."""

    def __init__(self, real: importlib.machinery.ModuleSpec) -> None:
        self._real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        assert self._real.loader is not None
        return self._real.loader.create_module(self._real)

    def exec_module(self, module: types.ModuleType) -> None:
        assert self._real.loader is not None
        blocked = "aiohttp" not in sys.modules
        if blocked:
            sys.modules["aiohttp"] = None  # type: ignore[assignment]  # import -> ImportError
        try:
            self._real.loader.exec_module(module)
        finally:
            if blocked and sys.modules.get("aiohttp", False) is None:
                del sys.modules["aiohttp"]
        if getattr(module, "aiohttp", True) is None:
            module.aiohttp = DeferredModule("aiohttp")  # type: ignore[attr-defined]


class _DeferNatsAiohttp(importlib.abc.MetaPathFinder):
    """Finds ``nats.aio.transport`` as the path finders would and wraps its loader."""

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "nats.aio.transport":
            return None
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if real is None or real.loader is None:
            return None
        spec = importlib.util.spec_from_loader(
            fullname, _NatsTransportLoader(real), origin=real.origin
        )
        if spec is not None:
            spec.has_location = real.has_location
            spec.cached = real.cached
        return spec


_nats_finder = _DeferNatsAiohttp()


def defer_aiohttp_for_nats() -> None:
    """Load nats-py's transport module without aiohttp, unless it is already loaded."""
    with _lock:
        if "nats.aio.transport" in sys.modules or _nats_finder in sys.meta_path:
            return
        sys.meta_path.insert(0, _nats_finder)


def submodule_attributes(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A PEP 562 ``__getattr__`` for ``package``: each name of ``where`` is imported from its
    submodule (``where[name]``) on first use and kept in the package, so the next read is a
    plain one. Importing the package alone then loads none of them."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
