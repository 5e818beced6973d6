"""The master's API over TLS with the job's own certificate, which agents pin: real servers,
real handshakes, real jobs (one off loopback, in a network namespace of its own)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding

from planaria.agent.client import MasterClient, MasterRejected
from planaria.errors import PlanariaError
from planaria.master.job import Master
from planaria.master.runner import supervise
from planaria.master.server import make_app, serve
from planaria.master.tls import CertificateError, job_certificate, server_context
from planaria.protocol import API_PREFIX, FINGERPRINT_ENV, Heartbeat, HeartbeatReply
from planaria.scheduler.api import LaunchSpec
from planaria.scheduler.local import LocalOptions, LocalScheduler
from planaria.testing.jobs import EXAMPLE, events, job, planaria_command
from support.master import settings

TOKEN = "tls-test-token"
ADDRESS = "10.213.0.1"


# --------------------------------------------------------------------------- the certificate


def test_the_certificate_is_reused_and_its_key_is_private(tmp_path):
    first = job_certificate(tmp_path, [ADDRESS, "master.example", "0.0.0.0"])
    again = job_certificate(tmp_path, ["other.example"])
    assert again == first  # a master restarted on this run directory keeps its fingerprint
    assert stat.S_IMODE(os.stat(tmp_path / "tls").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(first.key).st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(first.cert.read_bytes())
    assert first.fingerprint == hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()
    key = cert.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(ADDRESS)]
    assert names.get_values_for_type(x509.DNSName) == ["master.example"]
    lasts = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert lasts.days >= 90
    context = server_context(first)
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2


def test_a_half_made_pair_is_made_anew_and_a_readable_key_refused(tmp_path):
    first = job_certificate(tmp_path, [ADDRESS])
    first.cert.unlink()  # the master died between the key and the certificate
    second = job_certificate(tmp_path, [ADDRESS])
    assert second.fingerprint != first.fingerprint
    assert sorted(p.name for p in (tmp_path / "tls").iterdir()) == ["cert.pem", "key.pem"]
    os.chmod(second.key, 0o644)
    with pytest.raises(CertificateError, match=r"key\.pem is readable by others \(mode 644\)"):
        job_certificate(tmp_path, [ADDRESS])
    os.chmod(second.key, 0o600)
    second.key.rename(tmp_path / "elsewhere.pem")
    second.key.symlink_to(tmp_path / "elsewhere.pem")
    with pytest.raises(CertificateError, match=r"cannot read .*key\.pem"):
        job_certificate(tmp_path, [ADDRESS])


# --------------------------------------------------------------------------- a live TLS server


async def with_tls_master(tmp_path: Path, body, host: str = "127.0.0.1") -> None:
    """A master serving TLS on ``host`` (loopback, by default) whose one node never calls
    back: ``body(port, fingerprint)`` plays the agents. Its certificate names ``host``, as the
    runner's does when nothing is advertised."""
    certificate = job_certificate(tmp_path, [host])
    master = Master(settings(tmp_path, nodes=1), LocalScheduler(LocalOptions()), tmp_path)
    app = make_app(master, TOKEN, hold=0.2)
    runner, port = await serve(app, host, 0, server_context(certificate))
    idle = LaunchSpec(job="api", command=(sys.executable, "-c", "import time; time.sleep(60)"))
    job_ = asyncio.ensure_future(supervise(master, idle))
    try:
        await body(port, certificate.fingerprint)
    finally:
        master.stop("test over")
        await asyncio.wait_for(job_, 30)
        await runner.cleanup()
        master.timeline.close()


NOBODY = Heartbeat(node_id="nobody", round=0, activity="idle", wait=False)


def test_the_pinned_certificate_is_trusted_and_a_wrong_pin_refused_at_once(tmp_path):
    async def body(port, fingerprint):
        url = f"https://127.0.0.1:{port}"
        good = MasterClient(url, TOKEN, fingerprint=fingerprint)
        try:
            # Answered over the pinned channel: the master does not know this node.
            with pytest.raises(MasterRejected, match="404 to /heartbeat: unknown node 'nobody'"):
                await good.call("/heartbeat", NOBODY, HeartbeatReply)
        finally:
            await good.close()
        wrong = "ab" * 32
        bad = MasterClient(url, TOKEN, give_up_after=15, fingerprint=wrong)
        started = time.monotonic()
        try:
            with pytest.raises(MasterRejected) as refused:
                await bad.call("/heartbeat", NOBODY, HeartbeatReply)
        finally:
            await bad.close()
        assert time.monotonic() - started < 2  # not retried as if the master were away
        message = str(refused.value)
        assert f"the job's is {wrong[:16]}..." in message
        assert f"its certificate's SHA-256 is {fingerprint[:16]}..." in message
        assert FINGERPRINT_ENV in message

    asyncio.run(with_tls_master(tmp_path, body))


def test_over_tls_a_missing_token_is_401_and_plain_http_is_refused(tmp_path):
    async def body(port, fingerprint):
        pin = aiohttp.Fingerprint(bytes.fromhex(fingerprint))
        url = f"https://127.0.0.1:{port}{API_PREFIX}/status"
        async with aiohttp.ClientSession() as session:
            async with session.get(url, ssl=pin) as reply:
                assert reply.status == 401
                assert "token" in (await reply.json())["error"]
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with session.get(url, ssl=pin, headers=auth) as reply:
                assert reply.status == 200
            with pytest.raises(aiohttp.ClientError):
                plain = f"http://127.0.0.1:{port}{API_PREFIX}/status"
                async with session.get(plain, headers=auth) as reply:
                    pytest.fail(f"plain HTTP was answered {reply.status}")
        answer = await asyncio.to_thread(_plain_request, port)
        assert not answer.startswith(b"HTTP/"), answer[:80]

    asyncio.run(with_tls_master(tmp_path, body))


def _plain_request(port: int) -> bytes:
    """What a plain-HTTP client with the right token reads back from the TLS port."""
    request = (
        f"GET {API_PREFIX}/status HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        got = b""
        try:
            while chunk := sock.recv(4096):
                got += chunk
        except ConnectionResetError:
            pass
    return got


def test_an_https_master_needs_a_fingerprint_and_http_takes_none():
    async def body():
        with pytest.raises(PlanariaError, match=f"no fingerprint .*{FINGERPRINT_ENV}"):
            MasterClient("https://10.0.0.1:1", TOKEN)
        with pytest.raises(PlanariaError, match="64 hex digits"):
            MasterClient("https://10.0.0.1:1", TOKEN, fingerprint="not-hex")
        with pytest.raises(PlanariaError, match="not https"):
            MasterClient("http://127.0.0.1:1", TOKEN, fingerprint="ab" * 32)

    asyncio.run(body())


async def _status(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "planaria", "status", *args,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_status_pins_the_run_s_certificate_of_a_master_bound_to_every_interface(tmp_path):
    """The certificate of a master bound to 0.0.0.0 names only the machine: ``planaria status``
    trusts it by its fingerprint, as agents do, by whatever address it asks; another
    certificate is refused before the token is sent."""

    async def body(port, fingerprint):
        (tmp_path / "token").write_text(TOKEN)
        for address in ("127.0.0.1", "localhost", "0.0.0.0"):
            url = f"https://{address}:{port}"
            rc, out, err = await _status(str(tmp_path), "--master", url, "--json")
            assert rc == 0, err
            assert json.loads(out)["job"] == "api"
        # Without the run directory, the fingerprint comes from where agents take it.
        url = f"https://127.0.0.1:{port}"
        env = {"PLANARIA_TOKEN": TOKEN, FINGERPRINT_ENV: fingerprint.upper()}
        rc, out, err = await _status("--master", url, "--json", env=env)
        assert rc == 0, err
        # Another job's certificate in the run directory: this master is not its job's.
        other = tmp_path / "other"
        other.mkdir()
        (other / "events.jsonl").write_text("")
        (other / "token").write_text(TOKEN)
        theirs = job_certificate(other, ["127.0.0.1"]).fingerprint
        rc, out, err = await _status(str(other), "--master", url)
        assert rc == 2, out + err
        assert f"the server at {url} is not this job's master" in err
        assert f"its certificate's SHA-256 is {fingerprint[:16]}..." in err
        assert f"the job's is {theirs[:16]}..." in err
        assert "Traceback" not in err
        rc, out, err = await _status("--master", url, env={**env, FINGERPRINT_ENV: "ab" * 32})
        assert rc == 2 and "is not this job's master" in err and FINGERPRINT_ENV in err, err
        rc, out, err = await _status("--master", url, env={**env, FINGERPRINT_ENV: ""})
        assert rc == 2 and f"the SHA-256 fingerprint of its certificate in {FINGERPRINT_ENV}" in err

    asyncio.run(with_tls_master(tmp_path, body, host="0.0.0.0"))


# --------------------------------------------------------------------------- real jobs

PROBE = """
import json, os, runpy, subprocess, sys
from pathlib import Path

out, mark = Path(sys.argv[1]), os.environ["PLANARIA_TEST_MARK"]

def environ(pid):
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\\0") if "=" in e)

agents = []
for entry in Path("/proc").iterdir():
    try:
        cmd = (entry / "cmdline").read_bytes().split(b"\\0")
        env = environ(entry.name) if cmd[1:4] == [b"-m", b"planaria", b"agent"] else {}
    except OSError:
        continue
    if env.get("PLANARIA_TEST_MARK") == mark:
        names = ("PLANARIA_MASTER", "PLANARIA_TOKEN", "PLANARIA_MASTER_FINGERPRINT")
        agents.append({k: env.get(k) for k in names})
ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
out.write_text(json.dumps({"agents": agents, "ps": ps, "worker_env": dict(os.environ)}))
if len(sys.argv) > 2:
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    from planaria import monitor
    for step in range(1, 4):
        monitor.step(step)
"""


def _job(tmp_path: Path, master: dict[str, object], train: bool) -> tuple[Path, Path]:
    probe, seen = tmp_path / "probe.py", tmp_path / "probe.json"
    probe.write_text(PROBE)
    command = [sys.executable, str(probe), str(seen)]
    if train:
        command += [str(EXAMPLE), "--steps", "5", "--ckpt-every", "5"]
    # Without torch to preload (training imports it itself); a generous heartbeat timeout,
    # since a node's first heartbeat waits for its warm interpreter on a busy machine.
    config = job(
        tmp_path,
        job={
            "command": command,
            "nodes": 1,
            "procs_per_node": 1,
            "max_restarts": 0,
            "preload": [],
        },
        master={"heartbeat_interval": "1s", "heartbeat_timeout": "60s", **master},
        rendezvous={"join_grace": "500ms", "join_timeout": "60s"},
    )
    return config, seen


def _run(tmp_path, mark, config: Path, netns: str | None = None):
    argv, env = planaria_command(mark, (str(config),))
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def _leaks(tmp_path: Path, result, seen: dict, token: str) -> list[str]:
    """Where the job's token shows: a file of the run (but the one a resumed master reads it
    from, private to the user), the run's output, a command line."""
    (run_dir,) = tmp_path.glob("planaria-runs/*")
    kept = run_dir / "token"
    assert kept.read_text() == token
    assert kept.stat().st_mode & 0o077 == 0 and run_dir.stat().st_mode & 0o077 == 0
    found = [
        str(p)
        for p in run_dir.rglob("*")
        if p.is_file() and p != kept and token.encode() in p.read_bytes()
    ]
    if token in result.stdout + result.stderr:
        found.append("planaria run's output")
    if token in seen["ps"]:
        found.append("ps")
    if token in json.dumps(seen["worker_env"]):
        found.append("the worker's environment")
    return found


def _pinned(tmp_path: Path) -> str:
    (cert,) = tmp_path.glob("planaria-runs/*/tls/cert.pem")
    der = x509.load_pem_x509_certificate(cert.read_bytes()).public_bytes(Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def test_tls_on_loopback_when_asked_and_the_token_shows_nowhere(tmp_path, mark):
    config, probe = _job(tmp_path, {"tls": True}, train=False)
    result = _run(tmp_path, mark, config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "master at https://127.0.0.1:" in result.stdout
    seen = json.loads(probe.read_text())
    (agent,) = seen["agents"]
    assert agent["PLANARIA_MASTER"].startswith("https://127.0.0.1:")
    assert agent["PLANARIA_MASTER_FINGERPRINT"] == _pinned(tmp_path)
    token = agent["PLANARIA_TOKEN"]
    assert token and len(token) >= 32
    assert _leaks(tmp_path, result, seen, token) == []
    assert "planaria agent" in seen["ps"] or "-m planaria agent" in seen["ps"]


@pytest.fixture
def netns():
    """A network namespace of its own, with loopback and ``ADDRESS`` on a veth pair (this
    kernel has no dummy interfaces; a veth pair whose both ends are inside does the same)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no ip command (iproute2)")
    name = f"pl-tls-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    try:
        for command in (
            "ip link set lo up",
            "ip link add pl0 type veth peer name pl1",
            f"ip addr add {ADDRESS}/24 dev pl0",
            "ip link set pl0 up",
            "ip link set pl1 up",
        ):
            subprocess.run(["ip", "netns", "exec", name, *command.split()], check=True)
        yield name
    finally:
        left = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in left.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_a_job_off_loopback_trains_over_tls_with_a_pinned_certificate(tmp_path, mark, netns):
    config, probe = _job(tmp_path, {"host": ADDRESS}, train=True)
    result = _run(tmp_path, mark, config, netns)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"master at https://{ADDRESS}:" in result.stdout
    assert "plain HTTP" not in output and "warning" not in result.stderr.lower()
    seen = json.loads(probe.read_text())
    (agent,) = seen["agents"]
    assert agent["PLANARIA_MASTER"].startswith(f"https://{ADDRESS}:")
    assert agent["PLANARIA_MASTER_FINGERPRINT"] == _pinned(tmp_path)
    assert _leaks(tmp_path, result, seen, agent["PLANARIA_TOKEN"]) == []
    timeline = events(tmp_path)
    assert not [e for e in timeline if "plain HTTP" in json.dumps(e)]
    (finished,) = [e for e in timeline if e["kind"] == "job_finished"]
    assert finished["data"]["state"] == "succeeded", finished
    assert [e["step"] for e in timeline if e["kind"] == "checkpoint_committed"] == [4]
    (rank_log,) = tmp_path.glob("planaria-runs/*/logs/rank-0.log")
    assert "done 5 steps" in rank_log.read_text()
    cert = x509.load_pem_x509_certificate(
        next(tmp_path.glob("planaria-runs/*/tls/cert.pem")).read_bytes()
    )
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(ADDRESS)]


def test_plain_http_off_loopback_only_when_asked_and_then_warned(tmp_path, mark, netns):
    config, probe = _job(tmp_path, {"host": ADDRESS, "tls": False}, train=False)
    result = _run(tmp_path, mark, config, netns)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"master at http://{ADDRESS}:" in result.stdout
    assert "over plain HTTP (master.tls: false)" in " ".join(result.stderr.split())
    (agent,) = json.loads(probe.read_text())["agents"]
    assert agent["PLANARIA_MASTER"].startswith(f"http://{ADDRESS}:")
    assert agent["PLANARIA_MASTER_FINGERPRINT"] is None
    assert not list(tmp_path.glob("planaria-runs/*/tls"))
