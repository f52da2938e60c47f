// The lane: one steady-state allreduce run without Python, for a caller that
// is not Python (the TensorFlow op HvsLaneAllreduce of horovod_spark.tensorflow).
//
// The fusion engine (collectives/fusion) agrees on every op in Python: a
// cycle is a coordination allreduce of an int32 vector, then the data
// collectives the vector said were ready.  In a training step that Python
// costs more than the collectives, and inside TensorFlow the call into Python
// costs as much again.  Once the engine has run an op and cached its signature
// at bit b of the vector, and armed a lane slot with it, the lane runs the
// same cycle in C++: it contributes the vector a rank with only b pending
// contributes (DATA at b, zeros elsewhere), and when the sum is exactly what
// every rank contributing that gives (size * DATA at b, zeros elsewhere:
// nobody joined, shutting down, announcing, asking for a stall report, or
// holding anything else cached), it runs b's allreduce and its postscale as
// the engine's executor would for one ready tensor: the same Context calls in
// the same order, so a rank in the lane and a rank in Python's cycle pair up.
//
// Any other sum is the engine's to handle: run() returns kHandover with the
// cycle lock still held and the summed vector in result(), and the caller
// hands both to Python, which finishes the cycle (engine._cycle_rest) and
// releases the lock.  Python and the lane take turns through one lock (the
// engine's cycle lock is this object's), so this rank's cycles stay serial.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "context.h"
#include "hvs/status.h"

namespace hvs {

// A lock any thread may release (Python's cycle may release what the lane took).
class CycleLock {
 public:
  bool try_acquire();
  // Waits up to timeout_s (< 0: for ever); returns whether it got the lock.
  bool acquire(double timeout_s = -1);
  void release();
  bool locked();

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool held_ = false;
};

enum LaneCode : int { kLaneDone = 0, kLaneFallback = 1, kLaneHandover = 2, kLaneError = 3 };

class Lane {
 public:
  Lane(Context* ctx, int rank, int size);

  CycleLock lock;

  // Called by the engine (Python).  Slots are armed after the engine ran the op once, with
  // the generation the engine last gave set_cache() when it read the bit from its cache:
  // an older one (the cache changed meanwhile) leaves the slot unarmed.
  void arm(int slot, int bit, size_t count, DType dt, double postscale, int64_t generation);
  // The cache changed: it has nbits bits, and the bits in `changed` were freed or given to
  // another signature.  Only the slots armed on those bits go stale (bits never move, so
  // a cached entry keeps its bit until evicted): a new name, an unnamed op or a barrier
  // leaves every other armed slot running in the lane.
  void set_cache(int64_t nbits, int64_t generation, const std::vector<int>& changed);
  // Off while this rank has joined, is shutting down, records a timeline, has stopped.
  void set_enabled(bool on) { enabled_.store(on); }
  // Stops the lane for good (before the Context goes); waits for a run in flight.
  void close(double timeout_s);
  // (last use, bit) of every slot the lane ran since the last call, oldest first:
  // the engine marks them used in its cache (LRU order must match other ranks').
  std::vector<std::pair<uint64_t, int>> take_uses();
  const std::vector<int32_t>& result() const { return vec_; }
  uint64_t synced_ns() const { return synced_ns_.load(); }
  const Status& error() const { return error_; }
  uint64_t cycles() const { return cycles_.load(); }
  uint64_t tensors() const { return tensors_.load(); }
  uint64_t bytes() const { return bytes_.load(); }
  double collective_s() const { return collective_ns_.load() * 1e-9; }

  // One op: kLaneDone, kLaneFallback (nothing done, lock free), kLaneHandover
  // (lock held, coordination done) or kLaneError (error(), lock free).
  int run(int slot, const void* in, void* out, size_t bytes);

  // Async ops (torch's allreduce_async_): enqueue() queues an armed slot's op and returns
  // its ticket (-1: the slot is not armed, is queued already, or the lane is off: nothing
  // queued).  wait() runs batch cycles until the ticket is done: every queued op
  // contributes DATA at its bit; when the sum holds nothing but DATA counts, the ops every
  // rank is ready for run as the engine's executor runs them (in bit order, one fusion
  // buffer per run of up to `threshold` bytes, the same Context calls), the others stay
  // queued.  Returns kLaneDone, kLaneHandover (lock held: the queue is the engine's to take),
  // kLaneError, or kLaneFallback (lock free: the lane is off, a queued slot went stale, or
  // `budget_s` passed without this ticket done; the engine takes the queue).
  int64_t enqueue(int slot, const void* in, void* out, size_t bytes);
  int wait(int64_t ticket, double budget_s);
  bool done(int64_t ticket);
  bool armed(int slot, size_t bytes);  // enqueue() would take it (were the engine idle)
  // The queued tickets, in order, removed from the queue (the caller holds `lock`).
  std::vector<int64_t> take_queue();
  size_t queued();
  void set_threshold(size_t bytes) { threshold_ = bytes; }

 private:
  struct Slot {
    bool armed = false;
    int bit = -1;
    size_t count = 0;
    DType dtype = DType::kFloat32;
    double postscale = 1.0;
    uint64_t epoch = 0;  // bit_epoch_[bit] when armed
    uint64_t last_use = 0;
  };
  struct Entry {
    int64_t ticket;
    int slot;
    const void* in;
    void* out;
    size_t bytes;
  };
  bool usable(int slot, size_t bytes, Slot* out);
  bool usable_locked(int slot, size_t bytes, Slot* out);
  int fail(Status st);
  // One batch cycle (lock held): *progress when some op finished; kLaneDone (cycle ran),
  // kLaneHandover, kLaneError or kLaneFallback (a queued slot went stale).
  int batch_cycle(bool* progress);

  Context* ctx_;  // guarded by lock; null once closed
  const int rank_, size_;
  std::atomic<bool> enabled_{true};
  std::mutex slots_mu_;  // arm() and run() (the table only, never held across a collective)
  std::vector<Slot> slots_;
  std::vector<int> used_;
  int64_t nbits_ = 0, generation_ = 0;
  std::vector<uint64_t> bit_epoch_;  // per cache bit: how many times it was freed or reassigned
  uint64_t uses_ = 0;
  std::vector<int32_t> vec_;
  std::vector<Entry> queue_;          // guarded by slots_mu_
  std::vector<int64_t> finished_;     // tickets done and not yet seen by wait() or done()
  int64_t next_ticket_ = 0;
  size_t threshold_ = 64 << 20;
  std::vector<char> fused_;
  std::atomic<uint64_t> synced_ns_{0}, cycles_{0}, tensors_{0}, bytes_{0}, collective_ns_{0};
  Status error_;
};

}  // namespace hvs

// The C entry the TensorFlow op calls (its address is handed over from Python).
extern "C" int hvs_lane_run(void* lane, int slot, const void* in, void* out, int64_t bytes);
