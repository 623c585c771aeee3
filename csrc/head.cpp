// Fused LM head + log-prob op (issue 44): hidden states and the vocab-parallel output weight in, the
// per-row partial stats out, without ever holding more than one [N, Vc] block of logits.
// Legend as in logprob.h, plus:
//   H      hidden size; hidden [N, H] (row n = token n), weight [V, H] (this rank's vocab shard)
//   Vc     vocab columns per block (`block`): the logits block is [N, Vc], reused for every block
//   K      blocks, ceil(V / Vc); Vr real (unpadded) columns of this shard, [Vr, V) is megatron's padding
//
// Why blocks of vocab columns (not of rows): backward then writes each block's grad_weight rows once, with
// one GEMM of depth N (g^T @ hidden), and accumulates only grad_hidden [N, H] over blocks. Blocks of rows
// would accumulate the whole [V, H] grad_weight once per block instead: V / N times more accumulator
// traffic, and N (the response tokens of a micro-batch) is well below V (49k-152k) in this project.
//
// Forward, per block k:  z = hidden @ weight[k]^T  (at::mm: oneDNN/MKL on CPU, cuBLAS on CUDA), padded columns
//   set to -1e30 as actor/model.py mask_padded_vocab does, then the row kernel of logprob_cpu.cpp /
//   logprob_cuda.cu streams the block once for its (max, sum-exp, target z, entropy term) per row: [K, N, 4].
//   The blocks are to the row what TP shards are: the Python side all-gathers [K, N, 4] over TP (still one
//   collective) and combine_row merges the W * K partial stats by max rescaling (the running max / sum-exp).
// Backward, per block: recompute z (nothing [N, V] was saved), the row kernel writes d loss / d z into the
//   block in place (global lse and entropy come in rowp), grad_weight[k] = g^T @ hidden, grad_hidden += g @
//   weight[k] (in fp32 for bf16/fp16: one rounding at the end, as a single unfused GEMM rounds once).
// The collectives (the stats all-gather, the TP all-reduce of grad_hidden) stay in Python (ops/head.py).
//
// Device: the same code runs on CPU and CUDA tensors; only the row kernels differ (partial_cpu/_cuda,
// backward_cpu/_cuda) and at::mm picks the BLAS. The CUDA branch is compiled with -DPACS_WITH_CUDA by the host
// compiler, as setup.py's CUDA build does (tests/ops/test_nvcc_compile.py); it was never run (no GPU was lent
// when it was written).
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
                int64_t block) {
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
  TORCH_CHECK(block > 0, "block (vocab columns per logits block) must be positive, got ", block);
}

int64_t num_blocks(int64_t vocab, int64_t block) { return (vocab + block - 1) / block; }

// Logits of vocab columns [v0, v0 + c) for every row, into the front of buf as a contiguous [N, c] tensor.
at::Tensor block_logits(const at::Tensor& hidden, const at::Tensor& weight, int64_t v0, int64_t c,
                        const at::Tensor& buf, int64_t valid_local) {
  at::Tensor z = buf.narrow(0, 0, hidden.size(0) * c).view({hidden.size(0), c});
  at::mm_out(z, hidden, weight.narrow(0, v0, c).t());
  // mask_padded_vocab's constant (finite: keeps p * z finite in the entropy); fp16's lowest value in fp16
  const int64_t real = std::max<int64_t>(0, std::min<int64_t>(c, valid_local - v0));
  if (real < c) z.narrow(1, real, c - real).fill_(z.scalar_type() == at::kHalf ? -65504.0 : -1e30);
  return z;
}

}  // namespace

at::Tensor head_partial(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                        int64_t vocab_start, double inv_temp, bool with_entropy, int64_t valid_local, int64_t block) {
  check_head(hidden, weight, targets, valid_local, block);
  const int64_t N = hidden.size(0), V = weight.size(0), Vc = std::min(block, V), K = num_blocks(V, Vc);
  at::Tensor stats = at::empty({K, N, kStats}, hidden.options().dtype(acc_type_for(hidden.scalar_type())));
  if (N == 0) return stats;
  at::Tensor h = hidden.contiguous(), w = weight.contiguous();
  at::Tensor buf = at::empty({N * Vc}, h.options());  // the only logits this op ever holds
  for (int64_t k = 0; k < K; ++k) {
    const int64_t v0 = k * Vc, c = std::min(Vc, V - v0);
    at::Tensor z = block_logits(h, w, v0, c, buf, valid_local);
    stats[k].copy_(partial_any(z.unsqueeze(0), targets, vocab_start + v0, inv_temp, with_entropy));
  }
  return stats;
}

at::Tensor head_backward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                         const at::Tensor& rowp, int64_t vocab_start, double inv_temp, bool with_entropy,
                         int64_t valid_local, int64_t block, const at::Tensor& grad_hidden) {
  check_head(hidden, weight, targets, valid_local, block);
  const int64_t N = hidden.size(0), V = weight.size(0), H = hidden.size(1);
  const auto acc = acc_type_for(hidden.scalar_type());
  TORCH_CHECK(rowp.dim() == 2 && rowp.size(0) == N && rowp.size(1) == kStats && rowp.is_contiguous() &&
                  rowp.scalar_type() == acc && rowp.device() == hidden.device(),
              "rowp must be a contiguous [N, 4] ", acc, " tensor on ", hidden.device(), ", got ", rowp.sizes(), " ",
              rowp.scalar_type());
  TORCH_CHECK(grad_hidden.sizes() == hidden.sizes() && grad_hidden.is_contiguous() &&
                  grad_hidden.scalar_type() == hidden.scalar_type() && grad_hidden.device() == hidden.device(),
              "grad_hidden must be a contiguous tensor shaped and typed like hidden ", hidden.sizes());
  at::Tensor gw = at::empty({V, H}, weight.options());
  // grad_hidden sums over blocks: in place for fp32/fp64, in an fp32 accumulator for half types
  const bool direct = acc == hidden.scalar_type();
  at::Tensor gh = direct ? grad_hidden : at::zeros({N, H}, hidden.options().dtype(acc));
  if (direct) gh.zero_();
  if (N == 0) return gw.zero_();
  const int64_t Vc = std::min(block, V), K = num_blocks(V, Vc);
  at::Tensor h = hidden.contiguous(), w = weight.contiguous();
  at::Tensor buf = at::empty({N * Vc}, h.options());
  for (int64_t k = 0; k < K; ++k) {
    const int64_t v0 = k * Vc, c = std::min(Vc, V - v0);
    at::Tensor g = block_logits(h, w, v0, c, buf, valid_local);
    at::Tensor g3 = g.unsqueeze(0);
    backward_any(g3, targets, rowp, vocab_start + v0, inv_temp, with_entropy, g3);  // d loss / d z, in place
    // padded columns are constants (mask_padded_vocab's masked_fill passes them no gradient), even if a
    // target id points into the padding
    const int64_t real = std::max<int64_t>(0, std::min<int64_t>(c, valid_local - v0));
    if (real < c) g.narrow(1, real, c - real).zero_();
    at::Tensor gw_k = gw.narrow(0, v0, c);
    at::mm_out(gw_k, g.t(), h);  // this block's weight rows, written once
    const at::Tensor w_k = w.narrow(0, v0, c);
    if (direct) {
      gh.addmm_(g, w_k);
    } else {
      gh.add_(at::mm(g, w_k));
    }
  }
  if (!direct) grad_hidden.copy_(gh);
  return gw;
}

}  // namespace pacs
