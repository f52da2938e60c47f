/* A stand-in for the CUDA runtime and NCCL, for the CUDA lane's device step on machines
 * without a GPU: each entry point the step loads appends one line to a log (read with
 * fake_log) and returns the code set with fake_fail (0: success).  Built twice by
 * test_cuda_runtime.py: -DFAKE_CUDART (libcudart's entry points) and -DFAKE_NCCL.  It
 * reduces nothing: what it checks is the order and the arguments of the calls. */
#include <stdio.h>
#include <string.h>

static char log_[8192];
static char fail_name_[64];
static int fail_code_;
static int events_;  /* events made since the last reset: their handles are 0xe1, 0xe2... */

static int record(const char* line, const char* name) {
  if (strlen(log_) + strlen(line) + 2 < sizeof log_) {
    strcat(log_, line);
    strcat(log_, "\n");
  }
  return strcmp(name, fail_name_) == 0 ? fail_code_ : 0;
}

const char* fake_log(void) { return log_; }
void fake_reset(void) { log_[0] = 0; fail_name_[0] = 0; fail_code_ = 0; events_ = 0; }
void fake_fail(const char* name, int code) {
  snprintf(fail_name_, sizeof fail_name_, "%s", name);
  fail_code_ = code;
}

#ifdef FAKE_CUDART
int cudaEventCreateWithFlags(void** ev, unsigned flags) {
  char line[128];
  *ev = (void*)(0xE0 + (long)++events_);
  snprintf(line, sizeof line, "cudaEventCreateWithFlags %p %u", *ev, flags);
  return record(line, "cudaEventCreateWithFlags");
}
int cudaEventRecord(void* ev, void* stream) {
  char line[128];
  snprintf(line, sizeof line, "cudaEventRecord %p %p", ev, stream);
  return record(line, "cudaEventRecord");
}
int cudaStreamWaitEvent(void* stream, void* ev, unsigned flags) {
  char line[128];
  snprintf(line, sizeof line, "cudaStreamWaitEvent %p %p %u", stream, ev, flags);
  return record(line, "cudaStreamWaitEvent");
}
int cudaEventDestroy(void* ev) {
  char line[128];
  snprintf(line, sizeof line, "cudaEventDestroy %p", ev);
  return record(line, "cudaEventDestroy");
}
const char* cudaGetErrorString(int rc) { return rc == 700 ? "an illegal memory access was encountered" : "fake CUDA error"; }
#endif

#ifdef FAKE_NCCL
static int version_ = 22105;  /* NCCL 2.21.5 */
void fake_set_version(int v) { version_ = v; }
int ncclAllReduce(const void* src, void* dst, size_t count, int dtype, int op, void* comm, void* stream) {
  char line[192];
  snprintf(line, sizeof line, "ncclAllReduce %p %p %zu %d %d %p %p", src, dst, count, dtype, op, comm, stream);
  return record(line, "ncclAllReduce");
}
const char* ncclGetErrorString(int rc) { return rc == 2 ? "unhandled system error" : "fake NCCL error"; }
int ncclGetVersion(int* version) {
  *version = version_;
  return record("ncclGetVersion", "ncclGetVersion");
}
#endif
