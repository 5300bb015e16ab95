#!/usr/bin/env node
// A DSec producer written from docs/events.md and the AsyncAPI document alone (no DSec code):
// it signs and chains envelopes with a user's credential; whoever runs it publishes the output
// on NATS (JetStream publish on `subject` with the `Nats-Msg-Id` header).
//
//   node sign.mjs --credential alice.json --asyncapi asyncapi.json --events events.json
//
// credential: the JSON file `dsec admin issue-user` writes ({"key": seed hex, "certificate"});
// events.json: [{"type": "spec.submitted", "aggregate_id": "sbx_...", "payload": {...}}, ...].
// Prints one message per line, the key registration first (chain position 0):
//   {"seq": 1, "subject": "...", "headers": {"Nats-Msg-Id": "<id>"}, "data": "<wire hex>"}

import { createPrivateKey, createPublicKey, randomBytes, sign } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { blake3Hex } from './blake3.mjs';
import { encode, Float } from './msgpack.mjs';

function args() {
  const out = {};
  const argv = process.argv.slice(2);
  for (let i = 0; i < argv.length; i += 2) out[argv[i].replace(/^--/, '')] = argv[i + 1];
  for (const need of ['credential', 'asyncapi', 'events']) {
    if (!out[need]) {
      console.error('usage: sign.mjs --credential FILE --asyncapi FILE --events FILE');
      process.exit(2);
    }
  }
  return out;
}

// RFC 9562 UUIDv7: 48-bit Unix milliseconds, version 7, variant 10, random bits
function uuid7() {
  const b = randomBytes(16);
  b.writeUIntBE(Date.now(), 0, 6);
  b[6] = (b[6] & 0x0f) | 0x70;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = b.toString('hex');
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

// docs/events.md, "Times": YYYY-MM-DDTHH:MM:SS[.ffffff]+00:00
function now() {
  const iso = new Date().toISOString(); // YYYY-MM-DDTHH:MM:SS.mmmZ
  const ms = iso.slice(20, 23);
  const fraction = ms === '000' ? '' : `.${ms}000`;
  return `${iso.slice(0, 19)}${fraction}+00:00`;
}

// The payload schema decides integer vs float (docs/events.md, section 3)
function typed(value, schema, document) {
  if (schema && schema.$ref) {
    const name = schema.$ref.split('/').pop();
    return typed(value, document.components.schemas[name], document);
  }
  if (value === null || typeof value === 'boolean' || typeof value === 'string') return value;
  if (typeof value === 'number') {
    const kinds = (schema?.anyOf ?? [schema ?? {}]).map((s) => s.type);
    const integer = kinds.includes('integer') && Number.isInteger(value);
    return kinds.includes('number') && !integer ? new Float(value) : value;
  }
  const member = schema?.anyOf?.find((s) => s.$ref || s.type === 'object' || s.type === 'array');
  if (member) return typed(value, member, document);
  if (Array.isArray(value)) return value.map((v) => typed(v, schema?.items, document));
  const out = new Map();
  for (const [k, v] of Object.entries(value)) {
    const property = schema?.properties?.[k] ?? schema?.additionalProperties;
    out.set(k, typed(v, typeof property === 'object' ? property : undefined, document));
  }
  return out;
}

function main() {
  const opts = args();
  const credential = JSON.parse(readFileSync(opts.credential, 'utf-8'));
  const document = JSON.parse(readFileSync(opts.asyncapi, 'utf-8'));
  const events = JSON.parse(readFileSync(opts.events, 'utf-8'));
  const cert = credential.certificate;
  // the raw 32-byte seed as a PKCS#8 Ed25519 private key (RFC 8410)
  const pkcs8 = Buffer.concat([Buffer.from('302e020100300506032b657004220420', 'hex'),
    Buffer.from(credential.key, 'hex')]);
  const key = createPrivateKey({ key: pkcs8, format: 'der', type: 'pkcs8' });
  const publicHex = Buffer.from(createPublicKey(key).export({ format: 'jwk' }).x, 'base64url')
    .toString('hex');
  if (publicHex !== cert.public_key) throw new Error('the certificate is for another key');
  const keyId = blake3Hex(Buffer.from(publicHex, 'hex')).slice(0, 16);
  const chain = uuid7();
  let seq = 0;
  let prev = null;

  const registration = {
    type: 'audit.key_registered',
    aggregate_id: keyId,
    tenant: 'system',
    payload: { producer: cert.subject, key_id: keyId, public_key: publicHex, endorsement: null,
      certificate: cert },
  };
  for (const event of [registration, ...events]) {
    const message = Object.values(document.components.messages)
      .find((m) => m['x-dsec-event-type'] === event.type);
    if (!message) throw new Error(`unknown event type ${event.type}`);
    const channel = Object.values(document.channels)
      .find((c) => Object.values(c.messages).some((r) => r.$ref.endsWith(`/${message.name}`)));
    const id = uuid7();
    const envelope = new Map(Object.entries({
      id,
      type: event.type,
      subject: channel.address.replace(/\{[^}]+\}/, event.aggregate_id),
      aggregate: message['x-dsec-aggregate'],
      aggregate_id: event.aggregate_id,
      time: now(),
      producer: cert.subject,
      tenant: event.tenant ?? cert.tenant,
      causation_id: null,
      correlation_id: id,
      schema_version: message['x-dsec-schema-version'],
      payload: typed(event.payload, message.payload.allOf[1].properties.payload, document),
      key_id: keyId,
      chain,
      chain_seq: seq,
      prev,
    }));
    envelope.set('sig', sign(null, encode(envelope), key).toString('hex'));
    const wire = encode(envelope);
    seq += 1;
    prev = blake3Hex(wire);
    console.log(JSON.stringify({ seq, subject: envelope.get('subject'),
      headers: { 'Nats-Msg-Id': id }, data: wire.toString('hex') }));
  }
}

main();
