"""ops/container/Containerfile says what docs/container.md and the Kubernetes example say.

Read as text, without podman: tests/container builds and runs the image for real.
"""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from reconciler.config.settings import Settings

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "ops" / "container" / "Containerfile"
IGNORE = REPO / ".dockerignore"
KUBERNETES = REPO / "ops" / "kubernetes" / "reconciler-sidecar.yaml"
PAGE = REPO / "docs" / "container.md"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in CONTAINERFILE.read_text().splitlines()
        if not line.lstrip().startswith("#")))
    found = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def values(keyword: str) -> list[str]:
    return [rest for key, rest in instructions() if key == keyword]


def runtime_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (key, _) in enumerate(steps) if key == "FROM")
    return steps[last_from:]


def build_args() -> dict[str, str]:
    found = {}
    for rest in values("ARG"):
        name, _, default = rest.partition("=")
        found.setdefault(name, default.strip('"'))
    return found


def requirements_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "container_requirements", REPO / "ops" / "container" / "requirements.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TestTheContainerfile:
    def test_both_stages_start_from_the_debian_base_argument(self) -> None:
        """ARG BASE=debian:bookworm-slim before the first FROM; every FROM uses it."""
        steps = instructions()
        assert steps[0] == ("ARG", "BASE=debian:bookworm-slim")
        froms = values("FROM")
        assert len(froms) == 2
        assert all(f.split()[0] == "${BASE}" for f in froms)

    def test_the_build_arguments_are_the_documented_ones(self) -> None:
        """EXTRAS, PIP_INDEX_URL, PIP_CERT and the labels' arguments, each in the docs' table."""
        args = build_args()
        assert {"BASE", "EXTRAS", "PIP_INDEX_URL", "PIP_CERT", "VERSION", "REVISION",
                "SOURCE"} <= set(args)
        page = PAGE.read_text()
        for name in args:
            assert f"`{name}`" in page, f"docs/container.md does not document {name}"

    def test_the_version_label_defaults_to_the_projects_version(self) -> None:
        assert build_args()["VERSION"] == VERSION
        labels = " ".join(values("LABEL"))
        for label in ("version", "source", "revision"):
            assert f"org.opencontainers.image.{label}=" in labels

    def test_the_runtime_runs_as_a_numeric_non_root_user(self) -> None:
        (user,) = [rest for key, rest in runtime_stage() if key == "USER"]
        uid, _, gid = user.partition(":")
        assert uid.isdigit()
        assert gid.isdigit()
        assert int(uid) != 0

    def test_it_runs_the_sidecar_through_the_reconciler_entry_point(self) -> None:
        assert json.loads(values("ENTRYPOINT")[-1]) == ["reconciler"]
        assert json.loads(values("CMD")[-1]) == ["run"]
        assert values("STOPSIGNAL") == ["SIGTERM"]

    def test_it_listens_on_every_address_at_the_default_port(self) -> None:
        port = Settings.model_fields["metrics_port"].default
        assert values("EXPOSE") == [str(port)]
        assert "RECONCILER_METRICS_HOST=0.0.0.0" in " ".join(values("ENV"))
        (check,) = values("HEALTHCHECK")
        assert "/healthz" in check
        assert "RECONCILER_METRICS_PORT" in check
        assert f"'{port}'" in check

    def test_it_writes_only_under_its_volume_which_is_its_working_directory(self) -> None:
        """The default database and artifact_root are relative: they land on the volume;
        no RECONCILER_DATABASE_URL in the image (it would clash with the _file setting)."""
        (volume,) = [json.loads(rest) for key, rest in runtime_stage() if key == "VOLUME"]
        (workdir,) = [rest for key, rest in runtime_stage() if key == "WORKDIR"]
        assert volume == [workdir]
        assert Settings.model_fields["database_url"].default == "sqlite:///reconciler.db"
        assert not Path(Settings.model_fields["artifact_root"].default).is_absolute()
        assert "RECONCILER_DATABASE_URL" not in " ".join(values("ENV"))

    def test_the_build_context_holds_what_the_file_copies(self) -> None:
        """Every COPY source from the context is let through .dockerignore, which
        starts by ignoring everything."""
        lines = [line for line in IGNORE.read_text().splitlines()
                 if line and not line.startswith("#")]
        assert lines[0] == "*"
        allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
        for rest in values("COPY"):
            if rest.startswith("--from"):
                continue
            source = rest.split()[0]
            assert source in allowed, f"{source} is not in the build context"


class TestRequirements:
    def test_build_and_run_requirements_come_from_pyproject(self) -> None:
        module = requirements_module()
        pyproject = REPO / "pyproject.toml"
        data = tomllib.loads(pyproject.read_text())
        assert module.requirements(pyproject, "build") == data["build-system"]["requires"]
        assert module.requirements(pyproject, "run") == data["project"]["dependencies"]
        with_celery = module.requirements(pyproject, "run", "celery")
        assert with_celery[-1].startswith("celery[redis]")

    def test_an_unknown_extra_is_refused_with_the_known_ones(self) -> None:
        module = requirements_module()
        with pytest.raises(ValueError, match="no extra 'nope'; the extras are: celery"):
            module.requirements(REPO / "pyproject.toml", "run", "nope")


class TestTheKubernetesExample:
    def test_it_names_the_image_built_here_and_runs_it_as_the_images_user(self) -> None:
        text = KUBERNETES.read_text()
        images = set(re.findall(r"^\s*image:\s*(\S+)\s*$", text, re.MULTILINE))
        ours = {image for image in images if "stale-claim-reconciler" in image}
        assert ours == {f"registry.example.com/stale-claim-reconciler:{VERSION}"}
        assert "ops/container/Containerfile" in text
        (user,) = [rest for key, rest in runtime_stage() if key == "USER"]
        uids = set(re.findall(r"runAsUser:\s*(\d+)", text))
        assert uids == {user.split(":")[0]}

    def test_the_sidecar_reads_its_secrets_from_files(self) -> None:
        text = KUBERNETES.read_text()
        assert "name: RECONCILER_CONSOLE_TOKEN_FILE" in text
        assert "name: RECONCILER_CONSOLE_TOKEN\n" not in text
        assert "--from-file=console-token=" in text
