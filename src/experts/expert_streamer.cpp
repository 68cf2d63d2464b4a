#include "experts/expert_streamer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/quant.h"
#include "core/quant_grouped.h"

#if TURBOSPARK_HAVE_URING
#include <liburing.h>
#endif

namespace turbospark {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kAlign = 4096;  // O_DIRECT: buffer, offset and length

int64_t align_down(int64_t v) { return v / kAlign * kAlign; }
int64_t align_up(int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

int64_t mtime_ns(const struct stat& st) { return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec; }

}  // namespace

ExpertStreamer::ExpertStreamer(ExpertStreamOptions options)
    : opt_(std::move(options)), cache_(opt_.slots, opt_.top_k, opt_.policy) {
  pread_fn_set_ = bool(opt_.pread_fn);
  if (!opt_.pread_fn) opt_.pread_fn = [](int fd, void* dst, size_t n, off_t off) { return ::pread(fd, dst, n, off); };
  opt_.prefetch_depth = int(std::clamp<int64_t>(opt_.prefetch_depth, 0, opt_.slots - 1));
  TS_CHECK(!opt_.speculate || opt_.slots >= 2 * int64_t(opt_.top_k),
           "expert streaming: speculation needs at least 2 x top_k = {} slots, got {} (a guess would evict the "
           "experts the next steps need)", 2 * opt_.top_k, opt_.slots);
  slots_.resize(size_t(opt_.slots));
  io_ = std::thread([this] { io_loop(); });
}

ExpertStreamer::~ExpertStreamer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  io_.join();
  for (Slot& s : slots_) std::free(s.buffer);
  for (File& f : files_) {
    if (f.fd_direct >= 0) ::close(f.fd_direct);
    if (f.fd >= 0) ::close(f.fd);
  }
}

int ExpertStreamer::file_index(const std::string& path, int64_t size) {
  for (size_t i = 0; i < files_.size(); ++i)
    if (files_[i].path == path) return int(i);
  File f;
  f.path = path;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) fail("expert streaming: cannot open {}: {}", path, std::strerror(errno));
  if (opt_.direct_io) f.fd_direct = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);  // -1: not supported here
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) fail("expert streaming: cannot stat {}: {}", path, std::strerror(errno));
  f.size = int64_t(st.st_size);
  f.mtime_ns = mtime_ns(st);
  TS_CHECK(f.size == size, "expert streaming: {} is {} bytes on disk but {} bytes were mapped: the file changed", path,
           f.size, size);
  std::lock_guard<std::mutex> lock(mu_);  // the I/O thread reads files_ (read_spans)
  files_.push_back(f);
  return int(files_.size() - 1);
}

const ExpertStreamer::Layout& ExpertStreamer::layout_of(const ExpertWeights& stored) {
  TS_CHECK(stored.gate.layer >= 0 && stored.gate.expert >= 0,
           "expert streaming: routed expert weights {} carry no layer/expert index", stored.gate.name);
  const int64_t key = key_of(stored.gate.layer, stored.gate.expert);
  auto it = layouts_.find(key);
  if (it != layouts_.end()) return it->second;
  Layout L;
  ExpertWeights copy = stored;
  const std::vector<PlaneField> planes = expert_planes(copy);
  if (opt_.store) {
    // One read of the expert's record; its planes must be the model's, byte for byte in size.
    const ExpertStore& st = *opt_.store;
    const ExpertStoreRecord* rec = st.find(stored.gate.layer, stored.gate.expert);
    if (!rec)
      fail("expert store {}: no record for layer {} expert {} (written from another model than {}?)", st.dir(),
           stored.gate.layer, stored.gate.expert, stored.gate.name);
    if (rec->plane_at.size() != planes.size())
      fail("expert store {}: layer {} expert {} has {} planes, the model's expert has {} (written from another model "
           "or format)", st.dir(), rec->layer, rec->expert, rec->plane_at.size(), planes.size());
    for (size_t i = 0; i < planes.size(); ++i) {
      const int64_t at = rec->plane_at[i];
      if ((planes[i].bytes == 0) != (at < 0) || (at >= 0 && at + planes[i].bytes > rec->bytes))
        fail("expert store {}: layer {} expert {} plane {} ({} bytes in the model) does not fit its record of {} "
             "bytes at {} (written from another model or format)", st.dir(), rec->layer, rec->expert, i,
             planes[i].bytes, rec->bytes, at);
    }
    const int64_t read = align_up(rec->bytes);
    L.spans.push_back({file_index(st.data_path(), st.data_bytes()), rec->offset, rec->offset + read, 0});
    L.plane_at = rec->plane_at;
    L.bytes = read;
    L.record = rec;
    slot_bytes_ = std::max(slot_bytes_, L.bytes);
    return layouts_.emplace(key, std::move(L)).first->second;
  }
  struct Located {
    int file;
    int64_t offset, bytes;
    size_t plane;
  };
  std::vector<Located> located;
  for (size_t i = 0; i < planes.size(); ++i) {
    if (planes[i].bytes == 0) {
      located.push_back({-1, 0, 0, i});
      continue;
    }
    const auto loc = locate_mapped(*planes[i].field, planes[i].bytes);
    if (!loc) {
      L.in_place = true;  // memory the checkpoint owns: nothing to stream
      return layouts_.emplace(key, std::move(L)).first->second;
    }
    located.push_back({file_index(loc->path, loc->file_size), loc->offset, planes[i].bytes, i});
  }
  // Spans: planes sorted by (file, offset); a plane overlapping the previous span's aligned
  // range joins it (keeps interleaved or adjacent planes' relative layout), else a new span.
  std::vector<size_t> order(located.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(located[a].file, located[a].offset) < std::tie(located[b].file, located[b].offset);
  });
  L.plane_at.assign(planes.size(), -1);
  int64_t at = 0;
  for (size_t oi : order) {
    const Located& p = located[oi];
    if (p.file < 0) continue;
    const int64_t b = align_down(p.offset), e = align_up(p.offset + p.bytes);
    if (!L.spans.empty() && L.spans.back().file == p.file && b < L.spans.back().end) {
      Span& s = L.spans.back();
      if (e > s.end) {
        at += e - s.end;
        s.end = e;
      }
    } else {
      L.spans.push_back({p.file, b, e, at});
      at += e - b;
    }
    const Span& s = L.spans.back();
    L.plane_at[p.plane] = s.at + (p.offset - s.begin);
  }
  L.bytes = at;
  slot_bytes_ = std::max(slot_bytes_, L.bytes);
  return layouts_.emplace(key, std::move(L)).first->second;
}

void ExpertStreamer::ensure_capacity(Slot& s, int64_t bytes) {
  if (s.capacity >= bytes) return;
  std::free(s.buffer);
  s.buffer = static_cast<uint8_t*>(std::aligned_alloc(size_t(kAlign), size_t(align_up(bytes))));
  TS_CHECK(s.buffer != nullptr, "expert streaming: cannot allocate a {}-byte slot", bytes);
  s.capacity = align_up(bytes);
}

void ExpertStreamer::plan_reads(const Layout& layout, uint8_t* buffer, std::vector<Read>& out) {
  for (const Span& s : layout.spans) {
    File f;
    {
      std::lock_guard<std::mutex> lock(mu_);
      f = files_[size_t(s.file)];
    }
    struct stat st {};
    TS_CHECK(::fstat(f.fd, &st) == 0 && int64_t(st.st_size) == f.size && mtime_ns(st) == f.mtime_ns,
             "expert streaming: {} changed on disk while the model was loaded (size or modification time)", f.path);
    Read r;
    r.file = s.file;
    r.direct = f.fd_direct >= 0 && !f.direct_refused;
    r.fd = r.direct ? f.fd_direct : f.fd;
    r.fd_buffered = f.fd;
    r.path = f.path;
    r.file_size = f.size;
    r.dst = buffer + s.at;
    r.offset = s.begin;
    r.bytes = s.end - s.begin;
    // The aligned range may run past the end of the file: only bytes up to the end must arrive.
    r.need = std::min(r.bytes, f.size - s.begin);
    TS_CHECK(r.need > 0, "expert streaming: {}: offset {} is past the end ({} bytes): the file changed", f.path,
             s.begin, f.size);
    out.push_back(std::move(r));
  }
}

namespace {

// One completion's effect on a read: bytes arrived, an error, or end of file too early.
// O_DIRECT continues only from an aligned point, so a partial count is cut back to one.
void take_result(int64_t got, int64_t at, int64_t& done, int64_t need, bool direct, const std::string& path,
                 std::string& error) {
  if (got < 0) {
    error = fmt::format("expert streaming: read of {} bytes at offset {} of {} failed: {}", need - done, at, path,
                        std::strerror(int(-got)));
  } else if (got == 0) {
    error = fmt::format("expert streaming: short read at offset {} of {} ({} of {} bytes): the file is truncated or "
                        "changed",
                        at, path, done, need);
  } else {
    done += got;
    if (direct && done < need && done % kAlign != 0) done = done / kAlign * kAlign;
  }
}

#if TURBOSPARK_HAVE_URING
// One ring per thread that reads (the backend's thread on a miss, the I/O thread for
// prefetches): a ring takes submissions from one thread at a time.
struct Ring {
  io_uring ring{};
  bool ok = false;
  Ring() { ok = io_uring_queue_init(64, &ring, 0) == 0; }
  ~Ring() {
    if (ok) io_uring_queue_exit(&ring);
  }
};
Ring* thread_ring() {
  thread_local Ring r;
  return r.ok ? &r : nullptr;
}
#endif

}  // namespace

void ExpertStreamer::refuse_direct(Read& r) {
  r.direct = false;
  r.fd = r.fd_buffered;
  std::lock_guard<std::mutex> lock(mu_);
  files_[size_t(r.file)].direct_refused = true;
}

void ExpertStreamer::submit_pread(Read& r) {
  while (r.error.empty() && r.done < r.need) {
    const ssize_t got = opt_.pread_fn(r.fd, r.dst + r.done, size_t(r.bytes - r.done), off_t(r.offset + r.done));
    if (got < 0 && errno == EINTR) continue;
    int64_t res = got < 0 ? -int64_t(errno) : int64_t(got);
    if (opt_.result_fn) res = opt_.result_fn(res);
    if (res == -EINVAL && r.direct) {  // O_DIRECT opened but refused here
      refuse_direct(r);
      continue;
    }
    take_result(res, r.offset + r.done, r.done, r.need, r.direct, r.path, r.error);
  }
}

void ExpertStreamer::run_reads(std::vector<Read>& reads) {
#if TURBOSPARK_HAVE_URING
  Ring* ring = opt_.io_uring && !pread_fn_set_ ? thread_ring() : nullptr;
  if (ring) {
    // Every unfinished read in flight at once; completions matched by index.
    for (;;) {
      int submitted = 0;
      for (size_t i = 0; i < reads.size(); ++i) {
        Read& r = reads[i];
        if (!r.error.empty() || r.done >= r.need) continue;
        io_uring_sqe* sqe = io_uring_get_sqe(&ring->ring);
        if (!sqe) break;  // ring full: the rest go in the next round
        io_uring_prep_read(sqe, r.fd, r.dst + r.done, unsigned(r.bytes - r.done), uint64_t(r.offset + r.done));
        io_uring_sqe_set_data64(sqe, uint64_t(i));
        ++submitted;
      }
      if (submitted == 0) return;
      const int rc = io_uring_submit_and_wait(&ring->ring, unsigned(submitted));
      if (rc < 0) fail("expert streaming: io_uring submit failed: {}", std::strerror(-rc));
      for (int n = 0; n < submitted; ++n) {
        io_uring_cqe* cqe = nullptr;
        const int wr = io_uring_wait_cqe(&ring->ring, &cqe);
        if (wr < 0) fail("expert streaming: io_uring wait failed: {}", std::strerror(-wr));
        Read& r = reads[size_t(io_uring_cqe_get_data64(cqe))];
        int64_t got = cqe->res;
        io_uring_cqe_seen(&ring->ring, cqe);
        if (got == -EINTR || got == -EAGAIN) continue;  // resubmitted next round
        if (opt_.result_fn) got = opt_.result_fn(got);
        if (got == -EINVAL && r.direct) {  // O_DIRECT refused by the file system
          refuse_direct(r);
          continue;
        }
        take_result(got, r.offset + r.done, r.done, r.need, r.direct, r.path, r.error);
      }
    }
  }
#endif
  for (Read& r : reads) submit_pread(r);
}

void ExpertStreamer::bind(Slot& s, const ExpertWeights& stored, const Layout& layout) {
  s.weights = stored;
  const std::vector<PlaneField> planes = expert_planes(s.weights);
  for (size_t i = 0; i < planes.size(); ++i)
    if (layout.plane_at[i] >= 0) *planes[i].field = s.buffer + layout.plane_at[i];
}

int32_t ExpertStreamer::place(int32_t layer, int32_t expert, bool* load, bool guess) {
  std::vector<int32_t> protect;
  int64_t busy = 0;  // slots loading, awaiting their acquire or in use
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& o = slots_[i];
      const bool held = o.state == SlotState::kLoading || o.awaiting || int32_t(i) == in_use_;
      busy += held;
      const bool demanded =
          guess && std::find(demand_keys_.begin(), demand_keys_.end(), o.key) != demand_keys_.end();
      if (held || demanded) protect.push_back(int32_t(i));
    }
  }
  // A guess never takes a slot the demand path may need: that path holds at most depth awaiting
  // slots and the one in use, and a miss needs one more, so guesses in flight stay within
  // slots - depth - 2 (with the seed's one-bank lesson in mind: no guess may make a demand
  // placement find every slot held). No free slot: no guess.
  if (guess && (busy + 1 > int64_t(slots_.size()) - opt_.prefetch_depth - 2 || protect.size() >= slots_.size())) {
    *load = false;
    return -1;
  }
  const int32_t e[1] = {expert};
  const ExpertCache::Plan plan = cache_.plan(layer, e, protect);
  *load = plan.load[0] != 0;
  if (*load) slots_[size_t(plan.slot[0])].speculative = false;  // an unused guess evicted
  return plan.slot[0];
}

void ExpertStreamer::clear_awaiting() {
  for (Slot& o : slots_) o.awaiting = false;
  awaiting_ = 0;
}

const ExpertWeights& ExpertStreamer::acquire(const ExpertWeights& stored) {
  ++stats_.acquires;
  const Layout& layout = layout_of(stored);
  if (layout.in_place) {
    ++stats_.in_place;
    return stored;
  }
  const int32_t layer = stored.gate.layer, expert = stored.gate.expert;
  in_use_ = -1;  // the backend is done with the previous expert
  bool load = false;
  const int32_t slot = place(layer, expert, &load);
  Slot& s = slots_[size_t(slot)];
  std::unique_lock<std::mutex> lock(mu_);
  if (load) {
    // A miss: read it here while the backend waits.
    ++stats_.misses;
    s.state = SlotState::kLoading;
    s.key = key_of(layer, expert);
    lock.unlock();
    const auto t0 = Clock::now();
    try {
      ensure_capacity(s, layout.bytes);
      std::vector<Read> reads;
      plan_reads(layout, s.buffer, reads);
      run_reads(reads);
      for (const Read& r : reads)
        if (!r.error.empty()) fail("{}", r.error);
      verify(layout, s.buffer);
    } catch (...) {
      cache_.invalidate(slot);
      lock.lock();
      s.state = SlotState::kEmpty;
      s.key = -1;
      clear_awaiting();
      throw;
    }
    const double dt = seconds_since(t0);
    bind(s, stored, layout);
    lock.lock();
    s.state = SlotState::kReady;
    stats_.read_seconds += dt;
    stats_.stall_seconds += dt;
    stats_.bytes_read += layout.bytes;
  } else {
    ++stats_.hits;
    if (s.speculative) {
      s.speculative = false;
      ++stats_.speculated_used;
    }
    if (s.awaiting) {
      s.awaiting = false;
      --awaiting_;
    }
    if (s.state == SlotState::kLoading) {
      const auto t0 = Clock::now();
      cv_.wait(lock, [&] { return s.state != SlotState::kLoading; });
      stats_.stall_seconds += seconds_since(t0);
    }
    if (s.state == SlotState::kFailed) {
      std::exception_ptr err = s.error;
      s.state = SlotState::kEmpty;
      s.key = -1;
      s.error = nullptr;
      clear_awaiting();
      lock.unlock();
      cache_.invalidate(slot);
      std::rethrow_exception(err);
    }
  }
  in_use_ = slot;
  return s.weights;
}

void ExpertStreamer::prefetch(std::span<const ExpertWeights* const> next) {
  int issued = 0;
  bool all = true;  // every expert of `next` resident or under way
  {
    std::lock_guard<std::mutex> lock(mu_);
    demand_keys_.clear();
    for (const ExpertWeights* w : next) demand_keys_.push_back(key_of(w->gate.layer, w->gate.expert));
  }
  for (const ExpertWeights* w : next) {
    std::unique_lock<std::mutex> lock(mu_);
    // Prefetched-but-unused slots are protected: at most depth (<= slots - 1) of them, so a
    // miss still finds a slot.
    if (awaiting_ >= opt_.prefetch_depth) {
      all = false;
      break;
    }
    lock.unlock();
    const Layout& layout = layout_of(*w);
    if (layout.in_place) continue;
    const int32_t layer = w->gate.layer, expert = w->gate.expert;
    if (cache_.slot_of(layer, expert)) continue;  // resident or under way: nothing to do
    bool load = false;
    const int32_t slot = place(layer, expert, &load);
    Slot& s = slots_[size_t(slot)];
    ensure_capacity(s, layout.bytes);
    bind(s, *w, layout);
    lock.lock();
    s.state = SlotState::kLoading;
    s.awaiting = true;
    ++awaiting_;
    s.key = key_of(layer, expert);
    s.error = nullptr;
    ++stats_.prefetched;
    ++issued;
    queue_.push_back({slot, &layout});
  }
  if (issued > 0) cv_.notify_all();  // once: the I/O thread takes the whole batch
  // What the micro-batch needs is all under way: the next layer's guess may start.
  if (all && !guess_.empty()) release_speculation();
}

void ExpertStreamer::speculate(std::span<const ExpertWeights* const> likely) {
  if (!opt_.speculate) return;
  guess_.assign(likely.begin(), likely.end());
}

void ExpertStreamer::release_speculation() {
  std::vector<const ExpertWeights*> guess;
  guess.swap(guess_);
  if (guess.size() > size_t(opt_.top_k)) guess.resize(size_t(opt_.top_k));  // a step's worth at most
  int issued = 0;
  for (const ExpertWeights* w : guess) {
    const Layout& layout = layout_of(*w);
    if (layout.in_place) continue;
    const int32_t layer = w->gate.layer, expert = w->gate.expert;
    if (cache_.slot_of(layer, expert)) continue;  // resident or under way
    bool load = false;
    const int32_t slot = place(layer, expert, &load, /*guess=*/true);
    if (!load || slot < 0) continue;
    Slot& s = slots_[size_t(slot)];
    ensure_capacity(s, layout.bytes);
    bind(s, *w, layout);
    std::lock_guard<std::mutex> lock(mu_);
    s.state = SlotState::kLoading;
    s.speculative = true;
    s.key = key_of(layer, expert);
    s.error = nullptr;
    ++stats_.speculated;
    ++issued;
    queue_.push_back({slot, &layout});
  }
  if (issued > 0) cv_.notify_all();
}

void ExpertStreamer::io_loop() {
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    // Every queued load at once: all their spans go in flight together.
    std::vector<Job> jobs(queue_.begin(), queue_.end());
    queue_.clear();
    std::vector<uint8_t*> buffers;
    for (const Job& j : jobs) buffers.push_back(slots_[size_t(j.slot)].buffer);
    lock.unlock();
    const auto t0 = Clock::now();
    std::vector<Read> reads;
    std::vector<size_t> first(jobs.size() + 1, 0);
    std::vector<std::exception_ptr> errors(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      try {
        plan_reads(*jobs[i].layout, buffers[i], reads);
      } catch (...) {
        errors[i] = std::current_exception();
      }
      first[i + 1] = reads.size();
    }
    try {
      run_reads(reads);
    } catch (...) {
      for (auto& e : errors)
        if (!e) e = std::current_exception();
    }
    // Each load's first read error, else its store record's checksum (outside the lock: the
    // compute thread's acquire() needs it meanwhile).
    for (size_t i = 0; i < jobs.size(); ++i) {
      for (size_t r = first[i]; r < first[i + 1] && !errors[i]; ++r) {
        if (!reads[r].error.empty()) errors[i] = std::make_exception_ptr(Error(reads[r].error));
      }
      if (!errors[i]) {
        try {
          verify(*jobs[i].layout, buffers[i]);
        } catch (...) {
          errors[i] = std::current_exception();
        }
      }
    }
    const double dt = seconds_since(t0);
    lock.lock();
    stats_.read_seconds += dt;
    for (size_t i = 0; i < jobs.size(); ++i) {
      Slot& s = slots_[size_t(jobs[i].slot)];
      if (!errors[i]) stats_.bytes_read += jobs[i].layout->bytes;
      s.state = errors[i] ? SlotState::kFailed : SlotState::kReady;
      // Moved, not copied: this thread keeps no reference, so the exception is destroyed by
      // the thread that caught it rather than here, concurrently with its what() (TSan).
      s.error = std::move(errors[i]);
    }
    lock.unlock();
    cv_.notify_all();
  }
}

void ExpertStreamer::verify(const Layout& layout, const uint8_t* buffer) const {
  if (!layout.record) return;
  const ExpertStoreRecord& r = *layout.record;
  const uint64_t sum = expert_store_checksum(buffer, r.bytes);
  if (sum != r.checksum)
    fail("expert store {}: the record of layer {} expert {} ({} bytes at {} in {}) fails its checksum (XXH3-64 {:016x}, "
         "the index says {:016x}): the file is damaged or was rewritten", opt_.store->dir(), r.layer, r.expert, r.bytes,
         r.offset, opt_.store->data_path(), sum, r.checksum);
}

std::vector<ExpertStreamer::FileRange> ExpertStreamer::file_ranges(const ExpertWeights& stored) {
  if (opt_.store) {
    // Read from the store: the ranges the expert occupies in the model's own files, which are
    // then never read at all.
    ExpertWeights copy = stored;
    std::vector<FileRange> out;
    for (const PlaneField& p : expert_planes(copy)) {
      if (p.bytes == 0) continue;
      if (auto loc = locate_mapped(*p.field, p.bytes)) out.push_back({loc->path, loc->offset, loc->offset + p.bytes});
    }
    return out;
  }
  const Layout& L = layout_of(stored);
  std::vector<FileRange> out;
  for (const Span& s : L.spans) out.push_back({files_[size_t(s.file)].path, s.begin, s.end});
  return out;
}

bool ExpertStreamer::uses_io_uring() const {
#if TURBOSPARK_HAVE_URING
  return opt_.io_uring && !pread_fn_set_ && thread_ring() != nullptr;
#else
  return false;
#endif
}

std::string ExpertStreamer::summary() const {
  std::lock_guard<std::mutex> lock(mu_);
  const ExpertStreamStats& st = stats_;
  const double hit = 100.0 * st.hit_rate();
  return fmt::format(
      "expert cache: {} slots of {:.2f} MiB ({}, {}), {} acquires, {:.1f}% hits ({} loads: {} waited for, {} prefetched{}), "
      "{:.2f} GiB read at {:.2f} GB/s, {:.3f} s stalled",
      cache_.slots(), double(slot_bytes_) / (1 << 20), eviction_policy_name(cache_.policy()),
      uses_io_uring() ? "io_uring" : "pread", st.acquires, hit, st.loads(), st.misses, st.prefetched,
      opt_.speculate ? fmt::format(", {} of {} guessed used ({:.1f}%)", st.speculated_used, st.speculated,
                                   st.speculated > 0 ? 100.0 * double(st.speculated_used) / double(st.speculated) : 0.0)
                     : std::string(),
      double(st.bytes_read) / (1 << 30), st.read_seconds > 0 ? double(st.bytes_read) / 1e9 / st.read_seconds : 0.0, st.stall_seconds);
}

}  // namespace turbospark
