"""A small ``multipart/form-data`` parser for ``POST /v1/files`` (the body is already buffered).

Stdlib only, so the service does not need ``python-multipart``.
"""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message
from email.parser import HeaderParser
from email.utils import collapse_rfc2231_value

from xservice.errors import InvalidRequestError


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
    """The form's fields by name (the first of repeated names wins)."""
    delimiter = b"--" + _boundary(content_type)
    parts = body.split(delimiter)
    if len(parts) < 3:
        raise InvalidRequestError("Malformed multipart body.", code="invalid_body")
    fields: dict[str, FormField] = {}
    for part in parts[1:]:
        if part.startswith(b"--"):
            break  # the closing delimiter
        head, sep, data = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            raise InvalidRequestError("Malformed multipart body.", code="invalid_body")
        try:  # part headers are UTF-8 (RFC 7578), e.g. a non-ASCII filename
            headers = HeaderParser().parsestr(head.decode("utf-8") + "\r\n\r\n")
        except UnicodeDecodeError:
            raise InvalidRequestError("Multipart part headers must be UTF-8.", code="invalid_body") from None
        name = headers.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        filename = _filename(headers.get_param("filename", header="content-disposition"))
        fields.setdefault(name, FormField(name, data.removesuffix(b"\r\n"), filename))
    return fields


def _filename(value: str | tuple[str, str, str] | None) -> str | None:
    """A part's filename as text (an RFC 2231 ``filename*=`` value decoded)."""
    return collapse_rfc2231_value(value) if isinstance(value, tuple) else value
