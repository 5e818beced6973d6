"""Options of the ``ray`` scheduler (``scheduler.options`` in a job's config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planaria.durations import Duration


class RayOptions(BaseModel):
    """Which Ray cluster, and what each node's agent reserves on its Ray node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str | None = Field(
        default=None,
        description="the cluster to join: `auto` (the one `ray start` left on this machine, "
        "or $RAY_ADDRESS), `ray://host:10001` (Ray Client), or the GCS address host:6379; "
        "none: start a local cluster of `local_nodes` nodes for this run",
    )
    num_cpus: float = Field(default=1.0, ge=0, description="CPUs each agent's actor reserves")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs each agent's actor reserves")
    memory: int | None = Field(
        default=None, ge=0, description="bytes of memory each agent's actor reserves"
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom resources each agent's actor reserves, e.g. {NPU: 8}",
    )
    local_nodes: int = Field(
        default=0,
        ge=0,
        description="without `address`: Ray nodes of the local cluster (0: as many as the "
        "job asks for); each has exactly one agent's resources",
    )
    namespace: str = Field(
        default="planaria", min_length=1, description="the Ray namespace of the agents' actors"
    )
    connect_timeout: Duration = Field(
        default=15.0, gt=0, description="how long joining the cluster may take"
    )
    start_timeout: Duration = Field(
        default=120.0,
        gt=0,
        description="how long an agent's actor may wait to be placed and started before it "
        "is given up as failed (resources taken by others, a node that cannot start it)",
    )
    topology_labels: list[str] | None = Field(
        default=None,
        description="the labels of a Ray node (`ray start --labels switch=s1`) that say where "
        "it stands, for rank placement (rendezvous.backend: topology); none: every label but "
        "Ray's own (`ray.io/...`)",
    )
    stop_grace: Duration = Field(
        default=5.0, description="time an agent gets after SIGTERM before SIGKILL"
    )

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(
                    f"{name!r} is one of Ray's own resources: use the option "
                    f"{'num_cpus' if name == 'CPU' else 'num_gpus' if name == 'GPU' else 'memory'}"
                )
            if amount < 0:
                raise ValueError(f"resource {name!r} must be 0 or more, not {amount}")
        return value

    @field_validator("topology_labels")
    @classmethod
    def _label_names(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(value):
            raise ValueError("a topology label has no name")
        return value

    def demand(self) -> dict[str, float]:
        """What one agent's actor reserves, in Ray's resource names (zero amounts left out)."""
        wanted = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        if self.memory:
            wanted["memory"] = float(self.memory)
        return {name: amount for name, amount in wanted.items() if amount > 0}
