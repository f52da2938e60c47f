// Status and the small dtype tables of include/hvs/types.h.
#include "hvs/status.h"

#include <cerrno>
#include <cstring>

#include "hvs/types.h"

namespace hvs {

namespace {
const std::string kEmpty;
const std::vector<std::string> kNoTrail;

const char* short_path(const char* file) {
  const char* p = std::strstr(file, "native/");
  return p ? p + 7 : file;
}
}  // namespace

Status Status::Error(Code code, std::string what, int peer) {
  Status s;
  s.state_.reset(new State{code, std::move(what), peer, std::string(), {}});
  return s;
}

Status Status::Errno(const std::string& call, int err, int peer) {
  Code code = Code::kSystem;
  if (err == EPIPE || err == ECONNRESET || err == ENOTCONN || err == ECONNABORTED)
    code = Code::kPeerLost;
  return Error(code, call + " failed: " + std::strerror(err), peer);
}

const std::string& Status::what() const { return state_ ? state_->what : kEmpty; }
const std::string& Status::hint() const { return state_ ? state_->hint : kEmpty; }
const std::vector<std::string>& Status::trail() const {
  return state_ ? state_->trail : kNoTrail;
}

Status&& Status::at(const char* file, int line) && {
  if (state_) state_->trail.push_back(std::string(short_path(file)) + ":" + std::to_string(line));
  return std::move(*this);
}

Status&& Status::with_hint(std::string hint) && {
  if (state_) state_->hint = std::move(hint);
  return std::move(*this);
}

size_t itemsize(DType dt) {
  static const size_t sizes[kNumDTypes] = {2, 2, 4, 8, 1, 2, 4, 8, 1, 1};
  return sizes[static_cast<int>(dt)];
}

const char* dtype_name(DType dt) {
  static const char* names[kNumDTypes] = {"float16", "bfloat16", "float32", "float64", "int8",
                                          "int16",   "int32",    "int64",   "uint8",   "bool"};
  return names[static_cast<int>(dt)];
}

const char* op_name(ReduceOp op) {
  static const char* names[kNumOps] = {"sum", "average", "min", "max", "product", "adasum"};
  return names[static_cast<int>(op)];
}

bool valid_dtype(int code) { return code >= 0 && code < kNumDTypes; }
bool valid_op(int code) { return code >= 0 && code < kNumOps; }

}  // namespace hvs
