"""``dsec env ls`` as a user runs it: the environment archives in a real object store."""

from __future__ import annotations

import io
import json
import time
import uuid
from pathlib import Path

import pytest
from dsec_testing.helpers import run_dsec_inproc
from dsec_testing.stack import S3Info

pytestmark = pytest.mark.integration


def _put(s3: S3Info, bucket: str, key: str, data: bytes) -> None:
    s3.client().put_object(bucket, key, io.BytesIO(data), len(data))


@pytest.fixture
def bucket(s3: S3Info) -> str:
    """A system bucket of this test's own, holding two archives and two objects that are not."""
    name = f"envls-{uuid.uuid4().hex[:12]}"
    s3.client().make_bucket(name)
    _put(s3, name, f"envs/{'a' * 64}.tar.zst", b"a" * 100)
    time.sleep(1.1)  # S3 times have a second's resolution: "b" is stored after "a"
    _put(s3, name, f"envs/{'b' * 64}.tar.zst", b"b" * 300)
    _put(s3, name, f"envs/{'c' * 64}.tar.zst.part", b"partial upload")
    _put(s3, name, "bundles/x.tar.zst", b"a code bundle")
    return name


def test_env_ls_lists_the_archives_in_the_object_store(
    tmp_path: Path, stack_env: dict[str, str], bucket: str
) -> None:
    env = {**stack_env, "DSEC_S3_BUCKET": bucket}

    result = run_dsec_inproc("env", "ls", "--json", home=tmp_path, env=env)

    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)["environments"]
    assert [(e["lock_hash"], e["size_bytes"]) for e in listed] == [("b" * 64, 300), ("a" * 64, 100)]
    assert listed[0]["object_key"] == f"envs/{'b' * 64}.tar.zst"
    assert listed[0]["stored_at"] > listed[1]["stored_at"]
    human = run_dsec_inproc("env", "ls", home=tmp_path, env=env)
    assert human.exit_code == 0 and "bbbbbbbbbbbbbbbb" in human.stdout and "300" in human.stdout


def test_env_ls_with_no_archives(tmp_path: Path, stack_env: dict[str, str], s3: S3Info) -> None:
    env = {**stack_env, "DSEC_S3_BUCKET": f"nothing-{uuid.uuid4().hex[:12]}"}  # not even a bucket
    result = run_dsec_inproc("env", "ls", "--json", home=tmp_path, env=env)
    assert (result.exit_code, result.stdout) == (0, '{"environments":[]}\n')
    result = run_dsec_inproc("env", "ls", home=tmp_path, env=env)
    assert result.stdout == "no environment archives in the object store\n"


def test_env_gc_is_gone(tmp_path: Path) -> None:
    """The builder and the node agents own their caches; the CLI changes nothing behind them."""
    result = run_dsec_inproc("env", "gc", home=tmp_path)
    assert result.exit_code == 2 and "No such command 'gc'" in result.output
