"""The external-data files an ONNX graph names, read from its protobuf without loading it.

The runtime has no `onnx` package, and older ONNX Runtime releases follow an external-data
`location` of `../../etc/passwd` wherever it leads, so the manifest loader lists every
location itself and keeps it inside the export (runtime/containment.py). This walks the
protobuf wire format along the few messages that can hold a tensor (initializers, sparse
initializers, Constant/attribute tensors, subgraphs, functions, training graphs); all other
fields, the weights included, are skipped by length, never copied.
"""

from __future__ import annotations

import mmap
from pathlib import Path

from .errors import SpecDeployError

# message -> {field number: message type of that (length-delimited) field}; onnx/onnx.proto.
_TENSOR, _SPARSE, _GRAPH, _NODE, _ATTRIBUTE, _FUNCTION, _TRAINING, _MODEL, _ENTRY = range(9)
_SCHEMA = {
    _MODEL: {7: _GRAPH, 20: _TRAINING, 25: _FUNCTION},
    _GRAPH: {1: _NODE, 5: _TENSOR, 15: _SPARSE},
    _NODE: {5: _ATTRIBUTE},
    _ATTRIBUTE: {5: _TENSOR, 6: _GRAPH, 10: _TENSOR, 11: _GRAPH, 22: _SPARSE, 23: _SPARSE},
    _SPARSE: {1: _TENSOR, 2: _TENSOR},
    _FUNCTION: {7: _NODE, 11: _ATTRIBUTE},
    _TRAINING: {1: _GRAPH, 2: _GRAPH},
    _TENSOR: {13: _ENTRY},  # external_data: key/value entries
}
_MAX_DEPTH = 64  # nested subgraphs; deeper is a hostile file, not a model


class _Malformed(Exception):
    pass


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _skip(buf, pos: int, end: int, wire: int, number: int, depth: int = 0) -> int:
    """Past one field that is not length-delimited (a group too: protobuf parsers skip those
    as unknown fields, so an initializer after one must still be seen)."""
    if wire == 0:
        return _varint(buf, pos, end)[1]
    if wire in (1, 5):
        pos += 8 if wire == 1 else 4
    elif wire == 3:
        if depth > _MAX_DEPTH:
            raise _Malformed("groups nested too deep")
        while True:
            key, pos = _varint(buf, pos, end)
            if key & 7 == 4:
                if key >> 3 != number:
                    raise _Malformed("a group ends with another field's number")
                return pos
            if key & 7 == 2:
                length, pos = _varint(buf, pos, end)
                pos += length
                if pos > end:
                    raise _Malformed("a field runs past the end of its message")
            else:
                pos = _skip(buf, pos, end, key & 7, key >> 3, depth + 1)
    else:
        raise _Malformed(f"wire type {wire} where a field starts")
    if pos > end:
        raise _Malformed("a field runs past the end of its message")
    return pos


def _fields(buf, pos: int, end: int):
    """(field number, start, stop) of each length-delimited field; other fields skipped."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Malformed("field number 0")
        if wire != 2:
            pos = _skip(buf, pos, end, wire, number)
            continue
        length, pos = _varint(buf, pos, end)
        if pos + length > end:
            raise _Malformed(f"field {number} runs past the end of its message")
        yield number, pos, pos + length
        pos += length


def _entry(buf, start: int, stop: int) -> tuple[bytes, bytes]:
    parts = {1: b"", 2: b""}
    for number, s, e in _fields(buf, start, stop):
        if number in parts:
            parts[number] = bytes(buf[s:e])
    return parts[1], parts[2]


def _walk(buf, kind: int, start: int, stop: int, depth: int, found: set[str]) -> None:
    if depth > _MAX_DEPTH:
        raise _Malformed("subgraphs nested too deep")
    children = _SCHEMA.get(kind, {})
    for number, s, e in _fields(buf, start, stop):
        child = children.get(number)
        if child == _ENTRY:
            key, value = _entry(buf, s, e)
            if key == b"location":
                try:
                    found.add(value.decode("utf-8"))
                except UnicodeDecodeError:
                    raise _Malformed("an external-data location is not UTF-8") from None
        elif child is not None:
            _walk(buf, child, s, e, depth + 1, found)


def _tensor_name_dims(buf, start: int, stop: int) -> tuple[bytes, list[int]]:
    """(name, dims) of a TensorProto: dims (field 1) packed or not, name (field 8); the rest skipped."""
    name, dims, pos = b"", [], start
    while pos < stop:
        key, pos = _varint(buf, pos, stop)
        number, wire = key >> 3, key & 7
        if number == 1 and wire == 0:
            value, pos = _varint(buf, pos, stop)
            dims.append(value)
        elif wire == 2:
            length, pos = _varint(buf, pos, stop)
            if pos + length > stop:
                raise _Malformed(f"field {number} runs past the end of its message")
            if number == 8:
                name = bytes(buf[pos : pos + length])
            elif number == 1:  # packed dims
                at = pos
                while at < pos + length:
                    value, at = _varint(buf, at, pos + length)
                    dims.append(value)
            pos += length
        else:
            pos = _skip(buf, pos, stop, wire, number)
    return name, dims


def _mapped(path: Path, read):
    """read(buf) over the ONNX file at `path`, mapped; one SpecDeployError for a malformed or unreadable file."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) == 0:
                raise _Malformed("the file is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return read(buf)
    except _Malformed as exc:
        raise SpecDeployError(f"{path} is not a valid ONNX file ({exc}); re-export it") from None
    except OSError as exc:
        raise SpecDeployError(f"cannot read {path}: {exc.strerror or exc}") from None


def initializer_dims(path: str | Path, name: str) -> list[int] | None:
    """The dims of the main graph's initializer `name` in the ONNX file at `path` (None: it has none)."""
    wanted = name.encode("utf-8")

    def read(buf):
        for number, s, e in _fields(buf, 0, len(buf)):
            if number != 7:  # ModelProto.graph
                continue
            for field, ts, te in _fields(buf, s, e):
                if field == 5:  # GraphProto.initializer
                    tensor, dims = _tensor_name_dims(buf, ts, te)
                    if tensor == wanted:
                        return dims
        return None

    return _mapped(Path(path), read)


def external_data_locations(path: str | Path) -> list[str]:
    """Every external-data `location` in the ONNX file at `path`, as written (relative to its folder)."""
    found: set[str] = set()
    _mapped(Path(path), lambda buf: _walk(buf, _MODEL, 0, len(buf), 0, found))
    return sorted(found)
