"""A reward worker process: ``python -m pacs_megatron.reward.worker FD`` (started by :mod:`.scorer`).

A fresh interpreter, not ``multiprocessing``: the trainer holds torch threads and gloo groups (so no fork),
and spawn re-imports the parent's ``__main__``. It speaks pickled messages on the inherited socket ``FD``
(init -> ready, score a chunk -> results flushed every ``FLUSH_S``), imports nothing heavy and dies with its
parent. The protocol, message by message: docs/rewards.md, "The worker's protocol".
"""

from __future__ import annotations

import numbers
import sys
import threading
from multiprocessing.connection import Connection

from pacs_megatron.utils.proc import helper_process, run_main

FLUSH_S = 0.01


def serve(conn: Connection) -> None:
    """Load the reward named by the init message, then score messages until told to stop."""
    helper_process()  # a stop signal is the trainer's (it still scores its step, then closes us)
    try:
        _, spec, sys_path = conn.recv()
        sys.path[:] = sys_path  # user reward modules resolve exactly as in the parent
        from pacs_megatron.reward.registry import load_reward_fn

        fn = load_reward_fn(spec)
        if spec == "math":  # pay math-verify's cold start (imports, grammar) before reporting ready
            fn("", "\\boxed{1}", "1", None)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    out = _Outbox(conn)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        if msg is None:
            return
        for i, prompt, response, answer, extra in msg[1]:
            out.put(_score_one(fn, i, prompt, response, answer, extra))
        out.flush()


class _Outbox:
    """Results waiting to be sent; flushed by the scoring loop and every FLUSH_S by a daemon thread."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.items: list[tuple] = []
        threading.Thread(target=self._flush_periodically, daemon=True).start()

    def put(self, result: tuple) -> None:
        with self.lock:
            self.items.append(result)

    def flush(self) -> None:
        with self.lock:
            if self.items:
                try:
                    self.conn.send(("results", self.items))
                except (OSError, ValueError):  # parent gone: the main loop sees EOF next
                    pass
                self.items = []

    def _flush_periodically(self) -> None:
        while True:
            threading.Event().wait(FLUSH_S)
            self.flush()


def _score_one(fn, i: int, prompt, response, answer, extra) -> tuple:
    try:
        value = fn(prompt, response, answer, extra)
    except Exception as e:  # noqa: BLE001 - a failing sample scores 0 and is counted
        return (i, "error", f"{type(e).__name__}: {e}")
    if isinstance(value, numbers.Real):
        return (i, "ok", float(value))
    return (i, "bad_type", f"{type(value).__name__} {value!r:.80}")


if __name__ == "__main__":
    run_main(lambda: serve(Connection(int(sys.argv[1]))))  # no interpreter teardown (utils/proc.py)
