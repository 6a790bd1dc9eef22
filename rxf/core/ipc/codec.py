"""The codec of every message between rxf's processes: msgpack through msgspec, never pickle.

A message is one of the tagged structs of `rxf.core.ipc.messages`; a receiver decodes with the
union its socket takes (`Decoder(ToScheduler)`), so the bytes become that type or a
`msgspec.DecodeError` / `msgspec.ValidationError`: nothing but those types can come out, and no
code runs while decoding.

Tensors (the preprocessed pixels in `MultimodalItem.data`) travel as a msgpack extension: a small
header (dtype, shape) and the raw bytes. Encoding copies a tensor once, header and bytes into one
extension; decoding makes no copy when the input buffer is writable (a ZMQ frame received with
`copy=False`): the tensor is a view of the received message, which it keeps alive. From a
read-only buffer (`bytes`) the tensor gets a copy of its own, since torch has no read-only tensors.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

# The extension type code of a tensor (0-127 are the application's).
TENSOR_EXT = 1
# Header: dtype code, number of dimensions, then one little-endian int64 per dimension.
_HEAD = struct.Struct("<BB")
_DIM = struct.Struct("<q")
# dtype <-> its code in the header: a fixed list, so both ends agree without sending names.
_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def _dtypes() -> tuple[Any, ...]:
    import torch  # here, not at import: the detokenizer and most messages never carry a tensor

    return tuple(getattr(torch, name) for name in _DTYPE_NAMES)


def _encode_tensor(obj: Any) -> msgspec.msgpack.Ext:
    import torch

    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"cannot send a {type(obj).__name__} between processes")
    dtypes = _dtypes()
    if obj.dtype not in dtypes:
        raise TypeError(f"cannot send a tensor of dtype {obj.dtype} between processes")
    t = obj.detach().cpu().contiguous()
    head = _HEAD.pack(dtypes.index(t.dtype), t.dim()) + b"".join(_DIM.pack(n) for n in t.shape)
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return msgspec.msgpack.Ext(TENSOR_EXT, b"".join((head, memoryview(raw))))


def _decode_ext(code: int, data: memoryview) -> Any:
    if code != TENSOR_EXT:
        raise ValueError(f"unknown msgpack extension type {code}")
    import torch

    code_of_dtype, ndim = _HEAD.unpack_from(data)
    offset = _HEAD.size
    shape = [_DIM.unpack_from(data, offset + i * _DIM.size)[0] for i in range(ndim)]
    offset += ndim * _DIM.size
    dtype = _dtypes()[code_of_dtype]
    if data.readonly:
        data = memoryview(bytearray(data))
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=numel, offset=offset).reshape(shape)


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_tensor)


def encode(msg: Any) -> bytes:
    """One message as bytes, for any receiver whose union holds its type."""
    return _encoder.encode(msg)


class Decoder:
    """Decodes the messages one kind of socket receives (`accepts`: a union of `messages`)."""

    def __init__(self, accepts: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(accepts, ext_hook=_decode_ext)

    def decode(self, buf: bytes | memoryview) -> Any:
        return self._decoder.decode(buf)
