"""Adapter-only weight sync (``sync.lora=adapter``): a LoRA actor's adapters to a vLLM engine that serves them.

    every sync        actor.peft_adapter(): TP all-gather, PP object all-gather (actor/lora/export.py)
                      -> PEFT adapter directory under /dev/shm (this rank's own; the previous one deleted)
                      -> engine.load_adapter(path, id): vLLM loads it as LoRARequest(id), drops the old one
    when base_due     before that, the BASE (actor.export_base_weights(): adapters off) through the normal
                      reshard, bucketed and bitwise checked like any full sync; vLLM then drops its adapters
                      and the ids restart at 1

The base is due at a process's first sync and after a PACS v2 reset (the reference's ``reset_step`` moved:
``update_stages.reset_reference`` sets it); the probe after every sync (weight_sync/sync.py) runs through the
adapter. The actor is reached through weight_sync/policy.py's protocol (weight_sync/ does not import actor/).
Why the base is sent then, and what was measured: docs/lora.md, "Weight sync".
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pacs_megatron.rollout.base import AdapterReceiver, Generator
from pacs_megatron.utils.logging import get_logger
from pacs_megatron.weight_sync.policy import PolicyWeights

if TYPE_CHECKING:
    from pacs_megatron.weight_sync.sync import SyncResult, WeightSync

logger = get_logger(__name__)

SHM = Path("/dev/shm")
"""Where the adapter directories go when the machine has it (a RAM disk: the round trip never hits a disk)."""


def base_generation(actor: PolicyWeights) -> int:
    """Which base the actor holds: the step of the last PACS v2 reset (0: the base RL started from)."""
    return int(actor.reference.reset_step) if actor.reference is not None else 0


def write_adapter_dir(tensors: dict[str, torch.Tensor], config: dict, path: Path) -> int:
    """A PEFT adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``, what vLLM's
    ``LoRARequest`` loads); the bytes of the tensors file."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return (path / "adapter_model.safetensors").stat().st_size


def adapter_dir_root(rank: int) -> Path:
    """A fresh directory for this rank's adapters (each rank feeds its own engine: no shared file system
    needed), under /dev/shm when the machine has one; removed when the sync is collected or at exit."""
    parent = SHM if SHM.is_dir() else None
    return Path(tempfile.mkdtemp(prefix=f"pacs_lora_r{rank}_", dir=parent))


class AdapterSync:
    """The adapter-only half of :class:`~pacs_megatron.weight_sync.sync.WeightSync`: which base the engine
    holds, the adapter ids, and the directory the adapters pass through (see the module docstring)."""

    def __init__(self, actor: PolicyWeights, engine: Generator, dtype: torch.dtype | None) -> None:
        """``dtype``: the adapters' dtype on the way (the engine's: vLLM computes the adapter in its own
        dtype, ``lora_dtype=auto``, so a wider copy would only carry bytes it drops); None keeps float32."""
        if not isinstance(engine, AdapterReceiver) or not engine.traits().serves_adapters:
            raise ValueError(
                f"sync.lora=adapter: {type(engine).__name__} serves no LoRA adapter (rollout.engine=vllm builds one "
                "that does); or set sync.lora=merged"
            )
        self.actor, self.dtype = actor, dtype
        self.engine: AdapterReceiver = engine
        self.root = adapter_dir_root(actor.groups.rank)
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self.base_mark: int | None = None
        """:func:`base_generation` of the base the engine holds (None: not sent by this process yet)."""
        self.next_id = 1
        """The id of the next adapter (vLLM's ``lora_int_id``, > 0): 1 after every base sync."""
        self._current: Path | None = None  # the directory of the adapter the engine serves
        self.parts: dict[str, float] = {}
        """Seconds of the last :meth:`push`'s parts: gather, write, load (bench/sync_lora.py reports them)."""

    @property
    def base_due(self) -> bool:
        """The engine's base is not the actor's: the next sync sends the base first."""
        return self.base_mark != base_generation(self.actor)

    def base_sent(self) -> None:
        """The engine now holds the actor's base (and, as vLLM does on a reload, no adapter): ids restart."""
        self.base_mark = base_generation(self.actor)
        self.next_id = 1

    def push_all(self, sync: WeightSync) -> tuple[SyncResult, tuple[float, int]]:
        """One sync of ``sync`` (the :class:`~pacs_megatron.weight_sync.sync.WeightSync` this serves) without
        its probe: the base first when :attr:`base_due` (``sync.push`` streams the adapters-off export, then
        its bitwise check), then the adapter. ``(SyncResult of both parts, the bitwise check's (seconds,
        tensors))``, the latter ``(nan, 0)`` when only the adapter moved: the probe checks it."""
        from pacs_megatron.weight_sync.sync import SyncResult

        base = self.base_due  # the same on every rank: the reset step is
        pushed, bitwise = SyncResult(0.0, 0.0, float("nan"), 0), (float("nan"), 0)
        if base:
            pushed = sync.push()
            bitwise = sync.check_bitwise()
            self.base_sent()
            logger.info(
                "adapter sync: base sent (%.4f GB in %.2f s), adapter ids restart", pushed.gbytes, pushed.seconds
            )
        seconds, nbytes = self.push()
        result = replace(
            pushed,
            seconds=pushed.seconds + seconds,
            gbytes=pushed.gbytes + nbytes / 1e9,
            adapter_gbytes=nbytes / 1e9,
            base_sent=float(base),
        )
        return result, bitwise

    def push(self) -> tuple[float, int]:
        """Gather the adapters, write them, have the engine load them (collective over the actor's TP and PP
        groups); ``(seconds, bytes of the adapter file)``."""
        start = time.perf_counter()
        tensors, config = self.actor.peft_adapter()
        gathered = time.perf_counter()
        if not tensors:
            raise RuntimeError("sync.lora=adapter: the actor has no adapters (actor.lora.rank > 0 adapts nothing?)")
        if self.dtype is not None:
            tensors = {k: v.to(self.dtype) for k, v in tensors.items()}
        adapter_id = self.next_id
        path = self.root / f"adapter_{adapter_id:06d}"
        if path.exists():  # a directory of an earlier base generation with the same id
            shutil.rmtree(path)
        nbytes = write_adapter_dir(tensors, config, path)
        written = time.perf_counter()
        name = f"pacs-base{self.base_mark}-adapter{adapter_id}"
        self.engine.load_adapter(str(path), adapter_id, name)
        loaded = time.perf_counter()
        self.parts = {"gather": gathered - start, "write": written - gathered, "load": loaded - written}
        if self._current is not None and self._current != path:
            shutil.rmtree(self._current, ignore_errors=True)  # vLLM holds the adapter in memory now
        self._current = path
        self.next_id += 1
        return time.perf_counter() - start, nbytes

    def close(self) -> None:
        """Remove the adapter directories now (idempotent; also done when collected)."""
        self._cleanup()
