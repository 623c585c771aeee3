"""Spawn gloo process groups on CPU for distributed tests (a small helper in the spirit of
slime's ``tests/_cp_dist_helpers.py``; torch's DTensorTestBase is private API).

    def _body(rank, world_size, x):          # module level, so spawned children can import it
        ...
        return some_tensor_or_dict

    results = run_distributed(_body, 2, x)   # one result per rank, in rank order

Each child: one intra-op thread (the machine has 2 cores), ``init_process_group("gloo")`` on a free
localhost port, the body, then ``destroy_process_group`` (4-rank runs otherwise crash at exit now
and then). A failure in any rank fails the test with that rank's traceback.

A child starts in milliseconds, not seconds: CPU ranks are forked from one ``forkserver`` per test session
that has imported torch, megatron-core (through :func:`import_megatron`) and the actor's stack once
(:data:`PRELOAD`), instead of each rank importing them anew (3-5 s of CPU a rank; a test may start 4 ranks on
2 cores). Each rank is still a fresh process, forked from the server's pristine state, never from an earlier
test's; it takes the test's ``os.environ`` as it is at the call. A child that succeeded ends with
``os._exit`` once its result is saved, without the interpreter's teardown (utils/proc.py's :func:`run_main`).

The children of a CPU test see no GPU (``CUDA_VISIBLE_DEVICES=""``), so the CPU suite runs the same on
a GPU machine: the actor picks CUDA whenever it sees it, and two gloo ranks then shared one GPU and died
of SIGSEGV (seen on an H100, 2026-11-25). GPU tests pass ``gpu=True``: NCCL, one GPU per rank.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pacs_megatron.parallel.cpu_patches import import_megatron
from pacs_megatron.utils.dist import free_port

if torch.version.cuda is None:  # a CPU-only torch; a CUDA one is not probed here, before the child hides its GPUs
    import_megatron()

PRELOAD = ["_dist", "pacs_megatron.actor.actor", "transformers.modeling_utils"]
"""What the forkserver imports once for all CPU ranks of a session (this module brings torch and megatron)."""


def _child(rank: int, world_size: int, port: int, out_dir: str, gpu: bool, environ, fn, args, kwargs) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the test's environment now, not the forkserver's at its start
    if not gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA in this child
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        if gpu:
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args, **kwargs)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is saved: no interpreter teardown (utils/proc.py's run_main says why)


def run_distributed(fn, world_size: int, *args, gpu: bool = False, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` gloo processes on CPU, or with
    ``gpu=True`` in NCCL processes, one GPU each."""
    if gpu and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"{world_size} NCCL ranks need {world_size} GPUs, {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory() as tmp:
        if not gpu:  # NCCL ranks spawn: nothing of CUDA may come from a parent (never run with forkserver)
            mp.set_forkserver_preload(PRELOAD)
        ctx = mp.start_processes(
            _child,
            args=(world_size, free_port(), tmp, gpu, dict(os.environ), fn, args, kwargs),
            nprocs=world_size,
            join=False,
            start_method="spawn" if gpu else "forkserver",
        )
        try:
            while not ctx.join():
                pass
        except Exception as e:
            errors = []
            for r in range(world_size):
                f = Path(tmp) / f"rank{r}.pt"
                if f.exists():
                    rec = torch.load(f, weights_only=False)
                    if not rec["ok"]:
                        errors.append(f"--- rank {r} ---\n{rec['error']}")
            raise AssertionError("distributed test failed:\n" + "\n".join(errors or [str(e)])) from None
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False)["result"] for r in range(world_size)]
