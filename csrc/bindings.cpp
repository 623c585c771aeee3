// Placeholder binding until the fused log-prob kernel lands: proves the extension builds and loads.
#include <torch/extension.h>

static bool built_with_cuda() {
#ifdef PACS_WITH_CUDA
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("built_with_cuda", &built_with_cuda, "whether the CUDA ops were compiled in");
}
