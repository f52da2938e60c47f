// A POSIX shared-memory segment shared by the ranks of one host.
//
// Layout: a header, one control block per local rank (its phase counter and
// abort flag, each on its own pair of cache lines so that no two ranks write
// the same line), then one data slot of `slot_bytes` per local rank.
//
// Lifetime: local rank 0 publishes a fresh random name, then creates the
// segment (so a death at any point leaves nothing that nobody can name);
// every other local rank attaches (retrying while it does not exist or is not
// initialised: kNotReady); the attach that makes the count complete unlinks
// the name, so once everyone is attached nothing is left in /dev/shm even if
// every process is killed.  The creator, and an attacher that gives up,
// unlink too (unlink is idempotent).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "hvs/status.h"

namespace hvs {

struct alignas(128) ShmControl {
  std::atomic<uint64_t> phase;    // phases this rank has posted, ever (its low half is a futex)
  std::atomic<uint32_t> waiters;  // ranks asleep on `phase`: the poster wakes them
  std::atomic<uint32_t> aborted;  // the Code of the error this rank gave up on, or 0
};

class Segment {
 public:
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  static Status create(const std::string& name, int nranks, size_t slot_bytes,
                       std::unique_ptr<Segment>* out);
  static Status attach(const std::string& name, int nranks, size_t slot_bytes,
                       std::unique_ptr<Segment>* out);

  // Removes the name from /dev/shm (the mapping stays valid); idempotent.
  void unlink();
  static void unlink(const std::string& name);
  int attached() const;

  const std::string& name() const { return name_; }
  int nranks() const { return nranks_; }
  size_t slot_bytes() const { return slot_bytes_; }
  ShmControl& control(int local) const;
  char* slot(int local) const;

 private:
  Segment() = default;
  static size_t total_bytes(int nranks, size_t slot_bytes);
  Status map(int fd, size_t bytes);

  std::string name_;
  int nranks_ = 0;
  size_t slot_bytes_ = 0;
  size_t bytes_ = 0;
  char* base_ = nullptr;
  bool unlinked_ = false;
};

}  // namespace hvs
