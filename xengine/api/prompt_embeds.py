"""Prompt embeddings as vLLM takes them (``prompt_embeds``): base64 of ``torch.save(tensor)``, read
without torch and without running any pickle code.

``torch.save`` writes a zip holding ``<name>/data.pkl`` (a pickle that rebuilds the tensor from a
storage) and the storages' raw bytes (``<name>/data/<key>``). ``decode_prompt_embeds`` reads the pickle
with an unpickler that knows only the four names a saved tensor uses (``torch._utils._rebuild_tensor_v2``,
``torch.<Dtype>Storage``, ``collections.OrderedDict``) as inert stand-ins and refuses every other one,
then views the storage bytes with numpy (float32, float16, bfloat16, as vLLM accepts; a leading batch
dimension of 1 dropped). The result is a contiguous float32 ``[tokens, hidden]`` array the engine
takes as it is (``PromptEmbeds``). Every failure is a ``ValueError`` naming ``prompt_embeds``.
Torch-free, so the service can check a request before it reaches the engine.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import pickle
import zipfile
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

_DTYPES = {"FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16"}
_PARAM = "invalid value for 'prompt_embeds'"


class PromptEmbeds(msgspec.Struct, kw_only=True):
    """A prompt given as embeddings: ``num_tokens`` x ``hidden_size`` float32, little-endian, row-major."""

    data: bytes
    num_tokens: int
    hidden_size: int

    def key(self) -> str:
        """The content's name for the prefix cache (identical embeddings share blocks)."""
        return hashlib.blake2b(self.data, digest_size=16).hexdigest()


@dataclass
class _Storage:
    dtype: str
    key: str
    numel: int


@dataclass
class _Tensor:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor without a storage")
    return _Tensor(storage, int(offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a saved tensor")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (
            isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in _DTYPES.values()
        ):
            raise pickle.UnpicklingError(
                "an unsupported storage (the dtype must be float32, float16 or bfloat16)"
            )
        return _Storage(pid[1], str(pid[2]), int(pid[4]))


def decode_prompt_embeds(encoded: str, max_bytes: int) -> PromptEmbeds:
    """The embeddings in ``encoded`` (base64 of ``torch.save(tensor)``); at most ``max_bytes`` of float32."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{_PARAM}: not valid base64") from None
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
        names = archive.namelist()
        pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise ValueError("no data.pkl")
        prefix = pkl[: -len("data.pkl")]
        if prefix + "byteorder" in names and archive.read(prefix + "byteorder") != b"little":
            raise ValueError("big-endian tensors are not supported")
        tensor = _Unpickler(io.BytesIO(archive.read(pkl))).load()
        if not isinstance(tensor, _Tensor):
            raise ValueError("the saved object is not a tensor")
        return _to_embeds(archive, prefix, tensor, max_bytes)
    except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, EOFError, TypeError, ValueError) as e:
        raise ValueError(f"{_PARAM}: not a tensor saved with torch.save ({e})") from None


def _to_embeds(archive: zipfile.ZipFile, prefix: str, t: _Tensor, max_bytes: int) -> PromptEmbeds:
    size = t.size[1:] if len(t.size) == 3 and t.size[0] == 1 else t.size
    stride = t.stride[1:] if len(t.size) == 3 and t.size[0] == 1 else t.stride
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"must be a [tokens, hidden] tensor, got shape {list(t.size)}")
    if size[0] * size[1] * 4 > max_bytes:
        raise ValueError(f"{size[0]}x{size[1]} embeddings exceed the {max_bytes} bytes accepted")
    info = archive.getinfo(f"{prefix}data/{t.storage.key}")
    itemsize = 4 if t.storage.dtype == "float32" else 2
    if info.file_size != t.storage.numel * itemsize or info.file_size > 2 * max_bytes:
        raise ValueError("the storage's size does not match the tensor")
    buf = archive.read(info)
    last = t.offset + sum((n - 1) * s for n, s in zip(size, stride))
    if t.offset < 0 or min(stride) < 0 or last >= t.storage.numel:
        raise ValueError("the tensor's view reaches outside its storage")
    if t.storage.dtype == "bfloat16":
        flat = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        flat = np.frombuffer(buf, dtype="<f4" if t.storage.dtype == "float32" else "<f2").astype(np.float32)
    view = np.lib.stride_tricks.as_strided(
        flat[t.offset :], shape=size, strides=tuple(s * 4 for s in stride), writeable=False
    )
    out = np.ascontiguousarray(view, dtype="<f4")
    if not np.isfinite(out).all():
        raise ValueError("the embeddings hold NaN or infinite values")
    return PromptEmbeds(data=out.tobytes(), num_tokens=int(size[0]), hidden_size=int(size[1]))
