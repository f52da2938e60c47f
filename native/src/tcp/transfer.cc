// One send stream and one receive stream over TCP, overlapped, with the op
// headers of header.h in front; see transfer.h.
#include "transfer.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "../clock.h"
#include "header.h"

namespace hvs {

namespace {

constexpr int kIov = 2;  // a header goes out with the first item (more at once slows the ring)
constexpr uint64_t kGraceNs = 300000000;  // for a notice, after a lost link (see explain)

struct Stream {
  size_t item = 0;  // index of the item in progress
  size_t done = 0;  // bytes of it already moved
};

// One header of this transfer on one link, ours going out or the peer's
// coming in.  `link` is null when there is none.
struct HeaderIo {
  Link* link = nullptr;
  Wire wire;
  size_t done = 0;
  bool sealed = false;          // going out: tagged (when its first byte goes)
  const OpTag* want = nullptr;  // coming in: what this rank expects there
  Role mine;                    // coming in: how its counts read here
  bool pending() const { return link && done < sizeof(Wire); }
  void seal_once() {  // going out: tagged as the next frame on its link, once
    if (!sealed) seal(*link, wire), sealed = true;
  }
  char* at() { return reinterpret_cast<char*>(&wire) + done; }
  size_t left() const { return sizeof(Wire) - done; }
};

// The tag of one transfer's payload on one link, where the op is sealed
// (Agreement::sealed): the send stream ends in a tag over its items, hashed as
// each item is first offered (its bytes are final then: a forwarded chunk is
// offered once it has arrived and been reduced); the receive stream hashes the
// bytes as they land, before any reduce, and ends in the peer's tag.
// A tag's counter is taken when its frame starts to move (a header sealed but
// never sent, as when a rank stops at a mismatch, must not skip one).
struct Seal {
  bool on = false, started = false;
  Mac mac;
  size_t hashed = 0;            // send: items hashed so far
  uint8_t tag[kTagBytes] = {};  // send: ours, once every item is hashed; receive: the peer's
  void begin_send(Link& l) { mac.start(*l.key, 'P', l.me, l.peer, l.sent++), started = true; }
  void begin_recv(Link& l) { mac.start(*l.key, 'P', l.peer, l.me, l.taken), started = true; }
};

struct Headers {
  HeaderIo out_to, out_from;  // ours: on `to` before the payload; on `from` (both ways)
  HeaderIo in_from, in_to;    // theirs: from `from` before the payload; from `to` (both ways)
  bool pending() const { return out_to.pending() || out_from.pending() || in_from.pending() || in_to.pending(); }
};

Status lost(const char* what, int peer) {
  return HVS_ERROR(Code::kPeerLost, std::string(what) + " failed: " + std::strerror(errno), peer)
      .with_hint("did that process exit or fail?");
}

Status closed(int peer) {
  return HVS_ERROR(Code::kPeerLost, "connection closed by the peer", peer)
      .with_hint("did that process exit or fail?");
}

bool would_block() { return errno == EAGAIN || errno == EWOULDBLOCK; }

// Hands the socket our header remainder and the ready items (up to kIov
// pieces) in one sendmsg; *sent is what it took.
Status send_once(Link& to, HeaderIo& hdr, const std::vector<SendItem>& items, const Stream& s,
                 size_t recvd, Seal& seal, size_t* offered, size_t* sent) {
  iovec iov[kIov];
  int n = 0;
  *offered = *sent = 0;
  if (hdr.pending()) {
    hdr.seal_once();
    iov[n++] = iovec{hdr.at(), hdr.left()};
  }
  size_t done = s.done;
  for (size_t i = s.item; i < items.size() && n < kIov; ++i, done = 0) {
    const SendItem& it = items[i];
    if (it.dep >= 0 && static_cast<size_t>(it.dep) >= recvd) break;  // not arrived yet
    if (seal.on && i >= seal.hashed) {  // the last item is the tag (see Seal)
      if (!seal.started) seal.begin_send(to);
      if (i + 1 == items.size())
        seal.mac.finish(seal.tag);
      else
        seal.mac.update(it.ptr, it.len);
      seal.hashed = i + 1;
    }
    if (it.len > done) iov[n++] = iovec{const_cast<char*>(it.ptr) + done, it.len - done};
  }
  for (int i = 0; i < n; ++i) *offered += iov[i].iov_len;
  if (n == 0) return Status();
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = n;
  ssize_t r;
  do r = ::sendmsg(to.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  while (r < 0 && errno == EINTR);
  if (r < 0) return would_block() ? Status() : lost("send", to.peer);
  *sent = static_cast<size_t>(r);
  return Status();
}

// Moves the stream past `n` sent bytes (header first) and past empty ready items.
void advance(HeaderIo& hdr, const std::vector<SendItem>& items, Stream& s, size_t recvd, size_t n) {
  if (hdr.pending()) {
    size_t k = std::min(n, hdr.left());
    hdr.done += k, n -= k;
  }
  while (s.item < items.size()) {
    const SendItem& it = items[s.item];
    if (it.dep >= 0 && static_cast<size_t>(it.dep) >= recvd) return;
    size_t k = std::min(n, it.len - s.done);
    s.done += k, n -= k;
    if (s.done < it.len) return;
    ++s.item, s.done = 0;
  }
}

Status send_some(Link& to, HeaderIo& hdr, const std::vector<SendItem>& items, Stream& s, size_t recvd,
                 Seal& seal, size_t* moved) {
  for (;;) {
    size_t offered, sent;
    HVS_CHECK(send_once(to, hdr, items, s, recvd, seal, &offered, &sent));
    advance(hdr, items, s, recvd, sent);
    if (sent) to.open = hdr.pending() || s.item < items.size();
    *moved += sent;
    if (sent == 0 || sent < offered) return Status();  // nothing ready, or the socket is full
  }
}

// Reads the peer's header; checks it once complete.  When the first payload
// item lands in staging (a reduce), its start comes in the same recvmsg: it
// is reduced only later, in recv_some, after the check.
Status recv_header(HeaderIo& h, const TransferOptions& opt, size_t* moved, Stream* s = nullptr,
                   const RecvItem* first = nullptr, Seal* seal = nullptr) {
  if (!h.pending()) return Status();
  iovec iov[2] = {iovec{h.at(), h.left()}, iovec{nullptr, 0}};
  const bool staged = first && first->own && s->done < first->len;
  if (staged) iov[1] = iovec{opt.staging + s->done, first->len - s->done};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = staged ? 2 : 1;
  ssize_t n;
  do n = ::recvmsg(h.link->fd, &msg, MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  if (n == 0) return closed(h.link->peer);
  if (n < 0) return would_block() ? Status() : lost("recv", h.link->peer);
  size_t k = std::min(static_cast<size_t>(n), h.left());
  h.done += k;
  *moved += static_cast<size_t>(n);
  if (h.pending()) return Status();  // (payload bytes come only after a whole header)
  HVS_CHECK(check_tag(*h.link, h.wire, true));
  if (seal && seal->on) seal->begin_recv(*h.link);  // the payload's tag follows the header's
  if (staged) {
    if (seal && seal->on) seal->mac.update(opt.staging + s->done, static_cast<size_t>(n) - k);
    s->done += static_cast<size_t>(n) - k;
  }
  return check_header(h.wire, *h.want, h.mine, *opt.agree, h.link->peer);
}

Status send_header(HeaderIo& h, size_t* moved) {
  if (!h.pending()) return Status();
  h.seal_once();
  ssize_t n;
  do n = ::send(h.link->fd, h.at(), h.left(), MSG_NOSIGNAL | MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  if (n < 0) return would_block() ? Status() : lost("send", h.link->peer);
  h.done += static_cast<size_t>(n);
  if (n > 0) h.link->open = h.pending();
  *moved += static_cast<size_t>(n);
  return Status();
}

Status recv_some(Link& from, const std::vector<RecvItem>& items, Stream& s,
                 const TransferOptions& opt, Seal& seal, size_t* moved) {
  while (s.item < items.size()) {
    const RecvItem& it = items[s.item];
    char* where = it.own ? opt.staging : it.ptr;
    const bool tag_item = seal.on && s.item + 1 == items.size();
    if (s.done < it.len) {
      ssize_t n = ::recv(from.fd, where + s.done, it.len - s.done, MSG_DONTWAIT);
      if (n == 0) return closed(from.peer);
      if (n < 0) {
        if (would_block()) return Status();
        if (errno == EINTR) continue;
        return lost("recv", from.peer);
      }
      if (seal.on && !tag_item) seal.mac.update(where + s.done, static_cast<size_t>(n));
      s.done += static_cast<size_t>(n);
      *moved += static_cast<size_t>(n);
      if (s.done < it.len) continue;
    }
    if (tag_item) {
      uint8_t want[kTagBytes];
      seal.mac.finish(want);
      if (!same_tag(want, seal.tag)) {
        if (!opt.agree || !opt.agree->confirm) return forged(from.peer, "an op's payload");
        if (opt.agree->tainted < 0) opt.agree->tainted = from.peer;  // the op goes on: see header.h
      }
      ++from.taken;
    }
    if (it.own) opt.fn(it.out, it.own, opt.staging, it.len / opt.elem);
    ++s.item;
    s.done = 0;
  }
  return Status();
}

HeaderIo outgoing(Link* l, const OpTag& tag, uint64_t seq, Role role) {
  HeaderIo h;
  h.link = l, h.wire = make_header(tag, seq, role);
  return h;
}

HeaderIo incoming(Link* l, const OpTag& want, Role mine) {
  HeaderIo h;
  h.link = l, h.want = &want, h.mine = mine;
  return h;
}

// Headers go out with the data (send_tag) and back against it (recv_tag).
Headers plan(Link* to, Link* from, const TransferOptions& opt) {
  Headers h;
  if (!opt.agree) return h;
  const OpTag& st = opt.send_tag ? *opt.send_tag : opt.agree->tag;
  const OpTag& rt = opt.recv_tag ? *opt.recv_tag : opt.agree->tag;
  const Role sender{opt.link_counts, false}, receiver{opt.link_counts, true};
  const uint64_t seq = opt.agree->seq;
  if (to) h.out_to = outgoing(to, st, seq, sender);
  if (from) h.in_from = incoming(from, rt, receiver);
  if (opt.both_ways) {
    if (from && from != to) h.out_from = outgoing(from, rt, seq, receiver);
    if (to && to != from) h.in_to = incoming(to, st, sender);
  }
  return h;
}

// The group's links this transfer does not read: notices may come there.
std::vector<Link*> watch_list(Link* to, Link* from, const TransferOptions& opt) {
  std::vector<Link*> w;
  if (!opt.agree || !opt.links || !opt.members) return w;
  for (int r : *opt.members) {
    Link* l = &(*opt.links)[r];
    if (r == opt.agree->rank || l->fd < 0 || l == from || (opt.both_ways && l == to)) continue;
    w.push_back(l);
  }
  return w;
}

struct Run {
  Link* to;
  const std::vector<SendItem>& sends;
  Link* from;
  const std::vector<RecvItem>& recvs;
  const TransferOptions& opt;
  Seal& out_seal;
  Seal& in_seal;
  Stream out, in;
  Headers h;
  std::vector<Link*> watch;
  std::vector<pollfd> fds;

  bool sending() const { return out.item < sends.size() || h.out_to.pending(); }
  bool send_ready() const {
    if (h.out_to.pending()) return true;
    return out.item < sends.size() && (sends[out.item].dep < 0 || static_cast<size_t>(sends[out.item].dep) < in.item);
  }
  bool receiving() const { return in.item < recvs.size() || h.in_from.pending(); }
  bool ack_ready() const { return !opt.chain_ack || (!h.in_to.pending() && !h.in_from.pending()); }
  bool done() const { return !sending() && !receiving() && !h.pending(); }
};

Status progress(Run& r, size_t* moved) {
  if (r.ack_ready()) HVS_CHECK(send_header(r.h.out_from, moved));
  if (r.sending()) HVS_CHECK(send_some(*r.to, r.h.out_to, r.sends, r.out, r.in.item, r.out_seal, moved));
  HVS_CHECK(recv_header(r.h.in_to, r.opt, moved));
  HVS_CHECK(recv_header(r.h.in_from, r.opt, moved, &r.in, r.in.item < r.recvs.size() ? &r.recvs[r.in.item] : nullptr,
                        &r.in_seal));
  if (r.h.in_from.pending() || r.in.item >= r.recvs.size()) return Status();
  const size_t before = r.in.item;
  HVS_CHECK(recv_some(*r.from, r.recvs, r.in, r.opt, r.in_seal, moved));
  if (r.in.item != before && r.sending())  // forward at once what has just arrived
    HVS_CHECK(send_some(*r.to, r.h.out_to, r.sends, r.out, r.in.item, r.out_seal, moved));
  return Status();
}

void want(std::vector<pollfd>& fds, const Link* l, short events) {
  if (!l || !events) return;
  for (pollfd& p : fds)
    if (p.fd == l->fd) {
      p.events |= events;
      return;
    }
  fds.push_back(pollfd{l->fd, events, 0});
}

// A watched link is readable: a notice, a contradicting header, or the start
// of a later step or op (then this transfer stops watching it).
Status look(Link* l, const TransferOptions& opt, bool* keep) {
  Wire w;
  ssize_t n = ::recv(l->fd, &w, sizeof w, MSG_PEEK | MSG_DONTWAIT);
  *keep = n < 0 ? (would_block() || errno == EINTR) : n > 0 && n < static_cast<ssize_t>(sizeof w);
  if (n < static_cast<ssize_t>(sizeof w)) return Status();  // the rest is on its way; or the
  HVS_CHECK(check_tag(*l, w, false));                      // ops reading it will fail
  return check_watched(w, opt.link_counts, *opt.agree, l->peer, keep);
}

// After a poll: looks at the watched links that became readable.
Status look_all(Run& r) {
  for (size_t i = 0; i < r.watch.size();) {
    short ev = 0;
    for (const pollfd& p : r.fds)
      if (p.fd == r.watch[i]->fd) ev = p.revents;
    bool keep = true;
    if (ev & (POLLIN | POLLHUP | POLLERR)) HVS_CHECK(look(r.watch[i], r.opt, &keep));
    if (keep)
      ++i;
    else
      r.watch.erase(r.watch.begin() + static_cast<long>(i));
  }
  return Status();
}

Status wait(Run& r, uint64_t left_ns) {
  r.fds.clear();
  want(r.fds, r.to, (r.send_ready() ? POLLOUT : 0) | (r.h.in_to.pending() ? POLLIN : 0));
  want(r.fds, r.from, (r.receiving() ? POLLIN : 0) | (r.h.out_from.pending() && r.ack_ready() ? POLLOUT : 0));
  for (Link* l : r.watch) want(r.fds, l, POLLIN);
  int n = ::poll(r.fds.data(), r.fds.size(), static_cast<int>(left_ns / 1000000) + 1);
  if (n < 0 && errno != EINTR) return HVS_ERROR(Code::kSystem, std::string("poll failed: ") + std::strerror(errno));
  if (n > 0) HVS_CHECK(look_all(r));
  return Status();  // errors on the read and written sockets surface from the next send/recv
}

// A header that is still due from a link, during explain: a notice there
// is the cause; a lost link or a plain header leaves it.
Status recheck(HeaderIo& h, const TransferOptions& opt) {
  size_t moved = 0;
  Status st = recv_header(h, opt, &moved);
  if (st.code() == Code::kMismatch) return st;
  if (!st.ok()) h.link = nullptr;
  return Status();
}

// A link of this transfer is lost.  A peer that found a mismatch closes its
// links soon after telling the others (its process exits): a notice, or a
// contradicting header, that comes within a short grace where a header is
// still due or on a watched link is the cause to report.
Status explain(Run& r, Status lost) {
  const uint64_t end = now_ns() + std::min(kGraceNs, r.opt.timeout_ns);
  while (lost.code() == Code::kPeerLost) {
    r.fds.clear();
    if (r.h.in_to.pending()) want(r.fds, r.to, POLLIN);
    if (r.h.in_from.pending()) want(r.fds, r.from, POLLIN);
    for (Link* l : r.watch) want(r.fds, l, POLLIN);
    uint64_t now = now_ns();
    if (r.fds.empty() || now >= end) break;
    if (::poll(r.fds.data(), r.fds.size(), static_cast<int>((end - now) / 1000000) + 1) <= 0) continue;
    HVS_CHECK(recheck(r.h.in_to, r.opt));
    HVS_CHECK(recheck(r.h.in_from, r.opt));
    HVS_CHECK(look_all(r));
  }
  return lost;
}

// Waiting for a peer's bytes is named before a peer that does not read ours.
Status stalled(const Run& r) {
  const Link* peer = r.to;
  bool receiving = true;
  if (r.receiving())
    peer = r.from;
  else if (!r.h.in_to.pending())
    receiving = false, peer = r.h.out_from.pending() ? r.from : r.to;
  return HVS_ERROR(Code::kTimeout,
                   receiving ? "no data from the peer" : "the peer is not reading what this rank sends",
                   peer->peer)
      .with_hint("is that process alive, and in the same collective?");
}

void count_moved(TransportStats& st, const std::vector<SendItem>& sends,
           const std::vector<RecvItem>& recvs, const Agreement* agree) {
  for (const SendItem& it : sends) st.tcp_sent += it.len;
  for (const RecvItem& it : recvs) st.tcp_received += it.len;
  const uint64_t seq = agree ? agree->seq : st.last_tcp_seq + 1;
  if (seq != st.last_tcp_seq) ++st.tcp_ops, st.last_tcp_seq = seq;
}

}  // namespace

Status transfer(Link* to, const std::vector<SendItem>& sends, Link* from,
                const std::vector<RecvItem>& recvs, const TransferOptions& opt) {
  Headers headers = plan(to, from, opt);
  Seal out_seal, in_seal;
  std::vector<SendItem> sealed_sends;
  std::vector<RecvItem> sealed_recvs;
  const bool sealed = opt.agree && opt.agree->sealed;
  if (sealed && to && to->key && !sends.empty()) {
    out_seal.on = true;
    sealed_sends = sends;
    sealed_sends.push_back(SendItem{reinterpret_cast<const char*>(out_seal.tag), kTagBytes, -1});
  }
  if (sealed && from && from->key && !recvs.empty()) {
    in_seal.on = true;
    sealed_recvs = recvs;
    sealed_recvs.push_back(RecvItem{reinterpret_cast<char*>(in_seal.tag), kTagBytes, nullptr, nullptr});
  }
  Run r{to, out_seal.on ? sealed_sends : sends, from, in_seal.on ? sealed_recvs : recvs, opt,
        out_seal, in_seal, {}, {}, std::move(headers), watch_list(to, from, opt), {}};
  uint64_t last_progress = now_ns();
  while (!r.done()) {
    size_t moved = 0;
    Status st = progress(r, &moved);
    if (!st.ok()) return explain(r, std::move(st));
    uint64_t now = now_ns();
    if (moved) {
      last_progress = now;
      continue;
    }
    if (now - last_progress >= opt.timeout_ns) return stalled(r);
    HVS_CHECK(wait(r, opt.timeout_ns - (now - last_progress)));
  }
  if (opt.stats) count_moved(*opt.stats, sends, recvs, opt.agree);
  return Status();
}

Status make_nonblocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
    return HVS_ERROR(Code::kSystem, std::string("fcntl(O_NONBLOCK) failed: ") + std::strerror(errno));
  return Status();
}

}  // namespace hvs
