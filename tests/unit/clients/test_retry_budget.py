"""The client's retry budget (gRPC's retry throttling) and its jittered backoff, without a server."""

from __future__ import annotations

import random
import threading

import grpc
import pytest

from celeris_client import CelerisClient, Overloaded, RetryPolicy, Unavailable
from celeris_client.errors import CelerisError, RetryBudget, is_retryable
from tests.unit.client_fakes import FakeCall, FakeRpcError, client_with, retry_info, snap

UNAVAILABLE = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")


def test_the_budget_allows_retries_only_while_more_than_half_its_tokens_are_left():
    b = RetryBudget(max_tokens=10, token_ratio=0.5)
    assert [b.failed() for _ in range(6)] == [True] * 4 + [False] * 2  # 9 8 7 6 | 5 4
    b.succeeded()  # 4.5: still no retry after the next failure
    assert not b.failed()
    for _ in range(20):
        b.succeeded()
    assert b.tokens == 10  # capped
    with pytest.raises(ValueError):
        RetryBudget(max_tokens=0)


def test_a_run_of_failing_calls_makes_at_most_n_plus_half_the_tokens_attempts():
    calls = 50
    c, stub = client_with([FakeCall([], UNAVAILABLE)] * (3 * calls))  # FAST: 3 attempts a call
    for _ in range(calls):
        with pytest.raises(Unavailable):
            c.generate("hi")
    retries = len(stub.made) - calls
    assert retries < c.retry.max_tokens / 2  # today's client made 2 retries a call: 100
    assert c.budget.tokens == 0


def test_successes_refill_the_budget_by_the_token_ratio():
    c, stub = client_with([FakeCall([], UNAVAILABLE)] * 15)
    for _ in range(5):  # after 5 failures the budget is at half: no more retries
        with pytest.raises(Unavailable):
            c.generate("hi")
    made = len(stub.made)
    assert made == 3 + 2 + 1 + 1 + 1  # FAST allows 3 attempts a call
    stub.calls = [FakeCall([snap(1), snap(2, done=True)])] * 20
    for _ in range(20):
        c.generate("hi")
    assert c.budget.tokens == pytest.approx(10 - made + 20 * c.retry.token_ratio)


def test_threads_sharing_one_client_share_one_budget():
    class Refusing:
        def __init__(self):
            self.made, self.lock = 0, threading.Lock()

        def Generate(self, request, timeout=None, metadata=()):
            with self.lock:
                self.made += 1
            return FakeCall([], FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_info(0.001)))

    c = CelerisClient("127.0.0.1:1", retry=RetryPolicy(max_attempts=5, initial_backoff_s=0.001, max_backoff_s=0.002))
    c._stub = stub = Refusing()
    threads, calls = [], 64

    def call() -> None:
        with pytest.raises(Overloaded):
            c.generate("hi")

    threads = [threading.Thread(target=call) for _ in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls <= stub.made < calls + c.retry.max_tokens / 2  # no budget: up to 5 x 64
    c.close()


def test_clients_can_share_a_budget():
    shared = RetryBudget()
    a, b = (CelerisClient("127.0.0.1:1", budget=shared) for _ in range(2))
    assert a.budget is b.budget is shared
    assert CelerisClient("127.0.0.1:1").budget is not CelerisClient("127.0.0.1:1").budget


def test_backoff_is_jittered_exponential_with_the_servers_delay_as_a_floor():
    rng = random.Random(1)
    p = RetryPolicy(max_attempts=9, initial_backoff_s=0.1, max_backoff_s=3.0)
    told = Overloaded(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", retry_after=0.5)
    for attempt in range(1, 9):
        delays = [p.delay(told, attempt, rng) for _ in range(200)]
        cap = min(3.0, 0.1 * 2 ** (attempt - 1))
        assert min(delays) >= 0.5 and max(delays) <= max(cap, 0.6)
        assert len(set(delays)) > 100  # jittered: no two clients told alike come back together
    plain = Unavailable(grpc.StatusCode.UNAVAILABLE, "x")
    assert max(p.delay(plain, 8, rng) for _ in range(200)) > 1.0  # backoff grows past the first caps
    assert not is_retryable(CelerisError(grpc.StatusCode.CANCELLED, "Channel closed!"))
    assert is_retryable(CelerisError(grpc.StatusCode.CANCELLED, "CANCELLED"))


def test_batch_waits_out_a_restart_within_its_window_only():
    from celeris_client.batch import FIRST_WAIT_S, MAX_WAIT_S, restart_wait

    refused = Unavailable(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    for attempt in range(8):
        cap = min(MAX_WAIT_S, FIRST_WAIT_S * 2 ** attempt)
        assert cap / 2 <= restart_wait(refused, attempt, left_s=60) <= cap
    assert restart_wait(refused, 8, left_s=1.0) is None  # the window is spent
    told = Overloaded(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_after=7.0)
    assert restart_wait(told, 0, left_s=60) == 7.0  # the server's delay is a floor
    bad = CelerisError(grpc.StatusCode.INVALID_ARGUMENT, "steps")
    assert restart_wait(bad, 0, left_s=60) is None
