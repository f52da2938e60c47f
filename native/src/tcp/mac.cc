// HMAC-SHA256 (FIPS 180-4, RFC 2104) for the mesh's frames; see mac.h.  The
// compression runs on the CPU's SHA extensions where it has them (x86-64:
// SHA-NI, chosen at run time), else in portable C++.
#include "mac.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define HVS_SHA_NI 1
#endif

namespace hvs {

namespace {

const uint32_t kK[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

const uint32_t kInit[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                           0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void compress_portable(uint32_t h[8], const uint8_t* p) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i)
    w[i] = (uint32_t(p[4 * i]) << 24) | (uint32_t(p[4 * i + 1]) << 16) | (uint32_t(p[4 * i + 2]) << 8) |
           uint32_t(p[4 * i + 3]);
  for (int i = 16; i < 64; ++i) {
    uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int i = 0; i < 64; ++i) {
    uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kK[i] + w[i];
    uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
  }
  h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

#ifdef HVS_SHA_NI
// `blocks` blocks with the SHA extensions: four rounds per step, the message
// schedule in four registers (w[4g..4g+3] in m[g % 4]).
__attribute__((target("sha,sse4.1,ssse3"))) void compress_ni(uint32_t h[8], const uint8_t* p,
                                                              size_t blocks) {
  const __m128i mask = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  __m128i tmp = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
  __m128i st1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 4));
  tmp = _mm_shuffle_epi32(tmp, 0xB1);        // CDAB
  st1 = _mm_shuffle_epi32(st1, 0x1B);        // EFGH
  __m128i st0 = _mm_alignr_epi8(tmp, st1, 8);  // ABEF
  st1 = _mm_blend_epi16(st1, tmp, 0xF0);     // CDGH
  for (; blocks; --blocks, p += 64) {
    const __m128i abef = st0, cdgh = st1;
    __m128i m[4];
    for (int g = 0; g < 16; ++g) {
      if (g < 4)
        m[g] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * g)), mask);
      const __m128i w = m[g & 3];
      __m128i msg = _mm_add_epi32(w, _mm_loadu_si128(reinterpret_cast<const __m128i*>(kK + 4 * g)));
      st1 = _mm_sha256rnds2_epu32(st1, st0, msg);
      if (g >= 3 && g <= 14) {  // the next four words, while m[(g - 1) & 3] is still plain
        __m128i& next = m[(g + 1) & 3];
        next = _mm_add_epi32(next, _mm_alignr_epi8(w, m[(g - 1) & 3], 4));
        next = _mm_sha256msg2_epu32(next, w);
      }
      st0 = _mm_sha256rnds2_epu32(st0, st1, _mm_shuffle_epi32(msg, 0x0E));
      if (g >= 1 && g <= 12) m[(g - 1) & 3] = _mm_sha256msg1_epu32(m[(g - 1) & 3], w);
    }
    st0 = _mm_add_epi32(st0, abef);
    st1 = _mm_add_epi32(st1, cdgh);
  }
  tmp = _mm_shuffle_epi32(st0, 0x1B);        // FEBA
  st1 = _mm_shuffle_epi32(st1, 0xB1);        // DCHG
  st0 = _mm_blend_epi16(tmp, st1, 0xF0);     // DCBA
  st1 = _mm_alignr_epi8(st1, tmp, 8);        // ABEF
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h), st0);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h + 4), st1);
}

bool has_sha_ni() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_1) || !(c & bit_SSSE3)) return false;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (b & (1u << 29)) != 0;  // CPUID.(EAX=7,ECX=0):EBX.SHA
}

// HVS_MAC_PORTABLE=1 takes the portable code even here (the tests check both).
const bool kShaNi = has_sha_ni() && !std::getenv("HVS_MAC_PORTABLE");
#endif

void compress_blocks(uint32_t h[8], const uint8_t* p, size_t blocks) {
#ifdef HVS_SHA_NI
  if (kShaNi) return compress_ni(h, p, blocks);
#endif
  for (; blocks; --blocks, p += 64) compress_portable(h, p);
}

void compress(uint32_t h[8], const uint8_t* p) { compress_blocks(h, p, 1); }

// The state after one block of the key xor'ed with `pad`.
void padded_state(const std::string& key, uint8_t pad, uint32_t out[8]) {
  uint8_t block[64];
  std::memset(block, 0, sizeof block);
  std::memcpy(block, key.data(), key.size() < 64 ? key.size() : 64);  // keys are 32 bytes
  for (uint8_t& b : block) b ^= pad;
  std::memcpy(out, kInit, sizeof kInit);
  compress(out, block);
}

void put_be32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v >> 24), p[1] = uint8_t(v >> 16), p[2] = uint8_t(v >> 8), p[3] = uint8_t(v);
}

}  // namespace

MacKey::MacKey(const std::string& key) {
  padded_state(key, 0x36, inner);
  padded_state(key, 0x5c, outer);
}

void Mac::start(const MacKey& key, char kind, int32_t from, int32_t to, uint64_t counter) {
  key_ = &key;
  std::memcpy(h_, key.inner, sizeof h_);
  fill_ = 0, total_ = 64;
  uint8_t head[17];
  head[0] = static_cast<uint8_t>(kind);
  put_be32(head + 1, static_cast<uint32_t>(from));
  put_be32(head + 5, static_cast<uint32_t>(to));
  put_be32(head + 9, static_cast<uint32_t>(counter >> 32));
  put_be32(head + 13, static_cast<uint32_t>(counter));
  update(head, sizeof head);
}

void Mac::block(const uint8_t* p) { compress(h_, p); }

void Mac::update(const void* data, size_t len) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_ += len;
  if (fill_) {
    size_t k = 64 - fill_ < len ? 64 - fill_ : len;
    std::memcpy(buf_ + fill_, p, k);
    fill_ += k, p += k, len -= k;
    if (fill_ < 64) return;
    block(buf_);
    fill_ = 0;
  }
  if (len >= 64) {
    compress_blocks(h_, p, len / 64);
    p += len / 64 * 64;
    len %= 64;
  }
  std::memcpy(buf_, p, len);
  fill_ = len;
}

namespace {
// SHA-256's padding of a message of `total` bytes whose last `fill` are in buf.
void final_blocks(uint32_t h[8], uint8_t buf[64], size_t fill, uint64_t total) {
  buf[fill++] = 0x80;
  if (fill > 56) {
    std::memset(buf + fill, 0, 64 - fill);
    compress(h, buf);
    fill = 0;
  }
  std::memset(buf + fill, 0, 56 - fill);
  const uint64_t bits = total * 8;
  put_be32(buf + 56, static_cast<uint32_t>(bits >> 32));
  put_be32(buf + 60, static_cast<uint32_t>(bits));
  compress(h, buf);
}
}  // namespace

void Mac::finish(uint8_t out[kTagBytes]) {
  final_blocks(h_, buf_, fill_, total_);
  uint8_t digest[64];
  for (int i = 0; i < 8; ++i) put_be32(digest + 4 * i, h_[i]);
  uint32_t h[8];
  std::memcpy(h, key_->outer, sizeof h);
  final_blocks(h, digest, 32, 64 + 32);
  uint8_t full[32];
  for (int i = 0; i < 8; ++i) put_be32(full + 4 * i, h[i]);
  std::memcpy(out, full, kTagBytes);
}

bool same_tag(const uint8_t a[kTagBytes], const uint8_t b[kTagBytes]) {
  uint8_t diff = 0;
  for (size_t i = 0; i < kTagBytes; ++i) diff |= static_cast<uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace hvs
