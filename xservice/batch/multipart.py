"""A small ``multipart/form-data`` parser for ``POST /v1/files`` (the body is already buffered).

Stdlib only, so the service does not need ``python-multipart``.
"""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message
from email.parser import HeaderParser
from email.utils import collapse_rfc2231_value

from xservice.http.errors import InvalidRequestError


@dataclass
class FormField:
    name: str
    data: bytes
    filename: str | None = None


def _boundary(content_type: str) -> bytes:
    msg = Message()
    msg["content-type"] = content_type
    if msg.get_content_type() != "multipart/form-data":
        raise InvalidRequestError(
            "Upload files as 'multipart/form-data' with fields 'file' and 'purpose'.", code="invalid_body"
        )
    boundary = msg.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise InvalidRequestError("The multipart Content-Type has no boundary.", code="invalid_body")
    return boundary.encode("latin-1")


def parse_form(body: bytes, content_type: str) -> dict[str, FormField]:
    """The form's fields by name (the first of repeated names wins).

    Parts are located with ``find`` and each field's data is copied once: an upload of ~100 MB is
    scanned, not split and re-sliced (each copy of it holds the GIL for tens of milliseconds)."""
    delimiter = b"--" + _boundary(content_type)
    starts = []
    at = body.find(delimiter)
    while at != -1:
        starts.append(at + len(delimiter))
        at = body.find(delimiter, at + len(delimiter))
    if len(starts) < 2:
        raise InvalidRequestError("Malformed multipart body.", code="invalid_body")
    ends = [at - len(delimiter) for at in starts[1:]] + [len(body)]
    fields: dict[str, FormField] = {}
    for start, end in zip(starts, ends):
        if body.startswith(b"--", start):
            break  # the closing delimiter
        field = _field(body, start, end)
        if field is not None:
            fields.setdefault(field.name, field)
    return fields


def _field(body: bytes, start: int, end: int) -> FormField | None:
    """The part of ``body`` between ``start`` and ``end`` (after its delimiter, before the next)."""
    if body.startswith(b"\r\n", start):
        start += 2
    sep = body.find(b"\r\n\r\n", start, end)
    if sep == -1:
        raise InvalidRequestError("Malformed multipart body.", code="invalid_body")
    try:  # part headers are UTF-8 (RFC 7578), e.g. a non-ASCII filename
        headers = HeaderParser().parsestr(body[start:sep].decode("utf-8") + "\r\n\r\n")
    except UnicodeDecodeError:
        raise InvalidRequestError("Multipart part headers must be UTF-8.", code="invalid_body") from None
    name = headers.get_param("name", header="content-disposition")
    if not isinstance(name, str):
        return None
    data_end = end - 2 if body.endswith(b"\r\n", sep + 4, end) else end
    filename = _filename(headers.get_param("filename", header="content-disposition"))
    return FormField(name, body[sep + 4 : data_end], filename)


def _filename(value: str | tuple[str, str, str] | None) -> str | None:
    """A part's filename as text (an RFC 2231 ``filename*=`` value decoded)."""
    return collapse_rfc2231_value(value) if isinstance(value, tuple) else value
