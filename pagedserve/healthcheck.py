"""`pagedserve healthcheck`: exit 0 when a service reports healthy, 1 when not (container health checks).

    pagedserve healthcheck --grpc localhost:50052                 grpc.health.v1 Check, "" = whole server
    pagedserve healthcheck --grpc localhost:50061 --service pagedserve.v1.WorkerService
    pagedserve healthcheck --http http://localhost:8000/ready    any 2xx answer

It imports grpc alone (no torch, no transformers): Docker runs it every few seconds in every container.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence


def check_grpc(address: str, service: str, timeout: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as error:
            return False, f"{error.code().name}: {error.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, status


def check_http(url: str, timeout: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return 200 <= response.status < 300, f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        return False, f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:
        return False, str(getattr(error, "reason", error))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve healthcheck",
        description="Exit 0 when the service is healthy (gRPC SERVING or HTTP 2xx), 1 otherwise.",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT", help="ask grpc.health.v1 at this address")
    target.add_argument("--http", metavar="URL", help="GET this URL; healthy on a 2xx answer")
    parser.add_argument("--service", default="", help='gRPC service name to ask about ("": the whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds before giving up")
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.grpc:
        healthy, detail = check_grpc(args.grpc, args.service, args.timeout)
        target = args.grpc + (f" ({args.service})" if args.service else "")
    else:
        healthy, detail = check_http(args.http, args.timeout)
        target = args.http
    if not args.quiet:
        print(f"{target}: {'healthy' if healthy else 'unhealthy'} ({detail})")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
