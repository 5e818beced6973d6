"""``planaria run``'s line cut in two before click sees it: everything from the training
script on belongs to the script, as with torchrun (``train.py --lr 0.1 -c x`` passes ``-c x``
to the script even though ``-c`` is also ours). Click would take options from anywhere on the
line, so :class:`RunCommand` cuts it at the first word that is neither an option of ours (with
its value) nor the job file; click then parses only the part before the cut, with its own
errors and help. A torchrun flag that has no meaning here is refused at the cut, with why."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperCommand

CONFIG_SUFFIXES = (".yaml", ".yml", ".toml")
"""A first word ending so is the job file, not a training script."""
META_LITERAL = "planaria.literal_command"
"""Key in the click context: the command came after ``--`` and is run as written."""

UNSUPPORTED = {
    "--rdzv-conf": "set the rendezvous section instead, e.g. --set rendezvous.join_timeout=15m "
    "for torchrun's join_timeout",
    "--start-method": "workers start from a warm interpreter, or are exec'd",
    "--event-log-handler": "events go to the run's events.jsonl and to planaria_job_event plugins",
    "--role": "a job has one role",
    "--run-path": "workers are separate processes, restarted in place",
    "--duplicate-stdout-filters": "each rank's whole output is in its log (logs/rank-N.log)",
    "--duplicate-stderr-filters": "each rank's whole output is in its log (logs/rank-N.log)",
    "--local-addr": "a node's address is that of its route to the master; PLANARIA_ADDR in "
    "the node's environment chooses another",
    "--logs-specs": "logs are the run's logs/ directory",
    "--numa-binding": "bind the node's task instead (srun --cpu-bind, numactl), which its "
    "workers inherit",
    "--signals-to-handle": "the agent forwards SIGTERM and SIGINT to the workers",
    "--virtual-local-rank": "every worker sees the node's GPUs (CUDA_VISIBLE_DEVICES) and takes "
    "cuda:LOCAL_RANK",
}
"""torchrun's flags that ``planaria run`` refuses, and why (README's "torchrun users" table
shows the same reasons)."""


def _unsupported(flag: str) -> str | None:
    name = flag.split("=", 1)[0]
    key = name if name in UNSUPPORTED else "--" + name[2:].replace("_", "-")
    reason = UNSUPPORTED.get(key) if name.startswith("-") else None
    return None if reason is None else f"planaria has no such flag: {reason}"


class RunCommand(TyperCommand):
    """Cuts the line before the training script; click parses only what comes before it."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        head, tail, literal = split_line(self.get_params(ctx), ctx, args)
        rest = super().parse_args(ctx, head)
        ctx.params["command"] = tail
        ctx.meta[META_LITERAL] = literal
        return rest


def split_line(
    params: Sequence[Any], ctx: Any, args: Sequence[str]
) -> tuple[list[str], list[str], bool]:
    """``(planaria's part, the command, whether it came after --)``: the command starts at
    ``--`` or at the first word that is neither an option with its value nor the job file.
    ``params`` are the command's (typer's own click) parameters."""
    takes_value: dict[str, bool] = {}
    for param in params:
        if param.param_type_name == "option":
            for name in (*param.opts, *param.secondary_opts):
                takes_value[name] = not param.is_flag and not param.count
    config_given = file_seen = False
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            return list(args[:i]), list(args[i + 1 :]), True
        if word.startswith("-") and word != "-":
            why = _unsupported(word)
            if why is not None:
                raise typer.BadParameter(why, ctx=ctx, param_hint=repr(word.split("=", 1)[0]))
            config_given = config_given or word.split("=", 1)[0] in ("-c", "--config")
            i += 2 if takes_value.get(word, False) else 1
            continue
        if not file_seen and not config_given and word.lower().endswith(CONFIG_SUFFIXES):
            file_seen = True
            i += 1
            continue
        return list(args[:i]), list(args[i:]), False
    return list(args), [], False
