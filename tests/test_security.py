"""Security on a real stack: mutual TLS on every internal link (a plaintext client is refused), also as
`pagedserve serve --internal-tls` sets it up; API keys compared in constant time with one prefix-cache
partition per key, request limits with clear 4xx errors (and gRPC's own limit on message size); and
model loading that never unpickles."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import httpx
import pytest
from stack_testing import Stack, assert_openai_error, running, wait_for

from pagedserve.grpc_utils import TLSConfig, open_sync_channel
from pagedserve.internal_tls import generate
from pagedserve.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    text_generation_pb2,
    text_generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
# Long enough for several full blocks (block size 16) of shared prefix.
SHARED_PROMPT = "You are a careful assistant. " * 12 + "Answer briefly:"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def stack(default_model_dir, tmp_path_factory, certs):
    tls_args = ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key), "--tls-ca", str(certs.ca)]
    stack = Stack(
        default_model_dir,
        tmp_path_factory.mktemp("security-logs"),
        num_workers=1,
        tls_args=[*tls_args, "--tls-require-client-cert"],
        client_tls=TLSConfig(str(certs.cert), str(certs.key), str(certs.ca)),
        gateway_args=["--api-keys", f"{KEY_A},{KEY_B}", "--max-body-bytes", "100000"],
    )
    with running(stack):
        yield stack


def _client(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.http_url, timeout=60, headers={"Authorization": f"Bearer {key}"})


@pytest.mark.slow
def test_stack_with_mutual_tls_serves(stack):
    with _client(stack, KEY_A) as client:
        response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_plaintext_and_certificateless_clients_are_refused_by_the_scheduler(stack, certs):
    with grpc.insecure_channel(stack.engine_address) as channel, pytest.raises(grpc.RpcError) as info:
        engine_pb2_grpc.EngineServiceStub(channel).GetStats(engine_pb2.GetStatsRequest(), timeout=3)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # TLS that trusts the CA but shows no client certificate: mutual TLS refuses it too.
    no_cert = TLSConfig(ca=str(certs.ca))
    with open_sync_channel(stack.engine_address, no_cert) as channel, pytest.raises(grpc.RpcError):
        engine_pb2_grpc.EngineServiceStub(channel).GetStats(engine_pb2.GetStatsRequest(), timeout=3)
    assert stack.engine_stats().workers[0].healthy  # and the real client gets in


@pytest.mark.slow
def test_wrong_or_missing_key_is_401(stack):
    for headers in ({"Authorization": "Bearer nope"}, {}, {"Authorization": f"Basic {KEY_A}"}):
        response = httpx.post(f"{stack.http_url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert assert_openai_error(response, 401)["code"] == "invalid_api_key"


def _hits(stack: Stack) -> int:
    return stack.engine_stats().prefix_cache_hits


@pytest.mark.slow
def test_tenants_never_share_cached_blocks_but_one_tenant_does(stack):
    body = {"prompt": SHARED_PROMPT, "max_tokens": 2}
    with _client(stack, KEY_A) as a, _client(stack, KEY_B) as b:
        start = _hits(stack)
        first = a.post("/v1/completions", json=body).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Another tenant with the very same prompt: no hit (nothing to learn from its latency).
        other = b.post("/v1/completions", json=body).json()
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert _hits(stack) == start
        # An explicit cache_salt cannot reach into another tenant's partition either.
        salted = b.post("/v1/completions", json={**body, "cache_salt": "x"}).json()
        assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert _hits(stack) == start
        # The same tenant again: its own blocks are reused.
        again = a.post("/v1/completions", json=body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert _hits(stack) > start
        # Within a tenant, a different cache_salt is a different partition.
        a_salted = a.post("/v1/completions", json={**body, "cache_salt": "private"}).json()
        assert a_salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.slow
def test_two_tenants_reusing_one_request_id_never_reach_each_others_request(stack):
    """Both run side by side under the id they chose; tenant A's request ends early (its client gone, so
    the gateway aborts it) and tenant B's, same id, is served whole."""

    def generate(stub, key: str, max_tokens: int):
        request = text_generation_pb2.GenerateRequest(
            prompt="Hello",
            request_id="same",
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        return stub.Generate(request, metadata=[("authorization", f"Bearer {key}")], timeout=60)

    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = text_generation_pb2_grpc.TextGenerationServiceStub(channel)
        a = generate(stub, KEY_A, 400)
        assert next(a).request_id == "same"
        b = generate(stub, KEY_B, 16)
        got = [next(b)]
        a.cancel()
        got += list(b)
    assert {m.request_id for m in got} == {"same"}
    assert got[-1].usage.completion_tokens == 16 == sum(len(m.token_ids) for m in got)
    wait_for(lambda: stack.engine_stats().num_requests_running == 0, 30, "tenant A's request still runs")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"prompt": "x", "stop": ["y" * 257]}, "stop"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "word " * 9000, "max_tokens": 1}, "prompt"),
        ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ],
)
def test_request_limits_are_clear_400s(stack, body, param):
    with _client(stack, KEY_A) as client:
        response = client.post("/v1/completions", json=body)
    error = assert_openai_error(response, 400)
    assert error["param"] == param, error


@pytest.mark.slow
def test_body_over_the_limit_is_413(stack):
    with _client(stack, KEY_A) as client:
        response = client.post("/v1/completions", json={"prompt": "x" * 200_000})
    assert_openai_error(response, 413)


@pytest.mark.slow
def test_grpc_request_over_the_body_limit_is_refused_by_grpc_itself(stack):
    # The public gRPC server takes messages up to --max-body-bytes (100000 here), as the HTTP API does.
    key = (("authorization", f"Bearer {KEY_A}"),)
    sampling = common_pb2.SamplingParams(max_tokens=2)
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = text_generation_pb2_grpc.TextGenerationServiceStub(channel)
        too_large = text_generation_pb2.GenerateRequest(prompt="x" * 100_001, sampling=sampling)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(too_large, metadata=key, timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in info.value.details()
        small = text_generation_pb2.GenerateRequest(prompt="Hello", sampling=sampling)
        assert list(stub.Generate(small, metadata=key, timeout=60))


def test_api_keys_compare_in_constant_time_and_map_to_distinct_tenants(monkeypatch):
    import hmac

    from pagedserve.gateway import auth
    from pagedserve.gateway.auth import ApiKeys, combined_salt

    # Every check compares the token with every key, each through hmac.compare_digest (whose time does not
    # depend on where the bytes differ), and never stops at the first match: the time taken tells nothing
    # of the key, nor of which key matched.
    compared: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", compare_digest)
    keys = ApiKeys([KEY_A, KEY_B])
    for token in (KEY_A.encode(), KEY_B.encode(), b"tenant-a-ke", b"x" * 100, b""):
        compared.clear()
        keys.tenant(token)
        assert [b for _, b in compared] == [KEY_A.encode(), KEY_B.encode()] and {a for a, _ in compared} == {
            token
        }
    monkeypatch.undo()

    a, b = keys.tenant(KEY_A.encode()), keys.tenant(KEY_B.encode())
    assert a and b and a != b and KEY_A not in a
    assert keys.tenant(b"tenant-a-ke") is None and keys.tenant(b"") is None
    assert keys.tenant_from_header(f"Bearer {KEY_B}") == b
    assert combined_salt(a, "s") != combined_salt(b, "s") != combined_salt("", "s")
    assert ApiKeys([]).tenant(b"anything") == ""
    assert (keys.tag(a), keys.tag(b), ApiKeys([]).tag("")) == ("t0", "t1", "")


def test_a_folder_with_only_pickle_weights_is_refused(tmp_path: Path, default_model_dir: Path):
    import torch

    from pagedserve.worker_svc.loader import load_model

    (tmp_path / "config.json").write_text((default_model_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled, ever")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin: pickle checkpoints are not loaded"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_tls_flags_must_go_together(tmp_path: Path):
    with pytest.raises(ValueError, match="go together"):
        TLSConfig(cert=str(tmp_path / "c.pem"))
    with pytest.raises(ValueError, match="needs --tls-ca"):
        TLSConfig(require_client_cert=True)
    assert json.dumps(TLSConfig().enabled) == "false"


def _stats(channel) -> engine_pb2.EngineStats:
    return engine_pb2_grpc.EngineServiceStub(channel).GetStats(engine_pb2.GetStatsRequest(), timeout=5).stats


def _model_info(channel) -> worker_pb2.ModelInfo:
    return (
        worker_pb2_grpc.WorkerServiceStub(channel)
        .GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=5)
        .info
    )


def _refused(address: str, tls: TLSConfig, auth, call=_stats) -> grpc.RpcError:
    with open_sync_channel(address, tls, auth=auth) as channel, pytest.raises(grpc.RpcError) as info:
        call(channel)
    return info.value


@pytest.mark.slow
def test_serve_with_internal_tls_serves_and_refuses_clients_without_a_certificate(
    default_model_dir, tmp_path
):
    args = ["--internal-tls", "--dtype", "float32", "--num-blocks", "64", "--log-level", "warning"]
    with running(Stack(default_model_dir, tmp_path, serve_args=args)) as stack:
        # The banner names the throwaway CA's folder (the launcher's certificate and key are there).
        folder = Path(re.search(r"certificates in (\S+)\)", stack.stdout_path.read_text()).group(1))
        ca, cert, key = (str(folder / name) for name in ("ca.pem", "cert.pem", "key.pem"))
        # End to end: the gateway reaches the scheduler, the scheduler its worker, over mutual TLS.
        response = httpx.post(
            f"{stack.http_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=120
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
        # Neither plaintext nor TLS without a client certificate gets past the handshake, token or not.
        for tls in (TLSConfig(), TLSConfig(ca=ca)):
            assert (
                _refused(stack.engine_address, tls, stack.client_auth).code() == grpc.StatusCode.UNAVAILABLE
            )
        # A client with the launcher's certificate is a member.
        stack.client_tls = TLSConfig(cert, key, ca)
        (worker,) = stack.engine_stats().workers
        assert worker.healthy
        # The worker refuses them the same way.
        for tls in (TLSConfig(), TLSConfig(ca=ca)):
            refused = _refused(worker.address, tls, stack.client_auth, _model_info)
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert not folder.exists(), "the throwaway CA goes with the stack"
