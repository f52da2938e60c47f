// Status codes and the CHECK macro.
//
// Every native function that can fail returns a Status.  An OK status is a
// null pointer (free to pass around); an error carries a code, a sentence
// saying what went wrong, the peer it concerns (world rank, or -1) and a trail
// of file:line breadcrumbs, one added by each HVS_CHECK it passes through on
// its way up to the binding, which turns it into a Python exception in one
// place (bindings.cc: raise_status).  Native code never prints or exits.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace hvs {

enum class Code : int {
  kOk = 0,
  kPeerLost = 1,      // EOF, reset, or a local peer's process is gone
  kTimeout = 2,       // no progress from a peer within the timeout
  kInvalid = 3,       // a bad argument reached native code
  kSystem = 4,        // a system call failed (errno text in the message)
  kMismatch = 5,      // ranks disagree (sizes, steps)
  kNotSupported = 6,  // op or dtype not implemented
  kNotReady = 7,      // try again: e.g. a shared segment not created yet
  kIntegrity = 8,     // a frame from a peer failed its integrity check (tcp/mac.h)
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Status&&) = default;
  Status& operator=(Status&&) = default;

  static Status Error(Code code, std::string what, int peer = -1);
  static Status Errno(const std::string& call, int err, int peer = -1);

  bool ok() const { return state_ == nullptr; }
  Code code() const { return state_ ? state_->code : Code::kOk; }
  int peer() const { return state_ ? state_->peer : -1; }
  const std::string& what() const;
  const std::string& hint() const;
  const std::vector<std::string>& trail() const;

  // Adds a breadcrumb; returns *this so the macros can pass it on.
  Status&& at(const char* file, int line) &&;
  Status&& with_hint(std::string hint) &&;

 private:
  struct State {
    Code code;
    std::string what;
    int peer;
    std::string hint;
    std::vector<std::string> trail;
  };
  std::unique_ptr<State> state_;
};

}  // namespace hvs

#define HVS_CHECK(expr)                                          \
  do {                                                           \
    ::hvs::Status hvs_status_ = (expr);                          \
    if (!hvs_status_.ok())                                       \
      return std::move(hvs_status_).at(__FILE__, __LINE__);      \
  } while (0)

#define HVS_ERROR(...) ::hvs::Status::Error(__VA_ARGS__).at(__FILE__, __LINE__)
