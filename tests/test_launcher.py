"""`pagedserve serve`'s supervision on real (tiny) child processes, with the clock passed in: a child
that dies is started again with the same arguments after a backoff that doubles, and past
--max-restarts-per-minute the stack stops. The same on a real stack, a worker SIGKILLed mid-stream, is
in test_fault_tolerance.py."""

from __future__ import annotations

import subprocess

import pytest

from pagedserve.launcher import (
    RESTART_WINDOW_S,
    LaunchConfig,
    Supervisor,
    TooManyRestarts,
    build_parser,
    cluster_environment,
    python_command,
)


def exits_with(code: int):
    """A child command factory: each start is `python -c 'exit(code)'`, its arguments echoed to stdout."""

    def command(*args: str) -> list[str]:
        return python_command("-c", f"import sys; print(sys.argv[1:]); sys.exit({code})", *args)

    return command


def wait_dead(supervisor: Supervisor, name: str) -> subprocess.Popen:
    process = supervisor.children[name].process
    assert process is not None
    process.wait(timeout=60)
    return process


def test_a_child_that_dies_starts_again_with_its_arguments_after_a_doubling_backoff():
    supervisor = Supervisor(
        stop_timeout=5, max_restarts_per_minute=3, restart_backoff=0.5, command=exits_with(3)
    )
    supervisor.start("worker-0", ["worker", "--worker-id", "worker-0"])
    child = supervisor.children["worker-0"]
    now, pids = 1000.0, []
    try:
        for delay in (0.5, 1.0, 2.0):
            pids.append(wait_dead(supervisor, "worker-0").pid)
            supervisor.supervise(now)
            assert child.process is None and child.restart_at == now + delay
            supervisor.supervise(now + delay - 0.01)
            assert child.process is None, "not before its backoff"
            now += delay
            supervisor.supervise(now)
            assert child.process is not None and child.process.pid not in pids
            assert child.process.args[-3:] == ["worker", "--worker-id", "worker-0"]
        # A fourth death within the minute is past the limit of three restarts.
        wait_dead(supervisor, "worker-0")
        with pytest.raises(TooManyRestarts, match=r"worker-0 exited with code 3 after 3 restart\(s\)"):
            supervisor.supervise(now + 1)
    finally:
        supervisor.stop()


def test_restarts_older_than_a_minute_no_longer_count():
    supervisor = Supervisor(
        stop_timeout=5, max_restarts_per_minute=1, restart_backoff=1.0, command=exits_with(0)
    )
    supervisor.start("gateway", ["gateway"])
    child = supervisor.children["gateway"]
    try:
        wait_dead(supervisor, "gateway")
        supervisor.supervise(0.0)
        supervisor.supervise(1.0)
        assert len(child.restarts) == 1
        wait_dead(supervisor, "gateway")
        later = 1.0 + RESTART_WINDOW_S + 1
        supervisor.supervise(later)  # the first restart has aged out: allowed, at the first backoff again
        assert child.restart_at == later + 1.0 and not child.restarts
    finally:
        supervisor.stop()


def test_no_restarts_allowed_stops_at_the_first_death():
    supervisor = Supervisor(stop_timeout=5, max_restarts_per_minute=0, command=exits_with(1))
    supervisor.start("scheduler", ["scheduler"])
    try:
        wait_dead(supervisor, "scheduler")
        with pytest.raises(TooManyRestarts, match="scheduler exited with code 1"):
            supervisor.supervise()
    finally:
        supervisor.stop()


def test_a_live_child_is_left_alone_and_stopped_at_the_end():
    sleeps = lambda *args: python_command("-c", "import time; time.sleep(600)")  # noqa: E731
    supervisor = Supervisor(stop_timeout=5, command=sleeps)
    supervisor.start("worker-0", ["worker"])
    process = supervisor.children["worker-0"].process
    supervisor.supervise()
    assert supervisor.children["worker-0"].process is process and process.poll() is None
    supervisor.stop()
    assert process.poll() is not None


def test_supervision_flags_default_to_five_restarts_a_minute():
    config = LaunchConfig(**vars(build_parser().parse_args([])))
    assert (config.max_restarts_per_minute, config.restart_backoff) == (5, 1.0)
    config = LaunchConfig(**vars(build_parser().parse_args(["--max-restarts-per-minute", "0"])))
    assert config.max_restarts_per_minute == 0


def test_children_get_the_configured_token_or_a_random_one_in_their_environment():
    from pagedserve.grpc_utils import ClusterAuth

    env, auth = cluster_environment(
        ClusterAuth("given-token"), {"PAGEDSERVE_CLUSTER_TOKEN_FILE": "/t", "X": "1"}
    )
    assert env == {"PAGEDSERVE_CLUSTER_TOKEN": "given-token", "X": "1"} and auth.token == "given-token"
    first = cluster_environment(ClusterAuth(None), {})[1].token
    second = cluster_environment(ClusterAuth(None), {})[1].token
    assert first and second and first != second and len(first) >= 32
