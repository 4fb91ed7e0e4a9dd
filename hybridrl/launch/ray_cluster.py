"""``launcher.name=ray``: one Ray actor per data-parallel rank, in a placement group.

Each actor sets the ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``
environment that torch.distributed reads (rank 0's node address and a free port on it
as the rendezvous) and runs the same training step as any other rank. On one host
``ray.init()`` is started for you; across hosts start a cluster (``ray start --head``
on one, ``ray start --address=HEAD:6379`` on the others) and pass
``launcher.ray_address=auto``. ``launcher.ray_placement=STRICT_SPREAD`` puts every rank on
its own node.

Failure: the first rank that fails (an error, or its actor dies) ends the job: the other
actors are killed, the placement group removed, and one ``ValueError`` names the rank.
"""

from __future__ import annotations

import dataclasses
import os
import socket

CPUS_PER_RANK = 1


def _require_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("launcher.name=ray needs Ray: pip install 'hybridrl[ray]'") from None
    return ray


class RankActor:
    """A data-parallel rank living in a Ray actor."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port (called on rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def run(self, config_yaml: str, master_addr: str, master_port: int) -> str | None:
        """Train; returns None on success or the rank's one-line error."""
        import yaml

        from hybridrl.config.io import build_config
        from hybridrl.job.loop import train

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          LOCAL_WORLD_SIZE="1", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        try:
            train(build_config(yaml.safe_load(config_yaml), source="ray launcher"))
        except BaseException as e:  # noqa: BLE001 - reported to the driver as one line
            return f"{type(e).__name__}: {' '.join(str(e).split()) or type(e).__name__}"
        return None


def launch_ray(cfg) -> None:
    ray = _require_ray()
    from ray.exceptions import RayActorError, RayTaskError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from hybridrl.config.io import config_to_yaml

    t = cfg.trainer
    n, gpu = cfg.launcher.num_workers, t.device.startswith("cuda")
    if t.threads == 0:  # each rank gets its bundle's cores
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(t, threads=CPUS_PER_RANK))
    started = not ray.is_initialized()
    if started:
        ray.init(address=cfg.launcher.ray_address, include_dashboard=False, log_to_driver=True)
    bundle = {"CPU": CPUS_PER_RANK, **({"GPU": 1} if gpu else {})}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=cfg.launcher.ray_placement)
    actors = []
    try:
        ready, _ = ray.wait([pg.ready()], timeout=120)
        if not ready:
            raise ValueError(f"Ray could not place {n} ranks of {bundle} with {cfg.launcher.ray_placement} in 120 s "
                             f"(cluster resources: {ray.cluster_resources()}); lower launcher.num_workers or add nodes")
        remote = ray.remote(RankActor)
        actors = [remote.options(num_cpus=CPUS_PER_RANK, num_gpus=1 if gpu else 0, max_restarts=0,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(
                                     pg, placement_group_bundle_index=i)).remote(i, n) for i in range(n)]
        addr, port = ray.get(actors[0].rendezvous.remote())
        text = config_to_yaml(cfg)
        pending = {a.run.remote(text, addr, port): rank for rank, a in enumerate(actors)}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(done[0])
            try:
                error = ray.get(done[0])
            except (RayActorError, RayTaskError) as e:
                error = f"its Ray actor died ({type(e).__name__})"
            if error is not None:
                raise ValueError(f"rank {rank} failed: {error}")
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)
        if started:
            ray.shutdown()
