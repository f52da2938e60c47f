// Agreement over TCP: every op tells its peers what it is before any payload.
//
// Terms (used by transfer.h and every TCP algorithm; tags: mac.h):
//   seq      this rank's number for the op: every Context op counts, even one
//            that moves nothing, so ranks that agree have the same seq
//   header   a Wire naming the sender's op (its OpTag) and seq.  It
//            is the first thing of every send stream of an op on a link, sent
//            with the first chunk (one sendmsg); the receiver compares it with
//            its own op before it reads, reduces or forwards any payload
//   both ways  for ops whose data moves one way along a link (chain broadcast,
//            a ring of 3 or more), each end also sends a header back, so both
//            ends of every link of the op check each other.  (In alltoall
//            every pair talks both ways anyway; its headers carry the counts
//            of both directions of their link.)
//   notice   a Wire saying "ranks a and b disagree" (their ops and seqs).  A
//            rank that failed with a mismatch (found here, told by a notice,
//            or found in shared memory) sends one on every link it has not yet
//            sent on in this op, or whose stream it has finished: there the
//            peer reads it where it expects a header (in this op or its
//            next), or while it waits on other links (watching them)
//   watch    links this transfer does not read: a notice there fails the
//            transfer; a header there from this op with another op's tag, or
//            from an op this rank has finished, is a mismatch too; any other
//            header belongs to a later step or op and is left in the socket
// So every rank that exchanges with a disagreeing rank fails in that op, and
// so does every rank still waiting in it; a rank whose part of the op did not
// depend on the disagreeing ranks (in alltoall, ranks whose own pairs agree)
// may finish, and fails at its next op.  The errors read like those of
// shared memory: "ranks disagree: this rank is in allreduce sum of 1024
// float32, the peer in allreduce sum of 15 int32".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../op.h"
#include "hvs/status.h"
#include "mac.h"
#include "transfer.h"

namespace hvs {

// How a tag's counts read: an alltoall tag holds what moves on one link, as
// its sender sees it, or (expects) as its receiver does.
struct Role {
  bool link_counts = false;
  bool expects = false;
};

struct Wire {
  enum Magic : uint32_t { kHeader = 0x48565348u, kNotice = 0x48565321u };  // "HSVH", "!SVH"
  // kForged: a notice that rank_a found a frame from rank_b changed on the way, not a mismatch
  enum Flags : uint32_t { kALinkCounts = 1, kAExpects = 2, kBLinkCounts = 4, kBExpects = 8, kBUnknown = 16,
                          kForged = 32 };
  uint32_t magic = 0;
  uint32_t flags = 0;  // the Roles of a and b; kBUnknown: b's op is not known
  uint64_t seq_a = 0, seq_b = 0;  // header: seq_a is the sender's seq
  int32_t rank_a = -1, rank_b = -1;  // notice: the ranks that disagree (a found it)
  OpTag a, b;  // header: a is the sender's op; notice: the ops of rank_a and rank_b
  uint8_t tag[kTagBytes] = {};  // over the bytes above (mac.h); zeros on an untagged link
  Role role_a() const { return Role{(flags & kALinkCounts) != 0, (flags & kAExpects) != 0}; }
  Role role_b() const { return Role{(flags & kBLinkCounts) != 0, (flags & kBExpects) != 0}; }
};
static_assert(sizeof(Wire) == 96 + kTagBytes, "a Wire has one size on every rank");

struct Agreement {  // what every transfer of one op checks
  OpTag tag;         // the op this rank is in
  uint64_t seq = 0;  // its number (see above)
  int rank = -1;     // this rank (world)
  Wire found;        // the first disagreement found or told of (magic 0: none yet)
  bool sealed = false;  // the payload of each transfer carries a tag too (mac.h)
  // Payload mode (Context::confirmed): a payload whose tag fails does not stop the op here
  // (its bytes changed, not their number, so the streams stay in step); the first peer
  // whose payload failed is kept, and the op ends in a confirmation round that fails it on
  // every rank.  Off: such a payload fails the op where it is read.
  bool confirm = false;
  int tainted = -1;
};

// Tags `w` as the next frame this rank sends on `l` (nothing on an untagged link).
void seal(Link& l, Wire& w);

// Checks the tag of `w`, the next frame from `l`'s peer; `take` counts it
// taken (a peek leaves it for the read that follows).
Status check_tag(Link& l, const Wire& w, bool take);

// The error of a frame whose tag does not hold.
Status forged(int peer, const char* what);

Wire make_header(const OpTag& tag, uint64_t seq, Role role);

// `in` was read where a header from `peer` is due; this rank expects `want`
// there (`mine` says how its count reads).  A mismatch or a notice fills
// ag.found and fails kMismatch.
Status check_header(const Wire& in, const OpTag& want, Role mine, Agreement& ag, int peer);

// `in` was peeked on a watched link from `peer`.  Fails on a notice or a
// contradicting header; otherwise *keep says whether to go on watching it.
Status check_watched(const Wire& in, bool link_counts, Agreement& ag, int peer, bool* keep);

// The notice a rank that failed with `st` (kMismatch, or kIntegrity: a forged notice) sends
// its peers.
Wire make_notice(const Agreement& ag, const Status& st);

// Sends `notice` on every link that is not inside a send stream, for at
// most `budget_ns`; a link that cannot take it in time is left.
void send_notices(std::vector<Link>& links, const Wire& notice, uint64_t budget_ns);

}  // namespace hvs
