// Integrity of the mesh's frames after the handshake: HMAC-SHA256, cut to 16 bytes.
//
// Terms (used by header.h and transfer.cc):
//   link key   32 bytes per connection, derived from the handshake's session key
//              (collectives/rendezvous/mesh.py): both ends hold it, no other
//              connection has it
//   frame      what a tag covers: an op header or notice (a Wire), or, where the
//              op is *sealed*, the payload one transfer sends on one link
//   counter    each end counts the frames it sent and those it took on a link;
//              a tag covers (kind, sender rank, receiver rank, counter, bytes),
//              so a frame changed, injected, replayed, reordered or reflected
//              back to its sender fails its check
// A link without a key (a key of zero length) sends and takes frames untagged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace hvs {

constexpr size_t kTagBytes = 16;

// SHA-256's state after the key's inner and outer pads: a tag costs two or
// three compressions for a header, not five.
class MacKey {
 public:
  explicit MacKey(const std::string& key);
  uint32_t inner[8], outer[8];
};

// A running tag: start(), update() over the frame's bytes, finish().
class Mac {
 public:
  Mac() = default;
  void start(const MacKey& key, char kind, int32_t from, int32_t to, uint64_t counter);
  void update(const void* data, size_t len);
  void finish(uint8_t out[kTagBytes]);

 private:
  const MacKey* key_ = nullptr;
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t fill_ = 0;
  uint64_t total_ = 0;  // bytes hashed, the pad's 64 included
  void block(const uint8_t* p);
};

// Constant-time comparison of two tags.
bool same_tag(const uint8_t a[kTagBytes], const uint8_t b[kTagBytes]);

}  // namespace hvs
