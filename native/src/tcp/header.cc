// Op headers, their checks and mismatch notices; see header.h.
#include "header.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "../clock.h"
#include "hvs/types.h"

namespace hvs {

namespace {
const char* kHint = "every rank must call the same collectives in the same order, with the same sizes";

// An op as the error names it.  A per-link alltoall tag holds what moves on
// one link: count is what the rank sends there and digest what it expects
// back, or the other way round when it `expects` (see pairwise.cc).
std::string op_text(const OpTag& t, Role role) {
  if (t.kind != OpTag::kAlltoall) return t.describe();
  std::string dt = dtype_name(static_cast<DType>(t.dtype));
  if (!role.link_counts) return "alltoall of " + dt;
  return std::string("alltoall ") + (role.expects ? "expecting " : "sending ") + std::to_string(t.count) + " " +
         dt + (role.expects ? " and sending " : " and expecting ") + std::to_string(t.digest);
}

uint32_t flags_of(Role a, Role b) {
  return (a.link_counts ? Wire::kALinkCounts : 0) | (a.expects ? Wire::kAExpects : 0) |
         (b.link_counts ? Wire::kBLinkCounts : 0) | (b.expects ? Wire::kBExpects : 0);
}

std::string seq_text(uint64_t seq) { return " (its native op " + std::to_string(seq) + ")"; }

// "<a>, <b>", with the op numbers when they differ.
std::string both(const std::string& a, uint64_t seq_a, const std::string& b, uint64_t seq_b) {
  if (seq_a == seq_b) return a + ", " + b;
  return a + seq_text(seq_a) + ", " + b + seq_text(seq_b);
}

bool compatible(const OpTag& x, const OpTag& y, bool link_counts) {
  if (!link_counts) return x == y;
  return x.kind == y.kind && x.dtype == y.dtype && x.op == y.op && x.root == y.root;
}

// Fills ag.found with "this rank (in `mine`) and `peer` (in theirs.a) disagree".
Status found_here(Agreement& ag, const OpTag& mine, Role my_role, const Wire& theirs, int peer) {
  Wire& f = ag.found;
  f = Wire();
  f.magic = Wire::kNotice;
  f.flags = flags_of(my_role, theirs.role_a());
  f.seq_a = ag.seq, f.seq_b = theirs.seq_a;
  f.rank_a = ag.rank, f.rank_b = peer;
  f.a = mine, f.b = theirs.a;
  std::string what = "ranks disagree: " + both("this rank is in " + op_text(mine, my_role), ag.seq,
                                               "the peer in " + op_text(theirs.a, theirs.role_a()),
                                               theirs.seq_a);
  return HVS_ERROR(Code::kMismatch, what, peer).with_hint(kHint);
}

// A notice from `told_by`: this rank is its side b (and still in the op
// rank a found it in), or a bystander.
Status told(Agreement& ag, const Wire& n, int told_by) {
  if (n.flags & Wire::kForged)  // not a disagreement: nothing to keep for a notice of ours
    return HVS_ERROR(Code::kIntegrity,
                     "rank " + std::to_string(n.rank_a) + " found a frame from rank " +
                         std::to_string(n.rank_b) + " that failed its integrity check (in " +
                         op_text(n.a, Role()) + seq_text(n.seq_a) + "); this rank stops in " +
                         op_text(ag.tag, Role()) + seq_text(ag.seq),
                     told_by)
        .with_hint("something between the hosts is altering or inserting traffic on the job's "
                   "connections; the communicator stops here");
  ag.found = n;
  std::string a = op_text(n.a, n.role_a());
  if (n.flags & Wire::kBUnknown) {  // found in shared memory on rank a's host
    std::string what = "ranks disagree: rank " + std::to_string(n.rank_a) + " (in " + a + ") and rank " +
                       std::to_string(n.rank_b) + ", on its host; this rank is in " + op_text(ag.tag, Role());
    return HVS_ERROR(Code::kMismatch, what, told_by).with_hint("see those ranks' errors; " + std::string(kHint));
  }
  std::string b = op_text(n.b, n.role_b());
  if (n.rank_b == ag.rank && n.seq_b == ag.seq && compatible(n.b, ag.tag, n.role_b().link_counts))
    return HVS_ERROR(Code::kMismatch, "ranks disagree: " + both("this rank is in " + b, n.seq_b,
                                                                "the peer in " + a, n.seq_a),
                     n.rank_a)
        .with_hint(kHint);
  std::string what = "ranks disagree: " +
                     both("rank " + std::to_string(n.rank_a) + " is in " + a, n.seq_a,
                          "rank " + std::to_string(n.rank_b) + " in " + b, n.seq_b) +
                     "; this rank is in " + op_text(ag.tag, Role()) +
                     (n.seq_a == ag.seq ? std::string() : seq_text(ag.seq));
  return HVS_ERROR(Code::kMismatch, what, told_by)
      .with_hint("rank " + std::to_string(n.rank_a) + " found it; " + kHint);
}
}  // namespace

void seal(Link& l, Wire& w) {
  if (!l.key) return;
  Mac m;
  m.start(*l.key, 'W', l.me, l.peer, l.sent++);
  m.update(&w, offsetof(Wire, tag));
  m.finish(w.tag);
}

Status forged(int peer, const char* what) {
  return HVS_ERROR(Code::kIntegrity,
                   std::string(what) + " from the peer failed its integrity check (changed, injected, "
                   "replayed or reordered on the way)", peer)
      .with_hint("something between the two hosts is altering or inserting traffic on the job's "
                 "connections; the communicator stops here");
}

Status check_tag(Link& l, const Wire& w, bool take) {
  if (!l.key) return Status();
  Mac m;
  m.start(*l.key, 'W', l.peer, l.me, l.taken);
  m.update(&w, offsetof(Wire, tag));
  uint8_t want[kTagBytes];
  m.finish(want);
  if (!same_tag(want, w.tag)) return forged(l.peer, "an op header");
  if (take) ++l.taken;
  return Status();
}

Wire make_header(const OpTag& tag, uint64_t seq, Role role) {
  Wire w;
  w.magic = Wire::kHeader;
  w.flags = flags_of(role, Role());
  w.seq_a = seq;
  w.a = tag;
  return w;
}

Status check_header(const Wire& in, const OpTag& want, Role mine, Agreement& ag, int peer) {
  if (in.magic == Wire::kHeader) {
    if (in.seq_a == ag.seq && in.a == want) return Status();
    return found_here(ag, want, mine, in, peer);
  }
  if (in.magic == Wire::kNotice) return told(ag, in, peer);
  return HVS_ERROR(Code::kMismatch, "the bytes from the peer are not an op header: the streams are out of step",
                   peer)
      .with_hint(kHint);
}

Status check_watched(const Wire& in, bool link_counts, Agreement& ag, int peer, bool* keep) {
  *keep = false;
  if (in.magic == Wire::kNotice) return told(ag, in, peer);
  if (in.magic != Wire::kHeader || in.seq_a > ag.seq) return Status();  // a later op's
  if (in.seq_a == ag.seq && compatible(in.a, ag.tag, link_counts)) return Status();  // a later step's
  // This op, but another collective; or an op this rank finished without it.
  return found_here(ag, ag.tag, Role(), in, peer);
}

Wire make_notice(const Agreement& ag, const Status& st) {
  if (st.code() == Code::kIntegrity) {
    Wire n;
    n.magic = Wire::kNotice;
    n.flags = Wire::kForged | Wire::kBUnknown;
    n.seq_a = n.seq_b = ag.seq;
    n.rank_a = ag.rank, n.rank_b = st.peer();
    n.a = ag.tag;
    return n;
  }
  if (ag.found.magic == Wire::kNotice) return ag.found;
  Wire n;  // found outside TCP (shared memory): only this rank's side is known
  n.magic = Wire::kNotice;
  n.flags = Wire::kBUnknown;
  n.seq_a = n.seq_b = ag.seq;
  n.rank_a = ag.rank, n.rank_b = st.peer();
  n.a = ag.tag;
  return n;
}

void send_notices(std::vector<Link>& links, const Wire& notice, uint64_t budget_ns) {
  std::vector<size_t> done(links.size(), 0);
  std::vector<Wire> wires(links.size(), notice);  // each tagged for its link
  for (size_t r = 0; r < links.size(); ++r)
    if (links[r].fd >= 0 && !links[r].open) seal(links[r], wires[r]);
  const uint64_t end = now_ns() + budget_ns;
  for (;;) {
    std::vector<pollfd> waiting;
    for (size_t r = 0; r < links.size(); ++r) {
      Link& l = links[r];
      if (l.fd < 0 || l.open) continue;
      const char* bytes = reinterpret_cast<const char*>(&wires[r]);
      ssize_t n = ::send(l.fd, bytes + done[r], sizeof notice - done[r], MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) done[r] += static_cast<size_t>(n);
      bool again = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
      if (done[r] == sizeof notice || (n < 0 && !again)) {
        l.open = true;  // sent, or the peer is gone: nothing more on this link
        continue;
      }
      waiting.push_back(pollfd{l.fd, POLLOUT, 0});
    }
    uint64_t now = now_ns();
    if (waiting.empty() || now >= end) return;
    (void)::poll(waiting.data(), waiting.size(), static_cast<int>((end - now) / 1000000) + 1);
  }
}

}  // namespace hvs
