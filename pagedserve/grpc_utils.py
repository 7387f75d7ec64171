"""What every gRPC server and client of the project shares: health, reflection, channel options, TLS.

Internal links (gateway -> scheduler -> workers, workers -> scheduler) are plaintext by default, or
TLS (optionally mutual) when a service gets `--tls-cert/--tls-key/--tls-ca`: `TLSConfig` holds those
paths, `listen()` opens a server port with them and `open_channel()` dials with them, so every
server and client of the project builds its credentials in this one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# NOTE: the largest message of the internal links is an Engine response carrying a long prompt's
# logprobs (20 alternatives a position, about 190 bytes: some 25 MB for a 128K-token prompt); plans,
# step results and prompts are far smaller. 64 MiB fits that and bounds what one message from a peer
# can make a service allocate.
INTERNAL_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", INTERNAL_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", INTERNAL_MAX_MESSAGE_BYTES),
    # Notice a dead peer within seconds, not at the next write.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # NOTE: a restarted peer (scheduler restart) is dialled again within ~2 s, not after gRPC's
    # default exponential backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

# The scheduler's channel to a worker: a worker whose host vanishes without closing its connections
# (network cut, frozen VM) is noticed within ~2 s by a keepalive ping left unanswered. A killed
# process is noticed at once anyway (its socket closes and the always-pending read fails).
WORKER_CHANNEL_OPTIONS = [
    *(o for o in CHANNEL_OPTIONS if o[0] not in ("grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms")),
    ("grpc.keepalive_time_ms", 1_000),
    ("grpc.keepalive_timeout_ms", 1_000),
]


def server_options(max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options of a gRPC server that refuses (RESOURCE_EXHAUSTED) messages over max_message_bytes."""
    return [
        ("grpc.max_send_message_length", INTERNAL_MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        # NOTE: the scheduler pings its workers every second; allow it (0 strikes = never GOAWAY).
        ("grpc.http2.min_ping_interval_without_data_ms", 500),
        ("grpc.http2.max_ping_strikes", 0),
    ]


SERVER_OPTIONS = server_options()


@dataclass(slots=True, frozen=True)
class TLSConfig:
    # PEM certificate chain this service presents (server side, and client side for mutual TLS).
    cert: str | None = None
    # PEM private key of that certificate.
    key: str | None = None
    # PEM CA bundle that peers' certificates must chain to (None: the system roots, client side only).
    ca: str | None = None
    # Server side: refuse clients that present no certificate signed by `ca` (mutual TLS).
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.require_client_cert and not self.ca:
            raise ValueError("--tls-require-client-cert needs --tls-ca to check client certificates")
        for path in (self.cert, self.key, self.ca):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path} does not exist")

    @property
    def enabled(self) -> bool:
        """Whether the links this service makes and serves use TLS."""
        return self.cert is not None or self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.cert is not None and self.key is not None, "a TLS server needs --tls-cert and --tls-key"
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            require_client_auth=self.require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None,
        )


PLAINTEXT = TLSConfig()


@dataclass(slots=True)
class ServiceTLSFields:
    """The TLS flags of a gRPC service (the scheduler, a worker) as config fields: its config inherits
    them, so `add_tls_arguments` fills them and `tls` reads them in one place."""

    # TLS on the service and on the channels it opens (see TLSConfig).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_require_client_cert: bool = False

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig(self.tls_cert, self.tls_key, self.tls_ca, self.tls_require_client_cert)


def add_tls_arguments(add, add_bool) -> None:
    """The four TLS flags, through a service's own `add(flag, convert, help)` / `add_bool` helpers."""
    add("--tls-cert", str, "PEM certificate for TLS on the internal gRPC links")
    add("--tls-key", str, "PEM private key of --tls-cert")
    add("--tls-ca", str, "PEM CA that peers' certificates must chain to")
    add_bool(
        "--tls-require-client-cert", "mutual TLS: refuse clients without a certificate from --tls-ca", False
    )


def listen(server: grpc.aio.Server, address: str, tls: TLSConfig = PLAINTEXT) -> int:
    """Open address on server, with TLS when tls has a certificate; returns the bound port (0: failed)."""
    if tls.cert is not None:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)


def public_server(max_message_bytes: int) -> grpc.aio.Server:
    """A server for the public API: anyone may connect (the API keys are checked by the service itself);
    a request larger than max_message_bytes is refused with RESOURCE_EXHAUSTED before it is parsed."""
    return grpc.aio.server(options=server_options(max_message_bytes))


def open_channel(address: str, tls: TLSConfig = PLAINTEXT, options=None) -> grpc.aio.Channel:
    """An asyncio channel to address, TLS when tls is enabled."""
    options = CHANNEL_OPTIONS if options is None else options
    if tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def open_sync_channel(address: str, tls: TLSConfig = PLAINTEXT, options=None) -> grpc.Channel:
    """A blocking channel to address, TLS when tls is enabled."""
    options = CHANNEL_OPTIONS if options is None else options
    if tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.insecure_channel(address, options=options)


def add_health_and_reflection(
    server: grpc.aio.Server, service_full_names: list[str]
) -> health.HealthServicer:
    """Serve grpc.health.v1 (overall status "" plus one per service) and server reflection.

    Services start NOT_SERVING; the caller flips them with `set_serving` once it can do real work.
    """
    servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*service_full_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return servicer


async def set_serving(servicer, service_full_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_full_names]:
        result = servicer.set(name, status)
        if hasattr(result, "__await__"):
            await result


async def check_health(
    address: str, service: str = "", timeout: float = 2.0, tls: TLSConfig = PLAINTEXT
) -> bool:
    """Whether the gRPC server at address reports SERVING for service ("" = the whole server)."""
    async with open_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING
