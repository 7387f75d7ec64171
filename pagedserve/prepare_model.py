"""`pagedserve prepare-model`: resolve a model once (convert a GGUF into the cache) and print its folder.

Deployments run it before the services start (compose's one-shot `model-init`), so one process pays
the conversion and the scheduler, gateway and every worker load the finished folder from the shared
cache. (The conversion also takes a file lock, so concurrent starts wait rather than race.)

    pagedserve prepare-model                       the default model into $PAGEDSERVE_CACHE_DIR
    pagedserve prepare-model --model /models/x.gguf --cache-dir /var/cache/pagedserve
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from pagedserve.logging import configure_logging, get_logger

log = get_logger("pagedserve.prepare_model")


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve prepare-model",
        description="Convert the model into the cache (once) and print the folder the services will load.",
    )
    parser.add_argument(
        "--model",
        default=env.get("PAGEDSERVE_MODEL") or None,
        help="model folder, .gguf file, or 'default' (env PAGEDSERVE_MODEL)",
    )
    parser.add_argument(
        "--cache-dir",
        default=env.get("PAGEDSERVE_CACHE_DIR") or None,
        help="where converted models are kept (env PAGEDSERVE_CACHE_DIR)",
    )
    parser.add_argument("--log-level", default=env.get("PAGEDSERVE_LOG_LEVEL", "info"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(os.environ).parse_args(argv)
    configure_logging("prepare-model", args.log_level)
    from pagedserve.model_files import model_name, resolve_model

    try:
        model_dir = resolve_model(args.model, args.cache_dir)
    except (FileNotFoundError, ValueError) as error:
        log.error("prepare_model_failed", error=str(error))
        return 1
    log.info("model_ready", model=model_name(model_dir), path=str(model_dir))
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
