// Hierarchical allreduce: reduce within each shared-memory group, a ring between
// the group leaders, broadcast within each group (context.h).
//
// Pipelined (a buffer of at least two `hier_chunk`s): the leaders' ring runs one
// chunk at a time on a thread of the leader's own, while the leader's caller
// thread goes on with the shared-memory phases of the chunks around it:
//
//   caller thread   reduce 0 | reduce 1 | bcast 0 | reduce 2 | bcast 1 | ...
//   ring thread                | ring 0              | ring 1             | ...
//
// so on a link slower than memory the shared-memory phases hide behind the wire,
// but for the first chunk's reduce and the last one's broadcast.  The chunking is
// a choice of sizes and options (in the op's tag), the same on every leader, so
// a host whose group stages through its segment (no cross-memory attach), or
// that has a single rank, runs the same rings one after another and pairs with a
// pipelined host.  Only the ring thread touches the TCP links, the staging
// buffer and the agreement during the op; the caller thread only the group.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "context.h"

namespace hvs {

namespace {

// Runs `job` on each submitted chunk, in order, on a thread of its own.  After the
// first error it takes no more; the destructor lets the running job end (each is
// bounded by the op's timeout) and joins.
class ChunkWorker {
 public:
  explicit ChunkWorker(std::function<Status(size_t, size_t)> job)
      : job_(std::move(job)), thread_([this] { loop(); }) {}

  ~ChunkWorker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void submit(size_t first, size_t n) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.emplace_back(first, n);
    }
    cv_.notify_all();
  }

  // Waits for the oldest chunk not yet waited for; the first error, once.
  Status wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ > waited_ || failed_; });
    if (failed_) {
      if (!error_.ok()) return std::move(error_);
      return HVS_ERROR(Code::kInvalid, "the ring thread failed before (its error was returned)");
    }
    ++waited_;
    return Status();
  }

 private:
  void loop() {
    for (;;) {
      std::pair<size_t, size_t> c;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopped with nothing left to run
        c = queue_.front();
        queue_.pop_front();
        if (stop_) return;  // the caller gave up: run nothing more
      }
      Status st = job_(c.first, c.second);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (st.ok()) {
          ++done_;
        } else {
          failed_ = true;
          error_ = std::move(st);
        }
      }
      cv_.notify_all();
      if (failed_) return;
    }
  }

  std::function<Status(size_t, size_t)> job_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<size_t, size_t>> queue_;
  size_t done_ = 0, waited_ = 0;
  bool stop_ = false, failed_ = false;
  Status error_;
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace

// The leaders' ring over dst, one ring per chunk (`chunk` elements; 0: one ring).  An
// empty buffer still runs one ring: its headers check that the leaders agree.
Status Context::leaders_ring(char* dst, size_t count, size_t elem, ReduceFn fn, size_t chunk) {
  TcpGroup g = tcp_group(leaders_);
  if (!chunk && count && count * elem <= opt_.doubling_bytes) {  // (the op's tag says so too)
    if (doubling_copy_.size() < count * elem) doubling_copy_.resize(count * elem);
    return rd_allreduce(g, dst, doubling_copy_.data(), count, elem, fn);
  }
  if (!chunk) chunk = std::max<size_t>(count, 1);
  size_t first = 0;
  do {
    const size_t n = std::min(chunk, count - first);
    HVS_CHECK(ring_allreduce(g, dst + first * elem, dst + first * elem, n, elem, fn));
    first += n;
  } while (first < count);
  return Status();
}

// With `cma` the shared-memory phases read the peers' buffers in place (a few steps,
// not one per segment-sized piece: on a loaded machine each step waits for the peer
// to be scheduled); a group where that does not work stages through the segment.
// The choice is the group's own: it changes nothing on the wire.
Status Context::hier_allreduce(const void* src, void* dst, size_t count, size_t elem, ReduceFn fn,
                               bool cma, size_t chunk) {
  char* out = static_cast<char*>(dst);
  const bool leader = locals_.front() == opt_.rank;
  bool used = false;
  if (shm_ && cma && chunk && count > chunk) {
    std::unique_ptr<ChunkWorker> ring;
    if (leader) {
      TcpGroup g = tcp_group(leaders_);
      ring.reset(new ChunkWorker([this, g, out, elem, fn](size_t first, size_t n) mutable {
        char* at = out + first * elem;
        return ring_allreduce(g, at, at, n, elem, fn);
      }));
    }
    CrossHost cross{[&](size_t first, size_t n) { ring->submit(first, n); },
                    [&](size_t, size_t) { return ring->wait(); }};
    HVS_CHECK(shm_hier_allreduce_cma(*shm_, src, dst, count, elem, fn, chunk, cross, &used));
    if (used) {
      ++stats_.pipelined_ops;  // every chunk's ring has finished: the thread writes nothing more
      return Status();
    }
    cma = false;  // the group's verdict: it stages
  }
  if (shm_ && cma) HVS_CHECK(shm_allreduce_cma(*shm_, src, dst, count, elem, fn, opt_.cma_chunk, &used));
  if (shm_ && !used)
    HVS_CHECK(shm_allreduce(*shm_, src, dst, count, elem, fn, 0, opt_.small_bytes));
  else if (!shm_ && dst != src && count)
    std::memmove(dst, src, count * elem);
  if (leader) HVS_CHECK(leaders_ring(out, count, elem, fn, chunk));
  if (!shm_) return Status();
  used = false;
  if (cma) HVS_CHECK(shm_broadcast_cma(*shm_, out, count * elem, 0, &used));
  if (!used) HVS_CHECK(shm_broadcast(*shm_, {Span{out, count * elem}}, 0));
  return Status();
}

}  // namespace hvs
