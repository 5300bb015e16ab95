#!/usr/bin/env node
// A DSec event verifier written from docs/events.md and the AsyncAPI document alone (no DSec
// code): node built-ins only (node:crypto for Ed25519), MessagePack and BLAKE3 beside it.
//
//   node verify.mjs --anchor <root public key hex> --asyncapi asyncapi.json --messages dump.jsonl
//
// dump.jsonl: one stored message per line, in stream order:
//   {"seq": 12, "subject": "dsec.sandbox.sbx_1.ready", "headers": {"Nats-Msg-Id": "..."},
//    "data": "<wire bytes, hex>"}
// Prints one JSON verdict per message: {"seq", "id", "type", "producer", "key_id", "verdict",
// "reason"}; verdict "ok" or one of: malformed, misrouted, uncertified-key, unknown-key,
// revoked-key, bad-signature, unauthorized, broken-chain, bad-msg-id.

import { createPublicKey, verify as edVerify } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { blake3Hex } from './blake3.mjs';
import { decode, encode, Malformed } from './msgpack.mjs';

const FIELDS = {
  aggregate: 'string', aggregate_id: 'string', causation_id: 'string|null', chain: 'string',
  chain_seq: 'integer', correlation_id: 'string', id: 'string', key_id: 'string',
  payload: 'map', prev: 'string|null', producer: 'string', schema_version: 'string',
  sig: 'string', subject: 'string', tenant: 'string', time: 'string', type: 'string',
};
const CERT_FIELDS = {
  subject: 'string', role: 'string', tenant: 'string|null', node_id: 'string|null',
  public_key: 'string', key_id: 'string', issued_at: 'string', expires_at: 'string|null',
  issuer: 'string', sig: 'string',
};
const TOKEN = /^[A-Za-z0-9_-]+$/;

class Verdict extends Error {
  constructor(verdict, reason) {
    super(reason);
    this.verdict = verdict;
  }
}

function kind(v) {
  if (v === null) return 'null';
  if (typeof v === 'string') return 'string';
  if (typeof v === 'bigint' || (typeof v === 'number' && Number.isInteger(v))) return 'integer';
  if (v instanceof Map) return 'map';
  return typeof v;
}

function checkFields(map, spec, what) {
  if (!(map instanceof Map)) throw new Verdict('malformed', `${what} is not a map`);
  const names = [...map.keys()].sort();
  const wanted = Object.keys(spec).sort();
  if (names.join() !== wanted.join()) {
    throw new Verdict('malformed', `${what} fields ${names} are not ${wanted}`);
  }
  for (const [name, types] of Object.entries(spec)) {
    if (!types.split('|').includes(kind(map.get(name)))) {
      throw new Verdict('malformed', `${what} field ${name} must be ${types}`);
    }
  }
}

const without = (map, key) => new Map([...map].filter(([k]) => k !== key));
const keyId = (raw) => blake3Hex(raw).slice(0, 16);
const isHex = (s, bytes) => typeof s === 'string' && s.length === 2 * bytes && /^[0-9a-f]*$/.test(s);

function ed25519(publicHex, message, sigHex) {
  // a raw 32-byte Ed25519 public key as a JWK (RFC 8037); signature: RFC 8032 Ed25519
  if (!isHex(publicHex, 32) || !isHex(sigHex, 64)) return false;
  const x = Buffer.from(publicHex, 'hex').toString('base64url');
  const key = createPublicKey({ key: { kty: 'OKP', crv: 'Ed25519', x }, format: 'jwk' });
  return edVerify(null, message, key, Buffer.from(sigHex, 'hex'));
}

function args() {
  const out = {};
  const argv = process.argv.slice(2);
  for (let i = 0; i < argv.length; i += 2) out[argv[i].replace(/^--/, '')] = argv[i + 1];
  for (const need of ['anchor', 'asyncapi', 'messages']) {
    if (!out[need]) {
      console.error('usage: verify.mjs --anchor HEX --asyncapi FILE --messages FILE.jsonl');
      process.exit(2);
    }
  }
  return out;
}

// What the AsyncAPI document says per event type: the channel address (subject with its
// parameter), the aggregate, and the certificate roles that may publish it.
function catalog(document) {
  const types = new Map();
  for (const channel of Object.values(document.channels)) {
    for (const ref of Object.values(channel.messages)) {
      const name = ref.$ref.split('/').pop();
      const message = document.components.messages[name];
      types.set(message['x-dsec-event-type'], {
        address: channel.address,
        aggregate: message['x-dsec-aggregate'],
        producers: message['x-dsec-producers'],
      });
    }
  }
  return types;
}

export class Verifier {
  constructor(anchorHex, document) {
    this.anchor = anchorHex;
    this.types = catalog(document);
    this.certs = new Map(); // key id -> certificate (a Map) of a registered, certified key
    this.revoked = new Set();
    this.chains = new Map(); // producer + chain -> {next, last}
  }

  check(message) {
    const wire = Buffer.from(message.data, 'hex');
    let env;
    try {
      env = decode(wire);
    } catch (err) {
      if (err instanceof Malformed) throw new Verdict('malformed', `not MessagePack: ${err.message}`);
      throw err;
    }
    const out = { id: null, type: null, producer: null, key_id: null };
    if (env instanceof Map) {
      for (const k of Object.keys(out)) out[k] = typeof env.get(k) === 'string' ? env.get(k) : null;
    }
    try {
      this.verify(message, wire, env);
      return { ...out, verdict: 'ok', reason: '' };
    } catch (err) {
      if (!(err instanceof Verdict)) throw err;
      return { ...out, verdict: err.verdict, reason: err.message };
    }
  }

  verify(message, wire, env) {
    // 1. the envelope: 17 fields, canonical bytes
    checkFields(env, FIELDS, 'envelope');
    if (!encode(env).equals(wire)) throw new Verdict('malformed', 'not canonical MessagePack');
    const f = Object.fromEntries(env);
    // 2. routing: type, aggregate and subject agree with the AsyncAPI document
    const spec = this.types.get(f.type);
    if (!spec) throw new Verdict('malformed', `unknown event type ${f.type}`);
    if (!TOKEN.test(f.aggregate_id)) throw new Verdict('malformed', 'aggregate_id is not a token');
    const subject = spec.address.replace(/\{[^}]+\}/, f.aggregate_id);
    if (f.aggregate !== spec.aggregate || f.subject !== subject) {
      throw new Verdict('malformed', `aggregate/subject are not ${spec.aggregate}/${subject}`);
    }
    if (message.subject !== f.subject) {
      throw new Verdict('misrouted', `stored on ${message.subject}, addressed to ${f.subject}`);
    }
    // 3. the key: registered in the log with a certificate from the root, not revoked
    if (f.type === 'audit.key_registered' && !this.certs.has(f.key_id)) this.register(env, f);
    const cert = this.certs.get(f.key_id);
    if (!cert) throw new Verdict('unknown-key', `key ${f.key_id} has no certified registration`);
    if (this.revoked.has(f.key_id)) throw new Verdict('revoked-key', `key ${f.key_id} was revoked`);
    const expires = cert.get('expires_at');
    if (expires !== null && Date.now() >= Date.parse(expires)) {
      throw new Verdict('uncertified-key', `certificate expired at ${expires}`);
    }
    // 4. the signature: Ed25519 over the canonical encoding of the other 16 fields
    if (!ed25519(cert.get('public_key'), encode(without(env, 'sig')), f.sig)) {
      throw new Verdict('bad-signature', `signature invalid for key ${f.key_id}`);
    }
    // 5. the key speaks as the producer its certificate names
    if (cert.get('subject') !== f.producer) {
      throw new Verdict('unauthorized', `key certified for ${cert.get('subject')}, used as ${f.producer}`);
    }
    // 6. the chain of this producer instance: every authentic event takes its position in it,
    // authorized or not
    const id = `${f.producer}\u0000${f.chain}`;
    const chain = this.chains.get(id) ?? { next: 0, last: null };
    // a broken chain does not resume: it still waits for the missing position
    if (f.chain_seq !== chain.next) {
      throw new Verdict('broken-chain', `chain ${f.chain}: position ${f.chain_seq}, expected ${chain.next}`);
    }
    if (f.prev !== chain.last) {
      throw new Verdict('broken-chain', `chain ${f.chain}: prev is not the hash of position ${chain.next - 1}`);
    }
    this.chains.set(id, { next: f.chain_seq + 1, last: blake3Hex(wire) });
    // 7. authorization: the certificate's role may publish this type (for this tenant/node)
    this.authorize(f, cert, spec);
    // 8. revocations by the operator take effect from here on
    if (f.type === 'audit.key_revoked') this.revoked.add(f.payload.get('key_id'));
    // 9. the deduplication header names the event
    const msgId = (message.headers ?? {})['Nats-Msg-Id'];
    // the id, or (section 8: another message took it first) the id, a dot and 16 hex digits
    const claimed = typeof msgId === 'string' && msgId.startsWith(`${f.id}.`)
      && /^[0-9a-f]{16}$/.test(msgId.slice(f.id.length + 1));
    if (msgId !== f.id && !claimed) {
      throw new Verdict('bad-msg-id', `Nats-Msg-Id ${msgId} is not the id ${f.id}`);
    }
  }

  register(env, f) {
    const reg = f.payload;
    const fail = (why) => { throw new Verdict('uncertified-key', why); };
    const publicKey = reg.get('public_key');
    if (!isHex(publicKey, 32)) fail('registration without a 32-byte public key');
    if (!ed25519(publicKey, encode(without(env, 'sig')), f.sig)) {
      fail('key registration not signed by the key it registers');
    }
    if (!(f.key_id === f.aggregate_id && f.key_id === reg.get('key_id'))) {
      fail('a key registration must be filed under the key id it registers');
    }
    const cert = reg.get('certificate');
    if (cert === null || cert === undefined) fail(`key ${f.key_id} has no certificate`);
    try {
      checkFields(cert, CERT_FIELDS, 'certificate');
    } catch (err) {
      fail(err.message);
    }
    if (cert.get('issuer') !== keyId(Buffer.from(this.anchor, 'hex'))) {
      fail(`certificate issued by ${cert.get('issuer')}, not by the trust root`);
    }
    if (!ed25519(this.anchor, encode(without(cert, 'sig')), cert.get('sig'))) {
      fail('the root signature of the certificate is invalid');
    }
    if (keyId(Buffer.from(cert.get('public_key'), 'hex')) !== cert.get('key_id')) {
      fail('certificate key id does not match its public key');
    }
    if (cert.get('public_key') !== publicKey || cert.get('key_id') !== reg.get('key_id')) {
      fail('the certificate is for another key');
    }
    if (cert.get('subject') !== reg.get('producer') || f.producer !== reg.get('producer')) {
      fail(`certificate for ${cert.get('subject')} registered as ${reg.get('producer')}`);
    }
    this.certs.set(f.key_id, cert);
  }

  authorize(f, cert, spec) {
    const no = (why) => { throw new Verdict('unauthorized', why); };
    const role = cert.get('role');
    if (cert.get('subject') !== f.producer) no(`key certified for ${cert.get('subject')}, used as ${f.producer}`);
    if (!spec.producers.includes(role)) no(`role ${role} may not publish ${f.type}`);
    if (role === 'user' && f.type !== 'audit.key_registered' && f.tenant !== cert.get('tenant')) {
      no(`user of tenant ${cert.get('tenant')} may not act for tenant ${f.tenant}`);
    }
    const node = f.payload.get('node_id');
    if (role === 'nodeagent' && node !== undefined && node !== null && node !== cert.get('node_id')) {
      no(`node agent of ${cert.get('node_id')} may not speak for node ${node}`);
    }
    if (f.type === 'audit.key_registered' && f.payload.get('key_id') !== cert.get('key_id')) {
      no('a key registration must register the key that signs it');
    }
    if (f.type === 'audit.key_revoked' && f.payload.get('key_id') === f.key_id) {
      no('a key never revokes itself');
    }
  }
}

function main() {
  const opts = args();
  const document = JSON.parse(readFileSync(opts.asyncapi, 'utf-8'));
  const verifier = new Verifier(opts.anchor, document);
  const counts = {};
  for (const line of readFileSync(opts.messages, 'utf-8').split('\n')) {
    if (!line.trim()) continue;
    const message = JSON.parse(line);
    let result;
    try {
      result = verifier.check(message);
    } catch (err) {
      result = { verdict: err instanceof Verdict ? err.verdict : 'malformed', reason: err.message };
    }
    counts[result.verdict] = (counts[result.verdict] ?? 0) + 1;
    console.log(JSON.stringify({ seq: message.seq, ...result }));
  }
  console.error(JSON.stringify(counts));
}

main();
