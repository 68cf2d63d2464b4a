// Matrix products and embedding lookups with block-quantized weights (ggml formats Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; layouts in core/quant.h).
//
// As in llama.cpp, each call first quantizes the activation rows to 8-bit blocks (BlockQ8x32
// for the 32-element formats, BlockQ8_K for the k-quants), then every weight block meets its
// activation block in integer multiply-adds (AVX2 maddubs/madd) with one float FMA per
// block. So results differ from "dequantize, then float matmul" by the activation rounding:
// per block of x, at most amax(block) / 254 per element, times |w| summed over the block.
// Decode (one activation row) is bound by streaming the weights, which are read once, in
// place, split by output rows across the pool. Prefill batches of every format but Q8_0 run
// tiled kernels (quant_gemm.h) that repack 8 weight rows at a time into per-thread scratch.
//
// The accumulation contract: every kernel (row or tiled, AVX2 or scalar, any number of
// tokens per call) computes an output the same way, so a row's result does not depend on
// what it is batched with (serving batches a request's decode row with other requests'
// prefill chunks) and the AVX2 paths equal the scalar reference bit for bit. Per block of
// the row, in order: the block's integer sum is exact; then, in float,
//   k-quants:  acc = fma(d * dy, sumi, acc); Q4_K/Q5_K also acc = fma(-(dmin * dy), summ, acc)
//   32-element formats: acc = fma(d * dy, sumi, acc) and, in a second chain,
//              off = fma(offset, sy, off), where offset is -8d, -16d or m (sy = dy * sum(qy));
//              the result is acc + off.
// A quantized activation that differs in one step (from a batch-dependent upstream op) still
// changes the result; the contract removes the differences that came from the kernels.
#pragma once

#include <cstdint>
#include <span>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace turbospark::cpu {

// y[t, o] = sum_i w[o, i] * x[t, i] for a quantized w ([out, in], row_bytes as core/quant.h
// defines), the same contract as cpu::matmul: x.cols == w.cols (a multiple of the format's
// block size), y.cols == w.rows, y.rows == x.rows, rows of x and y may be strided. Throws
// Error naming the dtype or the shapes when they do not fit.
void quant_matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y);

// One product of quant_matmul_jobs: y = x w^T with quant_matmul's contract for each.
struct QuantMatmulJob {
  const WeightView* w = nullptr;
  Mat x, y;
};

// Every job's product, each output equal to quant_matmul's bit for bit (the accumulation
// contract), in one parallel region: the rows of all the jobs are split across the pool
// together, and activation rows are quantized once per distinct x (jobs whose x is the same
// memory, shape and activation format share it). For the small products of a MoE decode step
// (a few rows through each of k experts' gate, up, then down), one dispatch instead of one per
// product: each of those is a few microseconds of work per thread, about what a dispatch costs.
// Jobs of kTiledMinTokens (16) rows or more take quant_matmul's tiled kernels, one call each.
// Outputs must not overlap inputs or each other. Throws as quant_matmul does.
void quant_matmul_jobs(ThreadPool& pool, std::span<const QuantMatmulJob> jobs);

// Whether quant_matmul takes weights of this dtype (the ggml block formats above).
bool quant_matmul_takes(DType dtype);

// out[t, :] = dequantized row ids[t] of `table` ([vocab, dim], any quantized or float
// dtype), times `scale`. Throws Error naming an id outside [0, vocab).
void quant_embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out);

namespace ref {
// The same integer arithmetic as quant_matmul (activations quantized identically) in plain
// scalar loops, single-threaded: the AVX2 path equals it bit for bit (the contract). Builds
// without AVX2 use these loops as the fast path's fallback.
void quant_matmul(const WeightView& w, const Mat& x, const Mat& y);
}  // namespace ref

}  // namespace turbospark::cpu
