// One send stream and one receive stream over TCP, overlapped; see transfer.h.
#include "transfer.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "../clock.h"

namespace hvs {

namespace {

struct Stream {
  size_t item = 0;  // index of the item in progress
  size_t done = 0;  // bytes of it already moved
};

// Returns bytes moved (0 when the socket would block).
Status send_some(const Link& to, const std::vector<SendItem>& items, Stream& s, size_t recvd,
                 size_t* moved) {
  *moved = 0;
  while (s.item < items.size()) {
    const SendItem& it = items[s.item];
    if (it.dep >= 0 && static_cast<size_t>(it.dep) >= recvd) return Status();  // not arrived yet
    if (s.done < it.len) {
      ssize_t n = ::send(to.fd, it.ptr + s.done, it.len - s.done, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return Status();
        if (errno == EINTR) continue;
        return HVS_ERROR(Code::kPeerLost, std::string("send failed: ") + std::strerror(errno), to.peer)
            .with_hint("did that process exit or fail?");
      }
      s.done += static_cast<size_t>(n);
      *moved += static_cast<size_t>(n);
      if (s.done < it.len) continue;
    }
    ++s.item;
    s.done = 0;
  }
  return Status();
}

Status recv_some(const Link& from, const std::vector<RecvItem>& items, Stream& s,
                 const TransferOptions& opt, size_t* moved) {
  *moved = 0;
  while (s.item < items.size()) {
    const RecvItem& it = items[s.item];
    char* where = it.own ? opt.staging : it.ptr;
    if (s.done < it.len) {
      ssize_t n = ::recv(from.fd, where + s.done, it.len - s.done, MSG_DONTWAIT);
      if (n == 0)
        return HVS_ERROR(Code::kPeerLost, "connection closed by the peer", from.peer)
            .with_hint("did that process exit or fail?");
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return Status();
        if (errno == EINTR) continue;
        return HVS_ERROR(Code::kPeerLost, std::string("recv failed: ") + std::strerror(errno), from.peer)
            .with_hint("did that process exit or fail?");
      }
      s.done += static_cast<size_t>(n);
      *moved += static_cast<size_t>(n);
      if (s.done < it.len) continue;
    }
    if (it.own) opt.fn(it.out, it.own, opt.staging, it.len / opt.elem);
    ++s.item;
    s.done = 0;
  }
  return Status();
}

Status wait_ready(const Link* to, bool want_send, const Link* from, bool want_recv,
                  uint64_t left_ns) {
  pollfd fds[2];
  int n = 0;
  if (want_send) fds[n++] = pollfd{to->fd, POLLOUT, 0};
  if (want_recv) {
    if (n == 1 && fds[0].fd == from->fd)
      fds[0].events |= POLLIN;
    else
      fds[n++] = pollfd{from->fd, POLLIN, 0};
  }
  int ms = static_cast<int>(left_ns / 1000000) + 1;
  int r = ::poll(fds, n, ms);
  if (r < 0 && errno != EINTR) return HVS_ERROR(Code::kSystem, std::string("poll failed: ") + std::strerror(errno));
  return Status();  // errors on the sockets surface from the next send/recv
}

}  // namespace

Status transfer(const Link* to, const std::vector<SendItem>& sends, const Link* from,
                const std::vector<RecvItem>& recvs, const TransferOptions& opt) {
  Stream out, in;
  uint64_t last_progress = now_ns();
  while (out.item < sends.size() || in.item < recvs.size()) {
    size_t sent = 0, got = 0;
    if (out.item < sends.size()) HVS_CHECK(send_some(*to, sends, out, in.item, &sent));
    if (in.item < recvs.size()) HVS_CHECK(recv_some(*from, recvs, in, opt, &got));
    if (got) HVS_CHECK(send_some(*to, sends, out, in.item, &sent));  // forward at once
    uint64_t now = now_ns();
    if (sent || got) {
      last_progress = now;
      continue;
    }
    if (now - last_progress >= opt.timeout_ns) {
      bool receiving = in.item < recvs.size();
      const Link* peer = receiving ? from : to;
      return HVS_ERROR(Code::kTimeout,
                       receiving ? "no data from the peer" : "the peer is not reading what this rank sends",
                       peer->peer)
          .with_hint("is that process alive, and in the same collective?");
    }
    bool want_send = out.item < sends.size() &&
                     (sends[out.item].dep < 0 || static_cast<size_t>(sends[out.item].dep) < in.item);
    bool want_recv = in.item < recvs.size();
    HVS_CHECK(wait_ready(to, want_send, from, want_recv, opt.timeout_ns - (now - last_progress)));
  }
  return Status();
}

Status make_nonblocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
    return HVS_ERROR(Code::kSystem, std::string("fcntl(O_NONBLOCK) failed: ") + std::strerror(errno));
  return Status();
}

}  // namespace hvs
