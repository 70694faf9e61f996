"""Copy and checksum in one pass over the bytes: the shm sender's staging of a payload
into its ring (common/transfer/shm_sender.py, ``copy_all``: several sources, one
destination), and the shm receiver's copy of it out of the segment into the places its
sink names (common/transfer/shm_receiver.py, ``scatter_all``: one source, several
destinations, the digest of the bytes as they landed).

The checksum is the data plane's own, XXH3-64 with seed 0 (``wire.checksum``, the BATCH
checksum of ``batch.py``): nothing on the wire changes, and the receiver checks it as
before. What changes is the sender's work: staging used to copy a piece into the ring and
then hash it back out of the cache; here each 64-byte stripe is loaded once, stored to
the ring and folded into XXH3's accumulators from the same register (AVX-512 where the
compiler targets it; a copy followed by a hash of the copy in cache otherwise).

XXH3 processes a long input in 64-byte stripes, 16 to a 1 KiB block (its accumulators
scrambled after each block), except that the stripe holding the input's last byte is
taken as the last 64 bytes of the input, with its own key. So a stripe ``[s, s + 64)``
is folded in as it goes by exactly when ``s + 64 < total``: the sender knows the whole
payload's length before it copies the first byte, and the last stripe is read back from
the destination at the end. A stripe that straddles two sources (chunk lengths that are
not multiples of 64) is read back from the destination once both halves are there.

Inputs of at most 240 bytes take XXH3's short paths: the caller hashes those with the
xxhash package (the copy is nothing then). tests/test_transfer_copysum.py holds the
kernel to the xxhash package's digests.

The kernel is built with torch's extension loader (kernels/cpu_build.py), so it is used
only in a process that has imported torch already (a model worker); a light process (the
cache pool) and a machine without a compiler keep the xxhash path.
"""

from __future__ import annotations

import sys

from kernels.cpu_build import CppKernel

SHORT = 240  # XXH3's short-input paths end here

_SOURCE = r"""
#include <torch/extension.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace py = pybind11;

static const uint8_t SECRET[192] = {
  0xb8,0xfe,0x6c,0x39,0x23,0xa4,0x4b,0xbe,0x7c,0x01,0x81,0x2c,0xf7,0x21,0xad,0x1c,
  0xde,0xd4,0x6d,0xe9,0x83,0x90,0x97,0xdb,0x72,0x40,0xa4,0xa4,0xb7,0xb3,0x67,0x1f,
  0xcb,0x79,0xe6,0x4e,0xcc,0xc0,0xe5,0x78,0x82,0x5a,0xd0,0x7d,0xcc,0xff,0x72,0x21,
  0xb8,0x08,0x46,0x74,0xf7,0x43,0x24,0x8e,0xe0,0x35,0x90,0xe6,0x81,0x3a,0x26,0x4c,
  0x3c,0x28,0x52,0xbb,0x91,0xc3,0x00,0xcb,0x88,0xd0,0x65,0x8b,0x1b,0x53,0x2e,0xa3,
  0x71,0x64,0x48,0x97,0xa2,0x0d,0xf9,0x4e,0x38,0x19,0xef,0x46,0xa9,0xde,0xac,0xd8,
  0xa8,0xfa,0x76,0x3f,0xe3,0x9c,0x34,0x3f,0xf9,0xdc,0xbb,0xc7,0xc7,0x0b,0x4f,0x1d,
  0x8a,0x51,0xe0,0x4b,0xcd,0xb4,0x59,0x31,0xc8,0x9f,0x7e,0xc9,0xd9,0x78,0x73,0x64,
  0xea,0xc5,0xac,0x83,0x34,0xd3,0xeb,0xc3,0xc5,0x81,0xa0,0xff,0xfa,0x13,0x63,0xeb,
  0x17,0x0d,0xdd,0x51,0xb7,0xf0,0xda,0x49,0xd3,0x16,0x55,0x26,0x29,0xd4,0x68,0x9e,
  0x2b,0x16,0xbe,0x58,0x7d,0x47,0xa1,0xfc,0x8f,0xf8,0xb8,0xd1,0x7a,0xd0,0x31,0xce,
  0x45,0xcb,0x3a,0x8f,0x95,0x16,0x04,0x28,0xaf,0xd7,0xfb,0xca,0xbb,0x4b,0x40,0x7e};

static const uint64_t P32_1 = 0x9E3779B1ULL, P32_2 = 0x85EBCA77ULL, P32_3 = 0xC2B2AE3DULL;
static const uint64_t P64_1 = 0x9E3779B185EBCA87ULL, P64_2 = 0xC2B2AE3D27D4EB4FULL,
    P64_3 = 0x165667B19E3779F9ULL, P64_4 = 0x85EBCA77C2B2AE63ULL,
    P64_5 = 0x27D4EB2F165667C5ULL;
static const int STRIPE = 64, PER_BLOCK = 16;  // (192 - 64) / 8 stripes a block

struct State { uint64_t acc[8]; uint64_t folded; };

static inline uint64_t rd64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }

static inline void fold(uint64_t* acc, const uint8_t* in, const uint8_t* key) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t v = rd64(in + 8 * i), k = v ^ rd64(key + 8 * i);
    acc[i ^ 1] += v;
    acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
  }
}

static inline void scramble(uint64_t* acc) {
  const uint8_t* key = SECRET + 192 - STRIPE;
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= rd64(key + 8 * i);
    acc[i] = a * P32_1;
  }
}

// Fold the stripe at byte `s` of the payload (lying at `in`), scrambling after a block.
static inline void stripe(uint64_t* acc, const uint8_t* in, uint64_t s) {
  const uint64_t n = (s / STRIPE) % PER_BLOCK;
  fold(acc, in, SECRET + 8 * n);
  if (n == PER_BLOCK - 1) scramble(acc);
}

// Copy the `n` bytes at `in` to `base[at:]`, folding in every stripe [s, s + 64) with
// s + 64 < total that is now wholly in `base`. The caller has checked the range.
#if defined(__AVX512F__)
// One 64-byte stripe ``v`` (the k-th of its block) into the accumulator, and the block's
// scramble after its last stripe: the vector form of ``stripe`` and ``scramble``.
static inline __m512i stripe512(__m512i acc, __m512i v, uint64_t k, __m512i skey,
                                __m512i prime) {
  const __m512i dk = _mm512_xor_si512(v, _mm512_loadu_si512(SECRET + 8 * k));
  const __m512i prod = _mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32));
  const __m512i swap = _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
  acc = _mm512_add_epi64(acc, _mm512_add_epi64(prod, swap));
  if (k == PER_BLOCK - 1) {
    __m512i a = _mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47));
    a = _mm512_xor_si512(a, skey);
    const __m512i lo = _mm512_mul_epu32(a, prime);
    const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
    acc = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
  }
  return acc;
}
#endif

static void copy_raw(uint8_t* base, int64_t at, const uint8_t* in, int64_t n, State* s,
                     int64_t total) {
  const int64_t end = at + n, limit = end < total - 1 ? end : total - 1;
  int64_t done = 0;  // bytes of src copied so far
  if ((int64_t)s->folded == at) {
    uint64_t pos = s->folded;
#if defined(__AVX512F__)
    __m512i acc = _mm512_loadu_si512(s->acc);
    const __m512i prime = _mm512_set1_epi64(P32_1);
    const __m512i skey = _mm512_loadu_si512(SECRET + 192 - STRIPE);
    for (; (int64_t)pos + STRIPE <= limit; pos += STRIPE, done += STRIPE) {
      const uint64_t k = (pos / STRIPE) % PER_BLOCK;
      const __m512i v = _mm512_loadu_si512(in + done);
      _mm512_storeu_si512(base + pos, v);
      acc = stripe512(acc, v, k, skey, prime);
    }
    _mm512_storeu_si512(s->acc, acc);
#else
    for (; (int64_t)pos + STRIPE <= limit; pos += STRIPE, done += STRIPE) {
      std::memcpy(base + pos, in + done, STRIPE);
      stripe(s->acc, base + pos, pos);
    }
#endif
    s->folded = pos;
  }
  std::memcpy(base + at + done, in + done, n - done);
  // Stripes that straddle sources, or all of them when this one did not start on one.
  for (uint64_t pos = s->folded; (int64_t)pos + STRIPE <= limit; pos += STRIPE) {
    stripe(s->acc, base + pos, pos);
    s->folded = pos + STRIPE;
  }
}

static uint64_t fold128(uint64_t a, uint64_t b) {
  const unsigned __int128 p = (unsigned __int128)a * b;
  return (uint64_t)p ^ (uint64_t)(p >> 64);
}

// `last`: the input's last 64 bytes, folded in with their own key.
static uint64_t digest_raw(const uint8_t* last, const State* s, int64_t total) {
  uint64_t acc[8];
  std::memcpy(acc, s->acc, sizeof(acc));
  fold(acc, last, SECRET + 192 - STRIPE - 7);
  uint64_t h = (uint64_t)total * P64_1;
  for (int i = 0; i < 4; ++i)
    h += fold128(acc[2 * i] ^ rd64(SECRET + 11 + 16 * i),
                 acc[2 * i + 1] ^ rd64(SECRET + 19 + 16 * i));
  h ^= h >> 37;
  h *= 0x165667919E3779F9ULL;
  return h ^ (h >> 32);
}

// Start, one copy per source and the digest in one call: a batch's 30 chunks cost one
// crossing into C++ rather than 32. The buffers are all requested (and the lengths
// checked) before the first byte moves, so a bad source copies nothing.
static uint64_t copy_all(py::buffer dst, py::sequence sources) {
  py::buffer_info d = dst.request(true);
  std::vector<py::buffer_info> infos;
  infos.reserve(sources.size());
  int64_t total = 0;
  for (py::handle source : sources) {
    infos.push_back(py::reinterpret_borrow<py::buffer>(source).request(false));
    total += infos.back().size * infos.back().itemsize;
  }
  if (total <= 240 || total > d.size * d.itemsize)
    throw std::invalid_argument("copysum: sources of " + std::to_string(total) +
                                " bytes for a " + std::to_string(d.size * d.itemsize) +
                                "-byte destination (more than 240 needed)");
  State s;
  const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
  std::memcpy(s.acc, init, sizeof(init));
  s.folded = 0;
  uint8_t* base = static_cast<uint8_t*>(d.ptr);
  int64_t at = 0;
  // The GIL stays held: taking it back after a 50 us copy could wait out another
  // thread's whole switch interval (5 ms).
  for (const py::buffer_info& r : infos) {
    const int64_t n = r.size * r.itemsize;
    copy_raw(base, at, static_cast<const uint8_t*>(r.ptr), n, &s, total);
    at += n;
  }
  return digest_raw(base + total - STRIPE, &s, total);
}

// Destination pieces of one payload: piece k holds payload bytes [at[k], at[k + 1]).
struct Pieces {
  std::vector<uint8_t*> ptr;
  std::vector<int64_t> at;
  size_t k = 0;  // the piece the cursor is in; moves forward only
  // Copy `n` bytes from `in` to payload offset `pos` (>= the cursor's), across pieces.
  void put(int64_t pos, const uint8_t* in, int64_t n) {
    while (n > 0) {
      while (pos >= at[k + 1]) ++k;
      const int64_t m = std::min(n, at[k + 1] - pos);
      std::memcpy(ptr[k] + (pos - at[k]), in, m);
      pos += m; in += m; n -= m;
    }
  }
};

// The receiving side's fused pass: copy the contiguous `source` into the `dests` pieces
// (back to back, as many bytes as the source) and hash what was stored. Each stripe is
// loaded from the source once, and the register that is folded in is the one stored, so
// the digest is of the bytes that landed even if the source changes meanwhile (a shared
// segment its sender can still write). The input's last 64 bytes, hashed with their own
// key, are read back from the destination. Buffers and lengths are checked before the
// first byte moves.
static uint64_t scatter_all(py::buffer source, py::sequence dests) {
  py::buffer_info src = source.request(false);
  const int64_t total = src.size * src.itemsize;
  std::vector<py::buffer_info> infos;
  infos.reserve(dests.size());
  Pieces p;
  p.at.push_back(0);
  for (py::handle d : dests) {
    infos.push_back(py::reinterpret_borrow<py::buffer>(d).request(true));
    p.ptr.push_back(static_cast<uint8_t*>(infos.back().ptr));
    p.at.push_back(p.at.back() + infos.back().size * infos.back().itemsize);
  }
  if (total <= 240 || p.at.back() != total)
    throw std::invalid_argument("scatter: a source of " + std::to_string(total) +
                                " bytes for destinations of " + std::to_string(p.at.back()) +
                                " bytes (equal, and more than 240, needed)");
  p.ptr.push_back(nullptr);
  p.at.push_back(INT64_MAX);  // a sentinel: the cursor never runs off the end
  State s;
  const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
  std::memcpy(s.acc, init, sizeof(init));
  const uint8_t* in = static_cast<const uint8_t*>(src.ptr);
  alignas(64) uint8_t tmp[STRIPE];
  int64_t pos = 0;
#if defined(__AVX512F__)
  __m512i acc = _mm512_loadu_si512(s.acc);
  const __m512i prime = _mm512_set1_epi64(P32_1);
  const __m512i skey = _mm512_loadu_si512(SECRET + 192 - STRIPE);
#endif
  while (pos + STRIPE < total) {
    while (pos >= p.at[p.k + 1]) ++p.k;
    // The stripes wholly inside this piece, with no boundary check each.
    const int64_t end = std::min(p.at[p.k + 1], total - 1);
    uint8_t* out = p.ptr[p.k] + (pos - p.at[p.k]);
    for (; pos + STRIPE <= end; pos += STRIPE, out += STRIPE) {
#if defined(__AVX512F__)
      const uint64_t k = (pos / STRIPE) % PER_BLOCK;
      const __m512i v = _mm512_loadu_si512(in + pos);
      _mm512_storeu_si512(out, v);
      acc = stripe512(acc, v, k, skey, prime);
#else
      std::memcpy(out, in + pos, STRIPE);
      stripe(s.acc, out, pos);  // what landed, not the source a second time
#endif
    }
    if (pos + STRIPE < total && pos < p.at[p.k + 1] && pos + STRIPE > p.at[p.k + 1]) {
      // A stripe across two pieces: stored through a buffer, folded from the same buffer.
      std::memcpy(tmp, in + pos, STRIPE);
      p.put(pos, tmp, STRIPE);
#if defined(__AVX512F__)
      _mm512_storeu_si512(s.acc, acc);
      stripe(s.acc, tmp, pos);
      acc = _mm512_loadu_si512(s.acc);
#else
      stripe(s.acc, tmp, pos);
#endif
      pos += STRIPE;
    }
  }
#if defined(__AVX512F__)
  _mm512_storeu_si512(s.acc, acc);
#endif
  p.put(pos, in + pos, total - pos);
  // Read the last 64 bytes back from where they landed (they may span pieces).
  size_t k = 0;
  for (int64_t at = total - STRIPE, n = STRIPE, o = 0; n > 0;) {
    while (at >= p.at[k + 1]) ++k;
    const int64_t m = std::min(n, p.at[k + 1] - at);
    std::memcpy(tmp + o, p.ptr[k] + (at - p.at[k]), m);
    at += m; o += m; n -= m;
  }
  return digest_raw(tmp, &s, total);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("copy_all", &copy_all);
  m.def("scatter_all", &scatter_all);
#if defined(__AVX512F__)
  m.attr("vectorized") = true;
#else
  m.attr("vectorized") = false;
#endif
}
"""

_KERNEL = CppKernel("pdserve_cpu_copysum", _SOURCE, "shm copies, then hashes")


def kernel(wait: bool = False):
    """The built module, or None: where torch is not imported (a light process), where it
    cannot be built, and, unless ``wait``, while its first build runs in the background."""
    if "torch" not in sys.modules:
        return None
    if not wait and not _KERNEL.ready():
        return None
    mod = _KERNEL.module()
    # Without AVX-512 the fold runs one lane at a time and loses to xxhash's own SIMD code
    # plus a memcpy, so only the vectorized build is worth using.
    return mod if mod is not None and getattr(mod, "vectorized", False) else None


def scatter_sum(mod, source: memoryview, destinations) -> int:
    """Copy ``source`` into ``destinations`` (writable buffers that, back to back, are
    exactly as long) with ``mod`` (from :func:`kernel`); return XXH3-64 (seed 0) of the
    bytes as they landed. The source must pass ``SHORT`` bytes. ValueError for lengths
    that do not add up (nothing copied then)."""
    return mod.scatter_all(source, destinations)


def copy_sum(mod, destination: memoryview, sources) -> int:
    """Copy ``sources`` back to back to the start of ``destination`` with ``mod`` (from
    :func:`kernel`); return XXH3-64 (seed 0) of them all. Their total must pass ``SHORT``."""
    return mod.copy_all(destination, sources)
