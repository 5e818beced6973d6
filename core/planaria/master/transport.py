"""How the master's API is protected on the wire: the one place where that is decided.

On loopback only this machine reaches the API, and plain HTTP with the job's token is enough.
Any other address puts the token and every request on a network: there the API speaks TLS
with the job's own certificate (:mod:`planaria.master.tls`), whose fingerprint agents pin.
``master.tls`` overrides the choice: ``true`` serves TLS on loopback too (a test, a proxy),
``false`` plain HTTP off loopback, which the user is warned about at start.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Transport:
    scheme: str
    """Of the URL agents are given: ``http`` or ``https``."""
    warning: str | None = None
    """What the user must hear before the job starts, when this transport exposes it."""

    @property
    def tls(self) -> bool:
        """Whether the server needs the job's certificate (and agents its fingerprint)."""
        return self.scheme == "https"


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


def transport(host: str, tls: bool | None = None) -> Transport:
    """How the API bound to ``host`` (``master.host``) is served; ``tls`` is ``master.tls``
    (None: TLS exactly when ``host`` is not loopback)."""
    loopback = is_loopback(host)
    if tls is None:
        tls = not loopback
    if tls:
        return Transport("https")
    if loopback:
        return Transport("http")
    shown = host or "every interface"
    return Transport(
        "http",
        warning=(
            f"the master's API listens on {shown} (master.host), beyond this machine, over "
            "plain HTTP (master.tls: false): the job's token and every request travel "
            "unencrypted, and whoever reads them on the network can control the job. Use it "
            "only on a network you trust, or remove master.tls to serve TLS."
        ),
    )
