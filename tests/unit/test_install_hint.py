"""What an error says to install: the distribution's name on the package index and, from this
checkout, the command that installs its folder into the environment planaria runs in."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from planaria import install
from planaria.errors import PluginNotFoundError
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria.scheduler.api import SchedulerRecord

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))


def _checkout_command(hint: str) -> list[str]:
    """The words of the hint's ``(from this checkout: ...)`` command."""
    assert "(from this checkout: " in hint and hint.endswith(")"), hint
    return shlex.split(hint.split("(from this checkout: ", 1)[1][:-1])


def test_this_checkout_is_found():
    assert install.checkout() == ROOT


@pytest.mark.parametrize("folder", PLUGINS, ids=lambda p: p.name)
def test_a_plugins_hint_installs_its_folder_of_this_checkout(folder):
    name = install.project_name(folder)
    assert name is not None and name.startswith("planaria-")
    hint = install.hint(name)
    assert hint.startswith(f"pip install {name} (from this checkout: "), hint
    python, dash_m, pip, verb, editable, where = _checkout_command(hint)
    assert (python, dash_m, pip, verb, editable) == (sys.executable, "-m", "pip", "install", "-e")
    assert Path(where) == folder and install.project_name(Path(where)) == name


@pytest.mark.parametrize("folder", PLUGINS, ids=lambda p: p.name)
def test_from_an_installed_wheel_the_hint_names_the_folder_of_a_checkout(folder, monkeypatch):
    monkeypatch.setattr(install, "checkout", lambda: None)
    name = install.project_name(folder)
    assert name is not None
    relative = folder.relative_to(ROOT).as_posix()
    assert install.hint(name) == f"pip install {name} (from a checkout: pip install -e {relative})"


def test_the_report_extras_hint_installs_the_core_of_this_checkout_with_it(monkeypatch):
    hint = install.hint(install.CORE, "report")
    assert hint.startswith("pip install 'planaria[report]' (from this checkout: "), hint
    assert _checkout_command(hint)[-1] == f"{ROOT}[report]"
    monkeypatch.setattr(install, "checkout", lambda: None)
    assert install.hint(install.CORE, "report").endswith(
        "(from a checkout: pip install -e '.[report]')"
    )


def test_every_well_known_plugin_is_a_folder_of_this_checkout():
    """A name the errors send the user to install is one this project publishes."""
    from planaria.plugin.kinds import well_known

    published = {install.project_name(folder) for folder in PLUGINS}
    for kind in PluginKind:
        for name, distribution in well_known(kind).items():
            assert distribution in published, (kind, name, distribution)
            assert install.folder(distribution, ROOT) is not None
    assert SchedulerRecord.well_known_commands <= set(SchedulerRecord.well_known)


def _installed(name: str) -> bool:
    return name in {ep.name for ep in entry_points(group="planaria")}


def test_a_missing_plugins_error_says_what_to_install(monkeypatch):
    monkeypatch.delenv("PLANARIA_DISABLE_PLUGINS", raising=False)
    if _installed("slurm"):
        pytest.skip("planaria-slurm is installed in this environment")
    with pytest.raises(PluginNotFoundError) as exc:
        PluginManager.from_entry_points().resolve(PluginKind.SCHEDULER, "slurm")
    said = str(exc.value)
    assert "scheduler 'slurm' is not installed. Choose one of: external, local" in said
    assert "or install it: pip install planaria-slurm (from this checkout: " in said
    assert _checkout_command(said)[-1] == str(ROOT / "plugins" / "slurm")


def _planaria(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PLANARIA_DISABLE_PLUGINS"}
    return subprocess.run(
        [str(Path(sys.executable).parent / "planaria"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_config_naming_a_missing_plugin_exits_2_with_the_hint(tmp_path):
    if _installed("slurm"):
        pytest.skip("planaria-slurm is installed in this environment")
    result = _planaria("config", "validate", str(ROOT / "examples" / "slurm.yaml"), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    said = " ".join(result.stderr.split())
    assert "scheduler.backend (line 11): scheduler 'slurm' is not installed" in said, said
    assert (
        "pip install planaria-slurm (from this checkout: "
        f"{sys.executable} -m pip install -e {ROOT}/plugins/slurm)" in said
    )


def test_a_missing_schedulers_command_says_what_to_install(tmp_path):
    """``planaria kubernetes ...`` without the plugin: not click's "No such command"."""
    if _installed("kubernetes"):
        pytest.skip("planaria-kubernetes is installed in this environment")
    result = _planaria("kubernetes", "manifest", "job.yaml", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    said = " ".join(result.stderr.split())
    assert "No such command" not in said
    assert said.startswith(
        "error: 'planaria kubernetes' comes with the kubernetes scheduler: scheduler "
        "'kubernetes' is not installed. Choose one of: external, local; or install it: pip install "
        f"planaria-kubernetes (from this checkout: {sys.executable} -m pip install -e "
        f"{ROOT}/plugins/kubernetes)"
    ), said
    # A name that is no scheduler is still click's own error.
    result = _planaria("nosuchcommand", cwd=tmp_path)
    assert result.returncode == 2 and "No such command 'nosuchcommand'" in result.stderr
