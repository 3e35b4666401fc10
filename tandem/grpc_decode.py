"""Request messages decoded so that a malformed body is the handler's to refuse (INVALID_ARGUMENT, one line), not
gRPC's: a deserializer that raises answers UNKNOWN naming the exception's class and logs a traceback per call — which a
client without credentials could repeat at will (an API-key check runs after the body is decoded)."""

from __future__ import annotations

from google.protobuf.message import DecodeError

MALFORMED = object()  # what ``tolerant``'s deserializer gives for bytes that are not the message


def tolerant(cls):
    """A request deserializer for the protobuf message class ``cls`` that returns MALFORMED instead of raising."""

    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError:
            return MALFORMED

    return parse
