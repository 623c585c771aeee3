// Fused vocab-parallel log-prob op: declarations shared by the CPU op, the CUDA op and the binding,
// plus the per-row math that both devices share (combine_row) and the input checks.
//
// Legend (used in every csrc file):
//   B, T   leading dims of the logits (any strides); N = B * T rows, row n = b * T + t
//   V      this rank's vocab shard (stride 1); global ids [vocab_start, vocab_start + V) live here
//   W      tensor-parallel world size (number of shards whose stats are combined)
//   z      logit / temperature; acc_t: float for fp32/bf16/fp16 logits, double for fp64 logits
//
// Per-row partial stats of one shard, [N, 4] acc_t ("kStats"):
//   0  m    max_j z_j
//   1  s    sum_j exp(z_j - m)
//   2  tz   z_target if the target id is in this shard, else exactly 0
//   3  a    sum_j exp(z_j - m) * (z_j - m)       (entropy; 0 when not asked)
// Combined per-row result, [N, 3] acc_t: 0 logp (0 for targets outside [0, W*V)), 1 lse, 2 entropy.
// Backward row parameters, [N, 4] acc_t: 0 lse, 1 g_logp, 2 g_entropy, 3 entropy.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define PACS_HD __host__ __device__
#else
#define PACS_HD
#endif

namespace pacs {

constexpr int64_t kStats = 4;
constexpr int64_t kOut = 3;

// Merge the W shards' partial stats of one row (max rescaling) into (logp, lse, entropy).
// Shards with s == 0 (every logit -inf) carry no mass and are skipped, so -inf * 0 never appears.
// A shard with s == NaN (a NaN logit in the row, see the partial ops) is NOT skipped: NaN then reaches
// sum, lse, logp and entropy of this row (and only this row), so a broken forward is visible downstream.
// With m_r <= M and d_r = m_r - M:   S = sum_r e^{d_r} s_r,
//   A = sum_j e^{z_j - M} (z_j - M) = sum_r e^{d_r} (a_r + d_r s_r)   (all terms <= 0, no cancellation)
//   lse = M + log S,   entropy = -sum_j p_j log p_j = log S - A / S.
template <typename acc_t>
PACS_HD inline void combine_row(const acc_t* stats, int64_t world, int64_t rows, int64_t n, int64_t target,
                                int64_t vocab_global, acc_t* out) {
  acc_t big = stats[n * kStats];
  for (int64_t r = 1; r < world; ++r) {
    const acc_t m = stats[(r * rows + n) * kStats];
    big = m > big ? m : big;
  }
  acc_t sum = 0, ent = 0, tz = 0;
  for (int64_t r = 0; r < world; ++r) {
    const acc_t* st = stats + (r * rows + n) * kStats;
    tz += st[2];  // exactly one shard holds the target; the others add an exact 0
    if (st[1] != acc_t(0)) {  // s > 0, or NaN: keep it (NaN must propagate; see above)
      const acc_t d = st[0] - big;
      const acc_t f = std::exp(d);
      sum += f * st[1];
      ent += f * (st[3] + d * st[1]);
    }
  }
  const acc_t log_sum = std::log(sum);
  const acc_t lse = big + log_sum;
  const bool valid = target >= 0 && target < vocab_global;
  out[n * kOut + 0] = valid ? tz - lse : acc_t(0);
  out[n * kOut + 1] = lse;
  out[n * kOut + 2] = log_sum - ent / sum;
}

// ---- input checks shared by both devices (messages name the argument and the fix) ----

inline void check_logits(const at::Tensor& logits, const char* name) {
  TORCH_CHECK(logits.dim() == 3, name,
              " must be 3-D [B, T, V] (the Python wrapper views 2-D [N, V] as [1, N, V]), got ", logits.sizes());
  TORCH_CHECK(logits.size(2) > 0, name, ": the vocab shard is empty (V = 0)");
  TORCH_CHECK(logits.stride(2) == 1 || logits.size(2) == 1, name,
              " must have stride 1 along the vocab dim; call .contiguous() first, got strides ", logits.strides());
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kDouble, name,
              " must be float32, bfloat16, float16 or float64, got ", dt);
}

inline void check_targets(const at::Tensor& targets, const at::Tensor& logits) {
  TORCH_CHECK(targets.scalar_type() == at::kLong, "targets must be int64 (global token ids), got ",
              targets.scalar_type());
  TORCH_CHECK(targets.is_contiguous() && targets.dim() == 1, "targets must be a contiguous 1-D [N] tensor, got sizes ",
              targets.sizes());
  TORCH_CHECK(targets.numel() == logits.size(0) * logits.size(1), "targets has ", targets.numel(),
              " elements but logits has B * T = ", logits.size(0) * logits.size(1), " rows");
  TORCH_CHECK(targets.device() == logits.device(), "targets is on ", targets.device(), " but logits on ",
              logits.device());
}

inline at::ScalarType acc_type_for(at::ScalarType dt) { return dt == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_rowwise(const at::Tensor& t, const at::Tensor& logits, int64_t cols, const char* name) {
  const int64_t rows = logits.size(0) * logits.size(1);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.is_contiguous(), name,
              " must be a contiguous [N, ", cols, "] tensor with N = ", rows, ", got sizes ", t.sizes());
  TORCH_CHECK(t.scalar_type() == acc_type_for(logits.scalar_type()), name, " must be ",
              acc_type_for(logits.scalar_type()), " for ", logits.scalar_type(), " logits, got ", t.scalar_type());
  TORCH_CHECK(t.device() == logits.device(), name, " is on ", t.device(), " but logits on ", logits.device());
}

inline void check_grad(const at::Tensor& grad, const at::Tensor& logits) {
  TORCH_CHECK(grad.sizes() == logits.sizes(), "grad must have the logits' shape ", logits.sizes(), ", got ",
              grad.sizes());
  TORCH_CHECK(grad.scalar_type() == logits.scalar_type(), "grad must have the logits' dtype ", logits.scalar_type(),
              ", got ", grad.scalar_type());
  TORCH_CHECK(grad.stride(2) == 1 || grad.size(2) == 1, "grad must have stride 1 along the vocab dim");
  TORCH_CHECK(grad.device() == logits.device(), "grad is on ", grad.device(), " but logits on ", logits.device());
}

inline void check_stats(const at::Tensor& stats, const at::Tensor& targets) {
  TORCH_CHECK(stats.dim() == 3 && stats.size(1) == targets.numel() && stats.size(2) == kStats &&
                  stats.is_contiguous(),
              "stats must be a contiguous [W, N, ", kStats, "] tensor (the all-gathered partial stats) with N = ",
              targets.numel(), ", got sizes ", stats.sizes());
  TORCH_CHECK(stats.scalar_type() == at::kFloat || stats.scalar_type() == at::kDouble,
              "stats must be float32 or float64, got ", stats.scalar_type());
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.is_contiguous() && targets.dim() == 1,
              "targets must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(stats.device() == targets.device(), "stats is on ", stats.device(), " but targets on ",
              targets.device());
}

// ---- entry points (validated inside; the binding dispatches on device) ----

// Partial stats [N, 4] of this shard; see the legend above.
at::Tensor partial_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, double inv_temp,
                       bool with_entropy);
// Combined [N, 3] (logp, lse, entropy) from the gathered stats [W, N, 4].
at::Tensor combine_cpu(const at::Tensor& stats, const at::Tensor& targets, int64_t vocab_global);
// Writes d(loss)/d(logits) into grad (which may be logits itself: in-place backward).
void backward_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& rowp, int64_t vocab_start,
                  double inv_temp, bool with_entropy, const at::Tensor& grad);

// Fused LM head (head.cpp, CPU and CUDA tensors): partial stats [K, N, 4] of logits hidden @ weight^T computed
// `block` vocab columns at a time (K blocks; combine them with the TP shards' as W * K shards), columns
// >= valid_local masked as vocab padding.
at::Tensor head_partial(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                        int64_t vocab_start, double inv_temp, bool with_entropy, int64_t valid_local, int64_t block);
// Writes d loss / d hidden (this shard's part, before the TP all-reduce) into grad_hidden; returns d loss / d weight.
at::Tensor head_backward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                         const at::Tensor& rowp, int64_t vocab_start, double inv_temp, bool with_entropy,
                         int64_t valid_local, int64_t block, const at::Tensor& grad_hidden);

#ifdef PACS_WITH_CUDA
at::Tensor partial_cuda(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, double inv_temp,
                        bool with_entropy);
at::Tensor combine_cuda(const at::Tensor& stats, const at::Tensor& targets, int64_t vocab_global);
void backward_cuda(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& rowp, int64_t vocab_start,
                   double inv_temp, bool with_entropy, const at::Tensor& grad);
#endif

}  // namespace pacs
