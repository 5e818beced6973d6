"""Channel binding: an agent that holds only the job's token learns the master's certificate.

Launchers started outside planaria (``srun planaria run --rdzv-endpoint HOST:PORT ...`` on
every node) share a secret, the job's token (``PLANARIA_TOKEN``), but no certificate: the
master makes its key when it starts. An agent must not send the token to whoever answers at
HOST:PORT, nor trust a master that cannot show it knows the token. So, before anything of the
job's goes out, the agent opens a TLS connection, reads the fingerprint of the certificate the
handshake showed, sends a fresh random nonce over that very connection, and checks the reply:
``HMAC-SHA256(token, "planaria-bind" | nonce | fingerprint)``. Only a server holding the token
can compute it, and a server in the middle shows a certificate of its own, whose fingerprint
the real master's proof does not cover. Once it checks, the agent pins that fingerprint, as
agents launched by the master do with the one they are given; the master checks the agent's
token on every request as before.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import secrets
import time
from collections.abc import Callable

from planaria.errors import PlanariaError
from planaria.master.tls import fingerprint_of, pinning_context
from planaria.protocol import API_PREFIX, BindReply, BindRequest

LABEL = b"planaria-bind"
RETRY_DELAY = 1.0


class BindingRefused(PlanariaError):
    """The server at the endpoint could not prove it holds the job's token: it is not this
    job's master (another job's, or someone else), or the tokens differ."""


def proof(token: str, nonce: str, fingerprint: str) -> str:
    """The master's answer to ``nonce`` over its certificate's ``fingerprint``."""
    message = b"|".join((LABEL, nonce.encode(), fingerprint.encode()))
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def prover(token: str, fingerprint: str) -> Callable[[str], str]:
    """What the master's ``POST /v1/bind`` answers with."""
    return lambda nonce: proof(token, nonce, fingerprint)


def learn_fingerprint(host: str, port: int, token: str, timeout: float = 10.0) -> str:
    """The fingerprint of the certificate of the master at ``host:port``, once it proved the
    token over it. Raises :class:`BindingRefused` when it cannot, ``OSError`` when nothing
    (or no TLS server) answers there."""
    nonce = secrets.token_hex(32)
    connection = http.client.HTTPSConnection(host, port, timeout=timeout, context=pinning_context())
    try:
        connection.connect()
        sock = connection.sock
        der = sock.getpeercert(binary_form=True) if sock is not None else None
        if der is None:
            raise BindingRefused(f"the server at {host}:{port} showed no certificate")
        fingerprint = fingerprint_of(der)
        body = BindRequest(nonce=nonce).model_dump_json()
        connection.request(
            "POST", f"{API_PREFIX}/bind", body, headers={"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        text = response.read().decode(errors="replace")
    except http.client.HTTPException as exc:
        raise OSError(f"no planaria master answers at {host}:{port}: {exc}") from exc
    finally:
        connection.close()
    if response.status != 200:
        raise BindingRefused(
            f"the server at {host}:{port} answered {response.status} to {API_PREFIX}/bind: "
            f"{_message(text)}"
        )
    try:
        given = BindReply.model_validate_json(text).proof
    except ValueError:
        raise BindingRefused(f"the server at {host}:{port} gave no proof: {text[:200]}") from None
    if not hmac.compare_digest(given, proof(token, nonce, fingerprint)):
        raise BindingRefused(
            f"the master at {host}:{port} does not hold this launcher's token (PLANARIA_TOKEN): "
            "it is another job's master, or the launchers were given different tokens; set the "
            "same PLANARIA_TOKEN in every launcher's environment"
        )
    return fingerprint


def wait_for_master(
    host: str,
    port: int,
    token: str,
    timeout: float,
    on_retry: Callable[[str], None] | None = None,
) -> str:
    """:func:`learn_fingerprint`, tried again every second while nothing answers (the master's
    launcher may start later than this one), for at most ``timeout`` seconds. A master that
    answers and cannot prove the token is refused at once."""
    deadline = time.monotonic() + timeout
    told = False
    while True:
        try:
            return learn_fingerprint(host, port, token)
        except (TimeoutError, OSError) as exc:
            if time.monotonic() + RETRY_DELAY > deadline:
                raise BindingRefused(
                    f"no planaria master answered at {host}:{port} within {timeout:g}s "
                    f"(rendezvous.join_timeout): {exc}"
                ) from None
            if not told and on_retry is not None:
                on_retry(str(exc))
                told = True
            time.sleep(RETRY_DELAY)


def _message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text[:200]
    return str(data.get("error") or data.get("message") or data) if isinstance(data, dict) else text
