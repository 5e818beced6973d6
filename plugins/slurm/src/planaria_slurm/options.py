"""Options of the ``slurm`` scheduler (``scheduler.options`` in a job's config)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planaria.durations import Duration

# What a value may hold where it goes into an #SBATCH line or a Slurm command's argument:
# no whitespace, quotes or shell characters (the batch script is a shell script).
_WORD = r"^[A-Za-z0-9_.,:=+@%/\[\]-]+$"


class SlurmOptions(BaseModel):
    """Where the nodes come from (an allocation, or one ``planaria submit`` asks for) and what
    to do with a bad one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str | None = Field(
        default=None,
        pattern=r"^[0-9]+$",
        description="the allocation whose nodes the job uses (default: $SLURM_JOB_ID, set "
        "inside sbatch and salloc)",
    )
    spares: int = Field(
        default=0,
        ge=0,
        description="nodes `planaria submit` asks for beyond job.nodes' maximum, to replace "
        "lost ones; inside an allocation every node beyond the maximum is a spare",
    )
    partition: str | None = Field(default=None, pattern=_WORD, description="sbatch --partition")
    time: str | None = Field(default=None, pattern=_WORD, description="sbatch --time")
    account: str | None = Field(default=None, pattern=_WORD, description="sbatch --account")
    gpus_per_node: str | None = Field(
        default=None, pattern=_WORD, description="sbatch --gpus-per-node (e.g. 8, or h100:8)"
    )
    gres: str | None = Field(default=None, pattern=_WORD, description="sbatch --gres")
    constraint: str | None = Field(
        default=None,
        # Slurm's feature expressions: "a100&ib", "[rack1|rack2]" (an #SBATCH line, no shell).
        pattern=r"^[A-Za-z0-9_.,:=+@%&|*\[\]()!-]+$",
        description="sbatch --constraint",
    )
    sbatch: list[str] = Field(
        default_factory=list,
        description="more #SBATCH lines for `planaria submit`, each one option, e.g. --qos=high",
    )
    requeue: bool = Field(
        default=False,
        description="when a lost node cannot be replaced (no spare left), requeue the batch "
        "job without the bad nodes; it resumes from the last committed checkpoint",
    )
    drain: bool = Field(
        default=False,
        description="drain a node the job excludes as bad (scontrol update state=drain; needs "
        "Slurm operator rights, a warning without them)",
    )
    state_dir: Path | None = Field(
        default=None,
        description="where the nodes found bad are remembered, so that later submissions "
        "exclude them; `planaria submit` sets it to <workdir>/.planaria",
    )
    stop_grace: Duration = Field(
        default=5.0, description="time a node's step gets after SIGTERM before SIGKILL"
    )
    watch_interval: Duration = Field(
        default=1.0, description="how often node states (sinfo) and steps (squeue) are read"
    )

    @field_validator("sbatch")
    @classmethod
    def _one_option_a_line(cls, value: list[str]) -> list[str]:
        for line in value:
            if not line.startswith("-") or any(c in line for c in "\n\r\0"):
                raise ValueError(
                    f"{line!r} is not one sbatch option: write it as --name=value, one per item"
                )
        return value
