"""The API definition: stubs up to date, buf lint clean, messages round-trip."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[3]
PROTOS = ROOT / "protos"
STUB_DIR = ROOT / "clients" / "celeris" / "v1"  # shipped by the client distribution
PROTO = "celeris/v1/generation.proto"
STUBS = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")


# Stamps of the generator's own version. The committed stubs carry the oldest versions the
# client distribution accepts (grpcio's stub refuses an older grpcio at import), so a newer
# grpcio-tools on the test machine must not count as a change.
STAMPS = (re.compile(rb"GRPC_GENERATED_VERSION = '[^']*'"),
          re.compile(rb"# Protobuf Python Version: \S+"),
          re.compile(rb"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,"))


def _unstamped(code: bytes) -> bytes:
    for stamp in STAMPS:
        code = stamp.sub(lambda m: (m.group(1) if m.groups() else b"") + b"<version>", code)
    return code


def _minimum(requirement: str) -> tuple[int, ...]:
    text = (ROOT / "clients" / "pyproject.toml").read_text()
    found = re.search(rf'"{requirement}>=([\d.]+)"', text)
    assert found, f"clients/pyproject.toml declares no minimum {requirement}"
    return tuple(map(int, found.group(1).split(".")))


def test_regenerating_stubs_changes_nothing(tmp_path: Path) -> None:
    # Same command as scripts/gen_protos.sh, written into a temp dir instead.
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc", "-I", str(PROTOS),
        f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}", str(PROTOS / PROTO),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    fresh = {name: (tmp_path / "celeris" / "v1" / name).read_bytes() for name in STUBS}
    committed = {name: (STUB_DIR / name).read_bytes() for name in STUBS}
    if _stamps(fresh) != _stamps(committed):  # another generator: its code may differ, the API may not
        assert _api(fresh) == _api(committed), "the stubs are stale: run scripts/gen_protos.sh"
        return
    for name in STUBS:
        assert _unstamped(fresh[name]) == _unstamped(committed[name]), f"{name} is stale: run scripts/gen_protos.sh"


def _stamps(stubs: dict[str, bytes]) -> list[bytes]:
    return [m.group(0) for code in stubs.values() for stamp in STAMPS for m in stamp.finditer(code)]


def _api(stubs: dict[str, bytes]) -> tuple:
    """What the stubs define, whatever generator wrote them: the file's serialized descriptor
    (messages, fields, services) and the RPC paths the gRPC stub binds."""
    descriptor = re.search(rb"AddSerializedFile\((b'(?:[^'\\]|\\.)*')\)", stubs["generation_pb2.py"])
    paths = sorted(set(re.findall(rb"'(/celeris\.v1\.\w+/\w+)'", stubs["generation_pb2_grpc.py"])))
    return ast.literal_eval(descriptor.group(1).decode("ascii")), paths


def test_stubs_accept_the_oldest_declared_grpcio_and_protobuf() -> None:
    grpc_stub = (STUB_DIR / "generation_pb2_grpc.py").read_text()
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub).group(1)
    assert tuple(map(int, grpc_version.split("."))) <= _minimum("grpcio")
    pb_stub = (STUB_DIR / "generation_pb2.py").read_text()
    pb_version = re.search(r"# Protobuf Python Version: ([\d.]+)", pb_stub).group(1)
    assert tuple(map(int, pb_version.split("."))) <= _minimum("protobuf")
    assert _unstamped(b"GRPC_GENERATED_VERSION = '1.99.0'") == b"<version>"


@pytest.mark.skipif(shutil.which("buf") is None, reason="buf binary not installed")
def test_buf_lint_is_clean() -> None:
    result = subprocess.run(
        ["buf", "lint"], cwd=PROTOS, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def _full_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id="req-1",
        chat=pb.ChatMessages(
            messages=[
                pb.ChatMessage(role="system", content="Be brief."),
                pb.ChatMessage(role="user", content="Hi"),
            ]
        ),
        gen_length=128,
        steps=64,
        block_length=32,
        temperature=0.0,  # zero is meaningful: greedy, still "set"
        remasking=pb.REMASKING_MARGIN,
        threshold=0.9,
        factor=1.0,
        cfg_scale=0.0,
        seed=0,
        stream_options=pb.StreamOptions(
            mode=pb.STREAM_MODE_EVERY_K_STEPS, every_k_steps=4
        ),
    )


OPTIONAL_KNOBS = (
    "gen_length", "steps", "block_length", "temperature",
    "threshold", "factor", "cfg_scale", "seed",
)


def test_generate_request_round_trip() -> None:
    request = _full_request()
    parsed = pb.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request
    assert parsed.WhichOneof("input") == "chat"
    assert [m.role for m in parsed.chat.messages] == ["system", "user"]
    assert parsed.remasking == pb.REMASKING_MARGIN
    assert parsed.stream_options.every_k_steps == 4
    assert parsed.threshold == pytest.approx(0.9)
    # Optional knobs set to zero are still present after the round trip.
    for knob in OPTIONAL_KNOBS:
        assert parsed.HasField(knob), knob


def test_unset_optional_knobs_are_absent() -> None:
    parsed = pb.GenerateRequest.FromString(
        pb.GenerateRequest(prompt="hello").SerializeToString()
    )
    assert parsed.WhichOneof("input") == "prompt"
    for knob in OPTIONAL_KNOBS:
        assert not parsed.HasField(knob), knob
    assert parsed.remasking == pb.REMASKING_UNSPECIFIED
    assert parsed.stream_options.mode == pb.STREAM_MODE_UNSPECIFIED


def test_oneof_input_keeps_the_last_one_set() -> None:
    request = pb.GenerateRequest(prompt="hello")
    request.token_ids.ids.extend([1, 2, 3])
    assert request.WhichOneof("input") == "token_ids"
    assert not request.HasField("prompt")


def test_final_response_round_trip() -> None:
    response = pb.GenerateResponse(
        request_id="req-1", step=64, total_steps=64, block_index=3, num_blocks=4,
        text="Hello",
        tokens=[pb.Token(id=7, text="Hello", committed_this_step=True, confidence=0.5)],
        committed_positions=[0], committed_confidences=[0.5], done=True,
        finish_reason=pb.FINISH_REASON_STOP, seed=42,
        usage=pb.Usage(prompt_tokens=5, generated_tokens=1, forward_passes=64),
        elapsed=Duration(seconds=1, nanos=500_000_000),
    )
    parsed = pb.GenerateResponse.FromString(response.SerializeToString())
    assert parsed == response
    assert parsed.elapsed.ToTimedelta().total_seconds() == pytest.approx(1.5)


def test_service_methods() -> None:
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "GetModelInfo", "Tokenize"}
    assert methods["Generate"].server_streaming
    assert not methods["Generate"].client_streaming
    assert not methods["GetModelInfo"].server_streaming
    # The grpc stubs import the messages as celeris.v1... and expose both sides.
    assert hasattr(pb_grpc, "GenerationServiceStub")
    assert hasattr(pb_grpc, "add_GenerationServiceServicer_to_server")
