// Steps, phases and waiting for the ranks of one host; see group.h.
#include "group.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "../clock.h"

namespace hvs {

namespace {
constexpr uint64_t kYieldNs = 2000000;       // yield for 2 ms after spinning, then nap
constexpr uint64_t kMaxNapNs = 1000000;      // naps grow to 1 ms
constexpr uint64_t kCheckEveryNs = 20000000;  // peer liveness every 20 ms

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
  nbuf_ = slot / chunk;
  buf_bytes_ = chunk;
  chunk_bytes_ = chunk;
  end_phase_.assign(nbuf_, 0);
}

char* ShmGroup::buffer(int local) const { return seg_->slot(local) + (step_ % nbuf_) * buf_bytes_; }

Status ShmGroup::begin_step() {
  if (step_ >= nbuf_) HVS_CHECK(wait_all(end_phase_[step_ % nbuf_] + 1));
  return Status();
}

void ShmGroup::end_step() {
  end_phase_[step_ % nbuf_] = phase_;
  ++step_;
}

void ShmGroup::post() {
  ++phase_;
  seg_->control(me_).phase.store(phase_, std::memory_order_release);
}

void ShmGroup::abort() { seg_->control(me_).aborted.store(1, std::memory_order_release); }

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
  const std::atomic<uint64_t>& flag = seg_->control(local).phase;
  const uint64_t start = now_ns();
  uint64_t last_check = start, nap = 20000;
  for (uint32_t i = 1;; ++i) {
    if (flag.load(std::memory_order_acquire) >= target) return Status();
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
    if (waited < policy_.spin_ns + kYieldNs) {
      sched_yield();
    } else {
      sleep_ns(nap);
      nap = nap * 2 > kMaxNapNs ? kMaxNapNs : nap * 2;
    }
    i = 0;  // one clock read per yield or nap
  }
}

Status ShmGroup::check_peers() const {
  for (int j = 0; j < size(); ++j) {
    if (j == me_) continue;
    if (!process_alive(pids_[j]))
      return HVS_ERROR(Code::kPeerLost,
                       "local peer process " + std::to_string(pids_[j]) + " has exited", world_[j])
          .with_hint("see that rank's output for its error");
    if (seg_->control(j).aborted.load(std::memory_order_acquire))
      return HVS_ERROR(Code::kPeerLost, "local peer gave up on the collective after an error",
                       world_[j])
          .with_hint("see that rank's error");
  }
  return Status();
}

}  // namespace hvs
