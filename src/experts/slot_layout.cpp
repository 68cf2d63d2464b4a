#include "experts/slot_layout.h"

#include <algorithm>

#include "core/error.h"
#include "core/quant.h"
#include "core/quant_grouped.h"

namespace turbospark {
namespace {

constexpr int64_t kPlaneAlign = 256;  // every plane 256-byte aligned in its slot: a device's vector loads

int64_t align_up(int64_t v) { return (v + kPlaneAlign - 1) / kPlaneAlign * kPlaneAlign; }

// Bytes from a plane's first row to the end of its last.
int64_t span(int64_t rows, int64_t stride, int64_t packed_row) { return rows <= 0 ? 0 : (rows - 1) * stride + packed_row; }

int64_t packed_group_row(const WeightView& w) {
  const int64_t groups = w.group_size > 0 ? w.cols / w.group_size : 0;
  return groups * int64_t(w.dtype == DType::MXFP4 ? 1 : dtype_size(w.scales_dtype));
}

struct HostPlane {
  const uint8_t* p = nullptr;
  int64_t bytes = 0;
};

// A view's data, scales and biases planes (null where absent) and their spans.
void host_planes(const WeightView& w, HostPlane out[3]) {
  int64_t packed = 0;
  if (is_grouped(w.dtype)) {
    packed = grouped_row_bytes(w.dtype, w.cols);
  } else if (is_quantized(w.dtype)) {
    packed = row_bytes(w.dtype, w.cols);
  } else {
    packed = w.cols * int64_t(dtype_size(w.dtype));
  }
  out[0] = {static_cast<const uint8_t*>(w.data), span(w.rows, w.row_bytes, packed)};
  out[1] = w.scales ? HostPlane{static_cast<const uint8_t*>(w.scales), span(w.rows, w.scales_row_bytes, packed_group_row(w))}
                    : HostPlane{};
  out[2] = w.biases ? HostPlane{static_cast<const uint8_t*>(w.biases), span(w.rows, w.biases_row_bytes, packed_group_row(w))}
                    : HostPlane{};
}

void all_planes(const ExpertWeights& e, HostPlane planes[3][3]) {
  host_planes(e.gate.view, planes[0]);
  host_planes(e.up.view, planes[1]);
  host_planes(e.down.view, planes[2]);
}

}  // namespace

ExpertSlotLayout ExpertSlotLayout::of(const ExpertWeights& e) {
  ExpertSlotLayout layout;
  HostPlane planes[3][3];
  all_planes(e, planes);
  for (int k = 0; k < 3; ++k) {
    const HostPlane& g = planes[0][k];
    const HostPlane& u = planes[1][k];
    if (g.p && u.p && u.p >= g.p && u.p < g.p + g.bytes) {
      planes[0][k].bytes = std::max(g.bytes, int64_t(u.p - g.p) + u.bytes);
      layout.plane_[1][k].shared = int64_t(u.p - g.p);
    }
  }
  int64_t at = 0;
  for (int v = 0; v < 3; ++v) {
    for (int k = 0; k < 3; ++k) {
      Plane& pl = layout.plane_[v][k];
      if (!planes[v][k].p) continue;
      pl.bytes = planes[v][k].bytes;
      if (pl.shared >= 0) continue;
      pl.offset = at;
      at += align_up(pl.bytes);
    }
  }
  layout.bytes_ = at;
  return layout;
}

void ExpertSlotLayout::for_each_copy(const ExpertWeights& e,
                                     const std::function<void(const void*, int64_t, int64_t)>& copy) const {
  HostPlane planes[3][3];
  all_planes(e, planes);
  for (int v = 0; v < 3; ++v) {
    for (int k = 0; k < 3; ++k) {
      const Plane& pl = plane_[v][k];
      const bool here = pl.offset >= 0 || pl.shared >= 0;
      TS_CHECK(here == (planes[v][k].p != nullptr) &&
                   (pl.shared < 0 || planes[1][k].p - planes[0][k].p == pl.shared),
               "expert slots: expert {} of layer {} ({}) is stored unlike the layer's layout", e.gate.expert,
               e.gate.layer, e.gate.name);
      if (pl.offset < 0) continue;  // absent, or inside the gate's copy
      TS_CHECK(planes[v][k].bytes <= pl.bytes, "expert slots: expert {} of layer {}: a plane of {} bytes in {}",
               e.gate.expert, e.gate.layer, planes[v][k].bytes, pl.bytes);
      copy(planes[v][k].p, pl.offset, pl.bytes);
    }
  }
}

void ExpertSlotLayout::views_in_slot(const ExpertWeights& host, void* slot_base, ExpertWeights* out) const {
  auto* base = static_cast<uint8_t*>(slot_base);
  WeightView* dst[3] = {&out->gate.view, &out->up.view, &out->down.view};
  const WeightView* src[3] = {&host.gate.view, &host.up.view, &host.down.view};
  for (int v = 0; v < 3; ++v) {
    WeightView d = *src[v];
    const void** ptr[3] = {&d.data, &d.scales, &d.biases};
    for (int k = 0; k < 3; ++k) {
      const Plane& pl = plane_[v][k];
      if (!*ptr[k]) continue;
      *ptr[k] = pl.shared >= 0 ? base + plane_[0][k].offset + pl.shared : base + pl.offset;
    }
    *dst[v] = d;
  }
}

ExpertWeights ExpertSlotLayout::in_slot(const ExpertWeights& host, void* slot_base) const {
  ExpertWeights out = host;
  views_in_slot(host, slot_base, &out);
  return out;
}

}  // namespace turbospark
