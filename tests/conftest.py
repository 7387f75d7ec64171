"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted into the same cache `make serve` uses, so the ~20 s conversion
    happens once per machine, not once per test run."""
    from pagedserve.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer():
    """The gateway's tokenizer of the default model (a module may define its own `tokenizer`)."""
    from pagedserve.gateway.tokenization import Tokenizer
    from pagedserve.model_files import resolve_model

    return Tokenizer.from_model_dir(resolve_model("default"))
