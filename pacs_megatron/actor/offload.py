"""Give the actor's optimizer state and grad buffer back to the rollout engine between phases.

    off = ActorOffload(model_chunks, optimizer, device)
    off.offload()        # after the update: Adam moments + fp32 main params -> pinned host, grad buffer freed
    off.restore()        # before the next train step / checkpoint (idempotent; the actor calls it lazily)

Design
- Storages, not tensors: each optimizer tensor's storage is copied into a pinned host buffer
  (allocated once, reused every step) and then resized to 0 bytes; restore resizes it back and copies
  the bytes in. Every Python reference (optimizer.state, the distributed optimizer's shard lists,
  param views) stays the same object, so the optimizer needs no rebuild and training after
  offload -> restore is bit-identical (tests/actor/test_actor_offload.py checks it on CPU).
- The grad buffer holds nothing needed after the update (the next train step zeroes it), so it is
  freed, not copied: megatron's own ``DistributedDataParallel.offload_grad_buffers`` (storage resize
  to 0) and ``restore_grad_buffers`` (reallocate, zero).
- Model parameters stay resident (the old-log-prob pass and the weight sync read them); for an fp32
  model the plain optimizer's params ARE the model params and are skipped.
- On CUDA the copies are non-blocking into pinned memory, then one synchronize before the device
  storages are freed. On CPU the same code runs (host buffers unpinned), which is what the test
  exercises; the GPU path ran once, on an H100 without TE (tests/actor/test_actor_gpu.py, 2026-11-25).
"""

from __future__ import annotations

import time

import torch

from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (Chained)Optimizer."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in chained if getattr(o, "optimizer", None) is not None]


class ActorOffload:
    """Offload / restore of one actor's optimizer state and grad buffers (see module docstring)."""

    def __init__(self, chunks: list, optimizer, device: torch.device) -> None:
        self.chunks, self.optimizer, self.device = chunks, optimizer, torch.device(device)
        self.offloaded = False
        self._host: dict[int, torch.Tensor] = {}  # storage data_ptr at offload -> host copy (reused)
        self._sizes: list[tuple[torch.UntypedStorage, int, torch.Tensor]] = []

    def _storages(self) -> list[torch.UntypedStorage]:
        model_ptrs = {p.data_ptr() for c in self.chunks for p in c.parameters()}
        seen, out = set(), []
        for opt in _inner_optimizers(self.optimizer):
            tensors = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
            tensors += [p for g in opt.param_groups for p in g["params"] if p.data_ptr() not in model_ptrs]
            for t in tensors:
                st = t.untyped_storage()
                if t.device != self.device or st.nbytes() == 0 or st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                out.append(st)
        return out

    def offload(self) -> dict[str, float]:
        """Move the optimizer state to host memory and free the grad buffers; returns metrics."""
        if self.offloaded:
            return {}
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        moved = 0
        self._sizes = []
        for st in self._storages():
            n = st.nbytes()
            host = self._host.get(st.data_ptr())
            if host is None or host.numel() != n:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
                self._host[st.data_ptr()] = host
            host.untyped_storage().copy_(st, non_blocking=cuda)
            self._sizes.append((st, n, host))
            moved += n
        if cuda:
            torch.cuda.synchronize()  # the copies must land before the device storages go
        for st, _, _ in self._sizes:
            st.resize_(0)
        freed_grads = 0
        for c in self.chunks:
            freed_grads += sum(b.grad_data.numel() * b.grad_data.element_size() for b in getattr(c, "buffers", []))
            c.offload_grad_buffers(synchronize=cuda, empty_cache=False)
        if cuda:
            torch.cuda.empty_cache()
        self.offloaded = True
        seconds = time.perf_counter() - t0
        logger.info(
            "actor offload: %.2f GB optimizer state to host, %.2f GB grad buffer freed in %.2f s",
            moved / 1e9,
            freed_grads / 1e9,
            seconds,
        )
        return {"actor/offload_gb": (moved + freed_grads) / 1e9, "timing/offload_s": seconds}

    def restore(self) -> None:
        """Bring back what :meth:`offload` moved (no-op when nothing is offloaded)."""
        if not self.offloaded:
            return
        cuda = self.device.type == "cuda"
        for st, n, host in self._sizes:
            st.resize_(n)
            st.copy_(host.untyped_storage(), non_blocking=cuda)
        for c in self.chunks:
            c.restore_grad_buffers(synchronize=False)
        if cuda:
            torch.cuda.synchronize()
        # keys of _host were the old device addresses; re-key so the next offload reuses the buffers
        self._host = {st.data_ptr(): host for st, _, host in self._sizes}
        self._sizes = []
        self.offloaded = False
