"""``python -m planaria_slurm.address``: the address of this host that the allocation's nodes
reach, printed for the batch script of ``planaria submit``.

The batch script runs the master on the batch host, which nobody knows when the job is
submitted, so the script asks here, at run time, and hands the answer to ``planaria run`` as
``PLANARIA_MASTER_ADVERTISE``: a master bound to every interface with no ``master.advertise``
tells its agents that address (:mod:`planaria.master.advertise`). It is the local address of
the route to the allocation's nodes (their ``NodeAddr``), else the default route's, else the
host's name. Prints the address alone on stdout and why on stderr; exits 2, printing nothing
on stdout, when it cannot tell (``planaria run`` then chooses, or stops, itself).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from planaria.master.advertise import Advertised, AdvertiseError, find
from planaria_slurm.scheduler import allocation_addresses


def batch_host_address(env: Mapping[str, str]) -> Advertised:
    """This host's address for the nodes of the allocation in ``env`` (``SLURM_JOB_ID``)."""
    return find(lambda: allocation_addresses(env.get("SLURM_JOB_ID") or None))


def main() -> int:
    try:
        chosen = batch_host_address(os.environ)
    except AdvertiseError as exc:
        print(
            f"planaria: cannot tell this host's address for the allocation's nodes: {exc}; a "
            "master bound to every interface chooses, or asks for master.advertise, itself",
            file=sys.stderr,
        )
        return 2
    print(
        f"planaria: this host's address for the allocation's nodes: {chosen.address} "
        f"({chosen.why}), for a master bound to every interface with no master.advertise",
        file=sys.stderr,
    )
    print(chosen.address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
