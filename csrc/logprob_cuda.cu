// CUDA op of the fused log-prob kernel. WRITTEN FOR GPU, NEVER RUN HERE: the development machine has
// no GPU; CI compiles this file with nvcc (tests/ops/test_nvcc_compile.py) but no kernel has executed.
// Legend and stats layout: logprob.h.
//
// Design (mirrors the CPU op, one thread block per row):
// - Forward: each thread streams its share of the row with 16-byte vector loads (8 bf16/fp16, 4 fp32),
//   keeps an online (max, sum-exp, entropy) triple in fp32 registers, rescaling once per vector when
//   the max grows; the block merges the triples with warp shuffles and one shared-memory round. Thread
//   0 loads the target logit at block start (its latency hides behind the row stream, not after the
//   reduction). Output: [N, 4] partial stats, so the row is read from HBM exactly once.
// - Base 2 inside the kernels: the logits are scaled once by log2(e) / T (folded into one multiply) and
//   exponentiated with exp2f, which with -ftz=true (setup.py) is a single ex2.approx.ftz.f32 per element;
//   m and the entropy term are converted back to natural units (times ln 2) when the stats are written,
//   so the [N, 4] layout and combine_row are the CPU op's.
// - NaN: a NaN logit makes the row's s NaN (exp2 propagates it; an all-NaN prefix is caught where the
//   max is still -inf) and merge keeps NaN shards, so logp / lse / entropy of that row are NaN.
// - Backward: recompute p = exp(z - lse) from the logits and the saved per-row lse (no saved N x V),
//   grad = (g_lp * (onehot - p) - g_h * p * (logp + H)) / T, written in the logits dtype with 16-byte
//   stores; grad may be the logits buffer itself (in-place backward): each element is read before it
//   is written by the same thread.
// - Rows need not be 16-byte aligned (V_local * sizeof(dtype) % 16 != 0, strided views): a scalar head
//   up to the first aligned element, the vector body, a scalar tail. If the gradient row and the
//   logits row are misaligned differently the backward row falls back to scalar accesses.
// - Each row is reduced by one block in a fixed order that depends on V and on the row's 16-byte alignment,
//   so results are batch-invariant on GPU when V_local * sizeof(dtype) is a multiple of 16 (real vocab shards).
// Includes: only the ATen/c10 headers needed (not torch/extension.h, not ATen/cuda/CUDAContext.h, which
// pulls cuSPARSE headers); compile with -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE outside a torch build tree.
#include "logprob.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>

namespace pacs {
namespace {

constexpr int kVecBytes = 16;
constexpr int kMaxWarps = 32;

// 2^x: ex2.approx.ftz.f32 under -ftz=true; exp2f(-inf) == 0 and NaN propagates.
__device__ __forceinline__ float dexp(float x) { return exp2f(x); }
__device__ __forceinline__ double dexp(double x) { return exp2(x); }
template <typename acc_t>
struct Log2 {
  static constexpr acc_t kE = acc_t(1.4426950408889634074);   // log2(e): z * kE is z in base-2 units
  static constexpr acc_t kLn2 = acc_t(0.6931471805599453094);  // back to natural units
};

template <typename acc_t>
__device__ __forceinline__ acc_t clamp_low(acc_t x) {
  return x < acc_t(-1000) ? acc_t(-1000) : x;  // keeps e * x finite where e == 0 and x == -inf
}

template <typename scalar_t>
struct alignas(kVecBytes) Pack {
  static constexpr int kN = kVecBytes / sizeof(scalar_t);
  scalar_t v[kN];
};

template <typename acc_t>
struct Online {
  acc_t m, s, a;
};

// Merge y into x (max rescaling); empty triples (s == 0) carry no mass and are skipped, NaN ones
// (s NaN) are kept so that the NaN reaches the row's result.
template <typename acc_t>
__device__ __forceinline__ Online<acc_t> merge(const Online<acc_t>& x, const Online<acc_t>& y) {
  const acc_t big = x.m > y.m ? x.m : y.m;
  Online<acc_t> r{big, acc_t(0), acc_t(0)};
  if (x.s != acc_t(0)) {
    const acc_t d = x.m - big, f = dexp(d);
    r.s += f * x.s;
    r.a += f * (x.a + d * x.s);
  }
  if (y.s != acc_t(0)) {
    const acc_t d = y.m - big, f = dexp(d);
    r.s += f * y.s;
    r.a += f * (y.a + d * y.s);
  }
  return r;
}

// Add k values z[0..k) (already times log2(e) / T: base-2 units) to the running triple.
template <typename acc_t, bool kEntropy, int K>
__device__ __forceinline__ void online_add(Online<acc_t>& o, const acc_t (&z)[K], int k) {
  acc_t bm = z[0];
#pragma unroll
  for (int i = 1; i < K; ++i)
    if (i < k) bm = z[i] > bm ? z[i] : bm;
  if (bm > o.m) {
    if (o.s > acc_t(0)) {
      const acc_t d = o.m - bm, f = dexp(d);
      if (kEntropy) o.a = f * (o.a + d * o.s);
      o.s *= f;
    }
    o.m = bm;
  }
  if (o.m == -std::numeric_limits<acc_t>::infinity()) {  // no finite value yet: the max skipped any NaN
#pragma unroll
    for (int i = 0; i < K; ++i)
      if (i < k && z[i] != z[i]) o.s = o.a = z[i];
    return;
  }
#pragma unroll
  for (int i = 0; i < K; ++i) {
    if (i < k) {
      const acc_t d = z[i] - o.m, e = dexp(d);
      o.s += e;
      if (kEntropy) o.a += e * clamp_low(d);
    }
  }
}

template <typename scalar_t, typename acc_t, bool kEntropy>
__device__ __forceinline__ void add_pack(Online<acc_t>& o, const Pack<scalar_t>& pk, acc_t inv_temp) {
  acc_t z[Pack<scalar_t>::kN];
#pragma unroll
  for (int k = 0; k < Pack<scalar_t>::kN; ++k) z[k] = static_cast<acc_t>(pk.v[k]) * inv_temp;
  online_add<acc_t, kEntropy, Pack<scalar_t>::kN>(o, z, Pack<scalar_t>::kN);
}

template <typename acc_t>
__device__ Online<acc_t> block_reduce(Online<acc_t> o) {
  __shared__ acc_t sm[3][kMaxWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    Online<acc_t> y{__shfl_xor_sync(0xffffffffu, o.m, off), __shfl_xor_sync(0xffffffffu, o.s, off),
                    __shfl_xor_sync(0xffffffffu, o.a, off)};
    o = merge(o, y);
  }
  if (lane == 0) {
    sm[0][warp] = o.m;
    sm[1][warp] = o.s;
    sm[2][warp] = o.a;
  }
  __syncthreads();
  if (warp == 0) {
    const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
    o = lane < nwarps ? Online<acc_t>{sm[0][lane], sm[1][lane], sm[2][lane]} : Online<acc_t>{ninf, 0, 0};
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      Online<acc_t> y{__shfl_xor_sync(0xffffffffu, o.m, off), __shfl_xor_sync(0xffffffffu, o.s, off),
                      __shfl_xor_sync(0xffffffffu, o.a, off)};
      o = merge(o, y);
    }
  }
  return o;  // valid in thread 0
}

// Elements before the first 16-byte aligned one (row pointers are at least element-aligned).
template <typename scalar_t>
__device__ __forceinline__ int64_t aligned_head(const scalar_t* p, int64_t vocab) {
  const int64_t mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % kVecBytes);
  const int64_t head = mis == 0 ? 0 : (kVecBytes - mis) / static_cast<int64_t>(sizeof(scalar_t));
  return head < vocab ? head : vocab;
}

template <typename scalar_t, typename acc_t, bool kEntropy>
__global__ void partial_kernel(const scalar_t* __restrict__ logits, int64_t T, int64_t sB, int64_t sT, int64_t V,
                               const int64_t* __restrict__ targets, int64_t vocab_start, acc_t inv_temp_nat,
                               acc_t* __restrict__ stats) {
  using P = Pack<scalar_t>;
  const acc_t inv_temp = inv_temp_nat * Log2<acc_t>::kE;  // one multiply per element: x * log2(e) / T
  constexpr int kN = P::kN;
  const int64_t n = blockIdx.x;
  const scalar_t* row = logits + (n / T) * sB + (n % T) * sT;
  const int64_t head = aligned_head(row, V);
  const int64_t nvec = (V - head) / kN;
  const int64_t tail = head + nvec * kN;
  // Prefetch the target logit (thread 0) before streaming the row, so its load overlaps the stream.
  const int64_t tl = targets[n] - vocab_start;
  const bool has_target = tl >= 0 && tl < V;
  scalar_t target_logit = scalar_t(0);
  if (threadIdx.x == 0 && has_target) target_logit = row[tl];
  Online<acc_t> o{-std::numeric_limits<acc_t>::infinity(), acc_t(0), acc_t(0)};
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) {
    const acc_t z[1] = {static_cast<acc_t>(row[i]) * inv_temp};
    online_add<acc_t, kEntropy, 1>(o, z, 1);
  }
  const P* vrow = reinterpret_cast<const P*>(row + head);
  const int64_t stride = blockDim.x;
  int64_t j = threadIdx.x;
  for (; j + stride < nvec; j += 2 * stride) {  // two 16-byte loads in flight per thread
    const P p0 = vrow[j], p1 = vrow[j + stride];
    add_pack<scalar_t, acc_t, kEntropy>(o, p0, inv_temp);
    add_pack<scalar_t, acc_t, kEntropy>(o, p1, inv_temp);
  }
  if (j < nvec) add_pack<scalar_t, acc_t, kEntropy>(o, vrow[j], inv_temp);
  for (int64_t i = tail + threadIdx.x; i < V; i += blockDim.x) {
    const acc_t z[1] = {static_cast<acc_t>(row[i]) * inv_temp};
    online_add<acc_t, kEntropy, 1>(o, z, 1);
  }
  o = block_reduce(o);
  if (threadIdx.x == 0) {
    acc_t* st = stats + n * kStats;
    st[0] = o.m * Log2<acc_t>::kLn2;  // -inf stays -inf
    st[1] = o.s;
    st[2] = has_target ? static_cast<acc_t>(target_logit) * inv_temp_nat : acc_t(0);
    st[3] = kEntropy ? o.a * Log2<acc_t>::kLn2 : acc_t(0);
  }
}

template <typename scalar_t, typename acc_t, bool kEntropy>
__device__ __forceinline__ scalar_t grad_elem(scalar_t x, int64_t col, int64_t tl, acc_t inv_temp, acc_t inv_temp2,
                                              acc_t lse2, acc_t g_lp, acc_t g_h, acc_t ent, bool zero) {
  // Base 2: inv_temp2 = log2(e) / T and lse2 = lse * log2(e), so lp2 = log2 p (one FMA + one ex2).
  if (zero) return scalar_t(0);
  const acc_t lp2 = static_cast<acc_t>(x) * inv_temp2 - lse2;
  const acc_t p = dexp(lp2);
  acc_t g = kEntropy ? -p * (g_lp + g_h * (clamp_low(lp2 * Log2<acc_t>::kLn2) + ent)) : -p * g_lp;
  if (col == tl) g += g_lp;
  return static_cast<scalar_t>(g * inv_temp);
}

template <typename scalar_t, typename acc_t, bool kEntropy>
__device__ __forceinline__ Pack<scalar_t> grad_pack(const Pack<scalar_t>& pin, int64_t col0, int64_t tl, acc_t inv_temp,
                                                    acc_t inv_temp2, acc_t lse2, acc_t g_lp, acc_t g_h, acc_t ent,
                                                    bool zero) {
  Pack<scalar_t> pout;
#pragma unroll
  for (int k = 0; k < Pack<scalar_t>::kN; ++k)
    pout.v[k] =
        grad_elem<scalar_t, acc_t, kEntropy>(pin.v[k], col0 + k, tl, inv_temp, inv_temp2, lse2, g_lp, g_h, ent, zero);
  return pout;
}

template <typename scalar_t, typename acc_t, bool kEntropy>
__global__ void backward_kernel(const scalar_t* logits, int64_t T, int64_t sB, int64_t sT, int64_t V,
                                const int64_t* __restrict__ targets, int64_t vocab_start, acc_t inv_temp,
                                const acc_t* __restrict__ rowp, scalar_t* grad, int64_t gB, int64_t gT) {
  // logits and grad may alias (in-place backward): no __restrict__ on them.
  using P = Pack<scalar_t>;
  constexpr int kN = P::kN;
  const int64_t n = blockIdx.x;
  const int64_t b = n / T, t = n % T;
  const scalar_t* row = logits + b * sB + t * sT;
  scalar_t* grow = grad + b * gB + t * gT;
  const acc_t* rp = rowp + n * kStats;
  const acc_t lse2 = rp[0] * Log2<acc_t>::kE, g_lp = rp[1], g_h = rp[2], ent = rp[3];
  const acc_t inv_temp2 = inv_temp * Log2<acc_t>::kE;
  // No upstream gradient (ignored target / masked row): exact zeros, also for a NaN row (0 * NaN = NaN).
  const bool zero = g_lp == acc_t(0) && g_h == acc_t(0);
  const int64_t tl = targets[n] - vocab_start;
  const bool same_alignment =
      reinterpret_cast<uintptr_t>(row) % kVecBytes == reinterpret_cast<uintptr_t>(grow) % kVecBytes;
  const int64_t head = same_alignment ? aligned_head(row, V) : V;
  const int64_t nvec = (V - head) / kN;
  const int64_t tail = head + nvec * kN;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x)
    grow[i] = grad_elem<scalar_t, acc_t, kEntropy>(row[i], i, tl, inv_temp, inv_temp2, lse2, g_lp, g_h, ent, zero);
  const P* vin = reinterpret_cast<const P*>(row + head);
  P* vout = reinterpret_cast<P*>(grow + head);
  const int64_t stride = blockDim.x;
  int64_t j = threadIdx.x;
  for (; j + stride < nvec; j += 2 * stride) {  // two 16-byte loads in flight per thread
    const P p0 = vin[j], p1 = vin[j + stride];
    vout[j] = grad_pack<scalar_t, acc_t, kEntropy>(p0, head + j * kN, tl, inv_temp, inv_temp2, lse2, g_lp, g_h, ent, zero);
    vout[j + stride] =
        grad_pack<scalar_t, acc_t, kEntropy>(p1, head + (j + stride) * kN, tl, inv_temp, inv_temp2, lse2, g_lp, g_h, ent, zero);
  }
  if (j < nvec)
    vout[j] = grad_pack<scalar_t, acc_t, kEntropy>(vin[j], head + j * kN, tl, inv_temp, inv_temp2, lse2, g_lp, g_h, ent, zero);
  for (int64_t i = tail + threadIdx.x; i < V; i += blockDim.x)
    grow[i] = grad_elem<scalar_t, acc_t, kEntropy>(row[i], i, tl, inv_temp, inv_temp2, lse2, g_lp, g_h, ent, zero);
}

template <typename acc_t>
__global__ void combine_kernel(const acc_t* __restrict__ stats, int64_t world, int64_t rows,
                               const int64_t* __restrict__ targets, int64_t vocab_global, acc_t* __restrict__ out) {
  const int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (n < rows) combine_row<acc_t>(stats, world, rows, n, targets[n], vocab_global, out);
}

int threads_for(int64_t vocab, int64_t elems_per_vec) {
  const int64_t vecs = vocab / elems_per_vec;
  return vecs >= 8192 ? 512 : vecs >= 1024 ? 256 : 128;
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor for the CUDA op, got ", t.device());
}

}  // namespace

at::Tensor partial_cuda(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, double inv_temp,
                        bool with_entropy) {
  check_logits(logits, "logits");
  check_targets(targets, logits);
  check_cuda(logits, "logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(1), V = logits.size(2), rows = logits.size(0) * T;
  TORCH_CHECK(rows < (int64_t(1) << 31), "logits has ", rows, " rows; the CUDA op handles at most 2^31 - 1");
  at::Tensor stats = at::empty({rows, kStats}, logits.options().dtype(acc_type_for(logits.scalar_type())));
  if (rows == 0) return stats;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "pacs_logprob_partial_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int threads = threads_for(V, Pack<scalar_t>::kN);
    auto kernel = with_entropy ? partial_kernel<scalar_t, acc_t, true> : partial_kernel<scalar_t, acc_t, false>;
    kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        logits.const_data_ptr<scalar_t>(), T, logits.stride(0), logits.stride(1), V, targets.const_data_ptr<int64_t>(),
        vocab_start, static_cast<acc_t>(inv_temp), stats.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return stats;
}

at::Tensor combine_cuda(const at::Tensor& stats, const at::Tensor& targets, int64_t vocab_global) {
  check_stats(stats, targets);
  check_cuda(stats, "stats");
  const c10::cuda::CUDAGuard guard(stats.device());
  const int64_t world = stats.size(0), rows = stats.size(1);
  at::Tensor out = at::empty({rows, kOut}, stats.options());
  if (rows == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  constexpr int kThreads = 256;
  const int64_t blocks = (rows + kThreads - 1) / kThreads;
  AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "pacs_logprob_combine_cuda", [&] {
    combine_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        stats.const_data_ptr<scalar_t>(), world, rows, targets.const_data_ptr<int64_t>(), vocab_global,
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

void backward_cuda(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& rowp, int64_t vocab_start,
                   double inv_temp, bool with_entropy, const at::Tensor& grad) {
  check_logits(logits, "logits");
  check_targets(targets, logits);
  check_rowwise(rowp, logits, kStats, "rowp");
  check_grad(grad, logits);
  check_cuda(logits, "logits");
  if (grad.data_ptr() == logits.data_ptr()) {
    TORCH_CHECK(grad.strides() == logits.strides(), "in-place backward needs grad to be exactly the logits tensor");
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(1), V = logits.size(2), rows = logits.size(0) * T;
  TORCH_CHECK(rows < (int64_t(1) << 31), "logits has ", rows, " rows; the CUDA op handles at most 2^31 - 1");
  if (rows == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "pacs_logprob_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int threads = threads_for(V, Pack<scalar_t>::kN);
    auto kernel = with_entropy ? backward_kernel<scalar_t, acc_t, true> : backward_kernel<scalar_t, acc_t, false>;
    kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        logits.const_data_ptr<scalar_t>(), T, logits.stride(0), logits.stride(1), V, targets.const_data_ptr<int64_t>(),
        vocab_start, static_cast<acc_t>(inv_temp), rowp.const_data_ptr<acc_t>(), grad.data_ptr<scalar_t>(),
        grad.stride(0), grad.stride(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace pacs
