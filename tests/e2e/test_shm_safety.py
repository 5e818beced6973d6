"""Another local user cannot make planaria (often root) write through a planted link or file.

The test makes a second, unprivileged user. Playing that user, it plants symbolic links and
files of its own in /dev/shm where planaria's files go (for nodes that do not exist yet, such as
a replacement), and checks that root's files stay untouched and every plant is refused.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import textwrap
import uuid
from pathlib import Path

import pytest

from planaria.checkpoint.segment import Segment, SegmentError
from planaria.progress import ProgressBoard, ProgressSlot
from planaria.shm import (
    UnsafePathError,
    create_file,
    make_private_dir,
    name_prefix,
    open_file,
    remove_dir,
)
from planaria.testing.jobs import events, job, run

SHM = Path("/dev/shm")
USER = "planaria-intruder"
VICTIM_TEXT = "root's own file: nobody may change it\n"

# The other user cannot enter root's home, where this test's interpreter may live: a system one.
INTRUDER_PYTHON = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin") or ""

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to add a second user"),
    pytest.mark.skipif(not INTRUDER_PYTHON, reason="no system python3 for the other user"),
]


@pytest.fixture(scope="module")
def intruder() -> pwd.struct_passwd:
    """An unprivileged user of this machine, made for these tests and removed after them."""
    made = False
    try:
        entry = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", USER], check=True)
        made = True
        entry = pwd.getpwnam(USER)
    yield entry
    if made:
        subprocess.run(["userdel", USER], check=False)


def as_intruder(user: pwd.struct_passwd, code: str, *args: str, **kwargs) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [INTRUDER_PYTHON, "-c", textwrap.dedent(code), *args],
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        text=True,
        **kwargs,
    )


def plant(user: pwd.struct_passwd, code: str) -> None:
    process = as_intruder(user, code, stderr=subprocess.PIPE)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    (tmp_path / "victim").mkdir()
    path = tmp_path / "victim" / "victim.txt"
    path.write_text(VICTIM_TEXT)
    path.chmod(0o644)
    return path


@pytest.fixture
def names():
    tag = f"planaria-test-{uuid.uuid4().hex[:8]}"
    yield tag
    for path in SHM.glob(f"{tag}*"):
        if path.is_dir() and not path.is_symlink():
            subprocess.run(["rm", "-rf", str(path)], check=False)
        else:
            path.unlink(missing_ok=True)


def test_a_planted_link_or_directory_is_never_taken_for_ours(intruder, victim, names):
    link, theirs = SHM / f"{names}-link", SHM / f"{names}-theirs"
    plant(
        intruder,
        f"""
        import os
        os.symlink({str(victim.parent)!r}, {str(link)!r})
        os.mkdir({str(theirs)!r}, 0o777)
        os.chmod({str(theirs)!r}, 0o777)
        """,
    )
    for path in (link, theirs):
        with pytest.raises(UnsafePathError, match="exists already"):
            make_private_dir(path)
    assert victim.read_bytes() == VICTIM_TEXT.encode()
    assert sorted(os.listdir(victim.parent)) == ["victim.txt"]
    assert not remove_dir(link) and not remove_dir(theirs)  # neither is ours to remove
    assert link.is_symlink() and theirs.is_dir() and victim.exists()


def test_inside_a_private_directory_the_other_user_can_plant_nothing(intruder, names):
    mine = make_private_dir(SHM / f"{names}-mine")
    assert mine.stat().st_mode & 0o777 == 0o700 and mine.stat().st_uid == 0
    process = as_intruder(
        intruder,
        f"""
        import os, sys
        try:
            os.symlink("/etc/passwd", {str(mine / "progress")!r})
        except PermissionError:
            sys.exit(0)
        sys.exit(1)
        """,
    )
    assert process.wait(30) == 0, "the other user could create a file in the private directory"
    board = ProgressBoard(mine / "progress", 2)
    board.close()
    assert remove_dir(mine) and not mine.exists()


def test_files_are_created_exclusively_and_opened_only_if_ours(intruder, victim, names):
    mine = make_private_dir(SHM / f"{names}-files")
    try:
        # Whatever got there first (here: root's own link, as a slip elsewhere could make),
        # a create never goes through it and an open never follows it.
        (mine / "progress").symlink_to(victim)
        with pytest.raises(FileExistsError):
            create_file(mine / "progress")
        with pytest.raises(UnsafePathError, match="symbolic link"):
            open_file(mine / "progress")
        with pytest.raises(FileExistsError):
            ProgressBoard(mine / "progress", 1)
        with pytest.raises(UnsafePathError):
            ProgressSlot(str(mine / "progress"), 0)
        with pytest.raises(SegmentError, match="symbolic link"):
            Segment.open(mine / "progress", writable=True)
        assert victim.read_bytes() == VICTIM_TEXT.encode()

        # A file of the other user's (e.g. crafted to look like a segment) is refused.
        theirs = SHM / f"{names}-crafted"
        plant(intruder, f"open({str(theirs)!r}, 'wb').write(b'PLNRSHM1' + bytes(8192))")
        with pytest.raises(UnsafePathError, match="not a regular file of this user"):
            open_file(theirs)
        with pytest.raises(SegmentError, match="not a regular file of this user"):
            Segment.open(theirs, writable=True)
        # A shared directory is no place to create a file in at all.
        with pytest.raises(UnsafePathError, match="mode 1777"):
            create_file(SHM / f"{names}-direct")
    finally:
        remove_dir(mine)


ATTACKER = """
import os, sys, time
victim, count, prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deadline = time.time() + 120
planted = False
while time.time() < deadline and not planted:
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix + "e2e-") and "-node-0" in name:
            run = name[len(prefix):name.index("-node-0")]
            for i in range(2, 2 + count):
                base = f"/dev/shm/{prefix}{run}-node-{i}"
                # Where the files of a node that will come would go: its progress board and
                # segments by name, and its directory (as a link, or a directory of mine).
                for suffix in (".progress", ".ckpt-0", ".ckpt-1", ".sock"):
                    os.symlink(victim, base + suffix)
                if i % 2 == 0:
                    os.symlink(os.path.dirname(victim), base)
                else:
                    os.mkdir(base, 0o777)
                    os.chmod(base, 0o777)
                    os.symlink(victim, base + "/progress")
            planted = True
            print(run, flush=True)
            break
    time.sleep(0.005)
"""


@pytest.mark.slow
def test_a_job_whose_replacement_nodes_were_planted_for_writes_nothing_through_them(
    tmp_path,
    mark,
    intruder,
    victim,
):
    victim.parent.chmod(0o755)  # the links' targets: root's, and root's alone to write
    attacker = as_intruder(
        intruder,
        ATTACKER,
        str(victim),
        "2",
        name_prefix(),  # the names this test's job gives its files
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        chaos = [{"kind": "kill_node", "node_rank": 1, "at_step": 8}]
        config = job(tmp_path, chaos=chaos, checkpoint={"keep_last": 2})
        result = run(tmp_path, mark, str(config))
        out, err = attacker.communicate(timeout=60)
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        for path in SHM.glob(f"{name_prefix()}e2e-*"):
            if path.is_symlink() or path.is_file():
                path.unlink(missing_ok=True)
            elif path.stat().st_uid != 0:
                subprocess.run(["rm", "-rf", str(path)], check=False)
    assert attacker.returncode == 0 and out.strip(), err
    assert victim.read_bytes() == VICTIM_TEXT.encode()
    assert sorted(os.listdir(victim.parent)) == ["victim.txt"]
    assert result.returncode == 0, result.stdout + result.stderr
    timeline = events(tmp_path)
    replaced = [e["data"].get("replacement") for e in timeline if e["kind"] == "node_replaced"]
    # node-2 and node-3 were planted: their agents refused to start; node-4 took the place.
    assert replaced[:3] == ["node-2", "node-3", "node-4"], json.dumps(timeline, indent=1)
    logs = tmp_path.glob("planaria-runs/*/logs/agents/node-2*")
    assert any("exists already" in p.read_text() for p in logs)
