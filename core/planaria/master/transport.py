"""How the master's API is protected on the wire: the one place where that is decided.

On loopback only this machine reaches the API, and plain HTTP with the job's token is enough.
Any other address puts the token and every request on a network in clear text; until the API
speaks TLS (a per-job certificate that agents pin), such a job gets a warning at start. TLS
plugs in here: :func:`transport` returns an ``https`` transport with the job's certificate, and
the server and the agents' URL follow what it says.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Transport:
    scheme: str
    """Of the URL agents are given: ``http``."""
    warning: str | None = None
    """What the user must hear before the job starts, when this transport exposes it."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the API on this machine (every address it names is a
    loopback one); an empty host, ``0.0.0.0`` or ``::`` mean every interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    try:
        return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)
    except ValueError:
        return False


def transport(host: str) -> Transport:
    """How the API bound to ``host`` (``master.host``) is served."""
    if is_loopback(host):
        return Transport("http")
    shown = host or "every interface"
    return Transport(
        "http",
        warning=(
            f"the master's API listens on {shown} (master.host), beyond this machine, over "
            "plain HTTP: the job's token and every request travel unencrypted, and whoever "
            "reads them on the network can control the job. Use it only on a network you "
            "trust, or set master.host to 127.0.0.1 when every node runs on this machine."
        ),
    )
