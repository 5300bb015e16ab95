"""The policy service's side of code uploads (protocol: :mod:`dsec_core.codeupload`).

A user's CLI holds no object-store credentials. It asks here, with a request signed by its
certified key, to store one bundle; a request checked like an event (certificate, not revoked,
a user of the request's tenant, the signature, the replay window) gets a grant: an S3 POST
policy for exactly ``bundles/<tenant>/<digest>.tar.zst`` and exactly the bundle's length,
encrypted to the client's one-time key. Anything else gets a signed refusal saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from dsec_core import codeupload, objectstore, remote, rpc
from dsec_core.codebundle import bundle_key
from dsec_core.codeupload import Grant, UploadError, UploadRequest
from dsec_core.identity import reserved_tenant
from dsec_core.service import Service
from prometheus_client import Counter

log = logging.getLogger("dsec.policy.uploads")

ANSWERS = Counter(
    "dsec_code_upload_answers_total",
    "Code-upload requests answered, by outcome (granted or the refusal's reason)",
    ["outcome"],
)
UNKNOWN_KEY_S = 2.0
"""A key id the log did not hold is not looked up again for this long: each lookup reads the
stream, and forged requests with fresh key ids cost their sender nothing."""
TENANT_GRANTS_PER_MIN = 60
"""Grants one tenant's users get from one instance a minute (a burst of as many): each lets
them store a bundle in the shared bucket."""
TENANT_BYTES_PER_HOUR = 16 * 2**30
"""Bytes one tenant's grants from one instance may store an hour (a burst of as many)."""


class _Allowance:
    """A tenant's grants and bytes: two buckets refilled evenly, the burst one period's worth."""

    def __init__(self) -> None:
        self.at = time.monotonic()
        self.grants = float(TENANT_GRANTS_PER_MIN)
        self.bytes = float(TENANT_BYTES_PER_HOUR)

    def take(self, size: int) -> str | None:
        """Why a grant of ``size`` bytes must wait, else None (and it is taken)."""
        now = time.monotonic()
        elapsed, self.at = now - self.at, now
        self.grants = min(TENANT_GRANTS_PER_MIN, self.grants + elapsed * TENANT_GRANTS_PER_MIN / 60)
        self.bytes = min(TENANT_BYTES_PER_HOUR, self.bytes + elapsed * TENANT_BYTES_PER_HOUR / 3600)
        if self.grants < 1:
            return f"more than {TENANT_GRANTS_PER_MIN} code uploads a minute"
        if self.bytes < size:
            return f"more than {TENANT_BYTES_PER_HOUR // 2**30} GiB of code uploads an hour"
        self.grants -= 1
        self.bytes -= size
        return None


class CodeUploads:
    """Answers upload requests for one policy service instance (a queue group shares them)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.replay = remote.TenantReplayWindows(codeupload.WINDOW_S)
        self._sub: Any = None
        self._store: Any = None
        self._bucket_ready = False
        self._refusals = rpc.RefusalLog(log, "code-upload request")
        self._allowances: dict[str, _Allowance] = {}
        self._unknown: dict[str, float] = {}  # key id -> until when it counts as unregistered

    def attach(self) -> CodeUploads:
        """Start and stop with the service."""
        self.service.on_start.append(self.start)
        self.service.on_stop.insert(0, self.stop)
        return self

    async def start(self) -> None:
        nc = self.service.nc
        assert nc is not None
        self.replay = remote.TenantReplayWindows(codeupload.WINDOW_S)
        self._sub = await nc.subscribe(
            codeupload.SUBJECT, queue=codeupload.QUEUE, cb=self._on_request
        )

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_request(self, msg: Any) -> None:
        try:
            await self._answer(msg)
        except Exception:  # a hostile request must never stop the service
            log.exception("code-upload request failed")

    async def _answer(self, msg: Any) -> None:
        # Every answer goes to the subject the message came with and names the hash of its
        # exact bytes: an altered copy of someone's request is refused to whoever sent it, and
        # its refusal is not one of the genuine request (the client checks the hash).
        reply, rh = msg.reply, rpc.request_hash(msg.data)
        try:
            request = codeupload.parse_request(msg.data)
        except UploadError as exc:
            await self._refuse(reply, "-", rh, "malformed", str(exc))
            return
        problem = await self._verify(request, reply)
        if problem is not None:
            await self._refuse(reply, request.id, rh, *problem)
            return
        try:
            granted = await self._grant(request)
        except Exception as exc:  # the object store or its configuration
            log.warning("cannot sign an upload grant: %s", type(exc).__name__)
            await self._refuse(
                reply,
                request.id,
                rh,
                "unavailable",
                f"the policy service cannot sign for the object store ({type(exc).__name__}); "
                "ask the operator to check DSEC_S3_* (`dsec status`)",
            )
            return
        answer = codeupload.grant(self.service.endorse, self.service.key_id, request, granted)
        ANSWERS.labels("granted").inc()
        nc = self.service.nc
        assert nc is not None
        await nc.publish(reply, answer)

    async def _verify(self, request: UploadRequest, reply: str | None) -> tuple[str, str] | None:
        """Why the request must be refused, checked like an event, the cheap checks first;
        None when it may be granted."""
        gate = self.service.gate
        assert gate is not None
        if reply != request.reply_to:
            return "malformed", "the reply subject is not the one the request signed"
        if not rpc.answerable(reply):
            return "malformed", "the reply subject is a service's inbox"
        outside = self.replay.outside(request.time)
        if outside is not None:
            return outside
        if self._unknown.get(request.key_id, 0.0) > time.monotonic():
            return "unknown-key", f"key {request.key_id} is not registered"
        refused = await rpc.user_refusal(
            gate.keys, request.key_id, request.producer, request.tenant, request.fields,
            codeupload.REQUEST_DOMAIN, action="store code",
        )  # fmt: skip
        if refused is not None:
            if refused[0] == "unknown-key":  # not read from the log again for a while
                self._forget_unknown()
                self._unknown[request.key_id] = time.monotonic() + UNKNOWN_KEY_S
            return refused
        reserved = reserved_tenant(request.tenant)
        if reserved is not None:
            return "unauthorized", reserved
        # checked, then the allowance taken, then recorded: a replay neither uses the
        # allowance up nor, refused for it, takes the id
        ids = (request.tenant, request.key_id, request.id)
        replayed = self.replay.refusal(*ids, request.time, record=False)
        if replayed is not None:
            return replayed
        allowance = self._allowances.setdefault(request.tenant, _Allowance())
        busy = allowance.take(request.size)
        if busy is not None:
            return "busy", f"tenant {request.tenant!r} asked for {busy}; try again later"
        self.replay.record(*ids)
        return None

    def _forget_unknown(self) -> None:
        now = time.monotonic()
        if len(self._unknown) >= 10_000:
            self._unknown = {k: t for k, t in self._unknown.items() if t > now}
            while len(self._unknown) >= 10_000:
                self._unknown.pop(next(iter(self._unknown)))

    async def _grant(self, request: UploadRequest) -> Grant:
        settings = self.service.settings
        key = bundle_key(request.tenant, request.digest)
        expires = datetime.now(UTC) + timedelta(seconds=codeupload.GRANT_S)
        if self._store is None:
            self._store = objectstore.client(settings)
        form = await asyncio.to_thread(self._presign, key, request.size, expires)
        endpoint = settings.s3_public_url or (
            f"{'https' if settings.s3_secure else 'http'}://{settings.endpoint('s3_endpoint')}"
        )
        return Grant(
            url=f"{endpoint}/{settings.s3_bucket}",
            fields={**form, "key": key},
            object_key=key,
            expires=expires,
        )

    def _presign(self, key: str, size: int, expires: datetime) -> dict[str, str]:
        """The POST policy's form fields (blocking: the store's region may be looked up once)."""
        from minio.datatypes import PostPolicy

        bucket = self.service.settings.s3_bucket
        if not self._bucket_ready:
            objectstore.ensure_bucket(self._store, bucket)
            self._bucket_ready = True
        policy = PostPolicy(bucket, expires)
        policy.add_equals_condition("key", key)
        policy.add_content_length_range_condition(size, size)
        return {str(k): str(v) for k, v in self._store.presigned_post_policy(policy).items()}

    async def _refuse(
        self, reply: str | None, rid: str, rh: bytes, reason: str, detail: str
    ) -> None:
        ANSWERS.labels(reason).inc()
        self._refusals.refused(rid, reason, detail)
        nc = self.service.nc
        if reply is not None and rpc.answerable(reply) and nc is not None:
            answer = codeupload.refusal(
                self.service.endorse, self.service.key_id, rid, rh, reason, detail
            )
            with contextlib.suppress(Exception):
                await nc.publish(reply, answer)
