// The MessagePack subset DSec envelopes use, written from the MessagePack specification
// (https://github.com/msgpack/msgpack/blob/master/spec.md) and the canonical rules of
// docs/events.md: decode keeps what re-encoding needs (a float stays a float, map order is
// kept); encode writes the canonical form (keys sorted by UTF-8 bytes, smallest integer form,
// floats as float 64, strings as str 8/16/32 by length).

export class Float {
  constructor(value) {
    this.value = value;
  }
}

export class Malformed extends Error {}

export function decode(bytes) {
  const buf = Buffer.from(bytes);
  let pos = 0;
  const need = (n) => {
    if (pos + n > buf.length) throw new Malformed(`truncated at byte ${pos}`);
  };
  const u8 = () => (need(1), buf[pos++]);
  const take = (n) => (need(n), buf.subarray((pos += n) - n, pos));
  const int = (n, signed) => {
    const b = take(n);
    if (n === 8) {
      const big = signed ? b.readBigInt64BE() : b.readBigUInt64BE();
      return big >= BigInt(Number.MIN_SAFE_INTEGER) && big <= BigInt(Number.MAX_SAFE_INTEGER)
        ? Number(big)
        : big;
    }
    return signed ? b.readIntBE(0, n) : b.readUIntBE(0, n);
  };
  const str = (n) => {
    const raw = take(n);
    const text = new TextDecoder('utf-8', { fatal: true });
    try {
      return text.decode(raw);
    } catch {
      throw new Malformed(`invalid UTF-8 in a string at byte ${pos - n}`);
    }
  };
  const array = (n) => Array.from({ length: n }, () => value());
  const map = (n) => {
    const out = new Map();
    for (let i = 0; i < n; i++) {
      const key = value();
      if (typeof key !== 'string') throw new Malformed('a map key that is not a string');
      if (out.has(key)) throw new Malformed(`duplicate map key ${JSON.stringify(key)}`);
      out.set(key, value());
    }
    return out;
  };
  function value() {
    const t = u8();
    if (t <= 0x7f) return t;
    if (t >= 0xe0) return t - 0x100;
    if ((t & 0xf0) === 0x80) return map(t & 0x0f);
    if ((t & 0xf0) === 0x90) return array(t & 0x0f);
    if ((t & 0xe0) === 0xa0) return str(t & 0x1f);
    switch (t) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return new Uint8Array(take(int(1, false)));
      case 0xc5: return new Uint8Array(take(int(2, false)));
      case 0xc6: return new Uint8Array(take(int(4, false)));
      case 0xca: return new Float(take(4).readFloatBE());
      case 0xcb: return new Float(take(8).readDoubleBE());
      case 0xcc: return int(1, false);
      case 0xcd: return int(2, false);
      case 0xce: return int(4, false);
      case 0xcf: return int(8, false);
      case 0xd0: return int(1, true);
      case 0xd1: return int(2, true);
      case 0xd2: return int(4, true);
      case 0xd3: return int(8, true);
      case 0xd9: return str(int(1, false));
      case 0xda: return str(int(2, false));
      case 0xdb: return str(int(4, false));
      case 0xdc: return array(int(2, false));
      case 0xdd: return array(int(4, false));
      case 0xde: return map(int(2, false));
      case 0xdf: return map(int(4, false));
      default: throw new Malformed(`type byte 0x${t.toString(16)} is not used by DSec envelopes`);
    }
  }
  const out = value();
  if (pos !== buf.length) throw new Malformed(`${buf.length - pos} bytes after the value`);
  return out;
}

function header(small, smallMax, tags, n) {
  if (small !== null && n <= smallMax) return Buffer.from([small | n]);
  const [t8, t16, t32] = tags;
  if (t8 !== null && n <= 0xff) return Buffer.from([t8, n]);
  if (n <= 0xffff) return Buffer.from([t16, n >> 8, n & 0xff]);
  const b = Buffer.alloc(5);
  b[0] = t32;
  b.writeUInt32BE(n, 1);
  return b;
}

function integer(v) {
  const n = BigInt(v);
  const b = Buffer.alloc(9);
  if (n >= 0n) {
    if (n <= 0x7fn) return Buffer.from([Number(n)]);
    if (n <= 0xffn) return Buffer.from([0xcc, Number(n)]);
    if (n <= 0xffffn) return (b.writeUInt16BE(Number(n), 1), (b[0] = 0xcd), b.subarray(0, 3));
    if (n <= 0xffffffffn) return (b.writeUInt32BE(Number(n), 1), (b[0] = 0xce), b.subarray(0, 5));
    return (b.writeBigUInt64BE(n, 1), (b[0] = 0xcf), b);
  }
  if (n >= -32n) return Buffer.from([Number(n) & 0xff]);
  if (n >= -0x80n) return (b.writeInt8(Number(n), 1), (b[0] = 0xd0), b.subarray(0, 2));
  if (n >= -0x8000n) return (b.writeInt16BE(Number(n), 1), (b[0] = 0xd1), b.subarray(0, 3));
  if (n >= -0x80000000n) return (b.writeInt32BE(Number(n), 1), (b[0] = 0xd2), b.subarray(0, 5));
  return (b.writeBigInt64BE(n, 1), (b[0] = 0xd3), b);
}

export function encode(v) {
  const parts = [];
  (function put(x) {
    if (x === null) parts.push(Buffer.from([0xc0]));
    else if (x === true) parts.push(Buffer.from([0xc3]));
    else if (x === false) parts.push(Buffer.from([0xc2]));
    else if (x instanceof Float) {
      const b = Buffer.alloc(9);
      b[0] = 0xcb;
      b.writeDoubleBE(x.value, 1);
      parts.push(b);
    } else if (typeof x === 'bigint' || (typeof x === 'number' && Number.isInteger(x))) {
      parts.push(integer(x));
    } else if (typeof x === 'number') {
      throw new TypeError('a non-integer number must be wrapped in Float');
    } else if (typeof x === 'string') {
      const raw = Buffer.from(x, 'utf-8');
      parts.push(header(0xa0, 31, [0xd9, 0xda, 0xdb], raw.length), raw);
    } else if (x instanceof Uint8Array) {
      parts.push(header(null, -1, [0xc4, 0xc5, 0xc6], x.length), Buffer.from(x));
    } else if (Array.isArray(x)) {
      parts.push(header(0x90, 15, [null, 0xdc, 0xdd], x.length));
      x.forEach(put);
    } else if (x instanceof Map) {
      const keys = [...x.keys()].sort((a, b) => Buffer.compare(Buffer.from(a), Buffer.from(b)));
      parts.push(header(0x80, 15, [null, 0xde, 0xdf], keys.length));
      for (const k of keys) {
        put(k);
        put(x.get(k));
      }
    } else throw new TypeError(`cannot encode ${typeof x}`);
  })(v);
  return Buffer.concat(parts);
}
