"""The Kubernetes manifests of ``ops/kubernetes``, as a platform team applies them: every
object valid against the Kubernetes schemas of the versions docs/container.md names
(``kubernetes-validate``, offline), and the ConfigMap's ``reconciler.toml`` (and each
``[source]`` the docs give in its place) loaded by the real loader from the paths the pods
mount."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from reconciler.config.loader import load_config

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "ops" / "kubernetes").glob("*.yaml"))
BESIDE = REPO / "ops" / "kubernetes" / "beside-a-job-system.yaml"
CONTAINER_DOC = REPO / "docs" / "container.md"
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")
"""The oldest and newest Kubernetes the docs name (docs/container.md)."""
SECRETS = "/var/run/secrets/stale-claim-reconciler"


def objects(path: Path) -> list[dict[str, Any]]:
    """Every object of a manifest file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The containers of a Deployment's or a Job's pod template (none for other kinds)."""
    if obj["kind"] not in ("Deployment", "Job"):
        return []
    return list(obj["spec"]["template"]["spec"]["containers"])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_object_is_valid_against_the_kubernetes_schemas(path: Path,
                                                              version: str) -> None:
    """Strict validation: an unknown or misspelt field is an error, as `kubectl apply
    --validate=strict` makes it."""
    for obj in objects(path):
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_docs_name_the_versions_validated() -> None:
    text = CONTAINER_DOC.read_text()
    for version in KUBERNETES_VERSIONS:
        assert version.rsplit(".", 1)[0] in text


def test_beside_a_job_system_has_the_shape_teams_deploy() -> None:
    """Two replicas, both probes, resources, a read-only root as a non-root user, a
    PodDisruptionBudget over the sidecar's pods, the config where RECONCILER_CONFIG
    points, secrets only as mounted files."""
    found = {obj["kind"]: obj for obj in objects(BESIDE)}
    assert set(found) == {"ConfigMap", "Job", "Deployment", "PodDisruptionBudget"}
    deployment, budget = found["Deployment"], found["PodDisruptionBudget"]
    assert deployment["spec"]["replicas"] == 2
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert budget["spec"]["minAvailable"] == 1
    for obj in (deployment, found["Job"]):
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in containers(obj):
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert "memory" in container["resources"]["limits"]
            env = {e["name"]: e for e in container["env"]}
            # The URL and tokens are never environment values.
            assert not {"RECONCILER_DATABASE_URL", "RECONCILER_CONSOLE_TOKEN"} & set(env)
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            config_path = Path(env["RECONCILER_CONFIG"]["value"])
            config_volume = volumes[mounts[str(config_path.parent)]]
            assert config_volume["configMap"]["name"] == found["ConfigMap"]["metadata"]["name"]
            assert config_path.name in found["ConfigMap"]["data"]
            assert volumes[mounts[SECRETS]]["secret"]["secretName"]
    [sidecar] = containers(deployment)
    assert sidecar["command"] == ["reconciler", "run"]
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"


def configmap_toml() -> str:
    """The ``reconciler.toml`` the ConfigMap holds."""
    [config_map] = [o for o in objects(BESIDE) if o["kind"] == "ConfigMap"]
    return str(config_map["data"]["reconciler.toml"])


def mounted(tmp_path: Path, text: str) -> Path:
    """``text`` as the pod sees it: the Secret's files (one line each) where it mounts
    them, moved under ``tmp_path``; the config file beside them."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "database-url").write_text("postgresql+psycopg://app:s3cret@db:5432/shop\n")
    (secrets / "broker-url").write_text("redis://:s3cret@redis:6379/0\n")
    (secrets / "redis-url").write_text("redis://:s3cret@redis:6379/0\n")
    (secrets / "console-operators").write_text("alice 0123456789abcdef0123\n")
    path = tmp_path / "reconciler.toml"
    path.write_text(text.replace(SECRETS, str(secrets)))
    return path


def test_the_configmaps_config_loads_as_the_pod_reads_it(tmp_path: Path) -> None:
    """The real loader, the Secret's files in place: the Celery source with its broker
    URL read from its file, the [kinds] rules, the console's operators."""
    config = load_config(str(mounted(tmp_path, configmap_toml())))
    settings = config.settings
    assert settings.database_url == "postgresql+psycopg://app:s3cret@db:5432/shop"
    assert (settings.metrics_host, settings.metrics_port) == ("0.0.0.0", 9464)  # noqa: S104
    assert config.source.kind == "celery"
    assert config.source.url == "redis://:s3cret@redis:6379/0"  # type: ignore[attr-defined]
    assert config.kinds.resolve("shop.tasks.build_report").effect.value == "idempotent"
    assert config.kinds.resolve("shop.tasks.send_invoice").max_attempts == 3


def docs_sources() -> dict[str, str]:
    """The ``[source]`` tables docs/container.md gives in the ConfigMap's place, by kind."""
    text = CONTAINER_DOC.read_text()
    blocks = re.findall(r"```toml\n(\[source\]\n.*?)```", text, re.DOTALL)
    return {re.search(r'kind = "([^"]+)"', block).group(1): block  # type: ignore[union-attr]
            for block in blocks}


def test_the_docs_show_the_configmap_as_the_file_holds_it() -> None:
    """docs/container.md shows the ConfigMap's reconciler.toml as it is in the manifest."""
    assert configmap_toml() in CONTAINER_DOC.read_text()


@pytest.mark.parametrize("kind", ["rq", "django-tasks", "table"])
def test_each_source_the_docs_give_loads_in_the_configmaps_place(tmp_path: Path,
                                                                  kind: str) -> None:
    """The docs' [source] for RQ, Django tasks and a home-grown table, put where the
    ConfigMap's Celery [source] is: each loads."""
    sources = docs_sources()
    text = configmap_toml()
    head, _, rest = text.partition("[source]\n")
    kinds = rest[rest.index("# What each task does"):]
    config = load_config(str(mounted(tmp_path, head + sources[kind] + "\n" + kinds)))
    assert config.source.kind == kind
