// The single pybind11 binding of pacs_megatron._C (the only translation unit that includes the slow
// torch/extension.h). It dispatches each op on the device of its first tensor argument; the ops
// themselves validate their inputs (logprob.h). Python side: pacs_megatron/ops/logprob.py.
#include <torch/extension.h>

#include "logprob.h"

namespace {

bool built_with_cuda() {
#ifdef PACS_WITH_CUDA
  return true;
#else
  return false;
#endif
}

[[noreturn]] void no_cuda(const char* op) {
  TORCH_CHECK(false, "pacs_megatron._C.", op, ": got CUDA tensors but the extension was built without CUDA; "
              "rebuild with a CUDA torch and toolkit (PACS_BUILD_CUDA=1) or use PACS_LOGPROB_IMPL=reference");
}

at::Tensor partial(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, double inv_temp,
                   bool with_entropy) {
  if (logits.is_cuda()) {
#ifdef PACS_WITH_CUDA
    return pacs::partial_cuda(logits, targets, vocab_start, inv_temp, with_entropy);
#else
    no_cuda("logprob_partial");
#endif
  }
  return pacs::partial_cpu(logits, targets, vocab_start, inv_temp, with_entropy);
}

at::Tensor combine(const at::Tensor& stats, const at::Tensor& targets, int64_t vocab_global) {
  if (stats.is_cuda()) {
#ifdef PACS_WITH_CUDA
    return pacs::combine_cuda(stats, targets, vocab_global);
#else
    no_cuda("logprob_combine");
#endif
  }
  return pacs::combine_cpu(stats, targets, vocab_global);
}

void backward(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& rowp, int64_t vocab_start,
              double inv_temp, bool with_entropy, const at::Tensor& grad) {
  if (logits.is_cuda()) {
#ifdef PACS_WITH_CUDA
    return pacs::backward_cuda(logits, targets, rowp, vocab_start, inv_temp, with_entropy, grad);
#else
    no_cuda("logprob_backward");
#endif
  }
  pacs::backward_cpu(logits, targets, rowp, vocab_start, inv_temp, with_entropy, grad);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pacs_megatron fused vocab-parallel log-prob op (CPU; CUDA when built_with_cuda())";
  m.def("built_with_cuda", &built_with_cuda, "whether the CUDA ops were compiled in");
  m.def("logprob_partial", &partial, "per-row partial stats [N, 4] (max, sum-exp, target z, entropy term) of a shard",
        py::arg("logits"), py::arg("targets"), py::arg("vocab_start"), py::arg("inv_temp"), py::arg("with_entropy"));
  m.def("logprob_combine", &combine, "combine gathered stats [W, N, 4] into [N, 3] (logp, lse, entropy)",
        py::arg("stats"), py::arg("targets"), py::arg("vocab_global"));
  m.def("logprob_backward", &backward, "write d loss / d logits into grad (may alias logits)", py::arg("logits"),
        py::arg("targets"), py::arg("rowp"), py::arg("vocab_start"), py::arg("inv_temp"), py::arg("with_entropy"),
        py::arg("grad"));
  // Fused LM head (csrc/head.cpp): device-generic, the row kernels above per [N, block] logits block
  m.def("head_partial", &pacs::head_partial,
        "partial stats [K, N, 4] of hidden @ weight^T, one [N, block] logits block at a time", py::arg("hidden"),
        py::arg("weight"), py::arg("targets"), py::arg("vocab_start"), py::arg("inv_temp"), py::arg("with_entropy"),
        py::arg("valid_local"), py::arg("block"));
  m.def("head_backward", &pacs::head_backward,
        "recompute each logits block; write d loss / d hidden into grad_hidden, return d loss / d weight",
        py::arg("hidden"), py::arg("weight"), py::arg("targets"), py::arg("rowp"), py::arg("vocab_start"),
        py::arg("inv_temp"), py::arg("with_entropy"), py::arg("valid_local"), py::arg("block"),
        py::arg("grad_hidden"));
}
