// CPU op of the fused log-prob kernel: per-row partial stats (forward), their combination, and the
// recomputing backward. Legend and stats layout: logprob.h.
//
// Design
// - OpenMP over rows (static schedule, torch's thread count). Each row is handled by one thread with
//   a fixed instruction sequence that depends only on the row's data and V, so a row's result is
//   bit-identical whatever else is in the batch and however many threads run (batch invariance).
// - One pass over memory per row: the row is streamed in L1-sized blocks; each block is converted to
//   acc_t (scaled by 1/temperature) into an aligned stack buffer, its max is taken, the running
//   (max, sum-exp, entropy) triple is rescaled once per block if the max grew, then the block's
//   exp terms are accumulated from L1. The forward reads the logits once; the backward reads them
//   once and writes the gradient once (in place when grad aliases logits). Nothing N x V is saved.
// - Vectorisation without -march=native: the inner loops are `#pragma omp simd` over float buffers
//   and exp is a branch-free Cody-Waite + degree-5 minimax polynomial (Cephes expf coefficients,
//   ~1.4 ulp for the arguments <= 0 used here) built from float ops and integer bit casts, which GCC
//   vectorises at any ISA. The row kernels are compiled for AVX-512, AVX2+FMA and baseline SSE2
//   (GCC target_clones); the loader picks one per process, so the wheel runs on every x86-64 CPU and
//   a given machine always runs the same code (results may differ by an ulp across ISAs).
// - fp32 accumulation for fp32/bf16/fp16 logits; fp64 logits run in double with std::exp (slow, for
//   gradcheck and oracles).
#include "logprob.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <limits>

// Row kernels are compiled three times (AVX-512, AVX2+FMA, baseline SSE2) and the best one for the running
// CPU is picked once by the loader (GCC target_clones / ifunc): no -march=native, so the wheel runs on any
// x86-64, yet gets wide vectors where they exist. The templates below are force-inlined into each clone.
// target_clones with arch= levels needs GCC >= 12 (GCC bug 101696); older compilers get the baseline code.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && !defined(PACS_NO_ISA_CLONES)
#define PACS_ISA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PACS_ISA_CLONES
#endif
#define PACS_INLINE inline __attribute__((always_inline))

// std::bit_cast is C++20; torch < 2.13 builds extensions as C++17 (the GPU image's torch), so use the
// builtin both standards share.
template <typename To, typename From>
PACS_INLINE To pacs_bits(From x) {
  return __builtin_bit_cast(To, x);
}

namespace pacs {
namespace {

constexpr int64_t kBlock = 2048;             // elements per L1 block (8 KiB of float)
constexpr int64_t kSerialWork = 1 << 16;     // below this many elements one thread is faster

// exp(x) for x <= 88 (callers pass x <= ~0): 0 below ln(FLT_MIN), NaN propagates, ~1.4 ulp.
// Branch-free on purpose: with GCC's default -ftrapping-math a float select feeding arithmetic
// becomes control flow and blocks vectorisation, so out-of-range lanes are computed (garbage,
// never UB: unsigned bit arithmetic) and then zeroed with an integer mask.
PACS_INLINE float exp_acc(float x) {
  constexpr float kLo = -87.33654f;
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits
  const float t = x * 1.44269504088896341f + kMagic;
  const float nf = t - kMagic;  // round(x / ln2)
  const uint32_t ni = pacs_bits<uint32_t>(t) - pacs_bits<uint32_t>(kMagic);
  float r = x - nf * 0.693359375f;  // Cody-Waite: ln2 split so that nf * hi is exact
  r = r - nf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const float y = p * pacs_bits<float>((ni + 127u) << 23);
  const uint32_t keep = 0u - static_cast<uint32_t>(!(x < kLo));  // all ones unless x < kLo (NaN keeps)
  return pacs_bits<float>(pacs_bits<uint32_t>(y) & keep);
}
PACS_INLINE double exp_acc(double x) { return std::exp(x); }

// max(x, -1000) without a float select (see exp_acc); keeps e * x finite where e == 0 and x == -inf.
PACS_INLINE float clamp_low(float x) {
  const uint32_t low = 0u - static_cast<uint32_t>(x < -1000.0f);
  return pacs_bits<float>((pacs_bits<uint32_t>(x) & ~low) | (pacs_bits<uint32_t>(-1000.0f) & low));
}
PACS_INLINE double clamp_low(double x) { return x < -1000.0 ? -1000.0 : x; }

// acc_t -> scalar_t stores. bf16 rounds to nearest even with integer ops only (vectorisable; c10's
// constructor branches on NaN); NaN becomes the canonical quiet NaN.
template <typename scalar_t, typename acc_t>
PACS_INLINE scalar_t to_scalar(acc_t x) {
  return static_cast<scalar_t>(x);
}
template <>
PACS_INLINE c10::BFloat16 to_scalar<c10::BFloat16, float>(float x) {
  const uint32_t u = pacs_bits<uint32_t>(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = 0u - static_cast<uint32_t>((u & 0x7fffffffu) > 0x7f800000u);
  return c10::BFloat16(static_cast<uint16_t>((rounded & ~nan) | (0x7fc0u & nan)), c10::BFloat16::from_bits());
}

template <typename scalar_t, typename acc_t>
PACS_INLINE void load_block(const scalar_t* __restrict src, acc_t* __restrict dst, int64_t len, acc_t scale) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) dst[i] = static_cast<acc_t>(src[i]) * scale;
}

template <typename scalar_t, typename acc_t, bool kEntropy>
PACS_INLINE void partial_row(const scalar_t* row, int64_t vocab, int64_t target_local, acc_t inv_temp, acc_t* out) {
  alignas(64) acc_t buf[kBlock];
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  acc_t m = kNegInf, s = 0, a = 0;
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t len = std::min(kBlock, vocab - start);
    load_block(row + start, buf, len, inv_temp);
    acc_t bm = kNegInf;
#pragma omp simd reduction(max : bm)
    for (int64_t i = 0; i < len; ++i) bm = buf[i] > bm ? buf[i] : bm;
    if (bm > m) {  // rescale the running sums to the new max (once per block, not per element)
      if (s > acc_t(0)) {
        const acc_t d = m - bm;
        const acc_t f = exp_acc(d);
        if constexpr (kEntropy) a = f * (a + d * s);
        s = f * s;
      }
      m = bm;
    }
    if (m == kNegInf) {  // all -inf (or NaN) so far: no mass, and -inf - -inf would be NaN
      // The max skips NaN, so a block of only NaN/-inf lands here: mark the row NaN (rare path, scalar).
      for (int64_t i = 0; i < len; ++i)
        if (buf[i] != buf[i]) s = a = std::numeric_limits<acc_t>::quiet_NaN();
      continue;
    }
    acc_t bs = 0, ba = 0;
    if constexpr (kEntropy) {
#pragma omp simd reduction(+ : bs, ba)
      for (int64_t i = 0; i < len; ++i) {
        const acc_t d = buf[i] - m;
        const acc_t e = exp_acc(d);
        bs += e;
        ba += e * clamp_low(d);
      }
    } else {
#pragma omp simd reduction(+ : bs)
      for (int64_t i = 0; i < len; ++i) bs += exp_acc(buf[i] - m);
    }
    s += bs;
    a += ba;
  }
  out[0] = m;
  out[1] = s;
  out[2] = (target_local >= 0 && target_local < vocab) ? static_cast<acc_t>(row[target_local]) * inv_temp : acc_t(0);
  out[3] = kEntropy ? a : acc_t(0);
}

// d/dz of (g_lp * logp_target + g_h * H) = g_lp * (onehot - p) - g_h * p * (logp + H), times 1/T for d/dx.
template <typename scalar_t, typename acc_t, bool kEntropy>
PACS_INLINE void backward_row(const scalar_t* row, scalar_t* grow, int64_t vocab, int64_t target_local,
                              acc_t inv_temp, const acc_t* rp) {
  alignas(64) acc_t buf[kBlock];
  const acc_t lse = rp[0], g_lp = rp[1], g_h = rp[2], ent = rp[3];
  if (g_lp == acc_t(0) && g_h == acc_t(0)) {
    // No upstream gradient (an ignored target, a masked row): exact zeros, also for a NaN row where the
    // formula would give 0 * NaN = NaN and poison the model's gradient through a row nobody uses.
    std::fill(grow, grow + vocab, to_scalar<scalar_t, acc_t>(acc_t(0)));
    return;
  }
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t len = std::min(kBlock, vocab - start);
    load_block(row + start, buf, len, inv_temp);
    if constexpr (kEntropy) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) {
        const acc_t lp = buf[i] - lse;
        const acc_t p = exp_acc(lp);
        buf[i] = -p * (g_lp + g_h * (clamp_low(lp) + ent)) * inv_temp;
      }
    } else {
      const acc_t c = -g_lp * inv_temp;
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) buf[i] = c * exp_acc(buf[i] - lse);
    }
    const int64_t tl = target_local - start;
    if (tl >= 0 && tl < len) buf[tl] += g_lp * inv_temp;  // the one-hot term, added before rounding to scalar_t
    scalar_t* dst = grow + start;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) dst[i] = to_scalar<scalar_t, acc_t>(buf[i]);
  }
}

// ISA-cloned row entry points, one per logits dtype (fp64 is for gradcheck/oracles: no clones).
#define PACS_ROW_ENTRY(attr, scalar_t, acc_t)                                                                      \
  attr void partial_row_isa(const scalar_t* row, int64_t vocab, int64_t tl, acc_t inv_temp, acc_t* out, bool ent) { \
    if (ent) {                                                                                                      \
      partial_row<scalar_t, acc_t, true>(row, vocab, tl, inv_temp, out);                                            \
    } else {                                                                                                        \
      partial_row<scalar_t, acc_t, false>(row, vocab, tl, inv_temp, out);                                           \
    }                                                                                                               \
  }                                                                                                                 \
  attr void backward_row_isa(const scalar_t* row, scalar_t* grow, int64_t vocab, int64_t tl, acc_t inv_temp,        \
                             const acc_t* rp, bool ent) {                                                           \
    if (ent) {                                                                                                      \
      backward_row<scalar_t, acc_t, true>(row, grow, vocab, tl, inv_temp, rp);                                      \
    } else {                                                                                                        \
      backward_row<scalar_t, acc_t, false>(row, grow, vocab, tl, inv_temp, rp);                                     \
    }                                                                                                               \
  }
PACS_ROW_ENTRY(PACS_ISA_CLONES, float, float)
PACS_ROW_ENTRY(PACS_ISA_CLONES, c10::BFloat16, float)
PACS_ROW_ENTRY(PACS_ISA_CLONES, c10::Half, float)
PACS_ROW_ENTRY(, double, double)
#undef PACS_ROW_ENTRY

int threads_for(int64_t rows, int64_t vocab) {
  if (rows * vocab < kSerialWork) return 1;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows)));
}

// The OpenMP loops live in templates (a `#pragma omp` inside an AT_DISPATCH lambda does not compile).
template <typename scalar_t, typename acc_t>
void partial_loop(const at::Tensor& logits, const int64_t* targets, int64_t vocab_start, acc_t inv_temp, acc_t* stats,
                  bool ent) {
  const scalar_t* base = logits.const_data_ptr<scalar_t>();
  const int64_t T = logits.size(1), V = logits.size(2), sB = logits.stride(0), sT = logits.stride(1);
  const int64_t rows = logits.size(0) * T;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, V))
  for (int64_t n = 0; n < rows; ++n) {
    const scalar_t* row = base + (n / T) * sB + (n % T) * sT;
    partial_row_isa(row, V, targets[n] - vocab_start, inv_temp, stats + n * kStats, ent);
  }
}

template <typename scalar_t, typename acc_t>
void backward_loop(const at::Tensor& logits, const int64_t* targets, int64_t vocab_start, acc_t inv_temp,
                   const acc_t* rowp, const at::Tensor& grad, bool ent) {
  const scalar_t* base = logits.const_data_ptr<scalar_t>();
  scalar_t* gbase = grad.data_ptr<scalar_t>();
  const int64_t T = logits.size(1), V = logits.size(2), sB = logits.stride(0), sT = logits.stride(1);
  const int64_t gB = grad.stride(0), gT = grad.stride(1);
  const int64_t rows = logits.size(0) * T;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, V))
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t b = n / T, t = n % T;
    backward_row_isa(base + b * sB + t * sT, gbase + b * gB + t * gT, V, targets[n] - vocab_start, inv_temp,
                     rowp + n * kStats, ent);
  }
}

template <typename acc_t>
void combine_loop(const acc_t* stats, int64_t world, int64_t rows, const int64_t* targets, int64_t vocab_global,
                  acc_t* out) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * world, 64))
  for (int64_t n = 0; n < rows; ++n) combine_row<acc_t>(stats, world, rows, n, targets[n], vocab_global, out);
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor for the CPU op, got ", t.device());
}

}  // namespace

at::Tensor partial_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, double inv_temp,
                       bool with_entropy) {
  check_logits(logits, "logits");
  check_targets(targets, logits);
  check_cpu(logits, "logits");
  const int64_t rows = logits.size(0) * logits.size(1);
  at::Tensor stats = at::empty({rows, kStats}, logits.options().dtype(acc_type_for(logits.scalar_type())));
  const int64_t* tgt = targets.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "pacs_logprob_partial_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    acc_t* st = stats.data_ptr<acc_t>();
    partial_loop<scalar_t, acc_t>(logits, tgt, vocab_start, static_cast<acc_t>(inv_temp), st, with_entropy);
  });
  return stats;
}

at::Tensor combine_cpu(const at::Tensor& stats, const at::Tensor& targets, int64_t vocab_global) {
  check_stats(stats, targets);
  check_cpu(stats, "stats");
  const int64_t world = stats.size(0), rows = stats.size(1);
  at::Tensor out = at::empty({rows, kOut}, stats.options());
  AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "pacs_logprob_combine_cpu", [&] {
    combine_loop<scalar_t>(stats.const_data_ptr<scalar_t>(), world, rows, targets.const_data_ptr<int64_t>(),
                           vocab_global, out.data_ptr<scalar_t>());
  });
  return out;
}

void backward_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& rowp, int64_t vocab_start,
                  double inv_temp, bool with_entropy, const at::Tensor& grad) {
  check_logits(logits, "logits");
  check_targets(targets, logits);
  check_rowwise(rowp, logits, kStats, "rowp");
  check_grad(grad, logits);
  check_cpu(logits, "logits");
  if (grad.data_ptr() == logits.data_ptr()) {
    TORCH_CHECK(grad.strides() == logits.strides(), "in-place backward needs grad to be exactly the logits tensor");
  }
  const int64_t* tgt = targets.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "pacs_logprob_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t* rp = rowp.const_data_ptr<acc_t>();
    backward_loop<scalar_t, acc_t>(logits, tgt, vocab_start, static_cast<acc_t>(inv_temp), rp, grad, with_entropy);
  });
}

}  // namespace pacs
