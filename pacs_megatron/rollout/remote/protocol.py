"""What the trainer and the engine processes of ``rollout.placement=separate`` say to each other, and how
they find each other.

Two planes, as in verl / OpenRLHF:

- control (this module): one authenticated ``multiprocessing.connection`` per engine, pickled messages in
  both directions. Commands are served in order (FIFO per engine): that order is what bounds staleness
  (rollout/pipeline.py);
- data (weight_sync/remote.py): the weights, over a gloo (CPU) / NCCL (GPU) process group of trainer
  rank 0 and the engines.

Rendezvous through the trainer job's own TCPStore (``MASTER_ADDR:MASTER_PORT``, hosted by rank 0 or the
torchrun / Ray agent): the launcher hands the engines that address as ``PACS_ROLLOUT_STORE``. Trainer rank
0 puts a random auth key there; each engine listens on a port the kernel gives it and publishes
``host:port``; rank 0 connects to every engine::

    trainer rank 0                         engine e
      store.set(KEY_AUTH, key)               key = store.get(KEY_AUTH); listen; store.set(engine_key(e), addr)
      connect(store.get(engine_key(e)))  ->  accept
      Init(config, model dir, backend)   ->  build the engine (HF / vLLM)
                                         <-  Ready; both join the weight group
      Generate(tag, prompts, sampling)   ->  Result(tag, groups, version)
      LoadWeights(version, layout)       ->  WeightsWanted(version); receive; load; Loaded(version, probe log-probs)
      Close                              ->  exit 0
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from pacs_megatron.rollout.types import Response, SamplingParams

STORE_ENV = "PACS_ROLLOUT_STORE"
"""``host:port`` of the trainer job's TCPStore, set by the launcher in every engine process."""
INDEX_ENV = "PACS_ENGINE_INDEX"
"""This engine's index, 0 .. rollout.engines - 1."""
TIMEOUT_ENV = "PACS_ENGINE_TIMEOUT_S"
"""rollout.engine_timeout_s, for the engine's wait before it has the config."""
DELAY_ENV = "PACS_ENGINE_DELAY_S"
"""Test hook: seconds an engine sleeps before each generation (a slow engine); "A,B,..": engine e sleeps the
e-th value (the last one for the engines after it)."""
KEY_AUTH = "pacs_rollout/authkey"


def engine_key(index: int) -> str:
    return f"pacs_rollout/engine/{index}"


# ------------------------------------------------------------------------------------ messages


@dataclass(frozen=True)
class Init:
    """Trainer -> engine, once: what to build."""

    config: dict
    """The resolved run config (RunConfig as plain data)."""
    model_dir: str
    """The model directory (config.json, maybe weights; rank 0 has written it for the tiny model)."""
    tokenizer_dir: str
    """The tokenizer's directory (model.tokenizer, else the model directory)."""
    backend: str
    """Weight group backend: "gloo" (CPU trainer) or "nccl" (GPU)."""
    engines: int
    """Engine processes in the job."""


@dataclass(frozen=True)
class Generate:
    tag: Any
    prompts: list[list[int]]
    sampling: SamplingParams


@dataclass(frozen=True)
class LoadWeights:
    version: int
    """Policy version of the weights (the RL step that produced them); stamped on later samples."""
    layout: list
    """Per bucket: the tensor layout weight_sync/remote.py sends (names, shapes, dtypes, offsets)."""
    probe: list[list[int]] = field(default_factory=list)
    """Token sequences whose log-probs the engine returns once loaded (the post-sync probe, engine side)."""


@dataclass(frozen=True)
class Close:
    pass


@dataclass(frozen=True)
class Reply:
    """Engine -> trainer. ``busy_s`` / ``idle_s``: the engine's working and waiting time since its last
    reply (waiting: for a command, or for the trainer to send the weights it asked for)."""

    engine: int
    busy_s: float = 0.0
    idle_s: float = 0.0


@dataclass(frozen=True)
class Ready(Reply):
    device: str = "cpu"


@dataclass(frozen=True)
class Result(Reply):
    tag: Any = None
    groups: list[list[Response]] = field(default_factory=list)
    version: int = -1
    """The policy version of the weights that generated every response here."""


@dataclass(frozen=True)
class WeightsWanted(Reply):
    """The engine reached a LoadWeights: the sender may start the broadcast (NCCL must not spin before)."""

    version: int = -1


@dataclass(frozen=True)
class Loaded(Reply):
    version: int = -1
    probe_logprobs: list = field(default_factory=list)
    """The engine's per-token log-probs of ``Init.probe`` after loading (float32 tensors)."""
    load_s: float = 0.0
    probe_continuation: list = field(default_factory=list)
    """The engine's greedy continuation of the probe's prompts (its first PROBE_LEN // 2 tokens) under the loaded
    weights: the next version's probe continues them (weight_sync/remote.py, greedy bound)."""
    bitwise: Any = None
    """The engine's bitwise check of the load (rollout/weight_checksum.py ``Report``; None: not checked)."""


@dataclass(frozen=True)
class Failed(Reply):
    error: str = ""


def send(conn: Connection, msg) -> None:
    """Send ``msg`` by value: ``Connection.send`` pickles tensors as handles to shared memory (torch's
    multiprocessing reductions), which a process on another node cannot open."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection):
    """The next message on ``conn`` (see :func:`send`); EOFError when the other side closed."""
    return pickle.loads(conn.recv_bytes())


# ---------------------------------------------------------------------------------- rendezvous


def store_address() -> tuple[str, int]:
    """The trainer job's TCPStore: ``PACS_ROLLOUT_STORE`` in an engine, MASTER_ADDR/PORT in a trainer rank."""
    if STORE_ENV in os.environ:
        host, _, port = os.environ[STORE_ENV].rpartition(":")
        return host, int(port)
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def connect_store(timeout_s: float, address: tuple[str, int] | None = None):
    """A client of the job's TCPStore (it exists once trainer rank 0 or the launcher's agent started it)."""
    from torch.distributed import TCPStore

    host, port = address or store_address()
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def publish_auth(store) -> bytes:
    """Trainer rank 0: a fresh key for this job's control connections."""
    key = secrets.token_bytes(32)
    store.set(KEY_AUTH, key)
    return key


def _reachable_ip(host: str, port: int) -> str:
    """The address of this machine on the route to ``host`` (what the trainer can connect back to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: no packet is sent, the kernel only picks the route
        return s.getsockname()[0]


def engine_listen(store, index: int) -> Listener:
    """Engine: listen on a free port, publish ``ip:port`` under :func:`engine_key`."""
    key = store.get(KEY_AUTH)  # waits for trainer rank 0
    listener = Listener(("0.0.0.0", 0), authkey=key)
    host, port = store_address()
    store.set(engine_key(index), f"{_reachable_ip(host, port)}:{listener.address[1]}")
    return listener


def trainer_connect(store, key: bytes, index: int, timeout_s: float) -> Connection:
    """Trainer rank 0: the control connection to engine ``index`` (waits for it to publish its address)."""
    store.wait([engine_key(index)], timedelta(seconds=timeout_s))
    host, _, port = store.get(engine_key(index)).decode().rpartition(":")
    return Client((host, int(port)), authkey=key)
