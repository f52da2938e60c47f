// Chain broadcast, pairwise alltoall and the dissemination barrier over TCP.
//
// Broadcast: member 0 (the root) sends the buffer in chunks to member 1,
// which forwards each chunk to member 2 as soon as it has it, and so on: a
// pipelined chain, one link per member, bandwidth of one link.
// Alltoall: P - 1 steps; at step s member me sends to me + s and receives
// from me - s at once, so every pair exchanges exactly once and no member
// waits on two peers at the same time.
// Barrier: ceil(log2 P) rounds of one byte each way.
#include <algorithm>

#include "collectives.h"

namespace hvs {

namespace {
int mod(int a, int p) { return ((a % p) + p) % p; }
}  // namespace

Status chain_broadcast(TcpGroup& g, char* buf, size_t len) {
  const int p = g.size(), me = g.me;
  if (p == 1 || len == 0) return Status();
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  for (size_t off = 0; off < len; off += g.chunk) {
    size_t n = std::min(g.chunk, len - off);
    if (me > 0) recvs.push_back({buf + off, n, nullptr, nullptr});
    if (me < p - 1) sends.push_back({buf + off, n, me > 0 ? static_cast<long>(recvs.size()) - 1 : -1});
  }
  TransferOptions opt{g.timeout_ns};
  HVS_CHECK(transfer(me < p - 1 ? g.link(me + 1) : nullptr, sends, me > 0 ? g.link(me - 1) : nullptr,
                     recvs, opt));
  return Status();
}

Status pairwise_alltoall(TcpGroup& g, const std::vector<Span>& send, const std::vector<Span>& recv) {
  const int p = g.size(), me = g.me;
  TransferOptions opt{g.timeout_ns};
  for (int s = 1; s < p; ++s) {
    int to = mod(me + s, p), from = mod(me - s, p);
    std::vector<SendItem> sends;
    std::vector<RecvItem> recvs;
    if (send[to].ptr && send[to].len) sends.push_back({send[to].ptr, send[to].len, -1});
    if (recv[from].ptr && recv[from].len) recvs.push_back({recv[from].ptr, recv[from].len, nullptr, nullptr});
    if (sends.empty() && recvs.empty()) continue;
    HVS_CHECK(transfer(g.link(to), sends, g.link(from), recvs, opt));
  }
  return Status();
}

Status tcp_barrier(TcpGroup& g) {
  const int p = g.size(), me = g.me;
  char out = 1, in = 0;
  TransferOptions opt{g.timeout_ns};
  for (int dist = 1; dist < p; dist *= 2) {
    std::vector<SendItem> sends{{&out, 1, -1}};
    std::vector<RecvItem> recvs{{&in, 1, nullptr, nullptr}};
    HVS_CHECK(transfer(g.link(mod(me + dist, p)), sends, g.link(mod(me - dist, p)), recvs, opt));
  }
  return Status();
}

}  // namespace hvs
