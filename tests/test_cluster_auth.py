"""Cluster membership on a real grpc.aio server in this process: which calls an internal server admits
(the cluster token, compared in constant time; loopback peers when nothing is configured), what the
clients send, and where the token comes from. The same checks on real stacks are in
test_engine_service.py (a token) and test_security.py (mutual TLS)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.grpc_utils import (
    CLUSTER_TOKEN_HEADER,
    NO_CLUSTER_AUTH,
    ClusterAuth,
    TLSConfig,
    add_health_and_reflection,
    internal_server,
    is_loopback_peer,
    open_channel,
    open_sync_channel,
    set_serving,
)
from pagedserve.internal_tls import generate
from pagedserve.v1 import worker_pb2, worker_pb2_grpc

TOKEN = "cluster-secret-1234"


class EchoWorker(worker_pb2_grpc.WorkerServiceServicer):
    """A Worker service that answers GetModelInfo and one StepResult per plan, and remembers the
    metadata of the last call it served."""

    def __init__(self) -> None:
        self.metadata: dict[str, str] = {}

    async def GetModelInfo(self, request, context):
        self.metadata = dict(context.invocation_metadata())
        return worker_pb2.GetModelInfoResponse(info=worker_pb2.ModelInfo(model="echo"))

    async def Steps(self, request_iterator, context):
        async for request in request_iterator:
            yield worker_pb2.StepsResponse(result=worker_pb2.StepResult(step_id=request.plan.step_id))


async def start(auth: ClusterAuth, host: str = "127.0.0.1", tls: TLSConfig | None = None):
    tls = tls or TLSConfig()
    server = internal_server(auth, tls)
    servicer = EchoWorker()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, ["pagedserve.v1.WorkerService"])
    port = server.add_secure_port(f"{host}:0", tls.server_credentials()) if tls.cert else None
    port = port or server.add_insecure_port(f"{host}:0")
    await server.start()
    await set_serving(health, ["pagedserve.v1.WorkerService"], True)
    return server, servicer, port


async def call_both(address: str, auth: ClusterAuth) -> list[grpc.StatusCode]:
    """The status of a unary call (GetModelInfo) and of a stream (Steps) made with auth."""
    codes = []
    async with open_channel(address, auth=auth) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        for call in (
            lambda: stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=10),
            lambda: _collect(
                stub.Steps(iter([worker_pb2.StepsRequest(plan=worker_pb2.StepPlan(step_id=1))]), timeout=10)
            ),
        ):
            try:
                await call()
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as error:
                codes.append(error.code())
                if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                    assert "cluster token" in error.details() or "loopback" in error.details()
    return codes


async def _collect(call) -> list:
    return [item async for item in call]


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    return response.status


@pytest.mark.anyio
async def test_a_server_with_a_token_admits_only_calls_that_carry_it_and_health_stays_open():
    server, _, port = await start(ClusterAuth(TOKEN))
    address = f"127.0.0.1:{port}"
    try:
        assert await call_both(address, ClusterAuth(TOKEN)) == [grpc.StatusCode.OK] * 2
        assert await call_both(address, NO_CLUSTER_AUTH) == [grpc.StatusCode.UNAUTHENTICATED] * 2
        assert await call_both(address, ClusterAuth(TOKEN + "x")) == [grpc.StatusCode.UNAUTHENTICATED] * 2
        assert await call_both(address, ClusterAuth(TOKEN[:-1])) == [grpc.StatusCode.UNAUTHENTICATED] * 2
        assert await health_status(address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)


@pytest.mark.anyio
async def test_the_token_travels_beside_the_callers_own_metadata():
    server, servicer, port = await start(ClusterAuth(TOKEN))
    try:
        async with open_channel(f"127.0.0.1:{port}", auth=ClusterAuth(TOKEN)) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            await stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), metadata=(("traceparent", "00-ab"),))
        assert servicer.metadata["traceparent"] == "00-ab"
        assert servicer.metadata[CLUSTER_TOKEN_HEADER] == TOKEN

        def blocking_call() -> worker_pb2.GetModelInfoResponse:
            with open_sync_channel(f"127.0.0.1:{port}", auth=ClusterAuth(TOKEN)) as channel:
                return worker_pb2_grpc.WorkerServiceStub(channel).GetModelInfo(
                    worker_pb2.GetModelInfoRequest(), timeout=10
                )

        assert (await asyncio.to_thread(blocking_call)).info.model == "echo"
    finally:
        await server.stop(None)


def _non_loopback_address() -> str | None:
    """This machine's address on its default route, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.anyio
async def test_without_token_or_mutual_tls_only_loopback_peers_are_admitted():
    server, _, port = await start(NO_CLUSTER_AUTH, host="0.0.0.0")
    try:
        assert await call_both(f"127.0.0.1:{port}", NO_CLUSTER_AUTH) == [grpc.StatusCode.OK] * 2
        outside = _non_loopback_address()
        if outside is not None:
            codes = await call_both(f"{outside}:{port}", NO_CLUSTER_AUTH)
            assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 2
            assert await health_status(f"{outside}:{port}") == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.3.2.1:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("unix:/tmp/socket", True),
        ("ipv4:10.0.0.7:5000", False),
        ("ipv6:[2001:db8::1]:5000", False),
        ("ipv6:[::ffff:10.0.0.7]:5000", False),
        ("nonsense", False),
    ],
)
def test_loopback_peers_are_told_apart_from_the_others(peer, loopback):
    assert is_loopback_peer(peer) is loopback


@pytest.mark.anyio
async def test_mutual_tls_is_proof_enough_and_a_client_without_a_certificate_is_refused(tmp_path):
    certs = generate(tmp_path)
    server_tls = TLSConfig(str(certs.cert), str(certs.key), str(certs.ca), require_client_cert=True)
    # A token configured too changes nothing: the verified certificate is the proof.
    server, _, port = await start(ClusterAuth(TOKEN), host="127.0.0.1", tls=server_tls)
    member = TLSConfig(str(certs.cert), str(certs.key), str(certs.ca))
    try:
        async with open_channel(f"127.0.0.1:{port}", member) as channel:
            info = (
                await worker_pb2_grpc.WorkerServiceStub(channel).GetModelInfo(
                    worker_pb2.GetModelInfoRequest()
                )
            ).info
        assert info.model == "echo"
        async with open_channel(
            f"127.0.0.1:{port}", TLSConfig(ca=str(certs.ca)), auth=ClusterAuth(TOKEN)
        ) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await worker_pb2_grpc.WorkerServiceStub(channel).GetModelInfo(
                    worker_pb2.GetModelInfoRequest(), timeout=5
                )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


def test_the_token_comes_from_the_variable_or_the_file_never_both(tmp_path):
    assert ClusterAuth.load(None, env={}).token is None
    assert ClusterAuth.load(None, env={"PAGEDSERVE_CLUSTER_TOKEN": TOKEN}).token == TOKEN
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert ClusterAuth.load(str(token_file), env={}).token == TOKEN
    with pytest.raises(ValueError, match="not both"):
        ClusterAuth.load(str(token_file), env={"PAGEDSERVE_CLUSTER_TOKEN": TOKEN})
    with pytest.raises(ValueError, match="does not exist"):
        ClusterAuth.load(str(tmp_path / "missing"), env={})
    token_file.write_text("\n")
    with pytest.raises(ValueError, match="non-empty printable ASCII"):
        ClusterAuth.load(str(token_file), env={})


def test_every_service_reads_the_token_file_flag_and_its_variable(tmp_path):
    from pagedserve.gateway.config import GatewayConfig
    from pagedserve.scheduler_svc.service_config import SchedulerServiceConfig
    from pagedserve.worker_svc.config import WorkerConfig

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    env = {"PAGEDSERVE_CLUSTER_TOKEN_FILE": str(token_file)}
    for config in (
        GatewayConfig.from_args([], env=env),
        SchedulerServiceConfig.from_args([], env=env),
        WorkerConfig.from_args([], env=env),
        GatewayConfig.from_args(["--cluster-token-file", str(token_file)], env={}),
    ):
        assert config.cluster_token_file == str(token_file)
        assert config.cluster_auth.token == TOKEN
