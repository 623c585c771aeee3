"""Is a directory on a filesystem every rank sees? Checked at start, not at the first checkpoint.

``trainer.output_dir`` holds one checkpoint written by all ranks together (each its own shards) and
read back by all of them on resume, and rank 0's metrics; ``model.path`` of the tiny model is written
by rank 0 and read by every rank. On a node-local disk (``/tmp``, ``/scratch`` on many clusters,
a Ray worker's private temp dir) each node sees its own directory: the run starts, and fails hours
later at the first checkpoint or resume. The canary finds that before step 1:

rank 0 writes ``DIR/.pacs-canary-<nonce>`` holding the nonce, every rank reads it back (retrying
briefly: an NFS client may cache the directory's listing for a few seconds), the verdicts are
gathered, and every rank raises the same :class:`~pacs_megatron.config.ConfigError`: one line naming
the path and the hosts that cannot see it. Collective; a world of one checks nothing.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

from pacs_megatron.utils.dist import all_gather_objects, rank_and_world

VISIBLE_WAIT_S = 5.0
"""How long a rank keeps looking for the canary (NFS attribute caches hold a listing ~3 s)."""


def _host() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _sees(path: Path, nonce: str, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    while True:
        try:
            if path.read_text() == nonce:
                return True
        except OSError:
            pass
        if time.monotonic() >= end:
            return False
        time.sleep(0.2)


def unseen_by(directory: str | Path, wait_s: float = VISIBLE_WAIT_S) -> list[str]:
    """Collective: the ``host (rank r)`` entries of the ranks that cannot read what rank 0 wrote in
    ``directory`` ([] when all can). Rank 0 creates the directory; the canary is removed after."""
    rank, world = rank_and_world()
    if world == 1:
        return []
    directory = Path(directory)
    nonce = ""
    if rank == 0:
        nonce = uuid.uuid4().hex
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f".pacs-canary-{nonce}").write_text(nonce)
    nonce = all_gather_objects(nonce)[0]
    ok = rank == 0 or _sees(directory / f".pacs-canary-{nonce}", nonce, wait_s)
    verdicts = all_gather_objects((ok, _host()))
    if rank == 0:
        (directory / f".pacs-canary-{nonce}").unlink(missing_ok=True)
    return _by_host(verdicts)


def _by_host(verdicts: list[tuple[bool, str]]) -> list[str]:
    """``["n2 (ranks 2,3)", ...]`` for the ranks whose verdict is False, one entry per host."""
    hosts: dict[str, list[int]] = {}
    for r, (ok, host) in enumerate(verdicts):
        if not ok:
            hosts.setdefault(host, []).append(r)
    return [f"{h} (rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))})" for h, rs in hosts.items()]


def missing_on(path: str | Path) -> list[str]:
    """Collective: the hosts (with ranks) on which ``path`` does not exist. For inputs that may be
    copied to every node's own disk (a model directory), where a canary would be too strict."""
    return _by_host(all_gather_objects((Path(path).exists(), _host())))


def require_shared(directory: str | Path, key: str) -> None:
    """Collective: raise ConfigError on every rank when some rank cannot see ``directory``."""
    from pacs_megatron.config import ConfigError

    missing = unseen_by(directory)
    if missing:  # the same list on every rank: every rank raises
        raise ConfigError(
            f"{key}={directory} is not on a filesystem every node sees: {', '.join(missing)} cannot read "
            f"what rank 0 wrote there (a node-local disk?): put {key} on a shared filesystem"
        )
