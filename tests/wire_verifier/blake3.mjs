// BLAKE3 (hash mode, 32-byte output), written from the BLAKE3 specification
// (https://github.com/BLAKE3-team/BLAKE3-specs/blob/master/blake3.pdf): node:crypto has no BLAKE3.
// Sequential and unoptimised: enough for event-sized inputs.

const IV = Uint32Array.from([
  0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
]);
const PERMUTATION = [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8];
const CHUNK_START = 1, CHUNK_END = 2, PARENT = 4, ROOT = 8;
const BLOCK_LEN = 64, CHUNK_LEN = 1024;

const rotr = (x, n) => ((x >>> n) | (x << (32 - n))) >>> 0;

function g(s, a, b, c, d, x, y) {
  s[a] = (s[a] + s[b] + x) >>> 0;
  s[d] = rotr(s[d] ^ s[a], 16);
  s[c] = (s[c] + s[d]) >>> 0;
  s[b] = rotr(s[b] ^ s[c], 12);
  s[a] = (s[a] + s[b] + y) >>> 0;
  s[d] = rotr(s[d] ^ s[a], 8);
  s[c] = (s[c] + s[d]) >>> 0;
  s[b] = rotr(s[b] ^ s[c], 7);
}

function compress(cv, block, counter, blockLen, flags) {
  const s = new Uint32Array(16);
  s.set(cv, 0);
  s.set(IV.subarray(0, 4), 8);
  s[12] = counter >>> 0;
  s[13] = Math.floor(counter / 0x100000000) >>> 0;
  s[14] = blockLen;
  s[15] = flags;
  let m = Uint32Array.from(block);
  for (let r = 0; r < 7; r++) {
    g(s, 0, 4, 8, 12, m[0], m[1]);
    g(s, 1, 5, 9, 13, m[2], m[3]);
    g(s, 2, 6, 10, 14, m[4], m[5]);
    g(s, 3, 7, 11, 15, m[6], m[7]);
    g(s, 0, 5, 10, 15, m[8], m[9]);
    g(s, 1, 6, 11, 12, m[10], m[11]);
    g(s, 2, 7, 8, 13, m[12], m[13]);
    g(s, 3, 4, 9, 14, m[14], m[15]);
    if (r < 6) m = Uint32Array.from(PERMUTATION, (i) => m[i]);
  }
  for (let i = 0; i < 8; i++) {
    s[i] ^= s[i + 8];
    s[i + 8] ^= cv[i];
  }
  return s;
}

function words(bytes) {
  // 64 bytes (zero-padded) as 16 little-endian words
  const padded = new Uint8Array(BLOCK_LEN);
  padded.set(bytes);
  const view = new DataView(padded.buffer);
  return Uint32Array.from({ length: 16 }, (_, i) => view.getUint32(i * 4, true));
}

class Output {
  constructor(cv, block, counter, blockLen, flags) {
    Object.assign(this, { cv, block, counter, blockLen, flags });
  }
  chainingValue() {
    return compress(this.cv, this.block, this.counter, this.blockLen, this.flags).subarray(0, 8);
  }
  rootBytes32() {
    const s = compress(this.cv, this.block, 0, this.blockLen, this.flags | ROOT);
    const out = new Uint8Array(32);
    const view = new DataView(out.buffer);
    for (let i = 0; i < 8; i++) view.setUint32(i * 4, s[i], true);
    return out;
  }
}

const parentOutput = (left, right) => {
  const block = new Uint32Array(16);
  block.set(left, 0);
  block.set(right, 8);
  return new Output(IV, block, 0, BLOCK_LEN, PARENT);
};

function chunkOutput(cv, chunkIndex, chunk) {
  // every full block but the last is compressed here; the last one (possibly partial or
  // empty) goes into the Output with CHUNK_END
  const blocks = Math.max(1, Math.ceil(chunk.length / BLOCK_LEN));
  for (let b = 0; b < blocks - 1; b++) {
    const flags = b === 0 ? CHUNK_START : 0;
    const block = chunk.subarray(b * BLOCK_LEN, (b + 1) * BLOCK_LEN);
    cv = compress(cv, words(block), chunkIndex, BLOCK_LEN, flags).subarray(0, 8);
  }
  const last = chunk.subarray((blocks - 1) * BLOCK_LEN);
  const flags = (blocks === 1 ? CHUNK_START : 0) | CHUNK_END;
  return new Output(cv, words(last), chunkIndex, last.length, flags);
}

export function blake3(input) {
  const data = input instanceof Uint8Array ? input : new Uint8Array(input);
  const chunks = Math.max(1, Math.ceil(data.length / CHUNK_LEN));
  const stack = [];
  for (let i = 0; i < chunks - 1; i++) {
    let cv = chunkOutput(IV, i, data.subarray(i * CHUNK_LEN, (i + 1) * CHUNK_LEN)).chainingValue();
    // merge completed subtrees: as many as trailing zero bits of the chunk count so far
    for (let total = i + 1; (total & 1) === 0; total >>= 1) {
      cv = parentOutput(stack.pop(), cv).chainingValue();
    }
    stack.push(cv);
  }
  let output = chunkOutput(IV, chunks - 1, data.subarray((chunks - 1) * CHUNK_LEN));
  while (stack.length > 0) output = parentOutput(stack.pop(), output.chainingValue());
  return output.rootBytes32();
}

export const blake3Hex = (input) => Buffer.from(blake3(input)).toString('hex');
