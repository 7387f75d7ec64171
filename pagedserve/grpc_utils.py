"""What every gRPC server and client of the project shares: health, reflection, channel options, TLS,
message size limits and cluster membership.

Internal links (gateway -> scheduler -> workers, workers -> scheduler) are plaintext by default, or
TLS (optionally mutual) when a service gets `--tls-cert/--tls-key/--tls-ca`: `TLSConfig` holds those
paths, `listen()` opens a server port with them and `open_channel()` dials with them, so every
server and client of the project builds its credentials in this one place.

Only members of the cluster may call the scheduler's Engine service and the workers' Worker service
(`ClusterAuth`): a peer proves membership with a client certificate under the internal CA (a server
started with --tls-require-client-cert) or with the shared cluster token, which `open_channel(...,
auth=...)` puts into every call's metadata and `internal_server()` checks. grpc.health.v1 and
reflection stay open to anyone (probes, container health checks).
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.logging import get_logger

log = get_logger("pagedserve.grpc")

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


CLUSTER_TOKEN_ENV = "PAGEDSERVE_CLUSTER_TOKEN"
# The metadata key every internal call carries the cluster token in.
CLUSTER_TOKEN_HEADER = "x-pagedserve-cluster-token"
# Methods anyone may call: probes and container health checks need no credentials.
OPEN_METHOD_PREFIXES = (
    f"/{health.SERVICE_NAME}/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


@dataclass(slots=True, frozen=True)
class ClusterAuth:
    """How a member of the cluster proves it is one: the shared cluster token (None: none configured).

    Client side, `open_channel(..., auth=...)` sends the token with every call. Server side,
    `internal_server()` admits a call when the server verifies client certificates (mutual TLS under
    the internal CA: the certificate is the proof), or when the call carries the token (compared in
    constant time), or, with neither configured, when it comes from a loopback peer."""

    # The shared secret (printable ASCII), from PAGEDSERVE_CLUSTER_TOKEN or --cluster-token-file; kept
    # out of repr() so that no log line or traceback shows it.
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.token is not None and not (self.token and self.token.isascii() and self.token.isprintable()):
            raise ValueError("the cluster token must be non-empty printable ASCII")

    @classmethod
    def load(cls, token_file: str | None = None, env: Mapping[str, str] | None = None) -> ClusterAuth:
        """The token from token_file (--cluster-token-file, env PAGEDSERVE_CLUSTER_TOKEN_FILE) or from
        the PAGEDSERVE_CLUSTER_TOKEN variable; setting both is refused, neither gives no token."""
        env = os.environ if env is None else env
        variable = env.get(CLUSTER_TOKEN_ENV) or None
        if token_file:
            if variable is not None:
                raise ValueError(f"set {CLUSTER_TOKEN_ENV} or --cluster-token-file, not both")
            path = Path(token_file)
            if not path.is_file():
                raise ValueError(f"cluster token file {token_file} does not exist")
            return cls(path.read_text().strip())
        return cls(variable)

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """What a client adds to each call's metadata."""
        return () if self.token is None else ((CLUSTER_TOKEN_HEADER, self.token),)

    def server_interceptors(self, tls: TLSConfig) -> list[grpc.aio.ServerInterceptor]:
        """The check an internal server runs on every call (none where mutual TLS already proves it)."""
        if tls.require_client_cert:
            log.info("cluster_membership", proof="client certificate (mutual TLS)")
            return []
        if self.token is not None:
            log.info("cluster_membership", proof="cluster token")
            return [_ClusterTokenCheck(self.token)]
        log.warning(
            "cluster_membership_loopback_only",
            message=f"no cluster token ({CLUSTER_TOKEN_ENV} or --cluster-token-file) and no mutual TLS: "
            "only peers on this machine's loopback interface may call this service",
        )
        return [_LoopbackOnly()]


NO_CLUSTER_AUTH = ClusterAuth()


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of handler's kind that answers UNAUTHENTICATED without reading the request."""

    async def refuse(_request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return _handler_like(handler, refuse)


def _handler_like(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _metadata_value(metadata, key: str) -> str | None:
    for item_key, value in metadata or ():
        if item_key == key:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


class _ClusterTokenCheck(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call but health and reflection that lacks the cluster token.

    NOTE: the check reads the call's metadata before the handler runs and hands back the service's own
    handler when it passes, so a long stream (a worker's Steps) pays for it once, not per message."""

    def __init__(self, token: str):
        self._token = token.encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        sent = _metadata_value(details.invocation_metadata, CLUSTER_TOKEN_HEADER)
        if sent is None:
            return _refusal(handler, f"{details.method} needs the cluster token ({CLUSTER_TOKEN_HEADER})")
        if not hmac.compare_digest(sent.encode(), self._token):
            return _refusal(handler, f"{details.method}: wrong cluster token")
        return handler


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") is on this
    machine's loopback interface."""
    kind, _, rest = peer.partition(":")
    if kind in ("unix", "unix-abstract"):
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    host = rest.rsplit(":", 1)[0].strip("[]").split("%", 1)[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


async def _refuse_unless_loopback(context: grpc.aio.ServicerContext) -> None:
    if not is_loopback_peer(context.peer()):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "this service has no cluster token and no mutual TLS configured: it accepts loopback peers only",
        )


class _LoopbackOnly(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call but health and reflection from a peer off the loopback interface.

    NOTE: the peer's address is known only inside the call, so the handler is wrapped (a response stream
    passes through one more generator); only a cluster with neither token nor mutual TLS pays for it."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        original = (
            handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary
        )
        if inspect.isasyncgenfunction(original):

            async def behavior(request, context):
                await _refuse_unless_loopback(context)
                async for response in original(request, context):
                    yield response

        else:

            async def behavior(request, context):
                await _refuse_unless_loopback(context)
                return await original(request, context)

        return _handler_like(handler, behavior)


@dataclass(slots=True)
class ServiceTLSFields:
    """The flags that secure a gRPC service's links (the scheduler, a worker), TLS and the cluster
    token, as config fields: its config inherits them, so `add_tls_arguments` fills them and `tls` and
    `cluster_auth` read them in one place."""

    # TLS on the service and on the channels it opens (see TLSConfig).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_require_client_cert: bool = False
    # File holding the cluster token (None: PAGEDSERVE_CLUSTER_TOKEN, or no token); see ClusterAuth.
    cluster_token_file: str | None = None

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig(self.tls_cert, self.tls_key, self.tls_ca, self.tls_require_client_cert)

    @property
    def cluster_auth(self) -> ClusterAuth:
        return ClusterAuth.load(self.cluster_token_file)


def add_tls_arguments(add, add_bool) -> None:
    """The four TLS flags and --cluster-token-file, through a service's own `add(flag, convert, help)` /
    `add_bool` helpers."""
    add("--tls-cert", str, "PEM certificate for TLS on the internal gRPC links")
    add("--tls-key", str, "PEM private key of --tls-cert")
    add("--tls-ca", str, "PEM CA that peers' certificates must chain to")
    add_bool(
        "--tls-require-client-cert", "mutual TLS: refuse clients without a certificate from --tls-ca", False
    )
    add_cluster_token_argument(add)


def add_cluster_token_argument(add) -> None:
    add(
        "--cluster-token-file",
        str,
        f"file holding the token internal calls carry (or set {CLUSTER_TOKEN_ENV} to the token itself)",
    )


def listen(server: grpc.aio.Server, address: str, tls: TLSConfig = PLAINTEXT) -> int:
    """Open address on server, with TLS when tls has a certificate; returns the bound port (0: failed)."""
    if tls.cert is not None:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)


def internal_server(auth: ClusterAuth, tls: TLSConfig = PLAINTEXT) -> grpc.aio.Server:
    """A server for an internal service (the Engine, a Worker): members only (see ClusterAuth), messages
    up to INTERNAL_MAX_MESSAGE_BYTES."""
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=auth.server_interceptors(tls))


def public_server(max_message_bytes: int) -> grpc.aio.Server:
    """A server for the public API: anyone may connect (the API keys are checked by the service itself);
    a request larger than max_message_bytes is refused with RESOURCE_EXHAUSTED before it is parsed."""
    return grpc.aio.server(options=server_options(max_message_bytes))


class _CallWithMetadata:
    """A channel's multi-callable whose calls carry `extra` metadata after the caller's own."""

    __slots__ = ("_call", "_extra")

    def __init__(self, call, extra: tuple[tuple[str, str], ...]):
        self._call = call
        self._extra = extra

    def _metadata(self, metadata) -> tuple:
        return (*(metadata or ()), *self._extra)

    def __call__(self, *args, metadata=None, **kwargs):
        return self._call(*args, metadata=self._metadata(metadata), **kwargs)

    def with_call(self, *args, metadata=None, **kwargs):
        return self._call.with_call(*args, metadata=self._metadata(metadata), **kwargs)

    def future(self, *args, metadata=None, **kwargs):
        return self._call.future(*args, metadata=self._metadata(metadata), **kwargs)


class _ChannelWithMetadata:
    """A channel (asyncio or blocking) whose every call carries `extra` metadata: the cluster token.

    NOTE: not a grpc.aio client interceptor: an intercepted stream call passes each write through a
    queue and two tasks, and the scheduler's Steps stream to a worker is the hot path. This adds one
    function call per call, none per message."""

    def __init__(self, channel, extra: tuple[tuple[str, str], ...]):
        self._channel = channel
        self._extra = extra

    def unary_unary(self, *args, **kwargs):
        return _CallWithMetadata(self._channel.unary_unary(*args, **kwargs), self._extra)

    def unary_stream(self, *args, **kwargs):
        return _CallWithMetadata(self._channel.unary_stream(*args, **kwargs), self._extra)

    def stream_unary(self, *args, **kwargs):
        return _CallWithMetadata(self._channel.stream_unary(*args, **kwargs), self._extra)

    def stream_stream(self, *args, **kwargs):
        return _CallWithMetadata(self._channel.stream_stream(*args, **kwargs), self._extra)

    def __getattr__(self, name: str):
        return getattr(self._channel, name)

    async def __aenter__(self):
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, *exc_info):
        return await self._channel.__aexit__(*exc_info)

    def __enter__(self):
        self._channel.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._channel.__exit__(*exc_info)


def _with_auth(channel, auth: ClusterAuth):
    return _ChannelWithMetadata(channel, auth.call_metadata) if auth.token is not None else channel


def open_channel(
    address: str, tls: TLSConfig = PLAINTEXT, options=None, auth: ClusterAuth = NO_CLUSTER_AUTH
) -> grpc.aio.Channel:
    """An asyncio channel to address, TLS when tls is enabled, every call carrying auth's token."""
    options = CHANNEL_OPTIONS if options is None else options
    if tls.enabled:
        channel = grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    else:
        channel = grpc.aio.insecure_channel(address, options=options)
    return _with_auth(channel, auth)


def open_sync_channel(
    address: str, tls: TLSConfig = PLAINTEXT, options=None, auth: ClusterAuth = NO_CLUSTER_AUTH
) -> grpc.Channel:
    """A blocking channel to address, TLS when tls is enabled, every call carrying auth's token."""
    options = CHANNEL_OPTIONS if options is None else options
    if tls.enabled:
        channel = grpc.secure_channel(address, tls.channel_credentials(), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    return _with_auth(channel, auth)


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
