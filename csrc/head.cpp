// Fused LM head + log-prob op (issue 44): hidden states and the vocab-parallel output weight in, the
// per-row partial stats out, without ever holding more than one [chunk, V] block of logits.
// Legend as in logprob.h, plus:
//   H      hidden size; hidden [N, H] (row n = token n), weight [V, H] (this rank's vocab shard)
//   C      rows per chunk (`chunk`): the logits block is [C, V], reused for every chunk
//   Vr     real (unpadded) columns of this shard; columns [Vr, V) are megatron's vocab padding
//
// Forward, per chunk:  z = hidden[c] @ weight^T  (at::mm: oneDNN/MKL on CPU, cuBLAS on CUDA), the padded
//   columns set to -1e30 as actor/model.py mask_padded_vocab does, then the row kernel of logprob_cpu.cpp /
//   logprob_cuda.cu streams the block once for (max, sum-exp, target z, entropy term). The block stays hot in
//   cache between the GEMM and the row kernel on CPU when C * V is small.
// Backward, per chunk: recompute the block (the GEMM again: nothing [N, V] was saved), the row kernel writes
//   d loss / d z into the block in place, then grad_hidden[c] = g @ weight and grad_weight += g^T @ hidden[c].
//   grad_weight is accumulated in fp32 for bf16/fp16 (one rounding at the end, as a single unfused GEMM
//   would round once), in the weight's dtype otherwise.
// The collectives (one all-gather of the [N, 4] stats, the TP all-reduce of grad_hidden) stay in Python
// (pacs_megatron/ops/head.py), as for the logits op.
//
// Device: the same code runs on CPU and CUDA tensors; only the row kernels differ (partial_cpu/_cuda,
// backward_cpu/_cuda) and at::mm picks the BLAS. The CUDA branch is compiled by nvcc in
// tests/ops/test_nvcc_compile.py; it was never run (no GPU was lent when it was written).
#include "logprob.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

namespace pacs {
namespace {

at::Tensor partial_any(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, double inv_temp,
                       bool with_entropy) {
#ifdef PACS_WITH_CUDA
  if (logits.is_cuda()) return partial_cuda(logits, targets, vocab_start, inv_temp, with_entropy);
#endif
  TORCH_CHECK(logits.device().is_cpu(), "head op: got ", logits.device(),
              " tensors but the extension was built without CUDA");
  return partial_cpu(logits, targets, vocab_start, inv_temp, with_entropy);
}

void backward_any(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& rowp, int64_t vocab_start,
                  double inv_temp, bool with_entropy, const at::Tensor& grad) {
#ifdef PACS_WITH_CUDA
  if (logits.is_cuda()) return backward_cuda(logits, targets, rowp, vocab_start, inv_temp, with_entropy, grad);
#endif
  TORCH_CHECK(logits.device().is_cpu(), "head op: got ", logits.device(),
              " tensors but the extension was built without CUDA");
  backward_cpu(logits, targets, rowp, vocab_start, inv_temp, with_entropy, grad);
}

void check_head(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, int64_t valid_local,
                int64_t chunk) {
  TORCH_CHECK(hidden.dim() == 2, "hidden must be 2-D [N, H], got sizes ", hidden.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1), "weight must be [V_local, H] with H = ",
              hidden.size(1), " (the hidden size), got sizes ", weight.sizes());
  TORCH_CHECK(weight.size(0) > 0, "weight: the vocab shard is empty (V_local = 0)");
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "hidden (", hidden.scalar_type(), ") and weight (",
              weight.scalar_type(), ") must have one dtype: cast one of them");
  const auto dt = hidden.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kDouble,
              "hidden must be float32, bfloat16, float16 or float64, got ", dt);
  TORCH_CHECK(hidden.device() == weight.device(), "hidden is on ", hidden.device(), " but weight on ",
              weight.device());
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.dim() == 1 && targets.is_contiguous() &&
                  targets.numel() == hidden.size(0),
              "targets must be a contiguous 1-D int64 [N] tensor with N = ", hidden.size(0), ", got ",
              targets.sizes(), " ", targets.scalar_type());
  TORCH_CHECK(targets.device() == hidden.device(), "targets is on ", targets.device(), " but hidden on ",
              hidden.device());
  TORCH_CHECK(valid_local >= 0 && valid_local <= weight.size(0), "valid_local must be in [0, V_local = ",
              weight.size(0), "], got ", valid_local);
  TORCH_CHECK(chunk > 0, "chunk (rows per logits block) must be positive, got ", chunk);
}

// Logits of rows [r0, r0 + c) into the first c rows of buf, as a [1, c, V] view for the row kernels.
at::Tensor chunk_logits(const at::Tensor& hidden, const at::Tensor& weight, int64_t r0, int64_t c,
                        const at::Tensor& buf, int64_t valid_local) {
  at::Tensor z = buf.narrow(0, 0, c);
  at::mm_out(z, hidden.narrow(0, r0, c), weight.t());
  const int64_t V = weight.size(0);
  // mask_padded_vocab's constant (finite: keeps p * z finite in the entropy); fp16's lowest value in fp16
  if (valid_local < V) z.narrow(1, valid_local, V - valid_local).fill_(z.scalar_type() == at::kHalf ? -65504.0 : -1e30);
  return z.unsqueeze(0);
}

}  // namespace

at::Tensor head_partial(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                        int64_t vocab_start, double inv_temp, bool with_entropy, int64_t valid_local, int64_t chunk) {
  check_head(hidden, weight, targets, valid_local, chunk);
  const int64_t N = hidden.size(0), V = weight.size(0);
  at::Tensor stats = at::empty({N, kStats}, hidden.options().dtype(acc_type_for(hidden.scalar_type())));
  if (N == 0) return stats;
  const int64_t C = std::min(chunk, N);
  at::Tensor h = hidden.contiguous(), w = weight.contiguous();
  at::Tensor buf = at::empty({C, V}, h.options());  // the only logits this op ever holds
  for (int64_t r0 = 0; r0 < N; r0 += C) {
    const int64_t c = std::min(C, N - r0);
    at::Tensor z = chunk_logits(h, w, r0, c, buf, valid_local);
    stats.narrow(0, r0, c).copy_(partial_any(z, targets.narrow(0, r0, c), vocab_start, inv_temp, with_entropy));
  }
  return stats;
}

at::Tensor head_backward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                         const at::Tensor& rowp, int64_t vocab_start, double inv_temp, bool with_entropy,
                         int64_t valid_local, int64_t chunk, const at::Tensor& grad_hidden) {
  check_head(hidden, weight, targets, valid_local, chunk);
  const int64_t N = hidden.size(0), V = weight.size(0), H = hidden.size(1);
  const auto acc = acc_type_for(hidden.scalar_type());
  TORCH_CHECK(rowp.dim() == 2 && rowp.size(0) == N && rowp.size(1) == kStats && rowp.is_contiguous() &&
                  rowp.scalar_type() == acc && rowp.device() == hidden.device(),
              "rowp must be a contiguous [N, 4] ", acc, " tensor on ", hidden.device(), ", got ", rowp.sizes(), " ",
              rowp.scalar_type());
  TORCH_CHECK(grad_hidden.sizes() == hidden.sizes() && grad_hidden.is_contiguous() &&
                  grad_hidden.scalar_type() == hidden.scalar_type() && grad_hidden.device() == hidden.device(),
              "grad_hidden must be a contiguous tensor shaped and typed like hidden ", hidden.sizes());
  // fp32 accumulator for half types: each chunk's product is one GEMM, the sum over chunks stays in fp32
  at::Tensor gw = at::zeros({V, H}, weight.options().dtype(acc));
  if (N == 0) return gw.to(weight.scalar_type());
  const int64_t C = std::min(chunk, N);
  at::Tensor h = hidden.contiguous(), w = weight.contiguous();
  at::Tensor buf = at::empty({C, V}, h.options());
  for (int64_t r0 = 0; r0 < N; r0 += C) {
    const int64_t c = std::min(C, N - r0);
    at::Tensor z = chunk_logits(h, w, r0, c, buf, valid_local);
    backward_any(z, targets.narrow(0, r0, c), rowp.narrow(0, r0, c), vocab_start, inv_temp, with_entropy, z);
    const at::Tensor g = z.squeeze(0);  // d loss / d logits of the chunk, in the hidden states' dtype
    // padded columns are constants (mask_padded_vocab's masked_fill passes them no gradient), even if a
    // target id points into the padding
    if (valid_local < V) g.narrow(1, valid_local, V - valid_local).zero_();
    at::Tensor gh = grad_hidden.narrow(0, r0, c);
    at::mm_out(gh, g, w);
    const at::Tensor hc = h.narrow(0, r0, c);
    if (gw.scalar_type() == g.scalar_type()) {
      gw.addmm_(g.t(), hc);
    } else {
      gw.add_(at::mm(g.t(), hc));
    }
  }
  return gw.scalar_type() == weight.scalar_type() ? gw : gw.to(weight.scalar_type());
}

}  // namespace pacs
