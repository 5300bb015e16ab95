"""Backbone throughput: DSec (sign + encode + publish + consume + decode + verify) beside raw
nats-py JetStream publish/consume of payloads of the same size, in one run.

    uv run python bench/bus.py [--events 20000] [--repeat 3] [--quick] [--json]

Each path runs as it does in production: a producer process and a consumer process at the same
time. Raw nats-py publishes with pipelined acks (batches of 256 concurrent ``js.publish``); the
DSec producer seals batches of 256 and hands them to ``EventPublisher.publish_many`` (JetStream's
asynchronous publish: core publishes with reply subjects, at most 512 unacknowledged, one ack
callback); a second raw peer publishes that same pipelined way, so the figures separate DSec's own
work from the transport. Every path consumes through a pull consumer in batches of 512. The DSec
producer signs every envelope (Ed25519 over canonical MessagePack, built by msgspec in C); the
DSec consumer verifies every envelope as
``dsec audit verify`` does: certificate, producer authorization, chain position and ``prev``
link, stream sequence, and signatures per chain head (each chain's newest signature at least
every 256 events and at the end; by the ``prev`` hashes it covers every envelope before it, and
a chain that does not fit is checked signature by signature). Throughput = events / (first
publish -> last event consumed and verified). The DSec and raw runs alternate, each on a fresh
nats-server, ``--repeat`` times: the ratio of each pair is reported and their median (other
work on the machine moves both figures; the pair's ratio moves less).

Also measured: the replay verifier alone (the core of ``dsec audit verify``) over envelopes of six
interleaved producers, as shipped (chain heads) and checking every signature; ``dsec audit
verify`` end to end (the stream replayed through JetStream into the verifier, as the CLI does:
the verifier in a forked process fed batches while the stream is read); and, beside it, how fast
its reader alone reads the stream, and nats-py alone (a pull consumer fetching 2,048 at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import nats
from _common import emit, nats_server, percentile
from dsec_core import audit, identity
from dsec_core.audit import Verifier
from dsec_core.audit_worker import open_verifier
from dsec_core.bus import EventPublisher, ensure_stream, replay_batches, stream_seq
from dsec_core.envelope import Envelope
from dsec_core.events import KeyRegistered, SandboxExited, SandboxScheduled, SpecSubmitted
from dsec_core.identity import Role
from dsec_core.signing import Signer
from dsec_core.subjects import STREAM
from dsec_core.trust import Gate, KeyRing, handled_bucket
from nacl.signing import SigningKey
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

BATCH = 256


async def _connect(url: str) -> Any:
    """Through dsec_core.natsclient like every DSec client (credentials/TLS from DSEC_NATS_*)."""
    from dsec_core import natsclient
    from dsec_core.settings import Settings

    return await natsclient.connect(Settings(nats_url=url), "dsec-bench")


def _payload() -> SandboxExited:
    return SandboxExited(exit_code=0, reason="ok", duration_s=12.5)


def micro_sign_encode(n: int) -> dict[str, float]:
    signer = Signer("bench", SigningKey.generate())
    payload = _payload()
    samples = []
    for i in range(n):
        t = time.perf_counter()
        signer.seal(payload, aggregate_id=f"sbx_{i % 64}")
        samples.append((time.perf_counter() - t) * 1e6)
    return {
        "p50_us": round(percentile(samples, 0.5), 2),
        "p99_us": round(percentile(samples, 0.99), 2),
    }


ROOT = SigningKey.generate()
ANCHOR = bytes(ROOT.verify_key)


def _certified(name: str, role: Role = "nodeagent") -> tuple[Signer, KeyRegistered]:
    key = SigningKey.generate()
    tenant = "default" if role == "user" else None
    cert = identity.issue(
        ROOT, bytes(key.verify_key), subject=name, role=role, tenant=tenant, node_id="n1"
    )
    signer = Signer(name, key)
    reg = KeyRegistered(
        producer=name,
        key_id=signer.key_id,
        public_key=signer.public_raw.hex(),
        certificate=cert.model_dump(mode="json"),
    )
    return signer, reg


def verify_rates(n: int) -> dict[str, int]:
    """Events/s of the replay verifier: as shipped, and checking every signature."""
    wires = []
    signers = []
    for i in range(6):
        s, reg = _certified(f"svc{i}")
        signers.append(s)
        wires.append(s.seal(reg, aggregate_id=s.key_id).wire)
    payload = _payload()
    wires += [signers[i % 6].seal(payload, aggregate_id=f"sbx_{i % 64}").wire for i in range(n)]
    rates: dict[str, Any] = {}
    for name, every in (("chain_heads", audit.SIGNATURE_EVERY), ("every_signature", 1)):
        started, cpu = time.perf_counter(), time.process_time()
        report = audit.verify_stream(enumerate(wires, 1), ANCHOR, signature_every=every)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        if not report.ok:
            raise SystemExit(f"verification failed: {report.finding}")
        rates[name] = round(len(wires) / elapsed)
        if name == "chain_heads":
            rates["chain_heads_cpu_us_per_event"] = round(cpu * 1e6 / len(wires), 2)
    return rates


async def _consume(
    url: str, stream: str, subject: str, n: int, verify: int, ready: Connection
) -> tuple[float, float]:
    """Consume ``n`` messages; ``verify``: 0 for none, else the verifier's signature interval
    (``audit.SIGNATURE_EVERY`` as ``dsec audit verify``; 1: every signature on arrival)."""
    nc = await _connect(url)
    js = nc.jetstream()
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True)
    sub = await js.pull_subscribe(subject, stream=stream, config=config)
    verifier = Verifier(ANCHOR, verify or 1)
    ready.send("ready")
    cpu = time.process_time()
    got = 0
    while got < n:
        try:
            msgs = await sub.fetch(512, timeout=5)
        except nats.errors.TimeoutError:
            continue
        for m in msgs:
            if verify and verifier.feed(stream_seq(m), m.data) is not None:
                raise SystemExit(f"verification failed: {verifier.report.finding}")
        got += len(msgs)
    if verify and not verifier.finish().ok:  # the chains' last signatures
        raise SystemExit(f"verification failed: {verifier.report.finding}")
    if verify and verifier.report.injected:
        raise SystemExit(f"foreign messages in the bench: {verifier.report.injected[:3]}")
    done = time.time()
    cpu = time.process_time() - cpu
    await nc.close()
    return done, cpu


def _consumer_main(
    url: str, stream: str, subject: str, n: int, verify: int, conn: Connection
) -> None:
    conn.send(asyncio.run(_consume(url, stream, subject, n, verify, conn)))


async def _raw_publish(url: str, n: int, size: int) -> None:
    nc = await _connect(url)
    js = nc.jetstream()
    body = b"x" * size
    for base in range(0, n, BATCH):
        await asyncio.gather(
            *(js.publish(f"raw.sbx_{i % 64}.ev", body) for i in range(base, min(n, base + BATCH)))
        )
    await nc.close()


async def _raw_publish_async(url: str, n: int, size: int, window: int = 512) -> None:
    """Raw nats-py with the transport DSec's ``publish_many`` uses (core publishes with a reply
    subject each, at most ``window`` unacknowledged, acks read by one callback): the peer that
    differs from DSec only by DSec's own work (envelope, signature, ``Nats-Msg-Id``)."""
    nc = await _connect(url)
    body = b"x" * size
    inbox = nc.new_inbox()
    progress = asyncio.Event()
    outstanding = 0

    async def on_ack(msg: Any) -> None:
        nonlocal outstanding
        if "seq" not in json.loads(msg.data or b"{}"):
            raise SystemExit(f"not stored: {msg.data!r}")
        outstanding -= 1
        progress.set()

    sub = await nc.subscribe(f"{inbox}.*", cb=on_ack)
    for i in range(n):
        while outstanding >= window:
            progress.clear()
            await progress.wait()
        await nc.publish(f"raw.sbx_{i % 64}.ev", body, reply=f"{inbox}.{i}")
        outstanding += 1
    while outstanding:
        progress.clear()
        await progress.wait()
    await sub.unsubscribe()
    await nc.close()


async def _dsec_publish(url: str, n: int) -> int:
    nc = await _connect(url)
    signer, reg = _certified("nodeagent")
    publisher = EventPublisher(nc.jetstream(), signer)
    payload = _payload()
    await publisher.publish(reg, aggregate_id=signer.key_id)
    size = 0
    for base in range(0, n - 1, BATCH):
        batch = [
            publisher.signer.seal(payload, aggregate_id=f"sbx_{i % 64}")
            for i in range(base, min(n - 1, base + BATCH))
        ]
        size = len(batch[0].wire)
        await publisher.publish_many(batch)
    await nc.close()
    return size


async def _setup(url: str, dsec: bool) -> None:
    nc = await _connect(url)
    js = nc.jetstream()
    if dsec:
        await ensure_stream(js)
    else:
        await js.add_stream(StreamConfig(name="RAW", subjects=["raw.>"]))
    await nc.close()


def _server_cpu_s(url: str) -> float:
    """CPU seconds the bench's nats-server (found by its port) has used so far."""
    port = url.rsplit(":", 1)[1].encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if not cmd[0].endswith(b"nats-server") or cmd[cmd.index(b"-p") + 1] != port:
                continue
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            continue
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return float("nan")


def run_path(
    url: str,
    n: int,
    dsec: bool,
    size: int = 0,
    every: int = audit.SIGNATURE_EVERY,
    pipelined: bool = False,
) -> tuple[float, int, dict[str, float]]:
    """Run one producer/consumer pair; return (events per second, envelope size, CPU µs per
    event of the producer, the consumer and nats-server). ``every``: the DSec consumer's
    signature interval (1: it checks each signature as it arrives); ``pipelined``: the raw
    peer publishes as DSec's ``publish_many`` does (else with nats-py's ``js.publish``).

    The CPU figures do not depend on what else runs on the machine the way throughput does:
    on a busy machine compare ``cpu_us_per_event`` (their sum is what the two cores must do)."""
    asyncio.run(_setup(url, dsec))
    parent, child = mp.Pipe()
    stream, subject = (STREAM, "dsec.>") if dsec else ("RAW", "raw.>")
    verify = every if dsec else 0
    proc = mp.Process(target=_consumer_main, args=(url, stream, subject, n, verify, child))
    proc.start()
    assert parent.recv() == "ready"
    server_cpu = _server_cpu_s(url)
    started, producer_cpu = time.time(), time.process_time()
    if dsec:
        size = asyncio.run(_dsec_publish(url, n))
    elif pipelined:
        asyncio.run(_raw_publish_async(url, n, size))
    else:
        asyncio.run(_raw_publish(url, n, size))
    producer_cpu = time.process_time() - producer_cpu
    finished, consumer_cpu = parent.recv()
    server_cpu = _server_cpu_s(url) - server_cpu
    proc.join(30)
    if proc.exitcode != 0:
        raise SystemExit(f"consumer failed with exit code {proc.exitcode}")
    cpu = {
        "producer": producer_cpu * 1e6 / n,
        "consumer": consumer_cpu * 1e6 / n,
        "nats_server": server_cpu * 1e6 / n,
    }
    cpu["total"] = sum(cpu.values())
    return n / (finished - started), size, {k: round(v, 1) for k, v in cpu.items()}


async def gate_admit(url: str, n: int) -> dict[str, float]:
    """What each service consumer pays per event before its handler runs (the trust gate:
    certificate (cached), signature, authorization table, the sandbox's tenant (cached), the
    replay check in the KV bucket), over events of one submitted sandbox."""
    nc = await _connect(url)
    js = nc.jetstream()
    user, user_reg = _certified("user-bench", "user")
    agent, agent_reg = _certified("nodeagent")
    publisher = EventPublisher(js, user)
    await publisher.publish(user_reg, aggregate_id=user.key_id)
    submitted = await publisher.publish(
        SpecSubmitted(spec_yaml="x"), aggregate_id="sbx_gate", tenant="default"
    )
    # A node agent speaks for a sandbox only once the scheduler placed it on its node.
    scheduler, scheduler_reg = _certified("scheduler", "scheduler")
    schedulers = EventPublisher(js, scheduler)
    await schedulers.publish(scheduler_reg, aggregate_id=scheduler.key_id)
    await schedulers.publish(
        SandboxScheduled(node_id="n1"), aggregate_id="sbx_gate", tenant="default"
    )
    agents = EventPublisher(js, agent)
    await agents.publish(agent_reg, aggregate_id=agent.key_id)
    batch = [agent.seal(_payload(), aggregate_id="sbx_gate", tenant="default") for _ in range(n)]
    published = await agents.publish_many(batch)
    gate = Gate(KeyRing(nc, js, ANCHOR), js, await handled_bucket(js))
    samples = []
    for item in [submitted, *published]:
        started = time.perf_counter()
        admitted = await gate.admit(item.sealed.wire, stream_seq=item.stream_seq, consumer="b")
        samples.append((time.perf_counter() - started) * 1e6)
        if not isinstance(admitted, Envelope):
            raise SystemExit(f"the gate refused a genuine event: {admitted}")
    await nc.close()
    p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
    return {"p50_us": round(p50, 1), "p99_us": round(p99, 1)}


async def replay_verify(url: str) -> tuple[int, dict[str, float]]:
    """Events/s of ``dsec audit verify`` end to end: the whole DSEC_EVENTS stream replayed
    through JetStream (``dsec_core.bus.replay_batches``, as the CLI reads it) into the verifier
    (as the CLI: in a forked process of its own for a long log, fed while the stream is read);
    and the CPU µs per event of the reader (this process), the verifier process and nats-server
    (on a busy machine these say more than the throughput: the slowest of reader + server and
    verifier process bounds it on two idle cores)."""
    nc = await _connect(url)
    js = nc.jetstream()
    server = _server_cpu_s(url)
    before = os.times()
    started = time.perf_counter()
    messages = (await js.stream_info(STREAM)).state.messages
    verifier = open_verifier(ANCHOR, messages)
    try:
        async for msgs in replay_batches(js):
            if await verifier.feed(msgs):
                break
        report = await verifier.finish()
    finally:
        verifier.close()
    elapsed = time.perf_counter() - started
    after = os.times()
    server = _server_cpu_s(url) - server
    await nc.close()
    if not report.ok or report.injected:
        raise SystemExit(f"verification failed: {report.finding} {report.injected[:3]}")
    events = (report.last_seq or 0) - (report.first_seq or 1) + 1
    cpu = {
        "reader": after.user + after.system - before.user - before.system,
        "verifier_process": after.children_user
        + after.children_system
        - before.children_user
        - before.children_system,
        "nats_server": server,
    }
    return round(events / elapsed), {k: round(v * 1e6 / events, 2) for k, v in cpu.items()}


async def replay_read(url: str) -> int:
    """Messages/s of the replay's reader alone (``replay_batches``, nothing verified)."""
    nc = await _connect(url)
    js = nc.jetstream()
    started = time.perf_counter()
    count = 0
    async for msgs in replay_batches(js):
        count += len(msgs)
    elapsed = time.perf_counter() - started
    await nc.close()
    return round(count / elapsed)


async def nats_py_read(url: str) -> int:
    """Messages/s of nats-py alone reading the stream: a pull consumer fetching batches of
    2,048 (the usual way to read a stream with it; the peer of :func:`replay_read`)."""
    nc = await _connect(url)
    js = nc.jetstream()
    last = (await js.stream_info(STREAM)).state.last_seq
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True, inactive_threshold=30)
    started = time.perf_counter()
    sub = await js.pull_subscribe("dsec.>", stream=STREAM, config=config)
    count, seq = 0, 0
    while seq < last:
        msgs = await sub.fetch(2048, timeout=5)
        count += len(msgs)
        seq = stream_seq(msgs[-1])
    elapsed = time.perf_counter() - started
    await nc.close()
    return round(count / elapsed)


def main(n: int, repeat: int) -> None:
    sign = micro_sign_encode(min(n, 5000))
    verify = verify_rates(n)
    pairs, same = [], []
    replayed = gate = every_sig = read = nats_read = None
    replay_cpu: dict[str, float] = {}
    for _ in range(repeat):
        with nats_server() as url:
            dsec_rate, size, dsec_cpu = run_path(url, n, dsec=True)
            if replayed is None:
                replayed, replay_cpu = asyncio.run(replay_verify(url))
                read = asyncio.run(replay_read(url))
                nats_read = asyncio.run(nats_py_read(url))
                gate = asyncio.run(gate_admit(url, min(n, 2000)))
        with nats_server() as url:
            raw_rate, _, raw_cpu = run_path(url, n, dsec=False, size=size)
        with nats_server() as url:
            same_rate, _, same_cpu = run_path(url, n, dsec=False, size=size, pipelined=True)
        pairs.append((dsec_rate / raw_rate, dsec_rate, raw_rate, dsec_cpu, raw_cpu))
        same.append((dsec_rate / same_rate, same_rate, same_cpu))
        if every_sig is None:  # once: the consumer checking each signature as it arrives
            with nats_server() as url:
                every_sig = run_path(url, n, dsec=True, every=1)[0] / raw_rate
    assert gate is not None and replayed is not None and every_sig is not None
    pairs.sort(key=lambda p: p[0])
    ratios = [p[0] for p in pairs]
    ratio, dsec_rate, raw_rate, dsec_cpu, raw_cpu = pairs[len(pairs) // 2]
    cpu_ratio = raw_cpu["total"] / dsec_cpu["total"]
    same.sort(key=lambda p: p[0])
    same_ratio, same_rate, same_cpu = same[len(same) // 2]
    verify["replay_end_to_end"] = replayed
    verify["replay_cpu_us_per_event"] = replay_cpu
    verify["replay_read_only"] = read
    verify["nats_py_fetch_read_only"] = nats_read
    emit(
        "bus",
        {
            "sign_encode_us": sign,
            "dsec_events_per_s": round(dsec_rate),
            "raw_nats_py_msgs_per_s": round(raw_rate),
            "ratio_dsec_over_raw": round(ratio, 3),
            "ratios": [round(r, 3) for r in ratios],
            "ratio_consumer_every_signature": round(every_sig, 3),
            "pairs": [{"dsec": round(p[1]), "raw": round(p[2])} for p in pairs],
            "cpu_us_per_event": {"dsec": dsec_cpu, "raw": raw_cpu, "raw_pipelined": same_cpu},
            "raw_pipelined_msgs_per_s": round(same_rate),
            "ratio_dsec_over_raw_pipelined": round(same_ratio, 3),
            "ratios_over_raw_pipelined": [round(p[0], 3) for p in same],
            "cpu_ratio_raw_over_dsec": round(cpu_ratio, 3),
            "events": n,
            "envelope_bytes": size,
            "audit_verify_events_per_s": verify,
            "consumer_gate_us": gate,
        },
        f"bus: DSec backbone {dsec_rate:,.0f} ev/s vs raw nats-py {raw_rate:,.0f} msg/s "
        f"= {ratio:.0%} of raw (median of {len(ratios)} pairs: "
        f"{', '.join(f'{r:.0%}' for r in ratios)}; {every_sig:.0%} with the consumer checking "
        f"every signature on arrival); {same_ratio:.0%} of raw nats-py publishing the same "
        f"pipelined way ({same_rate:,.0f} msg/s); CPU per event {dsec_cpu['total']:.0f} vs "
        f"{raw_cpu['total']:.0f} µs (raw/DSec {cpu_ratio:.0%}); "
        f"sign+encode p50 {sign['p50_us']} µs; "
        f"audit verify core {verify['chain_heads']:,} ev/s ({verify['every_signature']:,} "
        f"checking every signature), end to end through JetStream {replayed:,} ev/s (its "
        f"reader alone {read:,} msg/s, nats-py fetch alone {nats_read:,} msg/s); "
        f"consumer gate p50 {gate['p50_us']} µs",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3, help="DSec/raw pairs (median ratio)")
    parser.add_argument("--quick", action="store_true", help="2,000 events, one pair")
    parser.add_argument("--json", action="store_true", help="only the ratio and JSON lines")
    args = parser.parse_args()
    main(2000 if args.quick else args.events, 1 if args.quick else max(1, args.repeat))
