"""The job's own key and certificate, which agents pin by fingerprint.

No certificate authority vouches for a master: each job makes an EC P-256 key and a
self-signed certificate for the addresses its agents use, and hands agents the certificate's
SHA-256 fingerprint next to the token. An agent trusts exactly that certificate, whoever
signed it, so a name or an expiry date cannot be forged to pass. The pair lives in the run
directory (``tls/``, 0700; the key 0600) and is reused when it is there: a master restarted
on the same run directory keeps the fingerprint the running agents have pinned.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import os
import secrets
import socket
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from planaria.errors import PlanariaError

VALID_FOR = datetime.timedelta(days=365)
"""For other clients (curl with ``--cacert``); a pinned fingerprint does not expire."""
CERT_NAME = "cert.pem"
KEY_NAME = "key.pem"


class CertificateError(PlanariaError):
    """The job's key or certificate cannot be made, read or trusted."""


@dataclass(frozen=True)
class JobCertificate:
    cert: Path
    key: Path
    fingerprint: str
    """SHA-256 of the certificate's DER bytes, lowercase hex: what agents pin."""


def fingerprint_of(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def job_certificate(run_dir: Path, names: list[str]) -> JobCertificate:
    """The job's certificate in ``run_dir/tls/``: the one there if a complete pair exists,
    else a new one whose subject alternative names are ``names`` (addresses as IP names,
    the rest as DNS names; wildcard addresses such as ``0.0.0.0`` are left out, and the
    machine's name stands in when none is left)."""
    folder = run_dir / "tls"
    _private_dir(folder)
    cert_path, key_path = folder / CERT_NAME, folder / KEY_NAME
    if cert_path.exists() or cert_path.is_symlink():
        return _load(cert_path, key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _self_signed(key, names)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # Each file is written under a fresh name and renamed into place, the certificate last:
    # a master that dies half way leaves no certificate, and the next one starts over.
    _write_new(key_path, key_pem)
    _write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return JobCertificate(
        cert_path, key_path, fingerprint_of(cert.public_bytes(serialization.Encoding.DER))
    )


def recorded_fingerprint(run_dir: Path) -> str:
    """The fingerprint of the certificate in ``run_dir/tls/``: what a client of the job's
    master other than its agents (``planaria status``) pins, as they do. The master may be
    bound to every interface and asked by any of its addresses, which no name in the
    certificate could all cover."""
    path = run_dir / "tls" / CERT_NAME
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as exc:
        raise CertificateError(
            f"cannot read the job's certificate {path}: {exc.strerror or exc}"
        ) from None
    except ValueError as exc:
        raise CertificateError(f"the job's certificate {path} is damaged: {exc}") from None
    return fingerprint_of(cert.public_bytes(serialization.Encoding.DER))


def pinning_context() -> ssl.SSLContext:
    """What a client that pins the job's certificate connects with: TLS 1.2 or later, no
    name or authority checked, since :func:`peer_fingerprint` is checked instead, before
    anything (the token) is sent."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def peer_fingerprint(sock: ssl.SSLSocket) -> str:
    """The fingerprint of the certificate the server at the other end of ``sock`` showed."""
    der = sock.getpeercert(binary_form=True)
    if der is None:
        raise CertificateError("the server showed no certificate")
    return fingerprint_of(der)


def server_context(cert: JobCertificate) -> ssl.SSLContext:
    """What the master serves its API with: TLS 1.2 or later, the job's certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert.cert, cert.key)
    except (OSError, ssl.SSLError) as exc:
        raise CertificateError(f"cannot load the job's certificate {cert.cert}: {exc}") from exc
    return context


def _san(names: list[str]) -> list[x509.GeneralName]:
    seen: list[x509.GeneralName] = []
    for name in names:
        entry: x509.GeneralName
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            if not name:
                continue
            entry = x509.DNSName(name)
        else:
            if address.is_unspecified:
                continue
            entry = x509.IPAddress(address)
        if entry not in seen:
            seen.append(entry)
    return seen


def _self_signed(key: ec.EllipticCurvePrivateKey, names: list[str]) -> x509.Certificate:
    # Bound to every interface and nothing advertised: the machine's name is the best guess.
    alternative = _san(names) or _san([socket.gethostname()])
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "planaria master")])
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(int.from_bytes(secrets.token_bytes(16), "big") >> 1)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
        .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )


def _private_dir(folder: Path) -> None:
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError as exc:
        raise CertificateError(f"cannot create {folder}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise CertificateError(f"{folder} is not a directory (a link?): remove it")
    if info.st_uid != os.getuid():
        raise CertificateError(f"{folder} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o077:
        os.chmod(folder, 0o700)


def _write_new(path: Path, data: bytes) -> None:
    """Write ``data`` at ``path`` 0600, through a name no one else can have made first."""
    staged = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(staged, flags, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(staged, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise CertificateError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _read_private(path: Path) -> bytes:
    """A file of ours that nobody else may read or replace: not a link, 0600 or stricter."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise CertificateError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise CertificateError(f"{path} is not a regular file of this user: remove it")
        if info.st_mode & 0o077:
            raise CertificateError(
                f"{path} is readable by others (mode {stat.S_IMODE(info.st_mode):o}): the "
                "job's key may have leaked; remove the run's tls/ directory to make a new one"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def _load(cert_path: Path, key_path: Path) -> JobCertificate:
    cert_pem = _read_private(cert_path)
    key_pem = _read_private(key_path)
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as exc:
        raise CertificateError(
            f"the job's certificate or key in {cert_path.parent} is damaged: {exc}"
        ) from exc
    if key.public_key() != cert.public_key():
        raise CertificateError(
            f"the key {key_path} does not belong to the certificate {cert_path}: remove both"
        )
    der = cert.public_bytes(serialization.Encoding.DER)
    return JobCertificate(cert_path, key_path, fingerprint_of(der))
