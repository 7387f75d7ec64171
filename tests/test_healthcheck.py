"""`pagedserve healthcheck` (container health checks), `pagedserve prepare-model` (compose's model-init)
and `pagedserve cluster-token` (compose's cluster-init)."""

from __future__ import annotations

import http.server
import json
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve import cluster_token, healthcheck, prepare_model

SERVICE = "pagedserve.v1.WorkerService"


@pytest.fixture
def grpc_health():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture
def http_status():
    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield status, f"http://127.0.0.1:{server.server_address[1]}/health"
    server.shutdown()
    server.server_close()


def test_grpc_serving_is_healthy_and_not_serving_is_not(grpc_health):
    servicer, address = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main(["--quiet", "--grpc", address]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main(["--quiet", "--grpc", address]) == 1


def test_grpc_check_asks_about_the_named_service(grpc_health, capsys):
    servicer, address = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main(["--grpc", address, "--service", SERVICE]) == 1  # unknown: NOT_FOUND
    assert "NOT_FOUND" in capsys.readouterr().out
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main(["--grpc", address, "--service", SERVICE]) == 0
    assert "healthy (SERVING)" in capsys.readouterr().out


def test_unreachable_grpc_server_is_unhealthy_within_the_timeout():
    assert healthcheck.main(["--quiet", "--grpc", "127.0.0.1:1", "--timeout", "0.5"]) == 1


def test_http_2xx_is_healthy_and_503_is_not(http_status):
    status, url = http_status
    assert healthcheck.main(["--quiet", "--http", url]) == 0
    status["code"] = 503
    assert healthcheck.main(["--quiet", "--http", url]) == 1


def test_unreachable_http_server_is_unhealthy():
    assert healthcheck.main(["--quiet", "--http", "http://127.0.0.1:1/health", "--timeout", "0.5"]) == 1


def test_healthcheck_needs_exactly_one_target():
    with pytest.raises(SystemExit):
        healthcheck.main([])
    with pytest.raises(SystemExit):
        healthcheck.main(["--grpc", "a:1", "--http", "http://a/"])


@pytest.fixture
def no_logging_setup(monkeypatch):
    # NOTE: configure_logging binds structlog to the sys.stdout of the moment, which capsys closes
    # after the test; the logs themselves are not what these tests check.
    monkeypatch.setattr(prepare_model, "configure_logging", lambda *args, **kwargs: None)


@pytest.mark.usefixtures("no_logging_setup")
def test_prepare_model_prints_the_folder_the_services_load(tmp_path, capsys):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert prepare_model.main(["--model", str(model), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(model)


@pytest.mark.usefixtures("no_logging_setup")
def test_prepare_model_fails_cleanly_on_a_missing_model(tmp_path):
    assert prepare_model.main(["--model", str(tmp_path / "missing")]) == 1


def test_prepare_model_reads_its_settings_from_the_environment():
    args = prepare_model.build_parser(
        {"PAGEDSERVE_MODEL": "m.gguf", "PAGEDSERVE_CACHE_DIR": "/c"}
    ).parse_args([])
    assert (args.model, args.cache_dir) == ("m.gguf", "/c")


@pytest.fixture
def no_token_logging_setup(monkeypatch):
    monkeypatch.setattr(cluster_token, "configure_logging", lambda *args, **kwargs: None)


@pytest.mark.usefixtures("no_token_logging_setup")
def test_cluster_token_is_written_once_for_its_owner_alone_and_kept_after(tmp_path, capsys):
    from pagedserve.grpc_utils import ClusterAuth

    path = tmp_path / "secrets" / "cluster-token"
    assert cluster_token.main(["--cluster-token-file", str(path)]) == 0
    token = ClusterAuth.load(str(path), env={}).token
    assert len(token) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert cluster_token.main(["--cluster-token-file", str(path)]) == 0
    assert ClusterAuth.load(str(path), env={}).token == token
    assert token not in capsys.readouterr().out


@pytest.mark.usefixtures("no_token_logging_setup")
def test_cluster_token_needs_a_file(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_CLUSTER_TOKEN_FILE", raising=False)
    assert cluster_token.main([]) == 2
