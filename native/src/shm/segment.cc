// POSIX shared memory: create, attach, unlink; see segment.h.
#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

namespace hvs {

namespace {
constexpr uint64_t kMagic = 0x68767373686d3031ull;  // "hvsshm01"

struct alignas(128) Header {
  uint64_t magic;
  uint64_t nranks;
  uint64_t slot_bytes;
  std::atomic<uint32_t> attached;
};

constexpr size_t kPage = 4096;
size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
size_t controls_offset() { return sizeof(Header); }
size_t slots_offset(int nranks) {
  return round_up(controls_offset() + sizeof(ShmControl) * nranks, kPage);
}
}  // namespace

size_t Segment::total_bytes(int nranks, size_t slot_bytes) {
  return slots_offset(nranks) + round_up(slot_bytes, kPage) * nranks;
}

Segment::~Segment() {
  if (base_) munmap(base_, bytes_);
}

Status Segment::map(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) return HVS_ERROR(Code::kSystem, "mmap of shared memory " + name_ + " failed: " + std::strerror(err));
  base_ = static_cast<char*>(p);
  bytes_ = bytes;
  return Status();
}

Status Segment::create(const std::string& name, int nranks, size_t slot_bytes,
                       std::unique_ptr<Segment>* out) {
  if (nranks < 1 || slot_bytes < kPage)
    return HVS_ERROR(Code::kInvalid, "shared memory needs >= 1 rank and slots >= 4096 bytes");
  std::unique_ptr<Segment> seg(new Segment());
  seg->name_ = name;
  seg->nranks_ = nranks;
  seg->slot_bytes_ = round_up(slot_bytes, kPage);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return HVS_ERROR(Code::kSystem, "shm_open(" + name + ") failed: " + std::strerror(errno));
  size_t bytes = total_bytes(nranks, seg->slot_bytes_);
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return HVS_ERROR(Code::kSystem, "ftruncate of shared memory " + name + " to " +
                                        std::to_string(bytes) + " bytes failed: " + std::strerror(err))
        .with_hint("is /dev/shm large enough? lower shm_slot_bytes");
  }
  Status st = seg->map(fd, bytes);
  if (!st.ok()) {
    shm_unlink(name.c_str());
    return std::move(st).at(__FILE__, __LINE__);
  }
  Header* h = new (seg->base_) Header();
  h->nranks = static_cast<uint64_t>(nranks);
  h->slot_bytes = seg->slot_bytes_;
  for (int i = 0; i < nranks; ++i) new (&seg->control(i)) ShmControl();
  h->attached.store(1, std::memory_order_relaxed);
  // The magic last: an attacher that sees it sees an initialised segment.
  reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kMagic, std::memory_order_release);
  if (nranks == 1) seg->unlink();
  *out = std::move(seg);
  return Status();
}

Status Segment::attach(const std::string& name, int nranks, size_t slot_bytes,
                       std::unique_ptr<Segment>* out) {
  std::unique_ptr<Segment> seg(new Segment());
  seg->name_ = name;
  seg->nranks_ = nranks;
  seg->slot_bytes_ = round_up(slot_bytes, kPage);
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0 && errno == ENOENT) return HVS_ERROR(Code::kNotReady, "shared memory " + name + " does not exist yet");
  if (fd < 0)
    return HVS_ERROR(Code::kSystem, "shm_open(" + name + ") to attach failed: " + std::strerror(errno));
  size_t bytes = total_bytes(nranks, seg->slot_bytes_);
  struct stat sb;
  if (fstat(fd, &sb) != 0 || sb.st_size == 0) {
    close(fd);
    return HVS_ERROR(Code::kNotReady, "shared memory " + name + " is not sized yet");
  }
  if (static_cast<size_t>(sb.st_size) != bytes) {
    close(fd);
    return HVS_ERROR(Code::kMismatch, "shared memory " + name + " has another size than expected for " +
                                          std::to_string(nranks) + " ranks; do all ranks use the same shm_slot_bytes?");
  }
  HVS_CHECK(seg->map(fd, bytes));
  Header* h = reinterpret_cast<Header*>(seg->base_);
  uint64_t magic = reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->load(std::memory_order_acquire);
  if (magic == 0) return HVS_ERROR(Code::kNotReady, "shared memory " + name + " is not initialised yet");
  if (magic != kMagic || h->nranks != static_cast<uint64_t>(nranks))
    return HVS_ERROR(Code::kMismatch, "shared memory " + name + " was made for another job");
  if (h->attached.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(nranks))
    seg->unlink();
  *out = std::move(seg);
  return Status();
}

void Segment::unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  shm_unlink(name_.c_str());  // ENOENT: another rank unlinked it first
}

void Segment::unlink(const std::string& name) { shm_unlink(name.c_str()); }

int Segment::attached() const {
  return static_cast<int>(reinterpret_cast<Header*>(base_)->attached.load(std::memory_order_acquire));
}

ShmControl& Segment::control(int local) const {
  return reinterpret_cast<ShmControl*>(base_ + controls_offset())[local];
}

char* Segment::slot(int local) const {
  return base_ + slots_offset(nranks_) + round_up(slot_bytes_, kPage) * static_cast<size_t>(local);
}

}  // namespace hvs
