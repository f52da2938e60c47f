// Recursive doubling allreduce over TCP, for small buffers.
//
// Terms: n members; p, the largest power of two <= n.  A *fold* member is one at index
// i >= p: it first sends its buffer to its *twin*, member i - p, which reduces it into
// its own, and at the end receives the result back from it.  Members below p then run
// log2 p *rounds*: in round k member i exchanges its buffer with its *partner* i ^ 2^k,
// and both reduce the other's into their own (sending a copy, so the reduce never writes
// what is still going out).  After the last round every member below p holds the
// reduction of all n.  A pair combines the same two values in both places (x op y and
// y op x: the same bits for the commutative ops), so every member ends with the same
// bits.  log2 p rounds (+2 where n is no power of two) of the whole buffer, where the
// ring takes 2(n - 1) steps of 1/n of it: fewer hops, more bytes, which is the better
// trade below a few KiB (the fusion engine's negotiation and cycle vectors).
// The links it needs are in the mesh's plan (collectives/rendezvous/plan.py).
#include <cstring>

#include "collectives.h"

namespace hvs {

Status rd_allreduce(TcpGroup& g, char* buf, char* copy, size_t count, size_t elem,
                    ReduceFn fn) {
  const int n = g.size(), me = g.me;
  if (n == 1) return Status();
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const size_t bytes = count * elem;
  if (g.staging->size() < bytes) g.staging->resize(bytes);
  TransferOptions one_way = group_options(g, true);  // data one way: headers both ways
  TransferOptions both = group_options(g, false);    // data both ways carries the headers
  for (TransferOptions* o : {&one_way, &both}) o->fn = fn, o->elem = elem, o->staging = g.staging->data();
  std::vector<SendItem> whole;
  if (bytes) whole.push_back({buf, bytes, -1});
  std::vector<RecvItem> none, land, reduce;
  if (bytes) land.push_back({buf, bytes, nullptr, nullptr});
  if (bytes) reduce.push_back({nullptr, bytes, buf, buf});  // buf = buf op received
  if (me >= p) {  // a fold member: in to the twin, and the result back
    HVS_CHECK(transfer(g.link(me - p), whole, nullptr, none, one_way));
    return transfer(nullptr, {}, g.link(me - p), land, one_way);
  }
  if (me + p < n) HVS_CHECK(transfer(nullptr, {}, g.link(me + p), reduce, one_way));
  std::vector<SendItem> from_copy;
  std::vector<RecvItem> into_buf;
  if (bytes) from_copy.push_back({copy, bytes, -1});
  if (bytes) into_buf.push_back({nullptr, bytes, buf, copy});  // buf = copy op received
  for (int k = 1; k < p; k *= 2) {
    if (bytes) std::memcpy(copy, buf, bytes);
    Link* partner = g.link(me ^ k);
    HVS_CHECK(transfer(partner, from_copy, partner, into_buf, both));
  }
  if (me + p < n) HVS_CHECK(transfer(g.link(me + p), whole, nullptr, none, one_way));
  return Status();
}

}  // namespace hvs
