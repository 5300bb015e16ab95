"""Root pytest configuration shared by every workspace member.

Kernel tests (marker ``kernel``) need root and kernel features. Elsewhere they skip with the
reason; with ``DSEC_REQUIRE_KERNEL=1`` (CI) such a skip becomes a failure, so a kernel test can
never pass CI by silently not running.
"""

from __future__ import annotations

import os

import pytest


def kernel_unavailable_reason() -> str | None:
    """Return why kernel tests cannot run here, or ``None`` when they can."""
    if os.geteuid() != 0:
        return "kernel tests need root"
    if not os.path.isdir("/sys/fs/cgroup"):
        return "no cgroup filesystem"
    return None


def require_kernel(reason: str) -> None:
    """Skip (or, under DSEC_REQUIRE_KERNEL=1, fail) a kernel test that cannot run."""
    if os.environ.get("DSEC_REQUIRE_KERNEL") == "1":
        pytest.fail(f"DSEC_REQUIRE_KERNEL=1 but kernel test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("kernel") is not None:
        reason = kernel_unavailable_reason()
        if reason is not None:
            require_kernel(reason)
