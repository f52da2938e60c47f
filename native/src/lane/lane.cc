// The lane (lane.h): the engine's steady-state cycle for one armed op, in C++.
#include "lane/lane.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "clock.h"

namespace hvs {

namespace {

constexpr int32_t kData = 1 + (1 << 16);  // collectives.fusion.coordinator.DATA

// As numpy's multiply by a scalar of the array's own type (the engine's postscale):
// float16 rounds the factor to float16, multiplies in float (exact for two halves)
// and rounds the product back, as numpy's half loop does.
template <typename T, typename Compute = T>
void scale(void* buf, size_t count, double factor) {
  const Compute f = static_cast<Compute>(static_cast<T>(factor));
  T* p = static_cast<T*>(buf);
  for (size_t i = 0; i < count; ++i) p[i] = static_cast<T>(static_cast<Compute>(p[i]) * f);
}

// The engine's postscale of a result, in the dtypes arm() accepts one for.
void postscale(DType dt, void* out, size_t count, double factor) {
  if (factor == 1.0) return;
  if (dt == DType::kFloat32) scale<float>(out, count, factor);
  else if (dt == DType::kFloat64) scale<double>(out, count, factor);
  else if (dt == DType::kFloat16) scale<_Float16, float>(out, count, factor);
}

}  // namespace

bool CycleLock::try_acquire() {
  std::lock_guard<std::mutex> g(m_);
  if (held_) return false;
  held_ = true;
  return true;
}

bool CycleLock::acquire(double timeout_s) {
  std::unique_lock<std::mutex> g(m_);
  if (timeout_s < 0) {
    cv_.wait(g, [this] { return !held_; });
  } else if (!cv_.wait_for(g, std::chrono::duration<double>(timeout_s), [this] { return !held_; })) {
    return false;
  }
  held_ = true;
  return true;
}

void CycleLock::release() {
  {
    std::lock_guard<std::mutex> g(m_);
    held_ = false;
  }
  cv_.notify_one();
}

bool CycleLock::locked() {
  std::lock_guard<std::mutex> g(m_);
  return held_;
}

Lane::Lane(Context* ctx, int rank, int size) : ctx_(ctx), rank_(rank), size_(size) {}

void Lane::arm(int slot, int bit, size_t count, DType dt, double postscale, int64_t generation) {
  std::lock_guard<std::mutex> g(slots_mu_);
  if (slot < 0) return;
  if (postscale != 1.0 && dt != DType::kFloat16 && dt != DType::kFloat32 && dt != DType::kFloat64)
    return;  // the dtypes scale() handles
  if (static_cast<size_t>(slot) >= slots_.size()) slots_.resize(slot + 1);
  Slot& s = slots_[slot];
  s.armed = false;
  if (size_ > 1 && (generation != generation_ || bit < 0 || static_cast<size_t>(bit) >= bit_epoch_.size()))
    return;  // the cache changed since the engine read the bit: the next run falls back again
  s.armed = true, s.bit = bit, s.count = count, s.dtype = dt, s.postscale = postscale;
  s.epoch = size_ > 1 ? bit_epoch_[bit] : 0;
}

void Lane::set_cache(int64_t nbits, int64_t generation, const std::vector<int>& changed) {
  std::lock_guard<std::mutex> g(slots_mu_);
  if (nbits > static_cast<int64_t>(bit_epoch_.size())) bit_epoch_.resize(nbits, 0);
  for (int bit : changed)
    if (bit >= 0 && static_cast<size_t>(bit) < bit_epoch_.size()) ++bit_epoch_[bit];
  nbits_ = nbits, generation_ = generation;
}

void Lane::close(double timeout_s) {
  enabled_.store(false);
  bool got = lock.acquire(timeout_s);
  ctx_ = nullptr;
  if (got) lock.release();
}

std::vector<std::pair<uint64_t, int>> Lane::take_uses() {
  std::lock_guard<std::mutex> g(slots_mu_);
  std::vector<std::pair<uint64_t, int>> out;
  if (size_ == 1) {  // a world of one has no cache to keep in step
    used_.clear();
    return out;
  }
  std::sort(used_.begin(), used_.end());
  used_.erase(std::unique(used_.begin(), used_.end()), used_.end());
  for (int slot : used_) {
    const Slot& s = slots_[slot];
    if (s.armed && s.epoch == bit_epoch_[s.bit]) out.emplace_back(s.last_use, s.bit);
  }
  used_.clear();
  std::sort(out.begin(), out.end());
  return out;
}

bool Lane::usable(int slot, size_t bytes, Slot* out) {
  std::lock_guard<std::mutex> g(slots_mu_);
  return usable_locked(slot, bytes, out);
}

int Lane::fail(Status st) {
  error_ = std::move(st);
  lock.release();
  return kLaneError;
}

int Lane::run(int slot, const void* in, void* out, size_t bytes) {
  if (!enabled_.load()) return kLaneFallback;
  lock.acquire();
  Context* ctx = ctx_;
  Slot s;
  if (ctx == nullptr || !enabled_.load() || !usable(slot, bytes, &s) || queued() > 0) {
    // (async ops queued: their cycle must carry them too, which the engine's does)
    lock.release();
    return kLaneFallback;
  }
  if (size_ > 1) {
    const size_t base = 1 + 3 * static_cast<size_t>(size_);
    const size_t n = base + static_cast<size_t>(nbits_);
    vec_.assign(n, 0);
    vec_[base + s.bit] = kData;
    Status st = ctx->fail(ctx->allreduce(vec_.data(), vec_.data(), n, DType::kInt32, ReduceOp::kSum,
                                         /*control=*/true));
    if (!st.ok()) return fail(std::move(st));
    synced_ns_.store(now_ns());
    for (size_t i = 0; i < n; ++i)  // every rank contributed exactly our vector?
      if (vec_[i] != (i == base + s.bit ? kData * size_ : 0)) return kLaneHandover;  // the engine's
  } else {
    synced_ns_.store(now_ns());
  }
  const uint64_t t0 = now_ns();
  Status st = ctx->fail(ctx->allreduce(in, out, s.count, s.dtype, ReduceOp::kSum));
  if (!st.ok()) return fail(std::move(st));
  postscale(s.dtype, out, s.count, s.postscale);
  collective_ns_ += now_ns() - t0;
  cycles_ += 1;
  tensors_ += 1;
  bytes_ += bytes;
  {
    std::lock_guard<std::mutex> g(slots_mu_);
    slots_[slot].last_use = ++uses_;
    used_.push_back(slot);
  }
  lock.release();
  return kLaneDone;
}

bool Lane::usable_locked(int slot, size_t bytes, Slot* out) {
  if (slot < 0 || static_cast<size_t>(slot) >= slots_.size()) return false;
  const Slot& s = slots_[slot];
  if (!s.armed || (size_ > 1 && (s.bit < 0 || s.bit >= nbits_ || s.epoch != bit_epoch_[s.bit])) ||
      s.count * itemsize(s.dtype) != bytes)
    return false;
  if (out) *out = s;
  return true;
}

int64_t Lane::enqueue(int slot, const void* in, void* out, size_t bytes) {
  if (!enabled_.load() || bytes == 0) return -1;
  std::lock_guard<std::mutex> g(slots_mu_);
  if (!usable_locked(slot, bytes, nullptr)) return -1;
  for (const Entry& e : queue_)
    if (e.slot == slot) return -1;  // one op per name at a time, as the engine's
  queue_.push_back(Entry{next_ticket_, slot, in, out, bytes});
  return next_ticket_++;
}

bool Lane::armed(int slot, size_t bytes) {
  std::lock_guard<std::mutex> g(slots_mu_);
  return usable_locked(slot, bytes, nullptr);
}

size_t Lane::queued() {
  std::lock_guard<std::mutex> g(slots_mu_);
  return queue_.size();
}

bool Lane::done(int64_t ticket) {
  std::lock_guard<std::mutex> g(slots_mu_);
  auto it = std::find(finished_.begin(), finished_.end(), ticket);
  if (it == finished_.end()) return false;
  finished_.erase(it);
  return true;
}

std::vector<int64_t> Lane::take_queue() {
  std::lock_guard<std::mutex> g(slots_mu_);
  std::vector<int64_t> out;
  for (const Entry& e : queue_) out.push_back(e.ticket);
  queue_.clear();
  return out;
}

int Lane::batch_cycle(bool* progress) {
  Context* ctx = ctx_;
  struct Armed {
    Entry e;
    Slot s;
  };
  std::vector<Armed> mine;  // the queue as this cycle contributes it
  {
    std::lock_guard<std::mutex> g(slots_mu_);
    for (const Entry& e : queue_) {
      Slot s;
      if (!usable_locked(e.slot, e.bytes, &s)) return kLaneFallback;
      mine.push_back(Armed{e, s});
    }
  }
  const size_t base = 1 + 3 * static_cast<size_t>(size_);
  std::vector<Armed*> ready;
  if (size_ > 1) {
    const size_t n = base + static_cast<size_t>(nbits_);
    vec_.assign(n, 0);
    for (const Armed& a : mine) vec_[base + a.s.bit] = kData;
    Status st = ctx->fail(ctx->allreduce(vec_.data(), vec_.data(), n, DType::kInt32, ReduceOp::kSum,
                                         /*control=*/true));
    if (!st.ok()) return fail(std::move(st));
    synced_ns_.store(now_ns());
    for (size_t i = 0; i < base; ++i)
      if (vec_[i] != 0) return kLaneHandover;  // a stall report, a join, a shutdown, a negotiation
    for (size_t i = base; i < n; ++i)  // nothing but whole ranks' DATA (no JOINED)
      if (vec_[i] % kData != 0 || vec_[i] / kData > size_) return kLaneHandover;
    for (Armed& a : mine)
      if (vec_[base + a.s.bit] == kData * size_) ready.push_back(&a);
  } else {
    synced_ns_.store(now_ns());
    for (Armed& a : mine) ready.push_back(&a);
  }
  std::sort(ready.begin(), ready.end(), [](const Armed* x, const Armed* y) { return x->s.bit < y->s.bit; });
  // The executor's groups: per dtype in order of first appearance, cut at the threshold.
  std::vector<DType> order;
  for (const Armed* a : ready)
    if (std::find(order.begin(), order.end(), a->s.dtype) == order.end()) order.push_back(a->s.dtype);
  const uint64_t t0 = now_ns();
  for (DType dt : order) {
    const size_t elem = itemsize(dt);
    std::vector<std::vector<Armed*>> groups;
    size_t group_bytes = 0;
    for (Armed* a : ready) {
      if (a->s.dtype != dt) continue;
      const size_t nbytes = a->s.count * elem;
      if (groups.empty() || group_bytes + nbytes > threshold_) groups.emplace_back(), group_bytes = 0;
      groups.back().push_back(a);
      group_bytes += nbytes;
    }
    for (auto& group : groups) {
      if (group.size() == 1) {
        Armed* a = group[0];
        Status st = ctx->fail(ctx->allreduce(a->e.in, a->e.out, a->s.count, dt, ReduceOp::kSum));
        if (!st.ok()) return fail(std::move(st));
        postscale(dt, a->e.out, a->s.count, a->s.postscale);
        continue;
      }
      size_t total = 0;
      for (Armed* a : group) total += a->s.count;
      if (fused_.size() < total * elem) fused_.resize(total * elem);
      size_t off = 0;
      for (Armed* a : group) {
        std::memcpy(fused_.data() + off, a->e.in, a->e.bytes);
        off += a->e.bytes;
      }
      Status st = ctx->fail(ctx->allreduce(fused_.data(), fused_.data(), total, dt, ReduceOp::kSum));
      if (!st.ok()) return fail(std::move(st));
      off = 0;
      for (Armed* a : group) {
        std::memcpy(a->e.out, fused_.data() + off, a->e.bytes);
        off += a->e.bytes;
        postscale(dt, a->e.out, a->s.count, a->s.postscale);
      }
    }
  }
  collective_ns_ += now_ns() - t0;
  if (!ready.empty()) {
    std::lock_guard<std::mutex> g(slots_mu_);
    for (Armed* a : ready) {  // in the executor's order: the cache's LRU order as Python's cycle
      slots_[a->e.slot].last_use = ++uses_;
      used_.push_back(a->e.slot);
      finished_.push_back(a->e.ticket);
      bytes_ += a->e.bytes;
      queue_.erase(std::find_if(queue_.begin(), queue_.end(),
                                [a](const Entry& e) { return e.ticket == a->e.ticket; }));
    }
    cycles_ += 1;
    tensors_ += ready.size();
    *progress = true;
  }
  return kLaneDone;
}

int Lane::wait(int64_t ticket, double budget_s) {
  const uint64_t budget_ns = static_cast<uint64_t>(std::max(0.0, budget_s) * 1e9);
  uint64_t since = now_ns();
  for (;;) {
    if (done(ticket)) return kLaneDone;
    lock.acquire();
    if (done(ticket)) {  // another waiter's cycle ran it
      lock.release();
      return kLaneDone;
    }
    bool queued_here = false;
    {
      std::lock_guard<std::mutex> g(slots_mu_);
      for (const Entry& e : queue_) queued_here = queued_here || e.ticket == ticket;
    }
    if (!queued_here || ctx_ == nullptr || !enabled_.load()) {  // taken by the engine, or off
      lock.release();
      return kLaneFallback;
    }
    bool progress = false;
    const int code = batch_cycle(&progress);
    if (code == kLaneHandover) return code;  // lock held
    if (code == kLaneError) return code;     // fail() released it
    lock.release();
    if (code == kLaneFallback) return code;
    if (progress) since = now_ns();
    else if (now_ns() - since > budget_ns) return kLaneFallback;
  }
}

}  // namespace hvs

extern "C" int hvs_lane_run(void* lane, int slot, const void* in, void* out, int64_t bytes) {
  return static_cast<hvs::Lane*>(lane)->run(slot, in, out, static_cast<size_t>(bytes));
}
