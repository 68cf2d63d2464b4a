// Expert streaming, CPU tier: routed experts read from the checkpoint file into a bounded set
// of RAM slots as the backend asks for them, instead of through the memory mapping, so a MoE
// model whose experts exceed RAM runs with the slots' memory plus the resident part.
//
// Where bytes come from: each stored expert's planes (gate, up, down: codes, scales, biases)
// point into a MappedFile; locate_mapped() turns them into (file, offset). The planes of one
// expert are read as few spans as possible: overlapping planes (gpt-oss's interleaved gate/up
// rows) share one span, so the copy keeps their relative layout. Spans are widened to 4 KiB
// boundaries and read with O_DIRECT where the file system allows it (no page-cache copy: the
// memory bound holds), with buffered reads otherwise. Experts not in a mapping (float stacks a
// checkpoint transposed into its own memory) are served in place and counted as resident.
//
// Placement and eviction are ExpertCache's (experts/expert_cache.h). acquire() returns the
// expert in its slot, loading it first on a miss (the caller waits: a stall). prefetch() hands
// the next experts of the micro-batch to one I/O thread, so their reads overlap the current
// expert's compute; slots being loaded and the slot in use are protected from eviction, and no
// more than slots - 1 loads are in flight, so a miss always finds a slot.
//
// Reads: io_uring (liburing) with every span of the loads at hand in flight at once (a miss's
// spans; all queued prefetches' spans), one ring per reading thread; pread where liburing is
// not built in or the kernel refuses a ring (some container sandboxes).
//
// Failures: a short read, an I/O error or a file whose size or modification time changed since
// it was opened throws an Error naming the file, offset and cause; the slot is emptied, never
// left holding wrong bytes.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "experts/expert_cache.h"
#include "experts/expert_store.h"
#include "ops/backend.h"

namespace turbospark {

struct ExpertStreamStats {
  int64_t acquires = 0;        // experts the backend asked for
  int64_t hits = 0;            // in a slot or on its way there (includes prefetched ones)
  int64_t misses = 0;          // loaded while the backend waited
  int64_t prefetched = 0;      // loads started by prefetch()
  int64_t speculated = 0;      // loads started by speculate() (a guess)
  int64_t speculated_used = 0; // of those, acquired before being evicted
  int64_t in_place = 0;        // acquires served from memory the checkpoint owns
  int64_t bytes_read = 0;      // from disk, including 4 KiB alignment
  double read_seconds = 0;     // inside read calls (the I/O thread's and misses')
  double stall_seconds = 0;    // acquire() waiting for bytes
  // Loads per streamed acquire: the cache's miss rate whether the load was a prefetch or not
  // (a speculative load counts once an acquire uses it; unused ones only cost bytes).
  int64_t loads() const { return misses + prefetched + speculated_used; }
  double hit_rate() const {
    const int64_t streamed = acquires - in_place;
    return streamed > 0 ? std::max(0.0, 1.0 - double(loads()) / double(streamed)) : 0.0;
  }
};

struct ExpertStreamOptions {
  int64_t slots = 0;
  int top_k = 1;
  EvictionPolicy policy = EvictionPolicy::kLru;
  int prefetch_depth = 2;  // loads prefetch() may have in flight (capped at slots - 1)
  // speculate(): load the guessed experts of the next layer once the ones at hand are under
  // way (refused below 2 x top_k slots: a guess would evict what the next acquires need).
  bool speculate = false;
  bool direct_io = true;   // O_DIRECT where the file system supports it
  bool io_uring = true;    // io_uring with every span of the loads at hand in flight; else pread
  // Read experts from this store (one aligned read per expert, checksummed) instead of the
  // model's own files.
  std::shared_ptr<const ExpertStore> store;
  // Test hooks for injected faults. pread_fn replaces the read primitive (and selects the
  // pread path): the count read, or -1 with errno set. result_fn sees each io_uring completion
  // (the byte count or -errno) and returns what the streamer should take it for.
  std::function<ssize_t(int fd, void* dst, size_t bytes, off_t offset)> pread_fn;
  std::function<int64_t(int64_t result)> result_fn;
};

class ExpertStreamer final : public ExpertProvider {
 public:
  explicit ExpertStreamer(ExpertStreamOptions options);
  ~ExpertStreamer() override;
  ExpertStreamer(const ExpertStreamer&) = delete;
  ExpertStreamer& operator=(const ExpertStreamer&) = delete;

  const ExpertWeights& acquire(const ExpertWeights& stored) override;
  void prefetch(std::span<const ExpertWeights* const> next) override;
  bool speculates() const override { return opt_.speculate; }
  void speculate(std::span<const ExpertWeights* const> likely) override;

  const ExpertStreamStats& stats() const { return stats_; }
  // A copy taken under the lock the I/O thread updates them under (for readers on other threads).
  ExpertStreamStats stats_snapshot() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  const ExpertCache& cache() const { return cache_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  // The file byte ranges [begin, end) the expert is read from (empty when served in place).
  struct FileRange {
    std::string path;
    int64_t begin, end;
  };
  std::vector<FileRange> file_ranges(const ExpertWeights& stored);
  // Whether reads go through io_uring (built with liburing and the kernel allows it) or pread.
  bool uses_io_uring() const;
  // One line: slots, policy, hit rate, bytes and GB/s read, stall time.
  std::string summary() const;

 private:
  struct Span {  // one read: file bytes [begin, end) (4 KiB aligned) to slot offset `at`
    int file;
    int64_t begin, end, at;
  };
  struct PlaneRef {  // a pointer field of the slot's ExpertWeights copy and its slot offset
    const void** field;
    int64_t at;
  };
  struct Layout {
    bool in_place = false;
    const ExpertStoreRecord* record = nullptr;  // read from the store: checked against its checksum
    std::vector<Span> spans;
    int64_t bytes = 0;
    // Plane offsets in the slot, in the order expert_planes() lists them (-1: an empty plane).
    std::vector<int64_t> plane_at;
  };
  struct File {
    std::string path;
    int fd_direct = -1, fd = -1;
    bool direct_refused = false;  // the file system refused an O_DIRECT read: buffered from then on
    int64_t size = 0;
    int64_t mtime_ns = 0;
  };
  enum class SlotState { kEmpty, kLoading, kReady, kFailed };
  struct Slot {
    uint8_t* buffer = nullptr;
    int64_t capacity = 0;
    SlotState state = SlotState::kEmpty;
    bool awaiting = false;  // prefetched for the micro-batch at hand, not yet acquired: kept
    bool speculative = false;  // loaded by speculate(), not acquired since
    std::exception_ptr error;
    ExpertWeights weights;  // views into buffer
    int64_t key = -1;
  };
  struct Job {
    int32_t slot;
    const Layout* layout;
  };

  static int64_t key_of(int32_t layer, int32_t expert) { return int64_t(layer) << 32 | uint32_t(expert); }
  const Layout& layout_of(const ExpertWeights& stored);
  int file_index(const std::string& path, int64_t size);
  void ensure_capacity(Slot& s, int64_t bytes);
  // One span's read: the part still to come, and the first failure.
  struct Read {
    int file = -1;
    int fd = -1;
    int fd_buffered = -1;  // where an O_DIRECT read the file system refuses (EINVAL) retries
    bool direct = false;
    std::string path;
    int64_t file_size = 0, mtime_ns = 0;
    uint8_t* dst = nullptr;
    int64_t offset = 0, bytes = 0, need = 0, done = 0;
    std::string error;  // empty while fine
  };
  // The reads of a layout's spans into buffer (checks the files have not changed).
  void plan_reads(const Layout& layout, uint8_t* buffer, std::vector<Read>& out);
  // Runs reads until each is complete or failed (any thread; io_uring or pread).
  void run_reads(std::vector<Read>& reads);
  void submit_pread(Read& r);
  // An O_DIRECT read came back EINVAL: this read and every later one of its file go buffered.
  void refuse_direct(Read& r);
  void bind(Slot& s, const ExpertWeights& stored, const Layout& layout);
  // A store record's checksum against the bytes read into buffer; throws naming the record.
  void verify(const Layout& layout, const uint8_t* buffer) const;
  // The slot for (layer, expert) by the cache's policy, never one being loaded, awaiting its
  // acquire or in use (nor, for a guess, one the last prefetch() list names); *load when its
  // bytes must be read there.
  int32_t place(int32_t layer, int32_t expert, bool* load, bool guess = false);
  void clear_awaiting();  // under mu_: after a failure, what was prefetched may never be acquired
  // Starts the pending guess's loads (prefetch() calls it once its list is all under way).
  void release_speculation();
  void io_loop();

  ExpertStreamOptions opt_;
  bool pread_fn_set_ = false;  // a test's read primitive: the pread path
  ExpertCache cache_;
  std::vector<Slot> slots_;
  std::map<int64_t, Layout> layouts_;
  std::vector<File> files_;
  int64_t slot_bytes_ = 0;
  int32_t in_use_ = -1;
  ExpertStreamStats stats_;

  mutable std::mutex mu_;  // guards slot states, errors, the queue and the I/O thread's stats
  std::condition_variable cv_;
  std::deque<Job> queue_;
  int64_t awaiting_ = 0;  // slots with awaiting set
  std::vector<const ExpertWeights*> guess_;    // speculate()'s experts, not yet started
  std::vector<int64_t> demand_keys_;           // the last prefetch() list: guesses never evict these
  bool stop_ = false;
  std::thread io_;
};

}  // namespace turbospark
