"""``launcher.kind=ray``: run the trainer's ranks as Ray actors in a placement group.

    driver (pacs-megatron train, or the entrypoint of ``ray job submit``)
      connect (launcher.ray_address) -> placement group of world_size bundles, bounded wait
      -> one RankActor per bundle (launch/ray_rank.py) -> ranks ordered by node, MASTER_ADDR = rank 0's node,
         MASTER_PORT = the rendezvous store rank 0's actor binds (a port the kernel gives it)
      -> every actor runs ``python -m pacs_megatron.launch`` with RANK, WORLD_SIZE, LOCAL_RANK, ... set
      -> supervise: stream logs, forward SIGINT/SIGTERM/SIGUSR1, first failure names its rank
         (a second SIGTERM / Ctrl-C is not forwarded: the driver stops supervising at once, 143 / 130)
      -> kill the actors, remove the placement group, return the trainer's exit code

Ranks are assigned to bundles in node order, so under ``pack`` each TP group shares a node. A rank exiting
non-zero gets the others :data:`~pacs_megatron.launch.local.GRACE_S` to follow; a lost actor stops the job at
once. Bundles, environment, separate engines and what was tested: docs/launch.md, "Ray".
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections import defaultdict

from pacs_megatron.config import RunConfig, to_yaml
from pacs_megatron.launch.engine_rank import STARTED_ENV
from pacs_megatron.launch.local import FORWARDED, GRACE_S
from pacs_megatron.launch.ray_rank import TRAINER, RankActor, RankProgram, RankResult
from pacs_megatron.utils.logging import get_logger
from pacs_megatron.utils.preemption import EXIT_PREEMPTED, NOT_SAVED, StopCounter, exit_now_code
from pacs_megatron.utils.proc import ray_job_runtime_env

logger = get_logger(__name__)

_STRATEGY = {"pack": "PACK", "spread": "SPREAD", "strict_spread": "STRICT_SPREAD"}
_PROBE_TIMEOUT_S = 5.0
# The driver's variables every rank gets: the run's own and the network / runtime settings that
# make or break a multi-node job (a rank's environment is its raylet's otherwise, not the driver's
# shell). launcher.env adds or overrides any others.
_FORWARDED_ENV_PREFIXES = (
    "PACS_", "HF_", "WANDB_", "NCCL_", "GLOO_", "TORCH_", "VLLM_", "UCX_", "NVTE_", "OMP_",
    "CUDA_DEVICE_MAX_CONNECTIONS",
)  # fmt: skip
_NOT_FORWARDED = {"TORCH_HOME"}  # a path on the driver's machine
RAY_STOP_WAIT_MIN_S = 120
"""Below this ``RAY_JOB_STOP_WAIT_TIME_S`` (Ray's default: 3 s) ``ray job stop`` SIGKILLs the driver,
and with it the ranks, before they can finish a step and checkpoint: warned at start."""
_STOPPED = (EXIT_PREEMPTED, 128 + signal.SIGINT)  # a rank that checkpointed and stopped on a signal


class LaunchError(RuntimeError):
    """The job could not be started or failed; the message is one line for the user."""


def connect(address: str) -> None:
    """``ray.init`` for ``launcher.ray_address`` ("" starts a private instance); one-line errors."""
    import ray

    if address and address != "auto":
        host, _, port = address.rpartition(":")
        try:  # ray.init retries an unreachable GCS for minutes: probe it first
            socket.create_connection((host.removeprefix("ray://") or "127.0.0.1", int(port)), _PROBE_TIMEOUT_S).close()
        except (OSError, ValueError) as e:
            raise LaunchError(
                f"launcher.ray_address={address!r}: no Ray head answers there ({e}); start one with "
                "`ray start --head --port PORT` and pass HOST:PORT, or use launcher.ray_address=auto on a cluster node"
            ) from None
    try:
        ray.init(address=address or None, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LaunchError(
            f"launcher.ray_address={address!r}: cannot connect to Ray ({first}); start a cluster with "
            "`ray start --head` or set launcher.ray_address to its HOST:PORT"
        ) from None


def _bundles(cfg: RunConfig) -> list[dict]:
    import ray

    gpus = cfg.launcher.gpus_per_rank
    if gpus < 0:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    bundle = {"CPU": float(cfg.launcher.cpus_per_rank)} | ({"GPU": float(gpus)} if gpus else {})
    return [dict(bundle) for _ in range(cfg.parallel.world_size + _engines(cfg))]


def _engines(cfg: RunConfig) -> int:
    return cfg.rollout.engines if cfg.rollout.placement == "separate" else 0


def reserve(cfg: RunConfig):
    """Create the placement group and wait ``placement_timeout_s`` for it; say what is missing if not."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = _bundles(cfg)
    strategy = _STRATEGY[cfg.launcher.placement]
    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=cfg.launcher.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per_node = [{k: v for k, v in n["Resources"].items() if k in ("CPU", "GPU")} for n in nodes]
        raise LaunchError(
            f"placement group not granted within launcher.placement_timeout_s={cfg.launcher.placement_timeout_s:g}: "
            f"asked {len(bundles)} bundles of {bundles[0]} ({strategy}, one per rank of parallel.world_size="
            f"{cfg.parallel.world_size} and per rollout engine: {_engines(cfg)}); the cluster has {len(nodes)} node(s) "
            f"with {per_node}. Use a smaller layout, "
            "another launcher.placement, launcher.gpus_per_rank=0, or add nodes"
        ) from None
    return pg


def _rank_order(places: list[dict]) -> list[int]:
    """Bundle index of each rank: bundles grouped by node (first-seen order), so consecutive ranks share one."""
    first_seen: dict[str, int] = {}
    for i, p in enumerate(places):
        first_seen.setdefault(p["node_id"], i)
    return sorted(range(len(places)), key=lambda i: (first_seen[places[i]["node_id"]], i))


def rank_envs(
    places: list[dict], order: list[int], cpus_per_rank: int, gcs_address: str, extra_env: dict | None = None
) -> list[dict[str, str]]:
    """The environment of each rank (index = rank), from the actors' places and the rank order: the
    driver's forwarded variables, ``extra_env`` (launcher.env), then the rank's own."""
    world = len(order)
    master = places[order[0]]
    on_node: dict[str, list[int]] = defaultdict(list)
    for rank, b in enumerate(order):
        on_node[places[b]["node_id"]].append(rank)
    forwarded = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV_PREFIXES)}
    forwarded = {k: v for k, v in forwarded.items() if k not in _NOT_FORWARDED} | dict(extra_env or {})
    envs = []
    for rank, b in enumerate(order):
        p = places[b]
        local = on_node[p["node_id"]]
        env = forwarded | {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(local)),
            "MASTER_ADDR": master["ip"],
            "MASTER_PORT": str(master["port"]),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # the store is rank 0's actor's (ray_rank.host_store)
            "OMP_NUM_THREADS": forwarded.get("OMP_NUM_THREADS", str(cpus_per_rank)),
            "PACS_LAUNCHER_KIND": "ray",
            "PACS_RAY_NODE_ID": p["node_id"],
            "PACS_NODE_IP": p["ip"],
            "RAY_ADDRESS": gcs_address,  # reward.backend=ray in a rank joins this cluster
        }
        gpu_ids = [g for r in local for g in places[order[r]]["gpu_ids"]]
        if gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        envs.append(env)
    return envs


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """``trainer.output_dir``, ``model.path`` (and a local ``model.tokenizer``) made absolute on the
    driver: a rank runs in the driver's working directory only where that exists on its node (else in
    a private temp dir), and ``ray job submit --working-dir`` unpacks a copy per node, so relative
    paths would scatter the run across nodes. Whether every node sees them is checked by the ranks
    at start (utils/shared_fs.py)."""
    cfg.trainer.output_dir = os.path.abspath(cfg.trainer.output_dir)
    cfg.model.path = os.path.abspath(cfg.model.path)
    if cfg.model.tokenizer and os.path.exists(cfg.model.tokenizer):
        cfg.model.tokenizer = os.path.abspath(cfg.model.tokenizer)
    return cfg


def warn_short_job_stop() -> None:
    """Under ``ray job submit``: warn when ``ray job stop`` would SIGKILL the ranks before a checkpoint."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:  # set by Ray's job supervisor for its driver
        return
    wait = int(os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "3") or 3)
    if wait < RAY_STOP_WAIT_MIN_S:
        logger.warning(
            "RAY_JOB_STOP_WAIT_TIME_S=%d: `ray job stop` kills the ranks %d s after SIGTERM, before they can "
            'checkpoint; submit with --runtime-env-json \'{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "600"}}\' '
            "(a step plus a checkpoint)",
            wait,
            wait,
        )


def main(cfg: RunConfig, program: RankProgram = TRAINER) -> int:
    """The ``launcher.kind=ray`` entry of ``pacs-megatron train`` (and of ``doctor --distributed``, another
    ``program`` on the same ranks): the job's exit code, errors in one line."""
    if program == TRAINER:  # a check (doctor) has nothing to checkpoint when stopped
        warn_short_job_stop()
    try:
        return launch_ray(absolute_paths(cfg), program)
    except LaunchError as e:
        logger.error("ray launcher: %s", e)
        return 1


def launch_ray(cfg: RunConfig, program: RankProgram = TRAINER) -> int:
    """Run the job on the Ray cluster of ``cfg.launcher``; the ranks' exit code (LaunchError if it
    cannot start or a rank is lost). A captured stdout (``program.capture_stdout``) of rank 0 is
    written to the driver's stdout once the ranks are done."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    connect(cfg.launcher.ray_address)
    pg, actors = None, []
    try:
        pg = reserve(cfg)
        bundles = pg.bundle_specs
        remote = ray.remote(RankActor)
        actors = [
            remote.options(
                num_cpus=b["CPU"],
                num_gpus=b.get("GPU", 0),
                max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                runtime_env=ray_job_runtime_env(),  # niceness 0, not Ray's 15: the ranks are the job
            ).remote(i)
            for i, b in enumerate(bundles)
        ]
        world = cfg.parallel.world_size
        places = ray.get([a.where.remote() for a in actors])
        order = _rank_order(places[:world])  # trainer ranks: the first world_size bundles; engines: the rest
        places[order[0]]["port"] = ray.get(actors[order[0]].host_store.remote())  # bound by rank 0's actor
        gcs = ray.get_runtime_context().gcs_address
        extra = cfg.launcher.env | ({STARTED_ENV: "1"} if _engines(cfg) else {})
        envs = rank_envs(places[:world], order, cfg.launcher.cpus_per_rank, gcs, extra)
        ranked = [actors[b] for b in order]
        where = [places[b] for b in order]
        logger.info(
            "ray: %d ranks (%s) on nodes %s",
            len(ranked),
            cfg.launcher.placement,
            [f"{w['host']}/{w['node_id'][:8]}" for w in where],
        )
        yaml = to_yaml(cfg)
        refs = [a.run.remote(r, yaml, envs[r], os.getcwd(), program) for r, a in enumerate(ranked)]
        engines = _start_engines(cfg, actors[world:], places[world:], places[order[0]], envs[0])
        code, report = _supervise(ranked, refs, where, engines)
        if report:
            sys.stdout.write(report)
            sys.stdout.flush()
        return code
    finally:
        for a in actors:
            ray.kill(a)
        if pg is not None:
            remove_placement_group(pg)
        ray.shutdown()


def _start_engines(cfg: RunConfig, actors: list, places: list[dict], master: dict, rank0_env: dict) -> dict:
    """Run the engine processes in their actors (placement=separate); ``{ref: (engine index, place)}``."""
    from pacs_megatron.launch.engine_rank import MODULE, engine_env

    store = f"{master['ip']}:{master['port']}"
    refs = {}
    for e, (actor, place) in enumerate(zip(actors, places)):
        gpu = ",".join(place["gpu_ids"]) or None  # GPU cluster: never run
        base = {k: v for k, v in rank0_env.items() if k not in ("CUDA_VISIBLE_DEVICES", STARTED_ENV)}
        env = engine_env(base, e, store, cfg.launcher.cpus_per_rank, cfg.rollout.engine_timeout_s, gpu)
        env["PACS_NODE_IP"], env["PACS_RAY_NODE_ID"] = place["ip"], place["node_id"]
        refs[actor.run.remote(e, "", env, os.getcwd(), RankProgram(MODULE))] = (e, place)
    if refs:
        logger.info("ray: %d rollout engine(s) on nodes %s", len(refs), [p["node_id"][:8] for _, p in refs.values()])
    return refs


def _supervise(actors: list, refs: list, where: list[dict], engines: dict | None = None) -> tuple[int, str]:
    """Wait for every rank; forward signals; on the first failure stop the rest and name that rank (or
    engine: one ending while the ranks run fails the job). Returns the exit code and rank 0's captured stdout.
    A second SIGTERM / Ctrl-C returns at once with 143 / 130: the caller's ``ray.kill`` ends every actor, and a
    rank dies with its actor (PR_SET_PDEATHSIG), its helpers with it."""
    import ray

    received: list[int] = []
    stops = StopCounter()
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in FORWARDED}
    pending = {ref: r for r, ref in enumerate(refs)}
    codes: dict[int, int] = {}
    failure: str | None = None
    lost = False
    stop_at: float | None = None
    report = ""
    try:
        engines = dict(engines or {})
        while pending:
            done, _ = ray.wait(list(engines), num_returns=len(engines), timeout=0) if engines else ([], [])
            for ref in done:  # an engine exits 0 only once the trainer closed it
                e, place = engines.pop(ref)
                try:
                    ended = ray.get(ref)
                    why = f"exited with code {ended.code}: {ended.tail[-1] if ended.tail else 'no output'}"
                except ray.exceptions.RayActorError:
                    ended, why = None, "was lost (its Ray actor died)"
                if (ended is None or ended.code != 0) and failure is None:
                    failure = f"rollout engine {e} on node {place['node_id'][:8]} ({place['host']}) {why}"
                    stop_at = time.monotonic() + GRACE_S
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
            for ref in ready:
                r = pending.pop(ref)
                node = f"node {where[r]['node_id'][:8]} ({where[r]['host']}, {where[r]['ip']})"
                try:
                    result: RankResult = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    if failure is None:
                        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                        failure = f"rank {r} on {node} was lost: its Ray actor died ({first[:200]})"
                        lost = True
                        stop_at = time.monotonic()  # its peers are stuck in a collective: stop them now
                    continue
                codes[r] = result.code
                report = result.stdout if r == 0 else report
                if result.code not in (0, *_STOPPED) and failure is None:
                    why = result.tail[-1] if result.tail else "no output"
                    failure = f"rank {r} on {node} exited with code {result.code}: {why}"
                    stop_at = time.monotonic() + GRACE_S
            while received:
                signum = received.pop(0)
                if stops.second(signum):
                    code = exit_now_code(signum)
                    name = signal.Signals(signum).name
                    logger.warning("second %s: killing the ranks and engines, exit code %d; %s", name, code, NOT_SAVED)
                    return code, report
                logger.warning("forwarding %s to %d ranks", signal.Signals(signum).name, len(pending))
                for a in actors:
                    a.signal.remote(signum)
            if stop_at is not None and pending and time.monotonic() >= stop_at:
                logger.error("%s; stopping the other ranks", failure)
                for r in pending.values():
                    ray.kill(actors[r])
                stop_at = float("inf")
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if lost:
        raise LaunchError(f"{failure}; the job failed, resume it with --resume auto")
    if failure is not None:
        logger.error(failure)
    return next((codes[r] for r in sorted(codes) if codes[r] != 0), 0), report
