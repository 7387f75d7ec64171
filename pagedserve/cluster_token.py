"""`pagedserve cluster-token`: write a random cluster token into a file, once (compose's `cluster-init`).

    pagedserve cluster-token --cluster-token-file /var/lib/pagedserve/cluster-token

The scheduler, the workers and the gateway then read the same file (`--cluster-token-file`, or
PAGEDSERVE_CLUSTER_TOKEN_FILE): only callers that send the token may use the Engine and Worker
services (see grpc_utils.ClusterAuth). A file that already holds a token is kept, so a redeployed
stack keeps the token its running services know. The token is never printed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

from pagedserve.flags import EnvFlags
from pagedserve.grpc_utils import ClusterAuth, add_cluster_token_argument
from pagedserve.logging import configure_logging, get_logger

log = get_logger("pagedserve.cluster_token")

TOKEN_BYTES = 32


def build_parser(env) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve cluster-token",
        description="Write a random cluster token into a file unless it holds one already.",
    )
    add_cluster_token_argument(EnvFlags(parser, env).add)
    parser.add_argument("--log-level", default=env.get("PAGEDSERVE_LOG_LEVEL", "info"))
    return parser


def write_once(path: Path) -> bool:
    """Write a new token into path (mode 0600) unless it holds a valid one; whether one was written."""
    if path.is_file() and path.read_text().strip():
        ClusterAuth.load(str(path), env={})  # a file that is there must hold a usable token
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: created with its mode, never readable by others even for a moment.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(os.environ).parse_args(argv)
    configure_logging("cluster-token", args.log_level)
    if not args.cluster_token_file:
        log.error(
            "cluster_token_failed", error="--cluster-token-file (or PAGEDSERVE_CLUSTER_TOKEN_FILE) is needed"
        )
        return 2
    path = Path(args.cluster_token_file)
    try:
        written = write_once(path)
    except (OSError, ValueError) as error:
        log.error("cluster_token_failed", path=str(path), error=str(error))
        return 1
    log.info("cluster_token_written" if written else "cluster_token_kept", path=str(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
