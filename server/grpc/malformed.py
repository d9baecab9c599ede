"""A request message that does not parse is the client's mistake: INVALID_ARGUMENT naming the
field, logged at warning level. gRPC's own handling of a deserializer that raises is UNKNOWN
("Unexpected <class 'DecodeError'>") and an error in the log, as if the server had failed.

`MalformedInterceptor` swaps each unary-request handler's deserializer for one that never
raises: bytes that do not parse become a `Malformed` record, and the handler's behaviour, wrapped,
aborts the call on it with a BadRequest field violation. The field is found by `wire_fault`, which
walks the wire format along the message's descriptor (protobuf's parser says only that parsing
failed): a string field with bad UTF-8 (`chat.messages[1].content`), a field cut short, or a
broken tag. Streaming-request methods (reflection) are left as they are: their messages arrive
after the behaviour has started.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import grpc
import structlog
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from celeris.engine.errors import FieldViolation, InvalidRequest
from celeris.server.errors import abort

log = structlog.get_logger("celeris.access")
_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = range(6)


@dataclass(frozen=True)
class Malformed:
    """What the safe deserializer returns for bytes that do not parse."""

    field: str  # a field path, or "" when the fault is not inside one
    description: str


def _varint(data: bytes, i: int) -> tuple[int, int]:
    """(value, next index) of the varint at data[i]; IndexError or ValueError when broken."""
    value = shift = 0
    while True:
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def wire_fault(data: bytes, desc: Descriptor, prefix: str = "") -> Optional[Malformed]:
    """The first fault in `data` read as a `desc` message: a field path and what is wrong, or
    None when the walk finds none (protobuf's parser may still refuse it)."""
    i, seen = 0, {}  # field number -> times seen, for repeated fields' indexes
    while i < len(data):
        try:
            key, i = _varint(data, i)
        except (IndexError, ValueError):
            return Malformed(prefix.rstrip("."), "a field tag is cut short or too long")
        number, wire = key >> 3, key & 7
        field = desc.fields_by_number.get(number)
        name = prefix + (field.name if field else f"<field {number}>")
        if field is not None and field.is_repeated:
            name += f"[{seen.get(number, 0)}]"
            seen[number] = seen.get(number, 0) + 1
        try:
            if wire == _VARINT:
                _, i = _varint(data, i)
                continue
            if wire in (_I64, _I32):
                i += 8 if wire == _I64 else 4
                if i > len(data):
                    raise IndexError
                continue
            if wire != _LEN:
                return Malformed(name, f"wire type {wire} is not one protobuf messages use here")
            size, i = _varint(data, i)
        except (IndexError, ValueError):
            return Malformed(name, "the field is cut short")
        body, i = data[i:i + size], i + size
        if i > len(data):
            return Malformed(name, f"the field says {size} bytes, fewer follow")
        if field is not None and field.type == FieldDescriptor.TYPE_STRING:
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as e:
                return Malformed(name, f"not valid UTF-8 (byte {e.start} of the string)")
        elif field is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
            inner = wire_fault(body, field.message_type, name + ".")
            if inner is not None:
                return inner
    return None


def safe_deserializer(message_type: Any) -> Callable[[bytes], Any]:
    """`message_type.FromString`, returning a `Malformed` instead of raising DecodeError."""
    def deserialize(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError:
            return wire_fault(data, message_type.DESCRIPTOR) or Malformed("", "the message does not parse as "
                                                                            + message_type.DESCRIPTOR.full_name)
    return deserialize


class MalformedInterceptor(grpc.aio.ServerInterceptor):
    """Unparsable requests of unary-request methods as INVALID_ARGUMENT (see the module notes)."""

    def __init__(self, message_types: dict[str, Any]):
        self.message_types = message_types  # full method name -> its request message class

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        request_type = self.message_types.get(details.method)
        if handler is None or request_type is None or handler.request_streaming:
            return handler
        method = details.method

        async def refuse(bad: Malformed, context) -> None:
            log.warning("rpc.malformed_request", method=method, peer=context.peer(), field=bad.field,
                        error=bad.description)
            await abort(context, InvalidRequest([FieldViolation(bad.field or "request", bad.description)]))

        inner = handler.unary_stream or handler.unary_unary
        if inspect.isasyncgenfunction(inner):  # Generate: yields its messages
            async def behaviour(request, context):
                if isinstance(request, Malformed):
                    await refuse(request, context)
                async for msg in inner(request, context):
                    yield msg
        else:  # unary, or streaming through context.write (health Watch)
            async def behaviour(request, context):
                if isinstance(request, Malformed):
                    await refuse(request, context)
                return await inner(request, context)
        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.unary_unary_rpc_method_handler
        return make(behaviour, safe_deserializer(request_type), handler.response_serializer)


def request_types(*services: Any) -> dict[str, Any]:
    """Full method name ("/celeris.v1.GenerationService/Generate") -> its request message class,
    for the services' descriptors."""
    from google.protobuf import message_factory

    return {f"/{svc.full_name}/{m.name}": message_factory.GetMessageClass(m.input_type)
            for svc in services for m in svc.methods}
