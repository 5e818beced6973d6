"""A worker's environment: torchrun's variables, so that a torchrun-ready script runs
unchanged, plus planaria's own (:func:`worker_env`)."""

from __future__ import annotations

from planaria.protocol import JobSpec, RendezvousInfo


def worker_env(
    spec: JobSpec, info: RendezvousInfo, local_rank: int, restart_count: int, extra: dict[str, str]
) -> dict[str, str]:
    """torchrun's environment for one worker, plus planaria's own variables."""
    rank = info.rank_offset + local_rank
    return {
        **extra,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_WORLD_SIZE": str(spec.procs_per_node),
        "GROUP_RANK": str(info.node_rank),
        "GROUP_WORLD_SIZE": str(info.num_nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(info.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": str(info.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.run_id,
        # True: a store hosted off the workers (rendezvous.store: master), rank 0 a client too.
        "TORCHELASTIC_USE_AGENT_STORE": str(info.agent_store),
    }
