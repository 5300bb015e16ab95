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
  :func:`lazy_module` returns a module that executes on first attribute access (the standard
  library's :class:`importlib.util.LazyLoader`).
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


def lazy_module(name: str) -> types.ModuleType:
    """``name``, imported now if it already is, else a module that loads on first attribute use.

    Submodules stay reachable as attributes once the package's own ``__init__`` imports them
    (``hvac.exceptions``, ``requests.exceptions``); an ``import name.sub`` statement loads the
    package at once, so callers use attribute access instead.
    """
    with _lock:
        module = sys.modules.get(name)
        if module is not None:
            return module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        loader = importlib.util.LazyLoader(spec.loader)
        spec.loader = loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loader.exec_module(module)
        return module


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
