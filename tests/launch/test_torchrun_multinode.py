"""``examples/torchrun/multinode.sh``: two torchrun agents ("nodes") on 127.0.0.1, one rank each, so
TP=2 spans them. SIGUSR1 to both agents mid-run (what a scheduler or an operator sends): torchrun
forwards it, both ranks checkpoint after the step and exit 143 before torchrun's shutdown timeout
could SIGKILL them; the same two commands again resume and complete, each step logged once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _launch_helpers import CONFIG, REPO, files_under, short_run, steps_of, wait_until

from pacs_megatron.utils.dist import free_port

SCRIPT = REPO / "examples" / "torchrun" / "multinode.sh"


def _agents(out: Path, steps: int, log: Path) -> list[subprocess.Popen]:
    port = str(free_port())
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "SHUTDOWN_TIMEOUT": "300"}
    fh = log.open("a")
    return [
        subprocess.Popen(
            ["bash", str(SCRIPT), "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
            + ["--master-port", port, "--nproc-per-node", "1", "--config", str(CONFIG), *short_run(out, steps)],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_agents_stop_and_resume(tmp_path):
    out, steps, log = tmp_path / "run", 25, tmp_path / "agents.log"
    agents = _agents(out, steps, log)
    try:
        alive = lambda: all(a.poll() is None for a in agents)  # noqa: E731
        wait_until(lambda: 2 in steps_of(out / "metrics.jsonl"), 240, "step 2", alive, lambda: files_under(tmp_path))
        for a in agents:
            a.send_signal(signal.SIGUSR1)
        codes = [a.wait(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    text = log.read_text()
    assert all(c != 0 for c in codes), codes  # stopped, not finished
    assert "closing signal SIGUSR1" in text, text[-3000:]  # torchrun forwarded it to its worker
    stopped = max(steps_of(out / "metrics.jsonl"))
    assert stopped < steps
    assert (out / "checkpoints" / f"step_{stopped:08d}" / "COMPLETE").is_file()
    assert "SIGKILL" not in text and f"checkpoint step {stopped} saved" in text

    agents = _agents(out, steps, log)
    codes = [a.wait(timeout=300) for a in agents]
    assert codes == [0, 0], log.read_text()[-3000:]
    assert steps_of(out / "metrics.jsonl") == list(range(1, steps + 1))
    assert steps_of(out / "rollouts.jsonl") == list(range(1, steps + 1))
