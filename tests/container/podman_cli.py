"""Podman as the container tests use it: every flag this machine needs, in one place.

The image is built from ops/container/Containerfile unchanged; what this machine needs is
said here, beside the flag, and nowhere else:

- ``--runtime runc``: podman's default OCI runtime (crun, where installed) refuses this
  machine's hybrid cgroup layout (v1 controllers with a v2 mount beside them); runc runs.
- ``--ulimit nofile=...`` and ``--ulimit nproc=...``: podman asks the runtime for its own
  default limits (1048576 open files), above the hard limits this machine allows, and the
  container fails to start ("error setting rlimit"). It gets the limits this process has.
- ``--network host`` on builds: the build's RUN steps reach the Debian mirror and PyPI the
  way the host does (no bridge or NAT to set up); podman passes the host's HTTP(S)_PROXY
  and NO_PROXY into the build on its own (``--http-proxy``, on by default).
- The host's CA bundle, mounted read-only into the build and named by ``PIP_CERT``: pip in
  the build trusts only that bundle here (its own certifi bundle is refused by the way the
  machine reaches PyPI), and the Debian base has no CA bundle of its own before the build.
- The host pip's index (``PIP_INDEX_URL`` or pip's config ``index-url``), as the
  ``PIP_INDEX_URL`` build argument, when it is a network URL (a ``file://`` index of the
  host's is not inside the build).
- ``--format docker``: an OCI-format image (podman's default) has no place for the
  Containerfile's HEALTHCHECK; the docker format keeps it, as docker builds it.

The base is a Debian bookworm root made by ``debootstrap --variant=minbase`` from the
mirror apt already uses on the host, trimmed as Debian's slim images are, and imported as
``localhost/debian:bookworm-slim``; it is kept between runs (made only when missing).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "ops" / "container" / "Containerfile"
BASE_IMAGE = "localhost/debian:bookworm-slim"
VERSION: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"localhost/stale-claim-reconciler:{VERSION}"
SUITE = "bookworm"
# The host's CA bundle, and where a build sees it.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_CA_BUNDLE = "/etc/ssl/certs/host-ca.crt"
# What Debian's slim images leave out (debuerreotype's --slim): documentation, manual
# pages, translations. The same dpkg filter keeps later installs (the image's) slim too.
SLIM_DPKG_FILTER = """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
"""
# Debian's images' apt configuration (debuerreotype): no downloaded packages or package
# caches left behind in a layer.
_APT_CLEAN_FILES = ("rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb "
                    "/var/cache/apt/*.bin || true")
APT_CLEAN = (f'DPkg::Post-Invoke {{ "{_APT_CLEAN_FILES}"; }};\n'
             f'APT::Update::Post-Invoke {{ "{_APT_CLEAN_FILES}"; }};\n'
             'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n')
SLIM_TRIM = ("usr/share/doc", "usr/share/man", "usr/share/groff", "usr/share/info",
             "usr/share/lintian", "usr/share/linda", "usr/share/locale")
# What debian:bookworm-slim sets, so the local base behaves like it.
BASE_CHANGES = ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                'CMD ["bash"]')
MISSING_HINT = "apt-get install -y podman runc debootstrap uidmap (.ci/run installs them)"
LOCK = Path(tempfile.gettempdir()) / "stale-claim-reconciler-container.lock"
COMMAND_TIMEOUT = 1200.0


def tool(name: str) -> str:
    """The absolute path of a program the tests run (PodmanError when it is missing)."""
    path = shutil.which(name)
    if path is None:
        raise PodmanError(f"{name} not found: {MISSING_HINT}")
    return path


class PodmanError(RuntimeError):
    """A podman (or debootstrap) command failed; the message carries its output's tail."""


def missing_tools() -> list[str]:
    """The programs the container tests need that this machine lacks."""
    return [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]


def _limits() -> list[str]:
    """The open-file and process limits this process has, for the container."""
    flags = []
    for name, which in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        soft, hard = resource.getrlimit(which)
        if hard == resource.RLIM_INFINITY:
            hard = soft if soft != resource.RLIM_INFINITY else 1 << 20
        if name == "nproc":
            # runc is refused any process limit above kernel.pid_max here (measured: 32768
            # starts, 32769 fails), although this process has a higher one.
            hard = min(hard, int(Path("/proc/sys/kernel/pid_max").read_text()))
        soft = hard if soft == resource.RLIM_INFINITY else min(soft, hard)
        flags += ["--ulimit", f"{name}={soft}:{hard}"]
    return flags


# Global flags, before the subcommand: the runtime that works here (see the docstring).
GLOBAL_FLAGS = ("--runtime", "runc")


def podman(*args: str, timeout: float = COMMAND_TIMEOUT, check: bool = True,
           input_bytes: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """``podman ARGS`` with this machine's global flags; PodmanError when it fails."""
    command = [tool("podman"), *GLOBAL_FLAGS, *args]
    proc = subprocess.run(command, input=input_bytes.decode() if input_bytes else None,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise PodmanError(f"{' '.join(command)} exited {proc.returncode}:\n"
                          f"{_tail(proc.stdout + proc.stderr)}")
    return proc


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def image_exists(image: str) -> bool:
    return podman("image", "exists", image, check=False).returncode == 0


def inspect_image(image: str) -> dict[str, object]:
    """The image's ``podman image inspect`` record."""
    records: list[dict[str, object]] = json.loads(podman("image", "inspect", image).stdout)
    return records[0]


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    """One base or image build at a time on this machine (parallel test runs share them)."""
    with LOCK.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------- #
# The base: Debian from the mirror apt already uses
# --------------------------------------------------------------------------------------- #


@dataclass(frozen=True, slots=True)
class AptSource:
    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]


def host_apt_sources(etc_apt: Path = Path("/etc/apt")) -> list[AptSource]:
    """The host's ``deb`` sources (one-line and deb822 formats) for this suite and its
    updates and security suites."""
    found: list[AptSource] = []
    files = [etc_apt / "sources.list", *sorted((etc_apt / "sources.list.d").glob("*.list")),
             *sorted((etc_apt / "sources.list.d").glob("*.sources"))]
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        found += _deb822(text) if path.suffix == ".sources" else _one_line(text)
    wanted = {SUITE, f"{SUITE}-updates", f"{SUITE}-security"}
    return [AptSource(s.uri, tuple(x for x in s.suites if x in wanted), s.components)
            for s in found if wanted & set(s.suites) and "main" in s.components]


def _one_line(text: str) -> list[AptSource]:
    sources = []
    for line in text.splitlines():
        words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()  # no [options]
        if len(words) >= 3 and words[0] == "deb":
            sources.append(AptSource(words[1], (words[2],), tuple(words[3:])))
    return sources


def _deb822(text: str) -> list[AptSource]:
    sources = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, value = line.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled") == "no":
            continue
        for uri in fields.get("uris", "").split():
            sources.append(AptSource(uri, tuple(fields.get("suites", "").split()),
                                     tuple(fields.get("components", "").split())))
    return sources


def debian_mirror(sources: Sequence[AptSource]) -> str:
    """The mirror of the suite itself (not its security archive)."""
    for source in sources:
        if SUITE in source.suites:
            return source.uri
    raise PodmanError(f"no Debian {SUITE} source in /etc/apt: cannot debootstrap the base")


def _base_sources(sources: Sequence[AptSource]) -> str:
    stanzas = [f"Types: deb\nURIs: {s.uri}\nSuites: {' '.join(s.suites)}\nComponents: main\n"
               "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n" for s in sources]
    return "\n".join(stanzas)


def ensure_base() -> float | None:
    """Make the base image when it is missing; the seconds it took, None when it was kept."""
    with _exclusive():
        if image_exists(BASE_IMAGE):
            return None
        started = time.monotonic()
        sources = host_apt_sources()
        mirror = debian_mirror(sources)
        with tempfile.TemporaryDirectory(prefix="reconciler-base-", dir="/var/tmp") as tmp:
            root = Path(tmp) / "root"
            proc = subprocess.run(
                [tool("debootstrap"), "--variant=minbase", SUITE, str(root), mirror],
                capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False)
            if proc.returncode != 0:
                raise PodmanError(f"debootstrap exited {proc.returncode}:\n"
                                  f"{_tail(proc.stdout + proc.stderr)}")
            _slim(root, sources)
            tar = subprocess.Popen([tool("tar"), "--numeric-owner", "-C", str(root), "-c", "."],
                                   stdout=subprocess.PIPE)
            try:
                changes = [arg for change in BASE_CHANGES for arg in ("--change", change)]
                imported = subprocess.run([tool("podman"), *GLOBAL_FLAGS, "import", *changes, "-",
                                           BASE_IMAGE], stdin=tar.stdout, capture_output=True,
                                          text=True, timeout=COMMAND_TIMEOUT, check=False)
            finally:
                assert tar.stdout is not None
                tar.stdout.close()
                tar.wait()
            if imported.returncode != 0 or tar.returncode != 0:
                raise PodmanError(f"podman import exited {imported.returncode} (tar "
                                  f"{tar.returncode}):\n{_tail(imported.stderr)}")
        return time.monotonic() - started


def _slim(root: Path, sources: Sequence[AptSource]) -> None:
    """Trim the root as Debian's slim images are, and point apt at the host's mirrors."""
    (root / "etc/dpkg/dpkg.cfg.d/docker").write_text(SLIM_DPKG_FILTER)
    (root / "etc/apt/apt.conf.d/docker-clean").write_text(APT_CLEAN)
    for folder in SLIM_TRIM:
        for child in (root / folder).glob("*"):
            if folder == "usr/share/doc" and child.is_dir() and not child.is_symlink():
                for extra in child.iterdir():  # keep each package's copyright
                    if extra.name != "copyright":
                        _remove(extra)
            elif child.name != "locale.alias":
                _remove(child)
    for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for child in (root / leftover).glob("*"):
            if child.is_file():
                child.unlink()
    for cache in (root / "var/cache/apt").glob("*.bin"):
        cache.unlink()
    (root / "etc/apt/sources.list").unlink(missing_ok=True)
    (root / "etc/apt/sources.list.d/debian.sources").write_text(_base_sources(sources))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


# --------------------------------------------------------------------------------------- #
# The image
# --------------------------------------------------------------------------------------- #


def _host_pip_index() -> str | None:
    """The index the host's pip uses, when the build can reach it too."""
    index = os.environ.get("PIP_INDEX_URL")
    if not index:
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                              capture_output=True, text=True, timeout=60, check=False)
        for line in proc.stdout.splitlines():
            key, _, value = line.partition("=")
            if key.endswith(".index-url"):
                index = value.strip().strip("'\"")
    if index and not index.startswith("file:"):
        return index
    return None


def build_flags(base: str = BASE_IMAGE) -> list[str]:
    """``podman build`` flags for this machine (see the module's docstring)."""
    flags = ["--runtime", "runc",  # the build's RUN steps too, not only `podman run`
             "--format", "docker", "--network", "host", *_limits(),
             "--build-arg", f"BASE={base}", "--build-arg", f"VERSION={VERSION}"]
    if HOST_CA_BUNDLE.is_file():
        flags += ["-v", f"{HOST_CA_BUNDLE}:{BUILD_CA_BUNDLE}:ro",
                  "--build-arg", f"PIP_CERT={BUILD_CA_BUNDLE}"]
    index = _host_pip_index()
    if index:
        flags += ["--build-arg", f"PIP_INDEX_URL={index}"]
    revision = subprocess.run([tool("git"), "-C", str(REPO), "rev-parse", "HEAD"],
                              capture_output=True, text=True, check=False).stdout.strip()
    if revision:
        flags += ["--build-arg", f"REVISION={revision}"]
    return flags


def build_image(image: str = IMAGE, *extra: str) -> float:
    """Build the image from the repository; the seconds it took. The image it replaces
    under the same tag is removed (its layers stay as the build's cache)."""
    with _exclusive():
        before = inspect_image(image)["Id"] if image_exists(image) else None
        started = time.monotonic()
        podman("build", "-f", str(CONTAINERFILE), "-t", image, *build_flags(), *extra,
               str(REPO))
        took = time.monotonic() - started
        if before is not None and inspect_image(image)["Id"] != before:
            podman("rmi", str(before), check=False)
        return took


def run_flags() -> list[str]:
    """``podman run`` flags for this machine (see the module's docstring)."""
    return _limits()
