// The ranks of one host, synchronising through a shared segment.
//
// Terms used by every shm algorithm:
//   step    one round in which each rank may write its slot buffer, then read
//           the buffers of the others.  Every collective is a sequence of
//           steps; all local ranks run the same sequence.
//   buffer  a slot is cut into `nbuf` buffers; step g uses buffer g % nbuf.
//   phase   a rank's counter in its control block, raised (post) after it
//           has written what the others wait for.  Counters only grow, so
//           nothing is ever reset and no extra barrier is needed between ops.
//
// Buffer reuse without barriers: a rank finishes reading the buffers of step
// g before it ends step g + 1 (an algorithm may defer its last reads of a
// step into the next one, to overlap them with that step's writes).  So
// before writing buffer g % nbuf a rank waits until every peer has ended step
// g - nbuf + 1; with many buffers that has almost always happened already,
// and the check is a few loads.
//
// Agreement: every buffer starts with a tag naming the op this rank is in
// (kind, dtype, reduce op, root, count, a digest of per-rank counts).  A rank
// reads a peer's buffer only after checking that tag against its own, so
// ranks that call different collectives, or the same one with other sizes,
// get a MismatchError naming both, never garbage.
//
// Waiting: spin on the peer's counter (no syscall on the fast path) for
// `spin_ns`, then sched_yield for `yield_ns` (another local rank may need
// this core), then sleep on a futex on the counter, which the peer wakes when
// it posts and sees a sleeper (so posting costs no syscall unless someone
// sleeps).  Sleeps last at most 20 ms: between them the peers' processes are
// checked (kill(pid, 0) and /proc state) and their abort flags read, so a dead
// peer is reported in milliseconds, not after the timeout.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../op.h"
#include "hvs/status.h"
#include "segment.h"

namespace hvs {

struct WaitPolicy {
  uint64_t spin_ns = 50000;
  uint64_t yield_ns = 200000;  // 0 when ranks outnumber cores: sleep at once
  uint64_t timeout_ns = 30000000000ull;
};

class ShmGroup {
 public:
  // `world` is the world rank of each local rank, `pids` their processes.
  ShmGroup(std::unique_ptr<Segment> seg, int me, std::vector<int> world, std::vector<pid_t> pids,
           WaitPolicy policy, size_t chunk_bytes);

  int size() const { return static_cast<int>(world_.size()); }
  int me() const { return me_; }
  int world_rank(int local) const { return world_[local]; }
  pid_t pid(int local) const { return pids_[local]; }

  // Cross-memory attach (cma.cc): wanted by this rank; agreed by all, once.
  enum class Cma { kUnknown, kOn, kOff };
  bool cma_wanted() const { return cma_wanted_; }
  void want_cma(bool wanted) { cma_wanted_ = wanted; }
  Cma cma() const { return cma_; }
  void set_cma(Cma state) { cma_ = state; }
  size_t buf_bytes() const { return buf_bytes_; }
  size_t chunk_bytes() const { return chunk_bytes_; }

  // The op every following step belongs to (its tag goes into each buffer).
  void set_op(const OpTag& tag) { tag_ = tag; }

  // Step bookkeeping; see the file comment.
  Status begin_step();
  void end_step();
  char* buffer(int local) const { return buffer(local, step_); }  // this step's
  char* buffer(int local, uint64_t step) const;
  uint64_t step() const { return step_; }

  void post();
  uint64_t phase() const { return phase_; }
  Status wait_all(uint64_t target);
  Status wait_one(int local, uint64_t target);
  // Wait for this step's post of every peer (of `root`), then check their tags.
  Status wait_step_all();
  Status wait_step_root(int root);
  void mark_aborted(Code why);  // tells the peers, which stop waiting for us

 private:
  Status wait_slow(int local, uint64_t target);
  Status check_peers() const;
  Status check_tag(int local) const;

  std::unique_ptr<Segment> seg_;
  int me_;
  std::vector<int> world_;
  std::vector<pid_t> pids_;
  WaitPolicy policy_;
  size_t nbuf_;
  size_t buf_bytes_;
  size_t chunk_bytes_;
  uint64_t phase_ = 0;
  uint64_t step_ = 0;
  std::vector<uint64_t> end_phase_;  // phase at the end of step g, at g % nbuf
  OpTag tag_;
  bool cma_wanted_ = false;
  Cma cma_ = Cma::kUnknown;
};

}  // namespace hvs
