"""The Containerfile, read with BuildKit's own parser (no container engine runs here), and the wheel it installs."""

from __future__ import annotations

import email.parser
import importlib.metadata
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import dockerfile  # type: ignore[import-not-found]  # a compiled module without stubs
import pytest
from deploy_helpers import DEPLOY, REPO, find, load_yaml_documents
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

CONTAINERFILE = REPO / "Containerfile"


def _stages() -> list[list[dockerfile.Command]]:
    stages: list[list[dockerfile.Command]] = []
    for command in dockerfile.parse_file(str(CONTAINERFILE)):
        if command.cmd == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(command)
    return stages


def _args() -> dict[str, str]:
    args: dict[str, str] = {}
    for command in dockerfile.parse_file(str(CONTAINERFILE)):
        if command.cmd == "ARG" and "=" in command.value[0]:
            name, _, value = command.value[0].partition("=")
            args.setdefault(name, value)
    return args


def _image(stage: list[dockerfile.Command]) -> str:
    image = str(stage[0].value[0])
    for name, value in _args().items():
        image = image.replace(f"${{{name}}}", value)
    return image


def test_it_is_a_multi_stage_build_on_slim_python() -> None:
    stages = _stages()
    assert len(stages) == 2
    assert [s[0].value[-1] for s in stages] == ["build", "runtime"]
    for stage in stages:
        assert _image(stage).startswith("docker.io/library/python:3.")
        assert "slim" in _image(stage)


def test_the_build_stage_makes_the_wheel_and_the_runtime_installs_only_wheels() -> None:
    build, runtime = _stages()
    build_runs = " ".join(c.value[0] for c in build if c.cmd == "RUN")
    assert "pip wheel" in build_runs
    (install,) = [c for c in runtime if c.cmd == "RUN" and "pip install" in c.value[0]]
    assert "--no-index" in install.value[0] and "--find-links /wheels" in install.value[0]
    assert any("from=build" in flag for flag in install.flags), "the wheels come from the build stage"
    assert not [c for c in runtime if c.cmd in ("COPY", "ADD") and not any("from=build" in f for f in c.flags)], (
        "the runtime stage takes nothing from the source tree"
    )


def test_the_runtime_runs_as_the_deployments_non_root_user() -> None:
    runtime = _stages()[-1]
    users = [c.value[0] for c in runtime if c.cmd == "USER"]
    assert users and users[-1] == "65532:65532"
    pod = find(load_yaml_documents(DEPLOY / "base" / "deployment.yaml"), "Deployment")["spec"]["template"]["spec"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (65532, 65532)


def test_the_entrypoint_is_the_console_script_and_the_ports_are_exposed() -> None:
    runtime = _stages()[-1]
    (entrypoint,) = [c for c in runtime if c.cmd == "ENTRYPOINT"]
    assert entrypoint.json and entrypoint.value == ("csinode-guard",)
    exposed = {p for c in runtime if c.cmd == "EXPOSE" for p in c.value}
    assert exposed == {"8443", "9090"}


def test_the_ignore_files_agree_and_keep_secrets_out() -> None:
    def entries(name: str) -> list[str]:
        lines = (REPO / name).read_text("utf-8").splitlines()
        return [line for line in lines if line and not line.startswith("#")]

    assert entries(".containerignore") == entries(".dockerignore")
    assert {".git", "certs", "tests", "*.key"} <= set(entries(".containerignore"))


def test_the_build_stage_copies_what_the_wheel_is_built_from() -> None:
    build = _stages()[0]
    copied = {source for c in build if c.cmd == "COPY" for source in c.value[:-1]}
    assert copied == {"pyproject.toml", "README.md", "webhook", "policies"}
    for source in copied:
        assert (REPO / source).exists(), source


@pytest.mark.slow
def test_the_wheel_installs_and_its_console_script_runs(tmp_path: Path) -> None:
    """What the two stages do, minus the container: build the wheel from a clean copy, install it, run it."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for name in ("webhook", "policies"):
        shutil.copytree(REPO / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(wheels), str(source)],
        check=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("csinode_guard-*.whl")
    # A venv that sees neither the base interpreter's packages nor this test venv's: only the wheel and the
    # distributions its metadata declares (with theirs, transitively) are copied in from this environment,
    # offline. A dependency the wheel forgets to declare is missing there, and the console script fails.
    target = tmp_path / "venv"
    venv.create(target, system_site_packages=False, with_pip=False)
    python = target / "bin" / "python"
    site_packages = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet",
         str(wheel)],
        check=True,
        timeout=600,
    )
    with zipfile.ZipFile(wheel) as archive:
        (metadata_name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        declared = email.parser.Parser().parsestr(archive.read(metadata_name).decode()).get_all("Requires-Dist", [])
    copied = _copy_requirement_closure(declared, site_packages)
    assert {"semver", "flask", "kubernetes", "gunicorn"} <= copied
    result = subprocess.run(
        [target / "bin" / "csinode-guard", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "0.1.0" in result.stdout
    located = subprocess.run(
        [python, "-c", "import webhook, sys; sys.stdout.write(webhook.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=True,
    )
    assert located.stdout.startswith(str(target)), "the installed wheel, not the source tree, was imported"


def _copy_requirement_closure(requirements: list[str], site_packages: Path) -> set[str]:
    """Copy the installed distributions named by ``requirements`` (Requires-Dist lines, no extras), and theirs,
    from this environment into ``site_packages``; return their normalized names."""
    copied: set[str] = set()
    pending = [Requirement(line) for line in requirements]
    while pending:
        requirement = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in copied:
            continue
        distribution = importlib.metadata.distribution(requirement.name)
        copied.add(name)
        base = Path(str(distribution.locate_file("")))
        for file in distribution.files or []:
            source = (base / file).resolve()
            if not source.is_file() or base.resolve() not in source.parents:
                continue  # console scripts and data outside site-packages are not needed to import
            destination = site_packages / source.relative_to(base.resolve())
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)
        pending += [Requirement(line) for line in distribution.requires or []]
    return copied


def test_the_ci_script_is_executable_shell() -> None:
    script = REPO / "ci" / "deploy-checks.sh"
    assert script.stat().st_mode & 0o111
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=60)
