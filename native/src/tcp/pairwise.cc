// Chain broadcast, pairwise alltoall and the dissemination barrier over TCP.
//
// Broadcast: member 0 (the root) sends the buffer in chunks to member 1,
// which forwards each chunk to member 2 as soon as it has it, and so on: a
// pipelined chain, one link per member, bandwidth of one link.  The headers
// back (header.h) are passed up the chain: a member sends its own once it
// has checked both neighbours' (the last one at once), so the root's return
// means every member agreed.
// Alltoall: P - 1 steps; at step s member me sends to me + s and receives
// from me - s at once, so every pair exchanges exactly once and no member
// waits on two peers at the same time.
// Barrier: ceil(log2 P) rounds; the op header is the whole message.
#include <algorithm>

#include "collectives.h"

namespace hvs {

namespace {
int mod(int a, int p) { return ((a % p) + p) % p; }
}  // namespace

Status chain_broadcast(TcpGroup& g, char* buf, size_t len) {
  const int p = g.size(), me = g.me;
  if (p == 1) return Status();
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  for (size_t off = 0; off < len; off += g.chunk) {
    size_t n = std::min(g.chunk, len - off);
    if (me > 0) recvs.push_back({buf + off, n, nullptr, nullptr});
    if (me < p - 1) sends.push_back({buf + off, n, me > 0 ? static_cast<long>(recvs.size()) - 1 : -1});
  }
  TransferOptions opt = group_options(g, true);
  opt.chain_ack = true;  // the root returns once every member has checked its neighbours
  HVS_CHECK(transfer(me < p - 1 ? g.link(me + 1) : nullptr, sends, me > 0 ? g.link(me - 1) : nullptr,
                     recvs, opt));
  return Status();
}

Status pairwise_alltoall(TcpGroup& g, const std::vector<Span>& send, const std::vector<Span>& recv,
                         const std::vector<bool>& remote, size_t elem) {
  const int p = g.size(), me = g.me;
  TransferOptions opt = group_options(g, false);
  // Per link: what the sender sends and expects back; what the receiver
  // expects and sends back.  Equal tags: both directions agree.
  OpTag out = g.agree->tag, in = g.agree->tag;
  opt.send_tag = &out, opt.recv_tag = &in, opt.link_counts = true;
  for (int s = 1; s < p; ++s) {
    int to = mod(me + s, p), from = mod(me - s, p);
    if (!remote[to] && !remote[from]) continue;
    std::vector<SendItem> sends;
    std::vector<RecvItem> recvs;
    if (remote[to] && send[to].len) sends.push_back({send[to].ptr, send[to].len, -1});
    if (remote[from] && recv[from].len) recvs.push_back({recv[from].ptr, recv[from].len, nullptr, nullptr});
    out.count = send[to].len / elem, out.digest = recv[to].len / elem;
    in.count = recv[from].len / elem, in.digest = send[from].len / elem;
    HVS_CHECK(transfer(remote[to] ? g.link(to) : nullptr, sends, remote[from] ? g.link(from) : nullptr,
                       recvs, opt));
  }
  return Status();
}

Status tcp_barrier(TcpGroup& g) {
  const int p = g.size(), me = g.me;
  const std::vector<SendItem> sends;
  const std::vector<RecvItem> recvs;
  for (int dist = 1; dist < p; dist *= 2)
    HVS_CHECK(transfer(g.link(mod(me + dist, p)), sends, g.link(mod(me - dist, p)), recvs,
                       group_options(g, false)));
  return Status();
}

}  // namespace hvs
