// Composition of shm and TCP collectives by topology; see context.h.
#include "context.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "clock.h"

namespace hvs {

namespace {
std::vector<size_t> byte_offsets(const std::vector<size_t>& counts, size_t elem) {
  std::vector<size_t> off(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i] * elem;
  return off;
}

int index_of(const std::vector<int>& v, int x) {
  return static_cast<int>(std::find(v.begin(), v.end(), x) - v.begin());
}

bool is_member(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

constexpr uint64_t kNoticeBudgetNs = 2000000000ull;  // a failing rank waits at most this for slow sockets
}  // namespace

Context::Context(ContextOptions opt, std::vector<int> fds, std::unique_ptr<Segment> seg,
                 const std::vector<std::string>& keys)
    : opt_(std::move(opt)) {
  agree_.rank = opt_.rank;
  links_.resize(opt_.size);
  for (int r = 0; r < opt_.size; ++r) {
    links_[r] = Link{r < static_cast<int>(fds.size()) ? fds[r] : -1, r, false};
    links_[r].me = opt_.rank;
    if (r < static_cast<int>(keys.size()) && !keys[r].empty()) links_[r].key = std::make_shared<MacKey>(keys[r]);
    if (links_[r].fd >= 0) (void)make_nonblocking(links_[r].fd);
  }
  std::vector<int> seen_hosts;
  for (int r = 0; r < opt_.size; ++r) {
    if (opt_.hosts[r] == opt_.hosts[opt_.rank]) locals_.push_back(r);
    if (std::find(seen_hosts.begin(), seen_hosts.end(), opt_.hosts[r]) == seen_hosts.end()) {
      seen_hosts.push_back(opt_.hosts[r]);
      leaders_.push_back(r);
    }
  }
  if (leaders_.size() == 1) leaders_.clear();
  if (seg && locals_.size() > 1) {
    std::vector<pid_t> pids;
    for (int r : locals_) pids.push_back(opt_.pids[r]);
    WaitPolicy policy{opt_.spin_ns, opt_.yield_ns, seconds_to_ns(opt_.timeout_s)};
    shm_.reset(new ShmGroup(std::move(seg), index_of(locals_, opt_.rank), locals_, std::move(pids),
                            policy, opt_.shm_chunk));
    shm_->want_cma(opt_.cma);
  }
}

Status Context::add_link(int peer, int fd, const std::string& key) {
  Link& l = links_[peer];
  if (l.fd >= 0) return HVS_ERROR(Code::kInvalid, "a link to that peer exists already", peer);
  l = Link{fd, peer, false};
  l.me = opt_.rank;
  if (!key.empty()) l.key = std::make_shared<MacKey>(key);
  return make_nonblocking(fd);
}

Status Context::check_usable() {
  ++agree_.seq;
  agree_.tag = OpTag();
  agree_.sealed = opt_.seal_payload;
  agree_.confirm = opt_.seal_payload && !confirming_ && !leaders_.empty();
  agree_.tainted = -1;
  if (failed_ != Code::kOk)
    return HVS_ERROR(failed_, "the communicator is unusable after an earlier error: " + failure_,
                     failed_peer_);
  if (locals_.size() > 1 && !shm_)
    return HVS_ERROR(Code::kInvalid, "ranks share a host but no shared memory segment was given");
  return Status();
}

Status Context::fail(Status st) {
  if (!st.ok() && failed_ == Code::kOk && st.code() != Code::kInvalid && st.code() != Code::kNotSupported) {
    failed_ = st.code();
    failure_ = st.what();
    failed_peer_ = st.peer();
    if (shm_) shm_->mark_aborted(st.code());
    // peers waiting for our header get this instead: a mismatch, or a forged frame found
    // here (one that every rank learnt in a confirmation round is no news)
    const bool forged_here = st.code() == Code::kIntegrity && !confirmed_failure_;
    if (st.code() == Code::kMismatch || forged_here)
      send_notices(links_, make_notice(agree_, st), std::min<uint64_t>(seconds_to_ns(opt_.timeout_s), kNoticeBudgetNs));
  }
  return st;
}

Status Context::allreduce(const void* src, void* dst, size_t count, DType dt, ReduceOp op,
                          bool control) {
  return confirmed(allreduce_op(src, dst, count, dt, op, control));
}
Status Context::allgather(const void* src, void* dst, const std::vector<size_t>& counts, DType dt,
                          bool control) {
  return confirmed(allgather_op(src, dst, counts, dt, control));
}
Status Context::broadcast(void* buf, size_t count, DType dt, int root) {
  return confirmed(broadcast_op(buf, count, dt, root));
}
Status Context::reducescatter(const void* src, void* dst, const std::vector<size_t>& counts,
                              DType dt, ReduceOp op) {
  return confirmed(reducescatter_op(src, dst, counts, dt, op));
}
Status Context::alltoall(const void* src, const std::vector<size_t>& send_counts, void* dst,
                         const std::vector<size_t>& recv_counts, DType dt) {
  return confirmed(alltoall_op(src, send_counts, dst, recv_counts, dt));
}
Status Context::barrier() { return confirmed(barrier_op()); }
// (adasum: its steps across hosts are public alltoalls and allgathers, each confirmed)

// A rank whose payload tag failed went on with the op (Agreement::confirm); now every rank
// puts in a word, rank * size + the peer whose payload failed, or "clean", and one control
// allreduce takes the least: the first finder's, on every rank.  A failed op returns as it
// is (its rank sends notices, see fail); the round's own failures are plain failures.
Status Context::confirmed(Status st) {
  if (!agree_.confirm) return st;
  const int tainted = agree_.tainted;
  if (!st.ok()) return st;
  const OpTag op = agree_.tag;
  const uint64_t seq = agree_.seq;
  constexpr int64_t kClean = INT64_MAX;
  int64_t word = tainted < 0 ? kClean : int64_t(opt_.rank) * opt_.size + tainted, least = kClean;
  confirming_ = true;
  Status round = allreduce_op(&word, &least, 1, DType::kInt64, ReduceOp::kMin, true);
  confirming_ = false;
  if (!round.ok() || least == kClean) return round;
  const int finder = static_cast<int>(least / opt_.size), sender = static_cast<int>(least % opt_.size);
  std::string who = finder == opt_.rank ? "this rank" : "rank " + std::to_string(finder);
  confirmed_failure_ = true;
  return HVS_ERROR(Code::kIntegrity,
                   "the payload rank " + std::to_string(sender) + " sent " + who + " failed its integrity "
                   "check (changed on the way) in " + op.describe() + " (its native op " + std::to_string(seq) +
                   "): no rank returns this op's result",
                   finder == opt_.rank ? sender : finder)
      .with_hint("something between the hosts is altering traffic on the job's connections; the "
                 "communicator stops here on every rank");
}

const char* Context::cma_state() const {
  if (!shm_) return "none";
  switch (shm_->cma()) {
    case ShmGroup::Cma::kOn: return "on";
    case ShmGroup::Cma::kOff: return "off";
    default: return "unknown";
  }
}

void Context::tag(const OpTag& t) {
  agree_.tag = t;
  if (!shm_) return;
  shm_->set_op(t);
  ++stats_.shm_ops;
  if (t.dtype >= 0) stats_.shm_bytes += t.count * itemsize(static_cast<DType>(t.dtype));
}

TcpGroup Context::tcp_group(const std::vector<int>& members) {
  return TcpGroup{members, index_of(members, opt_.rank), &links_, opt_.tcp_chunk,
                  seconds_to_ns(opt_.timeout_s), &staging_, &agree_, &stats_};
}

Status Context::allreduce_op(const void* src, void* dst, size_t count, DType dt, ReduceOp op,
                          bool control) {
  HVS_CHECK(check_usable());
  agree_.sealed = agree_.sealed || control;
  ReduceFn fn = reduce_fn(dt, op);
  if (!fn)
    return HVS_ERROR(Code::kNotSupported, std::string("reduce op ") + op_name(op) + " on " +
                                              dtype_name(dt) + " is not supported natively");
  const size_t elem = itemsize(dt);
  // Nothing to move.  TCP-only ranks still exchange headers (ring.cc); where
  // shared memory is in the path, the op is skipped on every rank alike.
  if (count == 0 && static_cast<int>(leaders_.size()) != opt_.size) return Status();
  if (opt_.size == 1) {
    if (dst != src) std::memmove(dst, src, count * elem);
    return Status();
  }
  // The algorithm is part of the tag: ranks that would take different ones (their
  // cma_bytes differ) fail with a MismatchError instead of reading garbage.
  const bool large = shm_ && opt_.cma_bytes && count * elem >= opt_.cma_bytes &&
                     shm_->cma() != ShmGroup::Cma::kOff;
  const bool cma = leaders_.empty() && large;
  // Between hosts the chunking is every leader's (its rings must pair): a choice of
  // sizes and options alone, never of a host's shared memory.
  const bool pipe = !leaders_.empty() && opt_.hier_chunk && count * elem >= 2 * opt_.hier_chunk;
  const size_t chunk = pipe ? std::clamp<size_t>(opt_.hier_chunk / elem, 1, 0xffffffffu) : 0;
  const bool doubling = !leaders_.empty() && !cma && !pipe && count && count * elem <= opt_.doubling_bytes;
  tag(OpTag{OpTag::kAllreduce, static_cast<int>(dt), static_cast<int>(op), -1, count,
            cma ? kCmaDigest : pipe ? kPipeDigest + chunk : doubling ? kDoublingDigest : 0});
  if (cma) {
    bool used = false;
    HVS_CHECK(shm_allreduce_cma(*shm_, src, dst, count, elem, fn, opt_.cma_chunk, &used));
    if (used) return Status();
  }
  if (leaders_.empty())
    return shm_allreduce(*shm_, src, dst, count, elem, fn, -1, opt_.small_bytes);
  return hier_allreduce(src, dst, count, elem, fn, large, chunk);
}

Status Context::allgather_op(const void* src, void* dst, const std::vector<size_t>& counts, DType dt,
                          bool control) {
  HVS_CHECK(check_usable());
  agree_.sealed = agree_.sealed || control;
  const size_t elem = itemsize(dt);
  std::vector<size_t> off = byte_offsets(counts, elem);
  char* out = static_cast<char*>(dst);
  tag(OpTag{OpTag::kAllgather, static_cast<int>(dt), -1, -1, off.back() / elem, digest_of(counts)});
  std::vector<char*> dsts;
  std::vector<size_t> bytes;
  for (int r : locals_) dsts.push_back(out + off[r]), bytes.push_back(counts[r] * elem);
  if (shm_)
    HVS_CHECK(shm_allgather(*shm_, src, dsts, bytes));
  else if (out + off[opt_.rank] != src)
    std::memmove(out + off[opt_.rank], src, counts[opt_.rank] * elem);
  if (leaders_.empty()) return Status();
  if (is_member(leaders_, opt_.rank)) {
    std::vector<std::vector<Span>> regions(leaders_.size());  // one per host, in rank order
    for (size_t h = 0; h < leaders_.size(); ++h)
      for (int r = 0; r < opt_.size; ++r)
        if (opt_.hosts[r] == opt_.hosts[leaders_[h]]) regions[h].push_back(Span{out + off[r], counts[r] * elem});
    TcpGroup g = tcp_group(leaders_);
    HVS_CHECK(ring_allgather(g, regions));
  }
  if (shm_) {
    std::vector<Span> remote;
    for (int r = 0; r < opt_.size; ++r)
      if (opt_.hosts[r] != opt_.hosts[opt_.rank]) remote.push_back(Span{out + off[r], counts[r] * elem});
    HVS_CHECK(shm_broadcast(*shm_, remote, 0));
  }
  return Status();
}

// The chain runs along the leaders' ring from the root's host's leader, so it needs only
// the ring's links (tcp/ plan: i +- 1); where the root is not that leader, its host's
// shared memory hands the leader the data first.
Status Context::broadcast_op(void* buf, size_t count, DType dt, int root) {
  HVS_CHECK(check_usable());
  if (root < 0 || root >= opt_.size)
    return HVS_ERROR(Code::kInvalid, "broadcast root " + std::to_string(root) + " is outside the world");
  Span all{static_cast<char*>(buf), count * itemsize(dt)};
  tag(OpTag{OpTag::kBroadcast, static_cast<int>(dt), -1, root, count, 0});
  const int root_host = opt_.hosts[root];
  const bool on_root_host = opt_.hosts[opt_.rank] == root_host;
  int lead = root;  // the leader of the root's host
  for (int l : leaders_)
    if (opt_.hosts[l] == root_host) lead = l;
  const bool first_here = shm_ && on_root_host && lead != root;
  if (first_here) HVS_CHECK(shm_broadcast(*shm_, {all}, index_of(locals_, root)));
  if (!leaders_.empty() && is_member(leaders_, opt_.rank)) {
    const int n = static_cast<int>(leaders_.size()), at = index_of(leaders_, lead);
    std::vector<int> chain;
    for (int i = 0; i < n; ++i) chain.push_back(leaders_[(at + i) % n]);
    TcpGroup g = tcp_group(chain);
    HVS_CHECK(chain_broadcast(g, all.ptr, all.len));
  }
  if (shm_ && !first_here)
    HVS_CHECK(shm_broadcast(*shm_, {all}, on_root_host ? index_of(locals_, root) : 0));
  return Status();
}

Status Context::reducescatter_op(const void* src, void* dst, const std::vector<size_t>& counts,
                              DType dt, ReduceOp op) {
  HVS_CHECK(check_usable());
  ReduceFn fn = reduce_fn(dt, op);
  if (!fn)
    return HVS_ERROR(Code::kNotSupported, std::string("reduce op ") + op_name(op) + " on " +
                                              dtype_name(dt) + " is not supported natively");
  const size_t elem = itemsize(dt);
  std::vector<size_t> off = byte_offsets(counts, elem);
  const char* in = static_cast<const char*>(src);
  tag(OpTag{OpTag::kReducescatter, static_cast<int>(dt), static_cast<int>(op), -1, off.back() / elem,
            digest_of(counts)});
  if (leaders_.empty() && shm_) {
    std::vector<size_t> elem_off(counts.size());
    for (size_t i = 0; i < counts.size(); ++i) elem_off[i] = off[i] / elem;
    return shm_reducescatter(*shm_, src, dst, elem_off, counts, elem, fn);
  }
  if (opt_.size == 1) {
    std::memmove(dst, in, counts[0] * elem);
    return Status();
  }
  if (static_cast<int>(leaders_.size()) == opt_.size) {  // one rank a host: a plain ring
    std::vector<size_t> lens(counts.size());
    for (size_t i = 0; i < counts.size(); ++i) lens[i] = counts[i] * elem;
    std::unique_ptr<char[]> tmp(new char[opt_.size > 2 ? off.back() : 1]);  // uninitialised
    TcpGroup g = tcp_group(leaders_);
    return ring_reducescatter(g, in, static_cast<char*>(dst), tmp.get(), off, lens, elem, fn);
  }
  // Mixed hosts: reduce everything, keep our block.  Costs a full-size temporary.
  std::unique_ptr<char[]> tmp(new char[off.back() + 1]);
  HVS_CHECK(hier_allreduce(src, tmp.get(), off.back() / elem, elem, fn));
  std::memcpy(dst, tmp.get() + off[opt_.rank], counts[opt_.rank] * elem);
  return Status();
}

Status Context::alltoall_op(const void* src, const std::vector<size_t>& send_counts, void* dst,
                         const std::vector<size_t>& recv_counts, DType dt) {
  HVS_CHECK(check_usable());
  const size_t elem = itemsize(dt);
  std::vector<size_t> soff = byte_offsets(send_counts, elem), roff = byte_offsets(recv_counts, elem);
  tag(OpTag{OpTag::kAlltoall, static_cast<int>(dt), -1, -1, 0, 0});  // sizes differ by rank
  char* in = const_cast<char*>(static_cast<const char*>(src));
  char* out = static_cast<char*>(dst);
  auto send_span = [&](int r) { return Span{in + soff[r], send_counts[r] * elem}; };
  auto recv_span = [&](int r) { return Span{out + roff[r], recv_counts[r] * elem}; };
  if (shm_) {
    std::vector<Span> send, recv;
    for (int r : locals_) send.push_back(send_span(r)), recv.push_back(recv_span(r));
    HVS_CHECK(shm_alltoall(*shm_, send, recv));
  } else {
    std::memmove(recv_span(opt_.rank).ptr, send_span(opt_.rank).ptr, send_span(opt_.rank).len);
  }
  if (leaders_.empty()) return Status();
  std::vector<Span> send(opt_.size, Span{nullptr, 0}), recv(opt_.size, Span{nullptr, 0});
  for (int r = 0; r < opt_.size; ++r)
    if (opt_.hosts[r] != opt_.hosts[opt_.rank]) send[r] = send_span(r), recv[r] = recv_span(r);
  std::vector<int> everyone(opt_.size);
  std::iota(everyone.begin(), everyone.end(), 0);
  std::vector<bool> remote(opt_.size);
  for (int r = 0; r < opt_.size; ++r) remote[r] = opt_.hosts[r] != opt_.hosts[opt_.rank];
  TcpGroup g = tcp_group(everyone);
  HVS_CHECK(pairwise_alltoall(g, send, recv, remote, elem));
  return Status();
}

Status Context::barrier_op() {
  HVS_CHECK(check_usable());
  tag(OpTag{OpTag::kBarrier, -1, -1, -1, 0, 0});
  if (shm_) HVS_CHECK(shm_barrier(*shm_));
  if (leaders_.empty()) return Status();
  if (is_member(leaders_, opt_.rank)) {
    TcpGroup g = tcp_group(leaders_);
    HVS_CHECK(tcp_barrier(g));
  }
  if (shm_) HVS_CHECK(shm_barrier(*shm_));
  return Status();
}

}  // namespace hvs
