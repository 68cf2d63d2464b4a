// The set torch.topk(scores, k, largest=True) picks on the CPU, computed where std:: is not
// available (CUDA device code): QSA's block selection (backends/cuda/qsa.cu).
//
// Why an emulation and not any correct top-k: QSA scores tie often (relu zeroes every index
// head for many blocks, so several blocks score exactly 0) and the blocks tied at the cutoff
// decide which tokens a query attends to. transformers calls torch.topk on the CPU, which
// runs a partial sort when k * 64 <= n and otherwise an nth_element over (value, index)
// pairs compared by value only; which of the tied pairs end up in front is whatever that
// sequence of swaps leaves there. The CPU backend calls the same std:: algorithms
// (backends/cpu/hybrid_ops.cpp). This header carries out the same sequence of comparisons and
// moves (heap selection for the partial sort; median-of-three introselect with an insertion
// sort of short ranges for nth_element), so the chosen set is the same, ties included.
// tests/unit/test_topk_like_torch.cpp holds it to the std:: algorithms over tie-heavy inputs.
//
// Only the set of the first k is specified; their order is not (QSA turns the selection
// into a mask).
#pragma once

#if defined(__CUDACC__)
#define TS_HOST_DEVICE __host__ __device__
#else
#define TS_HOST_DEVICE
#endif

namespace turbospark {

struct ScoredIndex {
  float score;
  int index;
};

namespace topk_detail {

// The order both algorithms are given: strictly greater score first (NaN compares false).
TS_HOST_DEVICE inline bool ahead(const ScoredIndex& x, const ScoredIndex& y) { return x.score > y.score; }

TS_HOST_DEVICE inline void swap_at(ScoredIndex* a, int i, int j) {
  const ScoredIndex t = a[i];
  a[i] = a[j];
  a[j] = t;
}

// Heap over a[0, len) whose root is the element every other is ahead of (the lowest score).
// Places `value` at `hole`: the hole first walks down to a leaf, always into the child that is
// not ahead of its sibling (the right one unless the right is ahead of the left), then
// `value` climbs back while its parent is ahead of it.
TS_HOST_DEVICE inline void heap_place(ScoredIndex* a, int hole, int len, ScoredIndex value) {
  const int top = hole;
  int child = hole;
  while (child < (len - 1) / 2) {
    child = 2 * (child + 1);
    if (ahead(a[child], a[child - 1])) --child;
    a[hole] = a[child];
    hole = child;
  }
  if ((len & 1) == 0 && child == (len - 2) / 2) {
    child = 2 * (child + 1);
    a[hole] = a[child - 1];
    hole = child - 1;
  }
  int parent = (hole - 1) / 2;
  while (hole > top && ahead(a[parent], value)) {
    a[hole] = a[parent];
    hole = parent;
    parent = (hole - 1) / 2;
  }
  a[hole] = value;
}

TS_HOST_DEVICE inline void heap_build(ScoredIndex* a, int len) {
  if (len < 2) return;
  for (int parent = (len - 2) / 2;; --parent) {
    heap_place(a, parent, len, a[parent]);
    if (parent == 0) return;
  }
}

// a[0, middle) ends up holding `middle` elements no element of a[middle, n) is ahead of:
// each later element strictly ahead of the heap's root replaces it.
TS_HOST_DEVICE inline void heap_select(ScoredIndex* a, int middle, int n) {
  heap_build(a, middle);
  for (int i = middle; i < n; ++i) {
    if (ahead(a[i], a[0])) {
      const ScoredIndex value = a[i];
      a[i] = a[0];
      heap_place(a, 0, middle, value);
    }
  }
}

// Moves the median of a[x], a[y], a[z] (by `ahead`) to a[result].
TS_HOST_DEVICE inline void median_to(ScoredIndex* a, int result, int x, int y, int z) {
  if (ahead(a[x], a[y])) {
    if (ahead(a[y], a[z])) {
      swap_at(a, result, y);
    } else if (ahead(a[x], a[z])) {
      swap_at(a, result, z);
    } else {
      swap_at(a, result, x);
    }
  } else if (ahead(a[x], a[z])) {
    swap_at(a, result, x);
  } else if (ahead(a[y], a[z])) {
    swap_at(a, result, z);
  } else {
    swap_at(a, result, y);
  }
}

// Hoare partition of [lo, hi) around a[pivot] (outside the range), without bounds checks:
// the median-of-three guarantees a stopper on each side.
TS_HOST_DEVICE inline int partition_around(ScoredIndex* a, int lo, int hi, int pivot) {
  for (;;) {
    while (ahead(a[lo], a[pivot])) ++lo;
    --hi;
    while (ahead(a[pivot], a[hi])) --hi;
    if (!(lo < hi)) return lo;
    swap_at(a, lo, hi);
    ++lo;
  }
}

TS_HOST_DEVICE inline void insertion_sort(ScoredIndex* a, int lo, int hi) {
  if (lo == hi) return;
  for (int i = lo + 1; i < hi; ++i) {
    const ScoredIndex value = a[i];
    if (ahead(value, a[lo])) {
      for (int j = i; j > lo; --j) a[j] = a[j - 1];
      a[lo] = value;
    } else {
      int j = i;
      while (ahead(value, a[j - 1])) {
        a[j] = a[j - 1];
        --j;
      }
      a[j] = value;
    }
  }
}

TS_HOST_DEVICE inline int floor_log2(int n) {
  int r = 0;
  while (n > 1) {
    n >>= 1;
    ++r;
  }
  return r;
}

// nth_element(a, a + nth, a + n) by `ahead`.
TS_HOST_DEVICE inline void nth_element(ScoredIndex* a, int nth, int n) {
  if (n == 0 || nth == n) return;
  int lo = 0, hi = n;
  int depth = 2 * floor_log2(n);
  while (hi - lo > 3) {
    if (depth == 0) {
      heap_select(a + lo, nth + 1 - lo, hi - lo);
      swap_at(a, lo, nth);
      return;
    }
    --depth;
    const int mid = lo + (hi - lo) / 2;
    median_to(a, lo, lo + 1, mid, hi - 1);
    const int cut = partition_around(a, lo + 1, hi, lo);
    if (cut <= nth) {
      lo = cut;
    } else {
      hi = cut;
    }
  }
  insertion_sort(a, lo, hi);
}

}  // namespace topk_detail

// Reorders a[0, n) so that a[0, k) is the set torch.topk(k) picks on the CPU (1 <= k <= n),
// in no particular order.
TS_HOST_DEVICE inline void select_top_k_like_torch(ScoredIndex* a, int n, int k) {
  if (k <= 0 || k >= n) return;
  if (k * 64 <= n) {
    topk_detail::heap_select(a, k, n);
  } else {
    topk_detail::nth_element(a, k - 1, n);
  }
}

}  // namespace turbospark
