"""The client library without a server: error parsing, retry policy, stream retry rules."""

from __future__ import annotations

import random

import grpc
import pytest
from google.rpc import error_details_pb2

from celeris.v1 import generation_pb2 as pb
from celeris_client import CelerisClient, InvalidArgument, Overloaded, RetryPolicy, Unavailable
from celeris_client.errors import CelerisError, error_from_rpc
from celeris_client.types import build_request
from tests.unit.client_fakes import FakeCall, FakeRpcError, client_with, retry_info, snap


def test_error_from_rpc_parses_bad_request_and_retry_info():
    bad = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field="steps", description="too many")])
    err = error_from_rpc(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "steps: too many", bad))
    assert isinstance(err, InvalidArgument) and err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [(v.field, v.description) for v in err.field_violations] == [("steps", "too many")]
    over = error_from_rpc(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_info(1.5)))
    assert isinstance(over, Overloaded) and over.retry_after == pytest.approx(1.5)


def test_retry_policy_backoff_jitter_and_retry_info():
    rng = random.Random(0)
    p = RetryPolicy(max_attempts=4, initial_backoff_s=0.1, max_backoff_s=0.3)
    unavailable = Unavailable(grpc.StatusCode.UNAVAILABLE, "x")
    delays = [p.delay(unavailable, n, rng) for n in (1, 2, 3)]
    assert all(0 <= d <= cap for d, cap in zip(delays, (0.1, 0.2, 0.3)))
    assert p.delay(unavailable, 4, rng) is None  # attempts exhausted
    told = Overloaded(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", retry_after=2.0)
    assert 2.0 <= p.delay(told, 1, rng) <= 2.4  # never earlier than the server asked
    assert p.delay(InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "x"), 1, rng) is None


def test_stream_retries_before_first_message():
    unavailable = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "restarting")
    c, stub = client_with([FakeCall([], unavailable), FakeCall([snap(1), snap(2, done=True)])])
    out = list(c.stream("hi"))
    assert [s.step for s in out] == [1, 2] and out[-1].done
    assert len(stub.made) == 2


def test_a_call_the_peer_cancelled_is_retried_before_its_first_message_only():
    """CANCELLED read by the client came from the other side (a call crossing a draining server's
    GOAWAY): retried like UNAVAILABLE, and likewise never once a message was delivered."""
    cancelled = FakeRpcError(grpc.StatusCode.CANCELLED, "CANCELLED")
    c, stub = client_with([FakeCall([], cancelled), FakeCall([snap(1), snap(2, done=True)])])
    assert [s.step for s in c.stream("hi")] == [1, 2] and len(stub.made) == 2
    c, stub = client_with([FakeCall([snap(1)], cancelled), FakeCall([snap(1), snap(2, done=True)])])
    with pytest.raises(CelerisError) as e:
        list(c.stream("hi"))
    assert e.value.code == grpc.StatusCode.CANCELLED and len(stub.made) == 1
    for local in ("Locally cancelled by application!", "Channel closed!"):  # grpc's own: never retried
        c, stub = client_with([FakeCall([], FakeRpcError(grpc.StatusCode.CANCELLED, local)),
                               FakeCall([snap(1), snap(2, done=True)])])
        with pytest.raises(CelerisError):
            list(c.stream("hi"))
        assert len(stub.made) == 1


def test_stream_never_replays_a_half_delivered_stream():
    unavailable = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection lost")
    c, stub = client_with([FakeCall([snap(1)], unavailable), FakeCall([snap(1), snap(2, done=True)])])
    got = []
    with pytest.raises(Unavailable):
        for s in c.stream("hi"):
            got.append(s.step)
    assert got == [1] and len(stub.made) == 1


def test_gives_up_after_max_attempts_and_not_on_invalid_argument():
    c, stub = client_with([FakeCall([], FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down")) for _ in range(3)])
    with pytest.raises(Unavailable):
        c.generate("hi")
    assert len(stub.made) == 3
    c, stub = client_with([FakeCall([], FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad"))])
    with pytest.raises(InvalidArgument):
        c.generate("hi")
    assert len(stub.made) == 1


def test_closing_a_stream_cancels_the_call():
    call = FakeCall([snap(1), snap(2, done=True)])
    c, _ = client_with([call])
    it = c.stream("hi")
    next(it)
    it.close()
    assert call.cancelled


def test_bearer_token_metadata_and_final_only_generate():
    c, stub = client_with([FakeCall([snap(2, done=True)])], token="s3cret")
    assert c.generate("hi", steps=2).steps == 2
    request, _, metadata = stub.made[0]
    assert ("authorization", "Bearer s3cret") in metadata
    assert request.stream_options.mode == pb.STREAM_MODE_FINAL_ONLY and request.steps == 2


def test_build_request_inputs_and_knobs():
    assert build_request("x").prompt == "x"
    assert list(build_request([5, 6]).token_ids.ids) == [5, 6]
    chat = build_request([{"role": "user", "content": "hi"}])
    assert chat.chat.messages[0].role == "user"
    r = build_request("x", seed=0, temperature=0.0, remasking="margin")
    assert r.HasField("seed") and r.HasField("temperature") and r.remasking == pb.REMASKING_MARGIN
    assert not build_request("x").HasField("steps")  # unset knobs stay unset: server defaults
    with pytest.raises(TypeError, match="unknown generation knob"):
        build_request("x", stepz=3)
    with pytest.raises(ValueError, match="remasking"):
        build_request("x", remasking="best")


def test_tls_choice():
    assert CelerisClient("localhost:50051").insecure
    assert CelerisClient("[::1]:50051").insecure
    assert not CelerisClient("celeris.example.com:443").insecure
    assert CelerisClient("celeris.example.com:80", insecure=True).insecure


def test_streams_ask_for_deltas_unless_told_otherwise():
    from celeris.v1 import generation_pb2 as pb
    from celeris_client.client import _delta_default
    from celeris_client.types import build_request

    assert build_request("x").stream_options.format == pb.SNAPSHOT_FORMAT_UNSPECIFIED  # raw requests: as before
    assert build_request("x", **_delta_default({})).stream_options.format == pb.SNAPSHOT_FORMAT_DELTA
    assert build_request("x", **_delta_default({"stream_format": "full"})).stream_options.format == pb.SNAPSHOT_FORMAT_FULL
