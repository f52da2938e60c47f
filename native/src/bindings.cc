// The Python module collectives._native.
//
// Buffers come in through the buffer protocol (numpy arrays, or torch CPU
// tensors viewed as numpy by the front end); their pointers are taken with
// the GIL held, then the GIL is released for the whole collective.  Every
// native error becomes a Python exception in one place, raise_status, with
// the message built by collectives.errors.describe().
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "context.h"
#include "cuda/runtime.h"
#include "lane/lane.h"
#include "reduce.h"
#include "shm/segment.h"
#include "tcp/mac.h"

namespace py = pybind11;
using namespace py::literals;

namespace hvs {
namespace {

struct Where {  // what an error message needs to know about this rank
  int rank = -1, size = -1;
  const std::vector<std::string>* addresses = nullptr;
  double timeout = 0;
  // Name op and rank in the message.  Collectives leave that to the
  // Communicator, which puts op, sequence number, tensor and rank in front.
  bool prefix = false;
};

const char* exception_name(Code code) {
  switch (code) {
    case Code::kPeerLost: return "PeerLostError";
    case Code::kTimeout: return "CollectiveTimeout";
    case Code::kMismatch: return "MismatchError";
    case Code::kNotSupported: return "NotSupported";
    case Code::kIntegrity: return "AuthenticationError";
    default: return "CollectiveError";
  }
}

[[noreturn]] void raise_status(const Status& st, const Where& w, const char* op, long seq) {
  py::module_ errors = py::module_::import("collectives.errors");
  py::object none = py::none();
  int peer = st.peer();
  py::object address = none;
  if (peer >= 0 && w.addresses && peer < static_cast<int>(w.addresses->size()))
    address = py::str((*w.addresses)[peer]);
  bool full = w.prefix || seq >= 0;
  std::string msg = py::str(errors.attr("describe")(
      st.what(), "rank"_a = full && w.rank >= 0 ? py::object(py::int_(w.rank)) : none,
      "size"_a = full && w.size >= 0 ? py::object(py::int_(w.size)) : none,
      "op"_a = full ? py::object(py::str(op)) : none,
      "seq"_a = seq >= 0 ? py::object(py::int_(seq)) : none,
      "peer"_a = peer >= 0 ? py::object(py::int_(peer)) : none, "address"_a = address,
      "timeout"_a = st.code() == Code::kTimeout ? py::object(py::float_(w.timeout)) : none,
      "hint"_a = st.hint().empty() ? none : py::object(py::str(st.hint()))));
  std::string trail;
  for (const std::string& t : st.trail()) trail += (trail.empty() ? "" : " < ") + t;
  if (!trail.empty()) msg += " [native " + trail + "]";
  py::object cls = st.code() == Code::kInvalid ? py::reinterpret_borrow<py::object>(PyExc_ValueError)
                                               : errors.attr(exception_name(st.code()));
  PyErr_SetString(cls.ptr(), msg.c_str());
  throw py::error_already_set();
}

struct Buffer {
  char* ptr;
  size_t bytes;
};

Buffer buffer_of(const py::buffer& b, bool writable, const char* what) {
  py::buffer_info info = b.request(writable);
  py::ssize_t expect = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != expect)
      throw py::value_error(std::string(what) + " must be C-contiguous");
    expect *= info.shape[d];
  }
  return Buffer{static_cast<char*>(info.ptr), static_cast<size_t>(info.size * info.itemsize)};
}

DType dtype_arg(int code) {
  if (!valid_dtype(code)) throw py::value_error("unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

ReduceOp op_arg(int code) {
  if (!valid_op(code)) throw py::value_error("unknown reduce op code " + std::to_string(code));
  return static_cast<ReduceOp>(code);
}

size_t count_of(const Buffer& b, DType dt, const char* what) {
  size_t elem = itemsize(dt);
  if (b.bytes % elem) throw py::value_error(std::string(what) + " is not a whole number of " + dtype_name(dt));
  return b.bytes / elem;
}

size_t sum(const std::vector<size_t>& v) {
  size_t s = 0;
  for (size_t x : v) s += x;
  return s;
}

// Owns a Segment until a Context takes it.
struct PySegment {
  std::unique_ptr<Segment> seg;
  Segment& get() {
    if (!seg) throw py::value_error("the shared memory segment was handed to a communicator");
    return *seg;
  }
};

class PyContext {
 public:
  PyContext(ContextOptions opt, std::vector<int> fds, PySegment* seg, std::vector<std::string> addresses,
            std::vector<py::bytes> keys)
      : addresses_(std::move(addresses)) {
    if (static_cast<int>(opt.hosts.size()) != opt.size || static_cast<int>(opt.pids.size()) != opt.size)
      throw py::value_error("hosts and pids need one entry per rank");
    if (!keys.empty() && static_cast<int>(keys.size()) != opt.size)
      throw py::value_error("keys: one link key per rank (b'' for none), or none at all");
    std::vector<std::string> raw(keys.begin(), keys.end());
    ctx_.reset(new Context(std::move(opt), std::move(fds), seg ? std::move(seg->seg) : nullptr, raw));
  }

  template <typename F>
  void run(const char* op, long seq, F f) {
    Status st;
    {
      py::gil_scoped_release nogil;
      st = ctx_->fail(f(*ctx_));
    }
    if (!st.ok()) {
      const ContextOptions& o = ctx_->options();
      raise_status(st, Where{o.rank, o.size, &addresses_, o.timeout_s}, op, seq);
    }
  }

  std::unique_ptr<Context> ctx_;
  std::vector<std::string> addresses_;
};

void check_counts(const std::vector<size_t>& counts, int size, const char* what) {
  if (static_cast<int>(counts.size()) != size)
    throw py::value_error(std::string(what) + " needs one count per rank");
}

void bind_context(py::module_& m) {
  py::class_<ContextOptions>(m, "ContextOptions")
      .def(py::init<>())
      .def_readwrite("rank", &ContextOptions::rank)
      .def_readwrite("size", &ContextOptions::size)
      .def_readwrite("hosts", &ContextOptions::hosts)
      .def_readwrite("pids", &ContextOptions::pids)
      .def_readwrite("timeout_s", &ContextOptions::timeout_s)
      .def_readwrite("spin_ns", &ContextOptions::spin_ns)
      .def_readwrite("yield_ns", &ContextOptions::yield_ns)
      .def_readwrite("shm_chunk", &ContextOptions::shm_chunk)
      .def_readwrite("small_bytes", &ContextOptions::small_bytes)
      .def_readwrite("cma_bytes", &ContextOptions::cma_bytes)
      .def_readwrite("cma_chunk", &ContextOptions::cma_chunk)
      .def_readwrite("cma", &ContextOptions::cma)
      .def_readwrite("tcp_chunk", &ContextOptions::tcp_chunk)
      .def_readwrite("hier_chunk", &ContextOptions::hier_chunk)
      .def_readwrite("doubling_bytes", &ContextOptions::doubling_bytes)
      .def_readwrite("seal_payload", &ContextOptions::seal_payload);

  py::class_<PyContext>(m, "Context")
      .def(py::init<ContextOptions, std::vector<int>, PySegment*, std::vector<std::string>,
                    std::vector<py::bytes>>(),
           "options"_a, "fds"_a, "segment"_a, "addresses"_a, "keys"_a = std::vector<py::bytes>())
      .def("add_link", [](PyContext& c, int peer, int fd, py::bytes key, std::string address) {
        const ContextOptions& o = c.ctx_->options();
        if (peer < 0 || peer >= o.size || peer == o.rank) throw py::value_error("add_link: no such peer");
        Status st = c.ctx_->add_link(peer, fd, std::string(key));
        if (!st.ok()) raise_status(st, Where{o.rank, o.size, &c.addresses_, o.timeout_s}, "connect", -1);
        c.addresses_[peer] = std::move(address);
      }, "peer"_a, "fd"_a, "key"_a, "address"_a)
      .def_property_readonly("hierarchical", [](PyContext& c) { return c.ctx_->hierarchical(); })
      .def_property_readonly("cma", [](PyContext& c) { return std::string(c.ctx_->cma_state()); })
      .def_property_readonly("stats", [](PyContext& c) {
        const TransportStats& s = c.ctx_->stats();
        return py::dict("tcp_ops"_a = s.tcp_ops, "tcp_bytes_sent"_a = s.tcp_sent,
                        "tcp_bytes_received"_a = s.tcp_received, "shm_ops"_a = s.shm_ops,
                        "shm_bytes"_a = s.shm_bytes, "pipelined_ops"_a = s.pipelined_ops);
      })
      .def("allreduce", [](PyContext& c, py::buffer src, py::buffer dst, int dtype, int op, long seq,
                           bool control) {
        DType dt = dtype_arg(dtype);
        ReduceOp o = op_arg(op);
        Buffer s = buffer_of(src, false, "src"), d = buffer_of(dst, true, "dst");
        if (s.bytes != d.bytes) throw py::value_error("allreduce src and dst differ in size");
        size_t n = count_of(d, dt, "dst");
        c.run("allreduce", seq, [&](Context& x) { return x.allreduce(s.ptr, d.ptr, n, dt, o, control); });
      }, "src"_a, "dst"_a, "dtype"_a, "op"_a, "seq"_a = -1, "control"_a = false)
      .def("allgather", [](PyContext& c, py::buffer src, py::buffer dst, int dtype,
                           std::vector<size_t> counts, long seq, bool control) {
        DType dt = dtype_arg(dtype);
        Buffer s = buffer_of(src, false, "src"), d = buffer_of(dst, true, "dst");
        check_counts(counts, c.ctx_->options().size, "allgather");
        if (count_of(s, dt, "src") != counts[c.ctx_->options().rank] || count_of(d, dt, "dst") != sum(counts))
          throw py::value_error("allgather buffers do not match the counts");
        c.run("allgather", seq, [&](Context& x) { return x.allgather(s.ptr, d.ptr, counts, dt, control); });
      }, "src"_a, "dst"_a, "dtype"_a, "counts"_a, "seq"_a = -1, "control"_a = false)
      .def("broadcast", [](PyContext& c, py::buffer buf, int dtype, int root, long seq) {
        DType dt = dtype_arg(dtype);
        Buffer b = buffer_of(buf, true, "buf");
        size_t n = count_of(b, dt, "buf");
        c.run("broadcast", seq, [&](Context& x) { return x.broadcast(b.ptr, n, dt, root); });
      }, "buf"_a, "dtype"_a, "root"_a, "seq"_a = -1)
      .def("reducescatter", [](PyContext& c, py::buffer src, py::buffer dst, int dtype, int op,
                               std::vector<size_t> counts, long seq) {
        DType dt = dtype_arg(dtype);
        ReduceOp o = op_arg(op);
        Buffer s = buffer_of(src, false, "src"), d = buffer_of(dst, true, "dst");
        check_counts(counts, c.ctx_->options().size, "reducescatter");
        if (count_of(s, dt, "src") != sum(counts) || count_of(d, dt, "dst") != counts[c.ctx_->options().rank])
          throw py::value_error("reducescatter buffers do not match the counts");
        c.run("reducescatter", seq, [&](Context& x) { return x.reducescatter(s.ptr, d.ptr, counts, dt, o); });
      }, "src"_a, "dst"_a, "dtype"_a, "op"_a, "counts"_a, "seq"_a = -1)
      .def("alltoall", [](PyContext& c, py::buffer src, std::vector<size_t> send_counts, py::buffer dst,
                          std::vector<size_t> recv_counts, int dtype, long seq) {
        DType dt = dtype_arg(dtype);
        Buffer s = buffer_of(src, false, "src"), d = buffer_of(dst, true, "dst");
        check_counts(send_counts, c.ctx_->options().size, "alltoall send");
        check_counts(recv_counts, c.ctx_->options().size, "alltoall recv");
        if (count_of(s, dt, "src") != sum(send_counts) || count_of(d, dt, "dst") != sum(recv_counts))
          throw py::value_error("alltoall buffers do not match the counts");
        c.run("alltoall", seq, [&](Context& x) { return x.alltoall(s.ptr, send_counts, d.ptr, recv_counts, dt); });
      }, "src"_a, "send_counts"_a, "dst"_a, "recv_counts"_a, "dtype"_a, "seq"_a = -1)
      .def("adasum", [](PyContext& c, py::buffer buf, int dtype, std::vector<size_t> segments, long seq) {
        DType dt = dtype_arg(dtype);
        Buffer b = buffer_of(buf, true, "buf");
        size_t n = count_of(b, dt, "buf");
        c.run("adasum", seq, [&](Context& x) { return x.adasum(b.ptr, n, dt, segments); });
      }, "buf"_a, "dtype"_a, "segments"_a, "seq"_a = -1)
      .def("barrier", [](PyContext& c, long seq) {
        c.run("barrier", seq, [&](Context& x) { return x.barrier(); });
      }, "seq"_a = -1);
}

// A Lane with what its errors need; kept alive by Python for as long as the process
// (a TensorFlow graph holds its address), closed when its engine stops.
struct PyLane {
  PyLane(PyContext& c)
      : lane(new Lane(c.ctx_.get(), c.ctx_->options().rank, c.ctx_->options().size)),
        where(Where{c.ctx_->options().rank, c.ctx_->options().size, &c.addresses_,
                    c.ctx_->options().timeout_s}),
        addresses(c.addresses_) {
    where.addresses = &addresses;
  }
  std::unique_ptr<Lane> lane;
  Where where;
  std::vector<std::string> addresses;
};

void bind_lane(py::module_& m) {
  py::class_<CycleLock>(m, "CycleLock",
                        "The fusion engine's cycle lock, shared with its lane (any thread may release it).")
      .def("acquire", [](CycleLock& l, bool blocking, double timeout) {
        if (!blocking) return l.try_acquire();
        py::gil_scoped_release nogil;
        return l.acquire(timeout);
      }, "blocking"_a = true, "timeout"_a = -1.0)
      .def("release", &CycleLock::release)
      .def("locked", &CycleLock::locked)
      .def("__enter__", [](CycleLock& l) {
        py::gil_scoped_release nogil;
        l.acquire();
      })
      .def("__exit__", [](CycleLock& l, py::args) { l.release(); });

  py::class_<PyLane>(m, "Lane", "The C++ steady-state cycle for armed ops (native/src/lane/lane.h).")
      .def(py::init<PyContext&>(), "context"_a)
      .def_property_readonly("lock", [](PyLane& l) { return &l.lane->lock; },
                             py::return_value_policy::reference_internal)
      .def("arm", [](PyLane& l, int slot, int bit, size_t count, int dtype, double postscale,
                     int64_t generation) {
        l.lane->arm(slot, bit, count, dtype_arg(dtype), postscale, generation);
      }, "slot"_a, "bit"_a, "count"_a, "dtype"_a, "postscale"_a, "generation"_a)
      .def("set_cache", [](PyLane& l, int64_t nbits, int64_t generation, std::vector<int> changed) {
        l.lane->set_cache(nbits, generation, changed);
      }, "nbits"_a, "generation"_a, "changed"_a)
      .def("set_enabled", [](PyLane& l, bool on) { l.lane->set_enabled(on); }, "on"_a)
      .def("close", [](PyLane& l, double timeout) {
        py::gil_scoped_release nogil;
        l.lane->close(timeout);
      }, "timeout"_a)
      .def("take_uses", [](PyLane& l) { return l.lane->take_uses(); })
      .def("result", [](PyLane& l) { return l.lane->result(); },
           "The summed coordination vector of the cycle handed over.")
      .def("raise_error", [](PyLane& l) { raise_status(l.lane->error(), l.where, "allreduce", -1); })
      .def("run", [](PyLane& l, int slot, py::buffer src, py::buffer dst) {
        Buffer s = buffer_of(src, false, "src"), d = buffer_of(dst, true, "dst");
        if (s.bytes != d.bytes) throw py::value_error("lane run: src and dst differ in size");
        py::gil_scoped_release nogil;
        return l.lane->run(slot, s.ptr, d.ptr, s.bytes);
      }, "slot"_a, "src"_a, "dst"_a, "One op as the TensorFlow op runs it; returns its LaneCode.")
      .def("run_at", [](PyLane& l, int slot, uintptr_t src, uintptr_t dst, size_t nbytes) {
        // The caller vouches for the addresses (a tensor it holds for the call): horovod_spark.torch
        // passes data_ptr(), which costs less than a buffer of the tensor.
        if (src == 0 || dst == 0) throw py::value_error("lane run_at: a null address");
        py::gil_scoped_release nogil;
        return l.lane->run(slot, reinterpret_cast<const void*>(src), reinterpret_cast<void*>(dst), nbytes);
      }, "slot"_a, "src"_a, "dst"_a, "nbytes"_a,
         "run() on raw addresses of nbytes each (contiguous memory the caller keeps alive).")
      .def("enqueue", [](PyLane& l, int slot, uintptr_t src, uintptr_t dst, size_t nbytes) {
        if (src == 0 || dst == 0) throw py::value_error("lane enqueue: a null address");
        return l.lane->enqueue(slot, reinterpret_cast<const void*>(src), reinterpret_cast<void*>(dst), nbytes);
      }, "slot"_a, "src"_a, "dst"_a, "nbytes"_a,
         "Queue an armed slot's async op on raw addresses (kept alive by the caller until done); "
         "returns its ticket, or -1 (nothing queued).")
      .def("wait", [](PyLane& l, int64_t ticket, double budget) {
        py::gil_scoped_release nogil;
        return l.lane->wait(ticket, budget);
      }, "ticket"_a, "budget"_a, "Run batch cycles until the ticket is done; returns a LaneCode.")
      .def("done", [](PyLane& l, int64_t ticket) { return l.lane->done(ticket); }, "ticket"_a)
      .def("armed", [](PyLane& l, int slot, size_t nbytes) { return l.lane->armed(slot, nbytes); },
           "slot"_a, "nbytes"_a)
      .def("take_queue", [](PyLane& l) { return l.lane->take_queue(); },
           "The queued tickets, in order, taken off the queue (hold the lock).")
      .def_property_readonly("queued", [](PyLane& l) { return l.lane->queued(); })
      .def("set_threshold", [](PyLane& l, size_t bytes) { l.lane->set_threshold(bytes); }, "bytes"_a)
      .def_property_readonly("address", [](PyLane& l) { return reinterpret_cast<uintptr_t>(l.lane.get()); })
      .def_property_readonly("synced", [](PyLane& l) { return l.lane->synced_ns() * 1e-9; })
      .def_property_readonly("cycles", [](PyLane& l) { return l.lane->cycles(); })
      .def_property_readonly("tensors", [](PyLane& l) { return l.lane->tensors(); })
      .def_property_readonly("bytes", [](PyLane& l) { return l.lane->bytes(); })
      .def_property_readonly("collective_s", [](PyLane& l) { return l.lane->collective_s(); });
  m.attr("LANE_RUN") = reinterpret_cast<uintptr_t>(&hvs_lane_run);
  py::dict codes;
  codes["done"] = static_cast<int>(kLaneDone);
  codes["fallback"] = static_cast<int>(kLaneFallback);
  codes["handover"] = static_cast<int>(kLaneHandover);
  codes["error"] = static_cast<int>(kLaneError);
  m.attr("LANE_CODES") = codes;
}

void bind_segment(py::module_& m) {
  // attach returns None while the segment is not there yet (the caller retries).
  auto make = [](bool create, const std::string& name, int nranks, size_t slot_bytes,
                 int rank) -> py::object {
    auto out = std::make_unique<PySegment>();
    Status st = create ? Segment::create(name, nranks, slot_bytes, &out->seg)
                       : Segment::attach(name, nranks, slot_bytes, &out->seg);
    if (st.code() == Code::kNotReady) return py::none();
    if (!st.ok()) raise_status(st, Where{rank, -1, nullptr, 0, true}, "shared memory setup", -1);
    return py::cast(std::move(out));
  };
  py::class_<PySegment>(m, "ShmSegment")
      .def_static("create", [make](const std::string& name, int nranks, size_t slot_bytes, int rank) {
        return make(true, name, nranks, slot_bytes, rank);
      }, "name"_a, "nranks"_a, "slot_bytes"_a, "rank"_a = -1)
      .def_static("attach", [make](const std::string& name, int nranks, size_t slot_bytes, int rank) {
        return make(false, name, nranks, slot_bytes, rank);
      }, "name"_a, "nranks"_a, "slot_bytes"_a, "rank"_a = -1)
      .def("unlink", [](PySegment& s) { s.get().unlink(); })
      .def_static("unlink_name", [](const std::string& name) { Segment::unlink(name); }, "name"_a)
      .def_property_readonly("attached", [](PySegment& s) { return s.get().attached(); })
      .def_property_readonly("name", [](PySegment& s) { return s.get().name(); });
}

void bind_kernels(py::module_& m) {
  m.def("mac_tag", [](py::bytes key, const std::string& kind, int sender, int receiver, uint64_t counter,
                      py::bytes data) {
    if (kind.size() != 1) throw py::value_error("kind is one character");
    MacKey k{std::string(key)};
    Mac mac;
    mac.start(k, kind[0], sender, receiver, counter);
    std::string d(data);
    mac.update(d.data(), d.size());
    uint8_t tag[kTagBytes];
    mac.finish(tag);
    return py::bytes(reinterpret_cast<const char*>(tag), kTagBytes);
  }, "key"_a, "kind"_a, "sender"_a, "receiver"_a, "counter"_a, "data"_a,
  "The tag the mesh puts on a frame (tcp/mac.h): HMAC-SHA256(key, kind | sender | receiver | "
  "counter | data), big-endian 32-bit ranks and 64-bit counter, cut to 16 bytes.");
  m.def("reduce", [](py::buffer out, py::buffer a, py::buffer b, int dtype, int op) {
    DType dt = dtype_arg(dtype);
    ReduceFn fn = reduce_fn(dt, op_arg(op));
    if (!fn) throw py::value_error("unsupported op for this dtype");
    Buffer o = buffer_of(out, true, "out"), x = buffer_of(a, false, "a"), y = buffer_of(b, false, "b");
    if (o.bytes != x.bytes || o.bytes != y.bytes) throw py::value_error("sizes differ");
    size_t n = count_of(o, dt, "out");
    py::gil_scoped_release nogil;
    fn(o.ptr, x.ptr, y.ptr, n);
  }, "out"_a, "a"_a, "b"_a, "dtype"_a, "op"_a, "out = a op b elementwise (for tests).");
  py::dict codes;
  for (int d = 0; d < kNumDTypes; ++d)
    codes[dtype_name(static_cast<DType>(d))] = py::make_tuple(d, itemsize(static_cast<DType>(d)));
  m.attr("DTYPES") = codes;
  py::dict ops;
  for (int o = 0; o < kNumOps; ++o) ops[op_name(static_cast<ReduceOp>(o))] = o;
  m.attr("OPS") = ops;
}

struct PyCudaRuntime {
  std::unique_ptr<CudaRuntime> rt;
};

void bind_cuda(py::module_& m) {
  py::class_<PyCudaRuntime>(m, "CudaRuntime",
                            "The CUDA lane's device step: the CUDA runtime and NCCL loaded at run "
                            "time (native/src/cuda/runtime.h).")
      .def(py::init([](std::vector<std::string> cudart, std::vector<std::string> nccl) {
             auto* p = new PyCudaRuntime();
             Status st = CudaRuntime::load(cudart, nccl, &p->rt);
             if (!st.ok()) {
               delete p;
               raise_status(st, Where{}, "CUDA lane", -1);
             }
             return p;
           }),
           "cudart"_a, "nccl"_a,
           "Names already loaded in this process, or paths (with a '/'), tried in order.")
      .def_property_readonly("nccl_version", [](PyCudaRuntime& r) { return r.rt->nccl_version(); })
      .def_property_readonly("libraries", [](PyCudaRuntime& r) {
        return py::make_tuple(r.rt->cudart_name(), r.rt->nccl_name());
      })
      .def("allreduce", [](PyCudaRuntime& r, uintptr_t comm, uintptr_t caller_stream,
                           uintptr_t engine_stream, uintptr_t src, uintptr_t dst, size_t count,
                           int dtype, int op) {
        DType dt = dtype_arg(dtype);
        ReduceOp o = op_arg(op);
        Status st;
        {
          py::gil_scoped_release nogil;
          st = r.rt->allreduce(reinterpret_cast<void*>(comm), reinterpret_cast<void*>(caller_stream),
                               reinterpret_cast<void*>(engine_stream),
                               reinterpret_cast<const void*>(src), reinterpret_cast<void*>(dst),
                               count, dt, o);
        }
        if (!st.ok()) raise_status(st, Where{}, "allreduce", -1);
      }, "comm"_a, "caller_stream"_a, "engine_stream"_a, "src"_a, "dst"_a, "count"_a, "dtype"_a, "op"_a,
      "Queue dst = op over every rank of src (device pointers, count elements) on the "
      "engine's stream, fenced by events on the caller's stream; returns at once.");
}

}  // namespace
}  // namespace hvs

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native CPU collectives of horovod-spark: shared memory within a host, TCP across hosts.";
  hvs::bind_kernels(m);
  hvs::bind_segment(m);
  hvs::bind_context(m);
  hvs::bind_lane(m);
  hvs::bind_cuda(m);
}
