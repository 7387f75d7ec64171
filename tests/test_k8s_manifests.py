"""The Kubernetes manifests (deploy/): what their probes, registration and scaling depend on.

Every container's command line is parsed by the real `pagedserve` subcommand's parser, with the
container's environment as the variables it reads, so an unknown flag, a PAGEDSERVE_* variable no
flag reads, or a value a flag refuses fails here rather than in a crash-looping pod. Where kubectl is
installed, the kustomizations themselves are rendered (`kubectl kustomize` needs no cluster) and the
CPU overlay is checked too.
"""

from __future__ import annotations

import argparse
import inspect
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from pagedserve import cli, cluster_token, healthcheck, model_files, prepare_model
from pagedserve.flags import env_var
from pagedserve.gateway import config as gateway_config
from pagedserve.grpc_utils import CLUSTER_TOKEN_ENV
from pagedserve.scheduler_svc import service_config
from pagedserve.worker_svc import config as worker_config

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "deploy" / "base"
CPU_OVERLAY = ROOT / "deploy" / "overlays" / "cpu"

# Each subcommand's parser, from the variables it reads (the parsers the subcommands themselves build).
PARSERS: dict[str, Callable[[Mapping[str, str]], argparse.ArgumentParser]] = {
    "scheduler": service_config.build_parser,
    "worker": worker_config.build_parser,
    "gateway": gateway_config.build_parser,
    "prepare-model": prepare_model.build_parser,
    "cluster-token": cluster_token.build_parser,
    "healthcheck": lambda env: healthcheck.build_parser(),
}
# PAGEDSERVE_* variables read outside any flag, and where.
NON_FLAG_VARIABLES = {
    "PAGEDSERVE_CACHE_DIR": inspect.getsource(model_files.default_cache_dir),
    CLUSTER_TOKEN_ENV: CLUSTER_TOKEN_ENV,
}
# What the downward API gives a pod, for $(VAR) references (sample values).
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "pagedserve-worker-7d9f-abcde"}
_REFERENCE = re.compile(r"\$\((\w+)\)")


def load_base() -> list[dict]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]
    return docs


def render(folder: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (kubectl kustomize renders the kustomizations)")
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def component(docs: list[dict], name: str) -> dict:
    return of_kind(docs, "Deployment")[f"pagedserve-{name}"]


def pod_containers(deployment: dict) -> list[dict]:
    spec = deployment["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def main_container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def container_env(container: dict, docs: list[dict]) -> dict[str, str]:
    """The container's variables as the pod sees them (secrets as a placeholder, $(VAR) expanded)."""
    config_maps = of_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), var["value"])
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = FIELD_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = "from-a-secret"
    return env


def parse(argv: list[str], env: Mapping[str, str]) -> tuple[str, argparse.ArgumentParser, argparse.Namespace]:
    """`pagedserve <command> ...` parsed as the CLI would: the command, its parser, its arguments."""
    assert argv[0] == "pagedserve", argv
    command, rest = argv[1], argv[2:]
    assert command in cli.SUBCOMMANDS, f"no `pagedserve {command}`"
    parser = PARSERS[command](env)
    try:
        return command, parser, parser.parse_args(rest)
    except SystemExit:
        pytest.fail(f"`pagedserve {command}` refuses {rest} with {sorted(env)}")


def container_argv(container: dict) -> list[str]:
    return container.get("command", ["pagedserve"]) + container.get("args", [])


def container_ports(container: dict) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in container.get("ports", [])}


def all_docs() -> list[tuple[str, list[dict]]]:
    variants = [("base files", load_base())]
    if shutil.which("kubectl"):
        variants += [("base", render(BASE)), ("cpu overlay", render(CPU_OVERLAY))]
    return variants


@pytest.fixture(params=all_docs(), ids=lambda v: v[0])
def docs(request) -> list[dict]:
    return request.param[1]


def test_every_subcommand_used_has_its_parser_here():
    assert set(PARSERS) <= set(cli.SUBCOMMANDS)


def test_every_container_runs_pagedserve_with_flags_and_variables_its_parser_accepts(docs):
    for deployment in of_kind(docs, "Deployment").values():
        for container in pod_containers(deployment):
            env = container_env(container, docs)
            _, parser, _ = parse(container_argv(container), env)
            flags = {env_var(s) for a in parser._actions for s in a.option_strings if s.startswith("--")}
            for name in env:
                if name.startswith("PAGEDSERVE_") and name not in flags:
                    assert name in NON_FLAG_VARIABLES, f"{container['name']}: no flag reads {name}"
                    assert name in NON_FLAG_VARIABLES[name]


def test_probes_run_pagedserve_healthcheck_on_the_ports_the_services_listen_on(docs):
    for deployment in of_kind(docs, "Deployment").values():
        container = main_container(deployment)
        _, _, args = parse(container_argv(container), container_env(container, docs))
        listening = {args.port} | ({args.grpc_port} if hasattr(args, "grpc_port") else set())
        assert set(container_ports(container).values()) == listening
        assert "readinessProbe" in container and "livenessProbe" in container
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None or "exec" not in probe:
                continue
            command, _, check = parse(probe["exec"]["command"], {})
            assert command == "healthcheck"
            address = f"//{check.grpc}" if check.grpc else check.http
            target = urlsplit(address)
            assert target.hostname == "localhost" and target.port in listening, (kind, address)
        ready = container["readinessProbe"]["exec"]["command"]
        assert ready[:2] == ["pagedserve", "healthcheck"]


def test_the_cluster_token_file_comes_from_the_secret_mounted_at_its_folder(docs):
    for deployment in of_kind(docs, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        secret_volumes = {v["name"] for v in pod["volumes"] if "secret" in v}
        container = main_container(deployment)
        token_file = Path(container_env(container, docs)["PAGEDSERVE_CLUSTER_TOKEN_FILE"])
        mounts = {Path(m["mountPath"]): m["name"] for m in container["volumeMounts"]}
        assert mounts.get(token_file.parent) in secret_volumes


def test_services_select_the_labels_of_their_deployments_and_route_to_named_ports(docs):
    deployments = of_kind(docs, "Deployment").values()
    for deployment in deployments:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in of_kind(docs, "Service").values():
        selector = service["spec"]["selector"]
        chosen = [
            d for d in deployments if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(chosen) == 1, service["metadata"]["name"]
        ports = container_ports(main_container(chosen[0]))
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)


def test_workers_and_gateway_reach_the_scheduler_through_its_service(docs):
    scheduler = of_kind(docs, "Service")["pagedserve-scheduler"]
    # Workers register before the scheduler is ready: the Service must route to it anyway.
    assert scheduler["spec"]["publishNotReadyAddresses"] is True
    addresses = {f"{scheduler['metadata']['name']}:{p['port']}" for p in scheduler["spec"]["ports"]}
    for name in ("worker", "gateway"):
        container = main_container(component(docs, name))
        _, _, args = parse(container_argv(container), container_env(container, docs))
        assert args.scheduler in addresses
    assert component(docs, "scheduler")["spec"]["replicas"] == 1


def test_workers_scale_without_fixed_ports_and_advertise_their_pod_ip(docs):
    worker = component(docs, "worker")
    for container in pod_containers(worker):
        assert all("hostPort" not in p for p in container.get("ports", []))
    assert "hostNetwork" not in worker["spec"]["template"]["spec"]
    container = main_container(worker)
    env = container_env(container, docs)
    _, _, args = parse(container_argv(container), env)
    assert args.advertise_address == f"{FIELD_VALUES['status.podIP']}:{args.port}"


def test_base_workers_run_on_a_gpu_and_the_cpu_overlay_on_none():
    for docs, device in ((load_base(), "cuda"), (render(CPU_OVERLAY), "cpu")):
        container = main_container(component(docs, "worker"))
        _, _, args = parse(container_argv(container), container_env(container, docs))
        assert args.device == device
        resources = container["resources"]
        gpus = [resources.get(k, {}).get("nvidia.com/gpu") for k in ("requests", "limits")]
        assert gpus == ([1, 1] if device == "cuda" else [None, None])
