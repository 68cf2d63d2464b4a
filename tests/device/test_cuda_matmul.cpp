// CUDA weight products (backends/cuda/matmul.h) against references on the host: every weight
// format x ragged shapes for matmul (GEMV and GEMM paths), embedding and routed experts (decode
// and grouped prefill paths), plus the refusal of an unsupported dtype by name.
//
// References: a float64 product of the rows core's scalar dequantizer (dequantize_weight_row)
// produces, for every format. The CPU backend's quantized matmuls round activations to 8 bits
// (Q8_K / q8 blocks, int8 MXFP4 and INT4 paths) while the CUDA kernels keep f32 activations,
// so they are not a reference at 1e-5; the CPU backend is compared directly where it computes
// in float (F32/F16/BF16 matmul, MXFP4 in exact mode, every embedding, BF16 experts).
//
// Weight bytes are made by quantizing random floats with core's quantizers (random bytes would
// give Inf/NaN f16 scales). Strided views get 0xff padding between rows (NaN as any float), so
// a kernel reading past a row fails. Outputs are NaN-poisoned before every run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backends/cpu/mxfp4.h"
#include "backends/cuda/matmul.h"
#include "backends/cuda/ops.h"
#include "core/error.h"
#include "core/quant.h"
#include "core/quant_grouped.h"
#include "device/device_util.h"
#include "ops/backend.h"

namespace turbospark {
namespace {

using testing::DeviceBuffer;
using testing::normalized_error;
using testing::random_floats;

// Error bounds, per path:
// GEMV / decode MoE / embedding: weights dequantized exactly in f32 registers, f32 FMA
// accumulation over <= ~1000 terms: expected ~1e-7 relative, 1e-5 leaves room for a
// different summation order and fma contraction in the dequantizers.
constexpr double kF32Tol = 1e-5;
// bf16 GEMM (cuBLASLt) and grouped MoE tiles: activations (and, unless stored as bf16,
// weights; in the MoE also the hidden activations) rounded to bf16, 2^-9 relative each:
// expected ~2e-3 relative, bounded at 1e-2 (2e-2 for the MoE's three roundings in series).
constexpr double kBf16Tol = 1e-2;
constexpr double kMoeBf16Tol = 2e-2;
// GEMV / decode MoE with int8 activations (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, q8.cuh): each activation
// rounded to 1/254 of its 32-block's range, ~0.5% relative per element, so ~5e-3 on a dot
// product against the exact f32 reference; bounded at 2e-2. Against the CPU backend, which
// quantizes the same way, the codes are identical and only f32 summation order differs.
constexpr double kInt8Tol = 2e-2;
// F32 weights with 16-byte-aligned rows take TF32 (10-bit mantissas, expected ~5e-4), others
// (odd column counts) the bf16 path: both are held to the bf16 bound.
constexpr double kTf32Tol = kBf16Tol;

struct Format {
  DType dtype;
  DType plane = DType::U8;  // INT4_AFFINE scale/bias dtype
  int group = 0;            // INT4_AFFINE group size
  bool planes = false;      // Q4_0 rewritten into code/scale planes on the device (repack.cu)
  std::string name() const {
    std::string n(dtype_name(dtype));
    if (planes) n.append("_planes");
    if (dtype == DType::INT4_AFFINE) {
      n.append("_").append(dtype_name(plane)).append("_g").append(std::to_string(group));
    }
    return n;
  }
  // Smallest column count the format allows (cols must be a multiple of it).
  int64_t granule() const {
    if (dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16) return 1;
    if (dtype == DType::INT4_AFFINE) return group;
    return is_quantized(dtype) ? block_size(dtype) : 32;
  }
  bool is_float() const { return granule() == 1; }
};

const std::vector<Format>& all_formats() {
  static const std::vector<Format> formats = {
      {DType::F32},  {DType::F16},  {DType::BF16}, {DType::Q4_0}, {DType::Q4_1},
      {DType::Q4_0, DType::U8, 0, true},
      {DType::Q5_0}, {DType::Q5_1}, {DType::Q8_0}, {DType::Q4_K}, {DType::Q5_K},
      {DType::Q6_K}, {DType::MXFP4}, {DType::INT4_AFFINE, DType::BF16, 32},
      {DType::INT4_AFFINE, DType::F16, 64}, {DType::INT4_AFFINE, DType::F32, 128}};
  return formats;
}

int64_t plane_size(DType t) { return int64_t(dtype_size(t)); }

// A weight in host memory with the checkpoint's layout; `view` points into the vectors.
struct HostWeight {
  std::vector<uint8_t> data, scales, biases;
  WeightView view;
};

// rows x cols random weights in format f. stride_mult > 1 spaces rows (every plane) that many
// packed rows apart, with 0xff in the gaps.
HostWeight make_weight(const Format& f, int64_t rows, int64_t cols, uint32_t seed, int stride_mult = 1) {
  HostWeight h;
  WeightView& v = h.view;
  v.dtype = f.dtype;
  v.rows = rows;
  v.cols = cols;
  const std::vector<float> src = random_floats(size_t(rows * cols), seed);
  int64_t packed = 0, scale_bytes = 0, bias_bytes = 0;
  if (f.dtype == DType::MXFP4) {
    packed = cols / 2;
    scale_bytes = cols / 32;
    v.group_size = 32;
    v.scales_dtype = DType::U8;
  } else if (f.dtype == DType::INT4_AFFINE) {
    packed = cols / 2;
    scale_bytes = bias_bytes = cols / f.group * plane_size(f.plane);
    v.group_size = f.group;
    v.scales_dtype = f.plane;
  } else {
    packed = row_bytes(f.dtype, cols);
  }
  v.row_bytes = packed * stride_mult;
  v.scales_row_bytes = scale_bytes * stride_mult;
  v.biases_row_bytes = bias_bytes * stride_mult;
  h.data.assign(size_t(std::max<int64_t>(rows * v.row_bytes, 1)), 0xff);
  h.scales.assign(size_t(rows * v.scales_row_bytes), 0xff);
  h.biases.assign(size_t(rows * v.biases_row_bytes), 0xff);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src.data() + r * cols;
    uint8_t* d = h.data.data() + r * v.row_bytes;
    if (f.dtype == DType::MXFP4) {
      mxfp4::quantize_row(s, d, h.scales.data() + r * v.scales_row_bytes, cols);
    } else if (f.dtype == DType::INT4_AFFINE) {
      int4_affine::quantize_row(s, cols, f.group, f.plane, d, h.scales.data() + r * v.scales_row_bytes,
                                h.biases.data() + r * v.biases_row_bytes);
    } else {
      quantize_row(f.dtype, s, d, cols);
    }
  }
  v.data = h.data.data();
  v.scales = h.scales.empty() ? nullptr : h.scales.data();
  v.biases = h.biases.empty() ? nullptr : h.biases.data();
  return h;
}

// Device copies of every plane, same layout (or, with planes, Q4_0 rewritten the way the CUDA
// backend stores it); view points into device memory.
struct DevWeight {
  DeviceBuffer<uint8_t> data, scales, biases, planes;
  WeightView view;
};

DevWeight upload(const HostWeight& h, bool planes = false) {
  DevWeight d;
  if (planes) {
    const DevWeight raw = upload(h);
    d.planes = DeviceBuffer<uint8_t>(size_t(cuda::q4_0_planes_bytes(h.view.rows, h.view.cols)));
    d.planes.poison();
    d.view = cuda::launch_repack_q4_0(raw.view, d.planes.get(), nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return d;
  }
  d.view = h.view;
  d.data = DeviceBuffer<uint8_t>(h.data);
  d.view.data = d.data.get();
  if (!h.scales.empty()) {
    d.scales = DeviceBuffer<uint8_t>(h.scales);
    d.view.scales = d.scales.get();
  }
  if (!h.biases.empty()) {
    d.biases = DeviceBuffer<uint8_t>(h.biases);
    d.view.biases = d.biases.get();
  }
  return d;
}

std::vector<double> dequantized(const WeightView& w) {
  std::vector<float> row(size_t(w.cols));
  std::vector<double> out(size_t(w.rows * w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    dequantize_weight_row(w, r, row.data());
    std::copy(row.begin(), row.end(), out.begin() + r * w.cols);
  }
  return out;
}

// y[t, o] = sum_i w[o, i] x[t, i] in float64; x [rows, cols] dense.
std::vector<float> reference_matmul(const WeightView& w, const std::vector<float>& x, int64_t rows) {
  const std::vector<double> wd = dequantized(w);
  std::vector<float> y(size_t(rows * w.rows));
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t o = 0; o < w.rows; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < w.cols; ++i) acc += wd[size_t(o * w.cols + i)] * double(x[size_t(t * w.cols + i)]);
      y[size_t(t * w.rows + o)] = float(acc);
    }
  return y;
}

// A device matrix [rows, cols] with row stride `stride` starting `offset` floats into its buffer
// (offset 1 makes rows 4-byte but not 16-byte aligned).
struct DevMat {
  DeviceBuffer<float> buf;
  Mat mat;
  DevMat(int64_t rows, int64_t cols, int64_t stride, int64_t offset = 0)
      : buf(size_t(std::max<int64_t>(rows * stride + offset, 1))), mat(buf.get() + offset, rows, cols, stride) {}
  void upload(const std::vector<float>& dense) {
    std::vector<float> host(buf.size(), 0.f);
    for (int64_t r = 0; r < mat.rows; ++r)
      std::copy_n(dense.begin() + r * mat.cols, mat.cols, host.begin() + (mat.data - buf.get()) + r * mat.stride);
    buf.upload(host);
  }
  std::vector<float> download() const {
    const std::vector<float> host = buf.download();
    std::vector<float> dense(size_t(mat.rows * mat.cols));
    for (int64_t r = 0; r < mat.rows; ++r)
      std::copy_n(host.begin() + (mat.data - buf.get()) + r * mat.stride, mat.cols, dense.begin() + r * mat.cols);
    return dense;
  }
};

double matmul_tolerance(const cuda::WeightMatmul& mm, const Format& f, const WeightView& dev, int64_t rows) {
  if (rows <= cuda::kGemvMaxRows) {
    return cuda::gemv_int8_activations(dev, rows, mm.num_sms()) ? kInt8Tol : kF32Tol;
  }
  return f.dtype == DType::F32 ? kTf32Tol : kBf16Tol;
}

struct Shape {
  int64_t rows, out, in_granules;  // in = in_granules * granule (float formats: see below)
};

// ---- matmul -------------------------------------------------------------------------------

// The int8-activation path against the exact product, element by element: each activation
// is rounded to the nearest multiple of d = amax / 127 of its 32-block (|error| <= d / 2), so
// |got - want| <= sum_i |w_oi| * amax_b(i) / 254, plus f32 rounding. A normalized error over
// a handful of outputs cannot bound this path (one 32-term dot can nearly cancel); this can,
// and a wrong code or scale overshoots it by orders of magnitude.
void expect_within_int8_bound(const WeightView& w, const std::vector<float>& x, int64_t rows,
                              const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(w.cols % 32, 0) << what;
  const std::vector<double> wd = dequantized(w);
  std::vector<double> half_step(size_t(w.cols / 32));
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t b = 0; b < w.cols / 32; ++b) {
      double amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(double(x[size_t(t * w.cols + b * 32 + i)])));
      half_step[size_t(b)] = amax / 254.0;
    }
    for (int64_t o = 0; o < w.rows; ++o) {
      double bound = 0, mag = 0;
      for (int64_t i = 0; i < w.cols; ++i) {
        const double wi = std::fabs(wd[size_t(o * w.cols + i)]);
        bound += wi * half_step[size_t(i / 32)];
        mag += wi * std::fabs(double(x[size_t(t * w.cols + i)]));
      }
      const size_t at = size_t(t * w.rows + o);
      ASSERT_TRUE(std::isfinite(got[at])) << what << " row " << t << " out " << o;
      EXPECT_LE(std::fabs(double(got[at]) - double(want[at])), bound * 1.001 + 1e-6 * mag)
          << what << " row " << t << " out " << o;
    }
  }
}

// The f32 GEMV against the exact product, element by element, relative to sum_i |w_oi x_i|:
// a reordered f32 sum of n terms moves by ~sqrt(n) 2^-24 of that (~2e-6 at 1000 terms;
// kF32Tol leaves 5x), which holds where the dot product cancels and a normalized error over
// a handful of outputs does not (one Q6_K output of 256 terms measured 1.2e-5 of itself).
void expect_within_f32_bound(const WeightView& w, const std::vector<float>& x, int64_t rows,
                             const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  const std::vector<double> wd = dequantized(w);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t o = 0; o < w.rows; ++o) {
      double mag = 0;
      for (int64_t i = 0; i < w.cols; ++i) mag += std::fabs(wd[size_t(o * w.cols + i)] * x[size_t(t * w.cols + i)]);
      const size_t at = size_t(t * w.rows + o);
      ASSERT_TRUE(std::isfinite(got[at])) << what << " row " << t << " out " << o;
      EXPECT_LE(std::fabs(double(got[at]) - double(want[at])), kF32Tol * mag + 1e-30)
          << what << " row " << t << " out " << o;
    }
}

TEST(CudaMatmul, EveryFormatRaggedShapes) {
  cuda::WeightMatmul mm;
  // in columns: granule multiples for block formats; odd sizes for float formats.
  const Shape shapes[] = {{1, 1, 1}, {1, 7, 4}, {1, 1000, 3}, {3, 129, 2}, {3, 7, 1},
                          {17, 129, 3}, {17, 1000, 1}, {64, 129, 4}, {500, 7, 2}, {500, 129, 1}};
  uint32_t seed = 1;
  for (const Format& f : all_formats()) {
    for (const Shape& s : shapes) {
      const int64_t in = f.is_float() ? (s.in_granules == 1 ? 67 : 67 * s.in_granules + 5) : f.granule() * s.in_granules;
      for (int variant = 0; variant < 2; ++variant) {
        // variant 1: strided weight rows (2x), unaligned x and y with padded strides.
        const int stride_mult = variant ? 2 : 1;
        const HostWeight hw = make_weight(f, s.out, in, seed++, stride_mult);
        const DevWeight dw = upload(hw, f.planes);
        const std::vector<float> x = random_floats(size_t(s.rows * in), seed++);
        DevMat dx(s.rows, in, in + (variant ? 3 : 0), variant ? 1 : 0);
        DevMat dy(s.rows, s.out, s.out + (variant ? 5 : 0), variant ? 1 : 0);
        dx.upload(x);
        dy.buf.poison();
        mm.matmul(dw.view, dx.mat, dy.mat, nullptr);
        const std::vector<float> got = dy.download();
        const std::vector<float> want = reference_matmul(hw.view, x, s.rows);
        const std::string what = f.name() + " rows " + std::to_string(s.rows) + " out " + std::to_string(s.out) +
                                 " in " + std::to_string(in) + " variant " + std::to_string(variant);
        if (s.rows <= cuda::kGemvMaxRows && cuda::gemv_int8_activations(dw.view, s.rows, mm.num_sms())) {
          expect_within_int8_bound(hw.view, x, s.rows, got, want, what);
        } else if (s.rows <= cuda::kGemvMaxRows) {
          expect_within_f32_bound(hw.view, x, s.rows, got, want, what);
        } else {
          EXPECT_LE(normalized_error(got, want), matmul_tolerance(mm, f, dw.view, s.rows)) << what;
        }
      }
    }
  }
}

// y = x W^T for one random weight of format f and random x, from the CPU backend and from the
// CUDA GEMV/GEMM (device output poisoned first).
struct BothMatmuls {
  std::vector<float> cpu, cuda;
  bool int8 = false;  // the CUDA GEMV quantized the activations (gemv_int8_activations)
  double tolerance = 0;  // matmul_tolerance of the CUDA path
};
BothMatmuls cpu_and_cuda_matmul(Backend& cpu, cuda::WeightMatmul& mm, const Format& f, int64_t rows, int64_t out,
                                int64_t in, uint32_t& seed) {
  const HostWeight hw = make_weight(f, out, in, seed++);
  const DevWeight dw = upload(hw, f.planes);
  std::vector<float> x = random_floats(size_t(rows * in), seed++);
  BothMatmuls r;
  r.int8 = rows <= cuda::kGemvMaxRows && cuda::gemv_int8_activations(dw.view, rows, mm.num_sms());
  r.tolerance = matmul_tolerance(mm, f, dw.view, rows);
  r.cpu.resize(size_t(rows * out));
  Weight w;
  w.view = hw.view;
  cpu.matmul(w, Mat(x.data(), rows, in), Mat(r.cpu.data(), rows, out));
  DevMat dx(rows, in, in), dy(rows, out, out);
  dx.upload(x);
  dy.buf.poison();
  mm.matmul(dw.view, dx.mat, dy.mat, nullptr);
  r.cuda = dy.download();
  return r;
}

// The CPU backend computes these formats in float (MXFP4 in its exact mode): agree with it.
// matmul_shared_input (an attention layer's q, k and v in one GEMV launch): every output is
// bit-identical to its own matmul, for every format, decode row counts, ragged output sizes
// (blocks of the three jobs differ in number and split-K), strided outputs, and a mix of
// formats that cannot share a launch (each then runs alone).
TEST(CudaMatmul, SharedInputEqualsSeparateMatmulsBitForBit) {
  cuda::WeightMatmul mm;
  uint32_t seed = 7000;
  const std::vector<Format> formats = all_formats();
  for (size_t fi = 0; fi < formats.size(); ++fi) {
    const Format& f = formats[fi];
    const int64_t in = f.is_float() ? 203 : f.granule() * 3;
    for (int64_t rows : {int64_t(1), int64_t(3), int64_t(8)}) {
      const int64_t outs[3] = {129, 7, 1000};
      // The last case's third weight is of the next format: no shared launch possible.
      const Format& f3 = rows == 8 ? formats[(fi + 1) % formats.size()] : f;
      if (in % f3.granule() != 0) continue;
      std::vector<HostWeight> hws;
      std::vector<DevWeight> dws;
      hws.reserve(3);
      dws.reserve(3);
      for (int i = 0; i < 3; ++i) {
        hws.push_back(make_weight(i == 2 ? f3 : f, outs[i], in, seed++));
        dws.push_back(upload(hws.back(), (i == 2 ? f3 : f).planes));
      }
      const std::vector<float> x = random_floats(size_t(rows * in), seed++);
      DevMat dx(rows, in, in + 4);
      dx.upload(x);
      std::vector<DevMat> fused, alone;
      for (int i = 0; i < 3; ++i) {
        fused.emplace_back(rows, outs[i], outs[i] + 3);
        alone.emplace_back(rows, outs[i], outs[i]);
        fused.back().buf.poison();
        alone.back().buf.poison();
      }
      const WeightView* ws[3] = {&dws[0].view, &dws[1].view, &dws[2].view};
      const Mat ys[3] = {fused[0].mat, fused[1].mat, fused[2].mat};
      mm.matmul_shared_input(ws, dx.mat, ys, {}, nullptr);
      for (int i = 0; i < 3; ++i) mm.matmul(dws[i].view, dx.mat, alone[i].mat, nullptr);
      for (int i = 0; i < 3; ++i)
        EXPECT_EQ(fused[i].download(), alone[i].download())
            << f.name() << " + " << f3.name() << " rows " << rows << " job " << i;
    }
  }
}

// matmul_shared_input with activations (the GEMV applying acts[i] as it stores): every output
// equals its own matmul followed by cuda::unary, for every format, decode row counts, five and
// six weights (launches of max_gemv_jobs() at most, in order), every activation with pre and
// post factors, a mix of formats that cannot share a launch (the unfused fallback), and one
// weight alone with an activation. Both sides compute post * act(pre * v) on the same f32 v, so
// the bound is a few ulp (a wrong activation, factor or job moves outputs by O(1)).
TEST(CudaMatmul, SharedInputActivationsEqualMatmulThenUnary) {
  cuda::WeightMatmul mm;
  uint32_t seed = 7500;
  const std::vector<Format> formats = all_formats();
  const MatmulAct kinds[] = {{Act::kSilu, 0.25f, 1.f}, {Act::kSigmoid, 0.25f, 2.f}, {},
                             {Act::kGeluTanh, 1.f, 1.f}, {Act::kTanh, 0.5f, -3.f}, {Act::kIdentity, 2.f, 0.5f}};
  for (size_t fi = 0; fi < formats.size(); ++fi) {
    const Format& f = formats[fi];
    const int64_t in = f.is_float() ? 203 : f.granule() * 3;
    for (int64_t rows : {int64_t(1), int64_t(3), int64_t(8)})
      for (int n : {1, 5, 6}) {
        // rows 8 with six weights: the last is of the next format (its launch falls back).
        const Format& last = rows == 8 && n == 6 ? formats[(fi + 1) % formats.size()] : f;
        if (in % last.granule() != 0) continue;
        const int64_t outs[6] = {129, 7, 1000, 32, 1, 300};
        std::vector<HostWeight> hws;
        std::vector<DevWeight> dws;
        hws.reserve(size_t(n));
        dws.reserve(size_t(n));
        for (int i = 0; i < n; ++i) {
          const Format& fw = i == n - 1 ? last : f;
          hws.push_back(make_weight(fw, outs[i], in, seed++));
          dws.push_back(upload(hws.back(), fw.planes));
        }
        const std::vector<float> x = random_floats(size_t(rows * in), seed++, -2.f, 2.f);
        DevMat dx(rows, in, in + 4);
        dx.upload(x);
        std::vector<DevMat> fused, alone;
        std::vector<const WeightView*> ws;
        std::vector<Mat> ys;
        std::vector<MatmulAct> acts;
        for (int i = 0; i < n; ++i) {
          fused.emplace_back(rows, outs[i], outs[i] + 3);
          alone.emplace_back(rows, outs[i], outs[i]);
          fused.back().buf.poison();
          alone.back().buf.poison();
          ws.push_back(&dws[size_t(i)].view);
          acts.push_back(kinds[(size_t(i) + fi + size_t(rows)) % std::size(kinds)]);
        }
        for (int i = 0; i < n; ++i) ys.push_back(fused[size_t(i)].mat);
        mm.matmul_shared_input(ws, dx.mat, ys, acts, nullptr);
        for (int i = 0; i < n; ++i) {
          const MatmulAct& a = acts[size_t(i)];
          mm.matmul(dws[size_t(i)].view, dx.mat, alone[size_t(i)].mat, nullptr);
          cuda::unary(alone[size_t(i)].mat, a.act, a.pre, a.post, alone[size_t(i)].mat, nullptr);
        }
        for (int i = 0; i < n; ++i) {
          const std::vector<float> got = fused[size_t(i)].download(), want = alone[size_t(i)].download();
          EXPECT_LE(normalized_error(got, want), 1e-6)
              << f.name() << " + " << last.name() << " rows " << rows << " weights " << n << " job " << i << " act "
              << int(acts[size_t(i)].act);
        }
      }
  }
}

TEST(CudaMatmul, MatchesCpuBackendFloatPaths) {
  cpu::mxfp4_set_int8_activations(false);
  auto cpu = make_cpu_backend(2);
  cuda::WeightMatmul mm;
  uint32_t seed = 100;
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::MXFP4}) {
    const Format f{t};
    for (int64_t rows : {1, 3, 17}) {
      const int64_t out = 129, in = f.is_float() ? 131 : 256;
      const BothMatmuls y = cpu_and_cuda_matmul(*cpu, mm, f, rows, out, in, seed);
      EXPECT_LE(normalized_error(y.cuda, y.cpu), y.tolerance) << f.name() << " rows " << rows;
    }
  }
  cpu::mxfp4_set_int8_activations(true);
}

// The int8-activation GEMV formats on matrices with rows enough for the dp4a path (and one
// without: split-K keeps f32 activations): the CPU backend quantizes activations the same way,
// so on the dp4a path the two agree to f32 summation order at every decode row count; the f32
// path is held to kInt8Tol against the CPU's int8 result. Q4_0 (both layouts) and Q8_0 take the
// whole-block dp4a kernel (gemv_q4_dp4a_kernel) wherever their codes fit shared memory.
TEST(CudaMatmul, Int8ActivationPathsMatchCpuBackend) {
  auto cpu = make_cpu_backend(2);
  cuda::WeightMatmul mm;
  uint32_t seed = 300;
  int int8_cases = 0;
  const Format formats[] = {{DType::Q4_0}, {DType::Q4_0, DType::U8, 0, true}, {DType::Q4_1}, {DType::Q5_0},
                            {DType::Q5_1}, {DType::Q8_0}};
  for (const Format& f : formats) {
    for (int64_t rows : {1, 2, 3, 8}) {
      for (int64_t in : {32, 224, 2048, 6144}) {
        for (int64_t out : {int64_t(129), int64_t(rows == 1 ? 20000 : 9000)}) {
          if (out > 129 && in > 2048) continue;  // host-side cost; 6144 covers the f32 path
          const BothMatmuls y = cpu_and_cuda_matmul(*cpu, mm, f, rows, out, in, seed);
          const bool int8 = y.int8;
          int8_cases += int8;
          if (f.dtype == DType::Q4_0 || f.dtype == DType::Q8_0) {
            // Both Q4_0 layouts and Q8_0 take the whole-block dp4a kernel while the codes (1.25
            // bytes an activation) fit the 48 KiB of shared memory a block gets without opting in.
            EXPECT_EQ(int8, rows * in * 5 / 4 <= 48 * 1024) << f.name() << " rows " << rows << " in " << in;
          } else if (out == 129 && in >= 2048) {
            EXPECT_FALSE(int8) << f.name() << ": f32 activations (a 129-row matrix splits K)";
          }
          EXPECT_LE(normalized_error(y.cuda, y.cpu), int8 ? 1e-5 : kInt8Tol)
              << f.name() << " rows " << rows << " out " << out << " in " << in << (int8 ? " (int8)" : " (f32)");
        }
      }
    }
  }
  EXPECT_GE(int8_cases, 40) << "the dp4a path ran in too few cases to be tested";
}

// ---- embedding ----------------------------------------------------------------------------

TEST(CudaEmbedding, EveryFormatAgainstCpuBackend) {
  auto cpu = make_cpu_backend(2);
  cuda::WeightMatmul mm;
  uint32_t seed = 200;
  const std::vector<int32_t> ids = {3, 0, 36, 3, 17};  // duplicates, first and last rows
  const int64_t vocab = 37;
  for (const Format& f : all_formats()) {
    const int64_t cols = f.is_float() ? 67 : f.granule() * 3;
    const HostWeight hw = make_weight(f, vocab, cols, seed++, 2);
    const DevWeight dw = upload(hw, f.planes);
    const float scale = 0.75f;
    std::vector<float> want(ids.size() * size_t(cols));
    Weight w;
    w.view = hw.view;
    cpu->embedding(w, ids.data(), int64_t(ids.size()), scale, Mat(want.data(), int64_t(ids.size()), cols));
    DeviceBuffer<int32_t> dids(ids);
    DevMat out(int64_t(ids.size()), cols, cols + 3, 1);
    out.buf.poison();
    mm.embedding(dw.view, dids.get(), int64_t(ids.size()), scale, out.mat, nullptr);
    EXPECT_LE(normalized_error(out.download(), want), 1e-6) << f.name();
  }
}

TEST(CudaEmbedding, OutOfRangeIdGivesNanRow) {
  cuda::WeightMatmul mm;
  const HostWeight hw = make_weight(Format{DType::BF16}, 4, 16, 7);
  const DevWeight dw = upload(hw);
  DeviceBuffer<int32_t> ids(std::vector<int32_t>{1, 4});
  DevMat out(2, 16, 16);
  out.buf.poison();
  mm.embedding(dw.view, ids.get(), 2, 1.f, out.mat, nullptr);
  const std::vector<float> got = out.download();
  for (int i = 0; i < 16; ++i) {
    EXPECT_TRUE(std::isfinite(got[size_t(i)]));
    EXPECT_TRUE(std::isnan(got[size_t(16 + i)]));
  }
}

// ---- routed experts -------------------------------------------------------------------------

enum class GluKind { kSilu, kGelu, kClamped };

struct MoeCase {
  Format gate_up, down;
  int n_experts, k;
  int64_t rows, hidden, inter;
  GluKind glu;
  bool biases, interleaved;
  bool same_experts = false;  // every row picks the same k experts (concentrated routing)
};

struct HostExperts {
  std::vector<HostWeight> gate_up;  // one per expert: [inter, hidden] each, or fused [2 inter, hidden]
  std::vector<HostWeight> gate, up, down;
  std::vector<std::vector<float>> gate_bias, up_bias, down_bias;
};

// The even and odd rows of a fused [2 inter, hidden] matrix as the gate and up views.
std::pair<WeightView, WeightView> split_interleaved(const WeightView& fused) {
  WeightView g = fused;
  g.rows = fused.rows / 2;
  g.row_bytes *= 2;
  g.scales_row_bytes *= 2;
  g.biases_row_bytes *= 2;
  WeightView u = g;
  u.data = static_cast<const uint8_t*>(fused.data) + fused.row_bytes;
  if (fused.scales) u.scales = static_cast<const uint8_t*>(fused.scales) + fused.scales_row_bytes;
  if (fused.biases) u.biases = static_cast<const uint8_t*>(fused.biases) + fused.biases_row_bytes;
  return {g, u};
}

double glu_ref(GluKind kind, double g, double u, double alpha, double limit) {
  switch (kind) {
    case GluKind::kSilu: return g / (1 + std::exp(-g)) * u;
    case GluKind::kGelu: return 0.5 * g * (1 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))) * u;
    default: {
      const double gc = std::min(g, limit), uc = std::clamp(u, -limit, limit);
      return (uc + 1) * gc / (1 + std::exp(-gc * alpha));
    }
  }
}

void run_moe_case(cuda::WeightMatmul& mm, const MoeCase& c, uint32_t seed) {
  const int E = c.n_experts;
  const float alpha = 1.702f, limit = 2.f;  // inside the projections' range (std ~3): clamps engage on part
  // Host weights and their device copies.
  const size_t nE = size_t(E);
  std::vector<HostWeight> fused(nE), gate(nE), up(nE), down(nE);
  std::vector<DevWeight> dfused(nE), dgate(nE), dup(nE), ddown(nE);
  std::vector<std::vector<float>> gb(nE), ub(nE), db(nE);
  std::vector<DeviceBuffer<float>> dgb, dub, ddb;
  std::vector<ExpertWeights> experts(nE);
  std::vector<WeightView> host_gate(nE), host_up(nE);
  for (int e = 0; e < E; ++e) {
    ExpertWeights& x = experts[size_t(e)];
    if (c.interleaved) {
      fused[size_t(e)] = make_weight(c.gate_up, 2 * c.inter, c.hidden, seed++);
      dfused[size_t(e)] = upload(fused[size_t(e)], c.gate_up.planes);
      std::tie(host_gate[size_t(e)], host_up[size_t(e)]) = split_interleaved(fused[size_t(e)].view);
      std::tie(x.gate.view, x.up.view) = split_interleaved(dfused[size_t(e)].view);
    } else {
      gate[size_t(e)] = make_weight(c.gate_up, c.inter, c.hidden, seed++);
      up[size_t(e)] = make_weight(c.gate_up, c.inter, c.hidden, seed++);
      dgate[size_t(e)] = upload(gate[size_t(e)], c.gate_up.planes);
      dup[size_t(e)] = upload(up[size_t(e)], c.gate_up.planes);
      host_gate[size_t(e)] = gate[size_t(e)].view;
      host_up[size_t(e)] = up[size_t(e)].view;
      x.gate.view = dgate[size_t(e)].view;
      x.up.view = dup[size_t(e)].view;
    }
    down[size_t(e)] = make_weight(c.down, c.hidden, c.inter, seed++);
    ddown[size_t(e)] = upload(down[size_t(e)], c.down.planes);
    x.down.view = ddown[size_t(e)].view;
    x.gate_up_interleaved = c.interleaved;
    x.act = c.glu == GluKind::kGelu ? Act::kGeluTanh : Act::kSilu;
    if (c.glu == GluKind::kClamped) x.glu_alpha = alpha, x.glu_limit = limit;
    if (c.biases) {
      gb[size_t(e)] = random_floats(size_t(c.inter), seed++, -0.2f, 0.2f);
      ub[size_t(e)] = random_floats(size_t(c.inter), seed++, -0.2f, 0.2f);
      db[size_t(e)] = random_floats(size_t(c.hidden), seed++, -0.2f, 0.2f);
    }
  }
  if (c.biases) {
    for (int e = 0; e < E; ++e) {
      dgb.emplace_back(gb[size_t(e)]);
      dub.emplace_back(ub[size_t(e)]);
      ddb.emplace_back(db[size_t(e)]);
    }
    for (int e = 0; e < E; ++e) {
      experts[size_t(e)].gate_bias = dgb[size_t(e)].get();
      experts[size_t(e)].up_bias = dub[size_t(e)].get();
      experts[size_t(e)].down_bias = ddb[size_t(e)].get();
    }
  }
  // Routing: k distinct experts per row from the first E - 1 (expert E - 1 is chosen by no
  // row); rows repeat experts across each other. (Cases of k = E once read past the pool.)
  ASSERT_LT(c.k, E) << "a case needs more experts than top-k: one is left unrouted";
  std::mt19937 rng(seed++);
  std::vector<int32_t> idx(size_t(c.rows * c.k));
  std::vector<float> wts = random_floats(size_t(c.rows * c.k), seed++, 0.1f, 1.f);
  std::vector<int32_t> pool(nE - 1);
  for (int64_t t = 0; t < c.rows; ++t) {
    for (int e = 0; e < E - 1; ++e) pool[size_t(e)] = e;
    if (!c.same_experts || t == 0) std::shuffle(pool.begin(), pool.end(), rng);
    if (c.same_experts && t > 0)
      for (int j = 0; j < c.k; ++j) pool[size_t(j)] = idx[size_t(j)];
    for (int j = 0; j < c.k; ++j) idx[size_t(t * c.k + j)] = pool[size_t(j)];
  }
  const std::vector<float> x = random_floats(size_t(c.rows * c.hidden), seed++);

  // float64 reference.
  std::vector<std::vector<double>> wg(nE), wu(nE), wd(nE);
  for (int e = 0; e < E; ++e) {
    wg[size_t(e)] = dequantized(host_gate[size_t(e)]);
    wu[size_t(e)] = dequantized(host_up[size_t(e)]);
    wd[size_t(e)] = dequantized(down[size_t(e)].view);
  }
  std::vector<float> want(size_t(c.rows * c.hidden));
  std::vector<double> h(size_t(c.inter));
  for (int64_t t = 0; t < c.rows; ++t) {
    std::vector<double> acc(size_t(c.hidden), 0.0);
    for (int j = 0; j < c.k; ++j) {
      const int e = idx[size_t(t * c.k + j)];
      for (int64_t i = 0; i < c.inter; ++i) {
        double g = 0, u = 0;
        for (int64_t q = 0; q < c.hidden; ++q) {
          g += wg[size_t(e)][size_t(i * c.hidden + q)] * x[size_t(t * c.hidden + q)];
          u += wu[size_t(e)][size_t(i * c.hidden + q)] * x[size_t(t * c.hidden + q)];
        }
        if (c.biases) g += gb[size_t(e)][size_t(i)], u += ub[size_t(e)][size_t(i)];
        h[size_t(i)] = glu_ref(c.glu, g, u, alpha, limit);
      }
      for (int64_t o = 0; o < c.hidden; ++o) {
        double y = 0;
        for (int64_t i = 0; i < c.inter; ++i) y += wd[size_t(e)][size_t(o * c.inter + i)] * h[size_t(i)];
        if (c.biases) y += db[size_t(e)][size_t(o)];
        acc[size_t(o)] += double(wts[size_t(t * c.k + j)]) * y;
      }
    }
    for (int64_t o = 0; o < c.hidden; ++o) want[size_t(t * c.hidden + o)] = float(acc[size_t(o)]);
  }

  DeviceBuffer<int32_t> didx(idx);
  DeviceBuffer<float> dwts(wts);
  DevMat dx(c.rows, c.hidden, c.hidden + 1, 1);  // unaligned rows: the decode path realigns them
  DevMat dout(c.rows, c.hidden, c.hidden + 2);
  dx.upload(x);
  dout.buf.poison();
  mm.moe_experts(experts, dx.mat, didx.get(), dwts.get(), c.k, dout.mat, nullptr);
  // Decode keeps f32 activations except on the Q4_0 / MXFP4 int8 kernels (x and h rounded per 32).
  const double tol = c.rows > cuda::kMoeDecodeMaxRows                         ? kMoeBf16Tol
                     : cuda::moe_int8_activations(experts[0], c.rows, c.k) ? kInt8Tol
                                                                            : kF32Tol;
  EXPECT_LE(normalized_error(dout.download(), want), tol)
      << "gate/up " << c.gate_up.name() << " down " << c.down.name() << " experts " << E << " k " << c.k << " rows "
      << c.rows << " hidden " << c.hidden << " inter " << c.inter << " glu " << int(c.glu) << " biases " << c.biases
      << " interleaved " << c.interleaved;
}

TEST(CudaMoe, DecodeAndPrefillAcrossFormatsAndVariants) {
  cuda::WeightMatmul mm;
  const Format bf16{DType::BF16}, f32{DType::F32}, f16{DType::F16}, q4k{DType::Q4_K}, q6k{DType::Q6_K},
      q8{DType::Q8_0}, q40{DType::Q4_0}, mx{DType::MXFP4}, i4{DType::INT4_AFFINE, DType::BF16, 32},
      q40p{DType::Q4_0, DType::U8, 0, true};
  std::vector<MoeCase> cases;
  // Every variant (act x biases x interleaved) at decode and prefill sizes, bf16 and MXFP4.
  for (const Format& f : {bf16, mx})
    for (GluKind glu : {GluKind::kSilu, GluKind::kGelu, GluKind::kClamped})
      for (bool biases : {false, true})
        for (bool inter : {false, true})
          for (int64_t rows : {1, 17}) cases.push_back({f, f, 8, 2, rows, 64, 96, glu, biases, inter});
  // Rows, k and expert counts; odd float sizes; k-quants with a different down format.
  const int64_t row_counts[] = {1, 3, 17, 64, 500};
  for (int64_t rows : row_counts) {
    cases.push_back({bf16, bf16, 4, 1, rows, 64, 32, GluKind::kSilu, false, false});
    cases.push_back({f32, f32, 16, 8, rows, 67, 45, GluKind::kGelu, true, false});
    cases.push_back({q4k, q6k, 128, 8, std::min<int64_t>(rows, 64), 256, 256, GluKind::kSilu, false, false});
    cases.push_back({i4, q8, 32, 2, rows, 64, 96, GluKind::kClamped, true, true});
    // Q4_0 in planes (the block32 decode kernels): hidden 160 leaves lanes without a block,
    // inter 96 gives the down pass k * 3 (expert, block) items per warp; odd output rows.
    cases.push_back({q40p, q40p, 16, 8, rows, 160, 96, GluKind::kSilu, true, false});
    cases.push_back({q40p, q40p, 12, 3, rows, 96, 32, GluKind::kGelu, false, true});
    // Top-10 (Qwen4-Exp): the f32 down kernel takes its experts 8 at a time, so two rounds;
    // the split bf16 down kernel gives two of its eight warps a second expert.
    cases.push_back({bf16, mx, 16, 10, rows, 64, 96, GluKind::kSilu, true, false});
    cases.push_back({bf16, bf16, 16, 10, rows, 64, 96, GluKind::kSilu, true, false});
  }
  // Decode sizes of the bf16 kernels with 16-byte units (two gate/up rows a warp, the down pass
  // split over warps, four output rows a block): down rows of 68 (a partial last block of four;
  // gate/up rows not 16-byte aligned, so those take the scalar-load kernel), expert rows of
  // 1088 (two passes of the down kernel's 96 units a lane group, the second partial), 40 inter
  // rows (gate/up warps past the end of a block's 16 rows).
  for (int64_t rows : {1, 3, 8}) {
    cases.push_back({bf16, bf16, 9, 8, rows, 68, 96, GluKind::kSilu, false, false});
    cases.push_back({bf16, bf16, 8, 4, rows, 256, 1088, GluKind::kClamped, true, true});
    cases.push_back({f16, f16, 8, 3, rows, 128, 40, GluKind::kGelu, true, false});
    // Q8_0 on the int8 decode kernels: ggml's 34-byte blocks put every other block's codes at
    // 2 mod 4 (FmtQ8_0::codes32's shifted loads), and 3-block rows every other row's start;
    // top-10 (the down pass's general loop), and expert rows past 32 blocks (its split form).
    cases.push_back({q8, q8, 16, 8, rows, 160, 96, GluKind::kSilu, true, false});
    cases.push_back({q8, q8, 12, 10, rows, 96, 64, GluKind::kGelu, false, true});
    cases.push_back({q8, q8, 8, 4, rows, 256, 1088, GluKind::kClamped, true, true});
  }
  // The Qwen3-30B-A3B expert shape at half width (hidden 1024, inter 384), decode rows.
  for (int64_t rows : {1, 2}) cases.push_back({q40p, q40p, 9, 8, rows, 1024, 384, GluKind::kSilu, false, false});
  cases.push_back({q40p, q40, 9, 8, 1, 96, 64, GluKind::kSilu, false, false});
  cases.push_back({f16, q40, 9, 8, 3, 96, 64, GluKind::kSilu, true, false});
  cases.push_back({f16, q40, 9, 8, 33, 96, 64, GluKind::kSilu, true, false});
  cases.push_back({q8, mx, 64, 8, 500, 64, 64, GluKind::kGelu, false, true});
  // The Qwen4-Exp Q8_0 fixture's experts as llama.cpp's converter writes them (Q8_0 gate/up, F16
  // down; hidden 32, inter 16: one Q8_0 block a row, fewer inter rows than a tile), top-10 of
  // 16, at decode, few-rows and whole-prompt sizes.
  for (int64_t rows : {1, 5, 9, 40}) cases.push_back({q8, f16, 16, 10, rows, 32, 16, GluKind::kSilu, false, false});
  // Grouped sizes (more than kMoeDecodeMaxRows rows) run through both grouped kernels: the
  // 128-row tiles and the few-rows-per-expert one (moe_grouped_small_kernel), whichever the
  // default would pick.
  cases.push_back({q40p, q40p, 128, 8, 64, 256, 128, GluKind::kSilu, false, false});  // serve-like: ~4 a expert
  cases.push_back({q40p, q40p, 16, 8, 40, 96, 64, GluKind::kSilu, false, false});     // 20 a expert: 3 passes
  // Every row on the same 8 experts (sequences decoding the same token): 64 rows an expert, the
  // passes spread over blocks.
  cases.push_back({q40p, q40p, 128, 8, 64, 256, 128, GluKind::kSilu, false, false, true});
  cases.push_back({bf16, bf16, 16, 4, 100, 64, 96, GluKind::kGelu, true, false, true});
  // gpt-oss-20b's expert rows at a quarter width: inter past 32 blocks (the down pass's split
  // kernel by default), a partial last pass of the lanes (34 blocks), MXFP4 with the clamped GLU,
  // biases and interleaved gate/up; and Q4_0 planes the same length.
  for (int64_t rows : {1, 3}) {
    cases.push_back({mx, mx, 8, 4, rows, 256, 1088, GluKind::kClamped, true, true});
    cases.push_back({q40p, q40p, 8, 4, rows, 256, 1088, GluKind::kSilu, false, false});
  }
  uint32_t seed = 1000;
  int small = 0;
  for (const MoeCase& c : cases) {
    seed += 100;
    if (c.rows <= cuda::kMoeDecodeMaxRows) {
      // The int8 decode kernels' variants (two or four rows a gate/up warp; down with the experts
      // split over warps or not); the other decode kernels ignore the switches.
      for (const char* wide : {"0", "1"})
        for (const char* split : {"0", "1"}) {
          SCOPED_TRACE(std::string("wide warps ") + wide + ", down split " + split);
          setenv("TURBOSPARK_CUDA_MOE_WIDE_WARPS", wide, 1);
          setenv("TURBOSPARK_CUDA_MOE_DOWN_SPLIT", split, 1);
          run_moe_case(mm, c, seed);
        }
      unsetenv("TURBOSPARK_CUDA_MOE_WIDE_WARPS");
      unsetenv("TURBOSPARK_CUDA_MOE_DOWN_SPLIT");
      continue;
    }
    for (const char* mode : {"0", "1"}) {
      SCOPED_TRACE(std::string("TURBOSPARK_CUDA_MOE_SMALL=") + mode);
      setenv("TURBOSPARK_CUDA_MOE_SMALL", mode, 1);
      small += mode[0] == '1' && cuda::moe_small_groups(c.rows * c.k, c.n_experts, c.hidden, c.inter);
      run_moe_case(mm, c, seed);
    }
    unsetenv("TURBOSPARK_CUDA_MOE_SMALL");
  }
  EXPECT_GT(small, 20) << "cases that ran the few-rows-per-expert kernel";
}

// BF16 experts run in float on the CPU backend: agree with it (decode and prefill). For Q4_0,
// Q8_0 and MXFP4 experts the CPU quantizes x and the hidden activations to int8. The CUDA
// decode kernels of all three quantize them the same way, so the two agree to f32 summation
// order plus the rare h element whose code flips at a rounding boundary (one step of amax /
// 127): 1e-4.
TEST(CudaMoe, MatchesCpuBackend) {
  auto cpu = make_cpu_backend(2);
  cuda::WeightMatmul mm;
  cpu::mxfp4_set_int8_activations(true);
  for (const Format& f : {Format{DType::BF16}, Format{DType::Q4_0}, Format{DType::Q4_0, DType::U8, 0, true},
                          Format{DType::Q8_0}, Format{DType::MXFP4}}) {
    const bool int8 = f.dtype != DType::BF16;
    const int E = 6, k = 2;
    const int64_t hidden = 64, inter = 32;
    std::vector<HostWeight> g, u, d;
    std::vector<DevWeight> dg, du, dd;
    std::vector<ExpertWeights> host(E), dev(E);
    for (int e = 0; e < E; ++e) {
      g.push_back(make_weight(f, inter, hidden, 10 + e));
      u.push_back(make_weight(f, inter, hidden, 20 + e));
      d.push_back(make_weight(f, hidden, inter, 30 + e));
    }
    for (int e = 0; e < E; ++e) {
      dg.push_back(upload(g[size_t(e)], f.planes));
      du.push_back(upload(u[size_t(e)], f.planes));
      dd.push_back(upload(d[size_t(e)], f.planes));
      host[size_t(e)].gate.view = g[size_t(e)].view;
      host[size_t(e)].up.view = u[size_t(e)].view;
      host[size_t(e)].down.view = d[size_t(e)].view;
      dev[size_t(e)].gate.view = dg[size_t(e)].view;
      dev[size_t(e)].up.view = du[size_t(e)].view;
      dev[size_t(e)].down.view = dd[size_t(e)].view;
    }
    for (int64_t rows : {int64_t(1), int64_t(3), int64_t(int8 ? 5 : 17)}) {
      std::vector<int32_t> idx(size_t(rows * k));
      for (int64_t t = 0; t < rows; ++t) idx[size_t(t * k)] = int32_t(t % 5), idx[size_t(t * k + 1)] = int32_t((t + 2) % 5);
      const std::vector<float> wts = random_floats(size_t(rows * k), 5, 0.1f, 1.f);
      std::vector<float> x = random_floats(size_t(rows * hidden), 6), want(size_t(rows * hidden));
      cpu->moe_experts(host, Mat(x.data(), rows, hidden), idx.data(), wts.data(), k, Mat(want.data(), rows, hidden));
      DeviceBuffer<int32_t> didx(idx);
      DeviceBuffer<float> dwts(wts);
      DevMat dx(rows, hidden, hidden), dout(rows, hidden, hidden);
      dx.upload(x);
      const bool both_int8 = cuda::moe_int8_activations(dev[0], rows, k);
      EXPECT_EQ(both_int8, (f.dtype == DType::Q4_0 || f.dtype == DType::MXFP4 || f.dtype == DType::Q8_0) &&
                               rows <= cuda::kMoeDecodeMaxRows)
          << f.name() << " rows " << rows;
      const double tol = rows > cuda::kMoeDecodeMaxRows ? kMoeBf16Tol : both_int8 ? 1e-4 : int8 ? kInt8Tol : kF32Tol;
      // Every variant of the int8 decode kernels (gate/up rows a warp, down split over warps).
      for (const char* variant : {"00", "01", "10", "11"}) {
        setenv("TURBOSPARK_CUDA_MOE_WIDE_WARPS", std::string(1, variant[0]).c_str(), 1);
        setenv("TURBOSPARK_CUDA_MOE_DOWN_SPLIT", std::string(1, variant[1]).c_str(), 1);
        dout.buf.poison();
        mm.moe_experts(dev, dx.mat, didx.get(), dwts.get(), k, dout.mat, nullptr);
        EXPECT_LE(normalized_error(dout.download(), want), tol) << f.name() << " rows " << rows << " variant " << variant;
      }
      unsetenv("TURBOSPARK_CUDA_MOE_WIDE_WARPS");
      unsetenv("TURBOSPARK_CUDA_MOE_DOWN_SPLIT");
    }
  }
}

// An expert id outside the table (the device cannot throw) makes its token's output row NaN
// and leaves the other rows exactly as a valid routing gives them, on every decode kernel
// family (f32 unit-wise, Q4_0 int8 in both layouts, MXFP4 int8) and on the grouped prefill path.
TEST(CudaMoe, InvalidExpertIdGivesNanRowOnly) {
  cuda::WeightMatmul mm;
  for (const Format& f : {Format{DType::BF16}, Format{DType::Q4_0}, Format{DType::Q4_0, DType::U8, 0, true},
                          Format{DType::MXFP4}}) {
    const int E = 4, k = 2;
    const int64_t hidden = 64, inter = 32;
    std::vector<HostWeight> hw;
    std::vector<DevWeight> dw;
    std::vector<ExpertWeights> dev(E);
    for (int e = 0; e < E; ++e)
      for (int m = 0; m < 3; ++m) hw.push_back(make_weight(f, m == 2 ? hidden : inter, m == 2 ? inter : hidden, 40 + 3 * e + m));
    for (const HostWeight& h : hw) dw.push_back(upload(h, f.planes));
    for (int e = 0; e < E; ++e) {
      dev[size_t(e)].gate.view = dw[size_t(3 * e)].view;
      dev[size_t(e)].up.view = dw[size_t(3 * e + 1)].view;
      dev[size_t(e)].down.view = dw[size_t(3 * e + 2)].view;
    }
    for (int64_t rows : {int64_t(3), int64_t(17)}) {
      std::vector<int32_t> good(size_t(rows * k));
      for (int64_t t = 0; t < rows; ++t) good[size_t(t * k)] = int32_t(t % E), good[size_t(t * k + 1)] = int32_t((t + 1) % E);
      std::vector<int32_t> bad = good;
      bad[size_t(1 * k + 1)] = E + 3;  // row 1's second expert
      bad[size_t(2 * k)] = -1;         // row 2's first
      const std::vector<float> wts = random_floats(size_t(rows * k), 7, 0.1f, 1.f);
      DevMat dx(rows, hidden, hidden);
      dx.upload(random_floats(size_t(rows * hidden), 8));
      DeviceBuffer<float> dwts(wts);
      auto run = [&](const std::vector<int32_t>& idx) {
        DeviceBuffer<int32_t> didx(idx);
        DevMat out(rows, hidden, hidden);
        out.buf.poison();
        mm.moe_experts(dev, dx.mat, didx.get(), dwts.get(), k, out.mat, nullptr);
        return out.download();
      };
      const std::vector<float> want = run(good), got = run(bad);
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t o = 0; o < hidden; ++o) {
          const size_t at = size_t(t * hidden + o);
          if (t == 1 || t == 2) {
            EXPECT_TRUE(std::isnan(got[at])) << f.name() << " rows " << rows << " row " << t << " out " << o;
          } else {
            ASSERT_TRUE(std::isfinite(want[at])) << f.name() << " rows " << rows << " row " << t;
            EXPECT_EQ(got[at], want[at]) << f.name() << " rows " << rows << " row " << t << " out " << o;
          }
        }
    }
  }
}

// The Q4_0 decode down kernel reads the routing before its programmatic-launch wait (the
// router ran before the gate/up kernel it follows). Here the router's top-k rewrites idx and
// weight right before moe_experts on the same stream, over a different routing left there
// before; the output must be exactly the one the new routing gives when run alone.
TEST(CudaMoe, DecodeReadsTheRoutingWrittenJustBefore) {
  cuda::WeightMatmul mm;
  const Format f{DType::Q4_0, DType::U8, 0, true};
  const int E = 16;
  const int64_t hidden = 256, inter = 64;
  std::vector<HostWeight> hw;
  std::vector<DevWeight> dw;
  std::vector<ExpertWeights> dev(E);
  for (int e = 0; e < E; ++e)
    for (int m = 0; m < 3; ++m)
      hw.push_back(make_weight(f, m == 2 ? hidden : inter, m == 2 ? inter : hidden, 60 + 3 * e + m));
  for (const HostWeight& h : hw) dw.push_back(upload(h, f.planes));
  for (int e = 0; e < E; ++e) {
    dev[size_t(e)].gate.view = dw[size_t(3 * e)].view;
    dev[size_t(e)].up.view = dw[size_t(3 * e + 1)].view;
    dev[size_t(e)].down.view = dw[size_t(3 * e + 2)].view;
  }
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);  // ordered with the uploads and poisoning
  for (int k : {8, 4, 3})
    for (int64_t rows : {int64_t(1), int64_t(2)}) {
      SCOPED_TRACE("k " + std::to_string(k) + " rows " + std::to_string(rows));
      ASSERT_TRUE(cuda::moe_int8_activations(dev[0], rows, k));
      DevMat dx(rows, hidden, hidden);
      dx.upload(random_floats(size_t(rows * hidden), uint32_t(70 + k)));
      DevMat logits(rows, E, E);
      logits.upload(random_floats(size_t(rows * E), uint32_t(80 + k), -3.f, 3.f));
      // Left over: the last k experts in reverse order with flat weights (never the router's pick
      // as a whole: it sorts by probability).
      std::vector<int32_t> stale(size_t(rows * k));
      for (int64_t t = 0; t < rows; ++t)
        for (int j = 0; j < k; ++j) stale[size_t(t * k + j)] = E - 1 - j;
      DeviceBuffer<int32_t> didx(stale);
      DeviceBuffer<float> dwts(std::vector<float>(size_t(rows * k), 1.f / float(k)));
      DevMat out(rows, hidden, hidden), alone(rows, hidden, hidden);
      out.buf.poison();
      alone.buf.poison();
      cuda::router_softmax_topk(logits.mat, k, true, didx.get(), dwts.get(), nullptr, stream);
      mm.moe_experts(dev, dx.mat, didx.get(), dwts.get(), k, out.mat, stream);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      ASSERT_NE(didx.download(), stale);
      mm.moe_experts(dev, dx.mat, didx.get(), dwts.get(), k, alone.mat, stream);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const std::vector<float> got = out.download(), want = alone.download();
      for (float v : want) ASSERT_TRUE(std::isfinite(v));
      EXPECT_EQ(got, want);
    }
  cudaStreamDestroy(stream);
}

// ---- refusals -------------------------------------------------------------------------------

template <class Fn>
void expect_refusal_naming(Fn&& fn, const std::string& what, const char* op) {
  try {
    fn();
    ADD_FAILURE() << op << " accepted an unsupported dtype";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << op << ": " << e.what();
  }
}

TEST(CudaMatmul, RefusesUnsupportedDtypeByName) {
  cuda::WeightMatmul mm;
  DeviceBuffer<uint8_t> bytes(4096);
  WeightView w;
  w.dtype = DType::I32;
  w.data = bytes.get();
  w.rows = 8;
  w.cols = 16;
  w.row_bytes = 64;
  DevMat x1(1, 16, 16), y1(1, 8, 8), x17(17, 16, 16), y17(17, 8, 8);
  DeviceBuffer<int32_t> ids(std::vector<int32_t>{0});
  expect_refusal_naming([&] { mm.matmul(w, x1.mat, y1.mat, nullptr); }, "I32", "gemv");
  expect_refusal_naming([&] { mm.matmul(w, x17.mat, y17.mat, nullptr); }, "I32", "gemm");
  expect_refusal_naming([&] { mm.embedding(w, ids.get(), 1, 1.f, x1.mat, nullptr); }, "I32", "embedding");
  std::vector<ExpertWeights> experts(2);
  WeightView down = w;
  down.rows = 16;
  down.cols = 8;
  down.row_bytes = 32;
  for (ExpertWeights& e : experts) e.gate.view = w, e.up.view = w, e.down.view = down;
  DeviceBuffer<float> wts(std::vector<float>{1.f});
  DevMat mx(1, 16, 16), mout(1, 16, 16);
  expect_refusal_naming([&] { mm.moe_experts(experts, mx.mat, ids.get(), wts.get(), 1, mout.mat, nullptr); }, "I32",
                        "moe_experts");
}

}  // namespace
}  // namespace turbospark
