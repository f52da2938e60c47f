// Steps, phases and waiting for the ranks of one host; see group.h.
#include "group.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "../clock.h"
#include "hvs/types.h"

namespace hvs {

namespace {
constexpr size_t kTagBytes = 64;  // the tag at the start of every buffer
static_assert(sizeof(OpTag) <= kTagBytes, "an OpTag fits its place");
constexpr uint64_t kCheckEveryNs = 20000000;  // peer liveness every 20 ms, the longest sleep

// The futex is the low 32 bits of the 64-bit phase counter (little endian).
uint32_t* futex_word(const std::atomic<uint64_t>& phase) {
  static_assert(sizeof(std::atomic<uint64_t>) == 8, "lock-free 64-bit atomics");
  return reinterpret_cast<uint32_t*>(const_cast<std::atomic<uint64_t>*>(&phase));
}

void futex_sleep(const std::atomic<uint64_t>& phase, uint32_t seen, uint64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1000000000ull), static_cast<long>(ns % 1000000000ull)};
  syscall(SYS_futex, futex_word(phase), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake_all(const std::atomic<uint64_t>& phase) {
  syscall(SYS_futex, futex_word(phase), FUTEX_WAKE, 0x7fffffff, nullptr, nullptr, 0);
}

// A zombie still answers kill(pid, 0); /proc tells it apart.
bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  int fd = open(path, O_RDONLY);
  if (fd < 0) return errno != ENOENT;
  char buf[512];
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return true;
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');
  if (!paren || paren[1] == 0 || paren[2] == 0) return true;
  char state = paren[2];
  return state != 'Z' && state != 'X' && state != 'x';
}
}  // namespace

ShmGroup::ShmGroup(std::unique_ptr<Segment> seg, int me, std::vector<int> world,
                   std::vector<pid_t> pids, WaitPolicy policy, size_t chunk_bytes)
    : seg_(std::move(seg)), me_(me), world_(std::move(world)), pids_(std::move(pids)),
      policy_(policy) {
  // Buffers of `chunk_bytes` (cache-sized), at least two per slot.
  size_t slot = seg_->slot_bytes();
  size_t chunk = chunk_bytes < 4096 ? 4096 : chunk_bytes / 4096 * 4096;
  if (chunk > slot / 2) chunk = slot / 2 / 64 * 64;
  nbuf_ = slot / chunk;  // >= 2
  buf_bytes_ = chunk - kTagBytes;
  chunk_bytes_ = chunk;
  end_phase_.assign(nbuf_, 0);
}

char* ShmGroup::buffer(int local, uint64_t step) const {
  return seg_->slot(local) + (step % nbuf_) * chunk_bytes_ + kTagBytes;
}

// end_phase_[(g + 1) % nbuf] holds the end of step g + 1 - nbuf.
Status ShmGroup::begin_step() {
  if (step_ + 1 >= nbuf_) HVS_CHECK(wait_all(end_phase_[(step_ + 1) % nbuf_]));
  std::memcpy(buffer(me_) - kTagBytes, &tag_, sizeof tag_);
  return Status();
}

Status ShmGroup::wait_step_all() {
  HVS_CHECK(wait_all(phase_));
  for (int j = 0; j < size(); ++j)
    if (j != me_) HVS_CHECK(check_tag(j));
  return Status();
}

Status ShmGroup::wait_step_root(int root) {
  HVS_CHECK(wait_one(root, phase_ + 1));
  HVS_CHECK(check_tag(root));
  return Status();
}

Status ShmGroup::check_tag(int local) const {
  OpTag theirs;
  std::memcpy(&theirs, buffer(local) - kTagBytes, sizeof theirs);
  if (theirs == tag_) return Status();
  return HVS_ERROR(Code::kMismatch, "ranks disagree: this rank is in " + tag_.describe() +
                                        ", the peer in " + theirs.describe(), world_[local])
      .with_hint("every rank must call the same collectives in the same order, with the same sizes");
}

void ShmGroup::end_step() {
  end_phase_[step_ % nbuf_] = phase_;
  ++step_;
}

void ShmGroup::post() {
  ++phase_;
  ShmControl& c = seg_->control(me_);
  // seq_cst on both sides: either the sleeper sees the new phase, or we see it.
  c.phase.store(phase_, std::memory_order_seq_cst);
  if (c.waiters.load(std::memory_order_seq_cst) != 0) futex_wake_all(c.phase);
}

void ShmGroup::mark_aborted(Code why) {
  seg_->control(me_).aborted.store(static_cast<uint32_t>(why), std::memory_order_release);
}

Status ShmGroup::wait_all(uint64_t target) {
  for (int j = 0; j < size(); ++j) {
    if (j == me_) continue;
    if (seg_->control(j).phase.load(std::memory_order_acquire) >= target) continue;
    HVS_CHECK(wait_slow(j, target));
  }
  return Status();
}

Status ShmGroup::wait_one(int local, uint64_t target) {
  if (seg_->control(local).phase.load(std::memory_order_acquire) >= target) return Status();
  HVS_CHECK(wait_slow(local, target));
  return Status();
}

Status ShmGroup::wait_slow(int local, uint64_t target) {
  ShmControl& c = seg_->control(local);
  const uint64_t start = now_ns();
  uint64_t last_check = start;
  for (uint32_t i = 1;; ++i) {
    if (c.phase.load(std::memory_order_acquire) >= target) return Status();
    if (i % 64 != 0) {
      cpu_relax();
      continue;
    }
    uint64_t now = now_ns(), waited = now - start;
    if (waited < policy_.spin_ns) continue;
    if (now - last_check >= kCheckEveryNs) {
      HVS_CHECK(check_peers());
      last_check = now;
    }
    if (waited >= policy_.timeout_ns)
      return HVS_ERROR(Code::kTimeout, "no progress from a local peer through shared memory",
                       world_[local])
          .with_hint("is that process alive, and in the same collective?");
    if (waited < policy_.spin_ns + policy_.yield_ns) {
      sched_yield();
      continue;
    }
    c.waiters.fetch_add(1, std::memory_order_seq_cst);
    uint64_t seen = c.phase.load(std::memory_order_seq_cst);
    if (seen < target) futex_sleep(c.phase, static_cast<uint32_t>(seen), kCheckEveryNs);
    c.waiters.fetch_sub(1, std::memory_order_seq_cst);
  }
}

// The root cause first: a peer that found a disagreement, then a peer that
// died without giving up on an op (a rank that failed and exited marked its
// failure first), then any peer that gave up or died.
Status ShmGroup::check_peers() const {
  int dead = -1, gave_up = -1;
  for (int j = 0; j < size(); ++j) {
    if (j == me_) continue;
    uint32_t why = seg_->control(j).aborted.load(std::memory_order_acquire);
    if (why == static_cast<uint32_t>(Code::kMismatch))
      return HVS_ERROR(Code::kMismatch, "the peer found that the ranks disagree on this collective",
                       world_[j])
          .with_hint("see that rank's error; every rank must call the same collectives, same sizes");
    if (why != 0 && gave_up < 0) gave_up = j;
    if (why == 0 && dead < 0 && !process_alive(pids_[j])) dead = j;
  }
  if (dead >= 0)
    return HVS_ERROR(Code::kPeerLost,
                     "local peer process " + std::to_string(pids_[dead]) + " has exited", world_[dead])
        .with_hint("see that rank's output for its error");
  if (gave_up >= 0)
    return HVS_ERROR(Code::kPeerLost, "local peer gave up on the collective after an error",
                     world_[gave_up])
        .with_hint("see that rank's error");
  return Status();
}

}  // namespace hvs
