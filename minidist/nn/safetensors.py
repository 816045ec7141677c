"""A small reader and writer for the safetensors format (Hugging Face's weight files).

The file is:  [8 bytes: N, little-endian u64] [N bytes: JSON header] [the tensors' bytes].
The header maps each name to {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}
(offsets into the byte buffer that follows the header), plus an optional "__metadata__"
object of string -> string. Data is little-endian, C order; tensors lie back to back and
cover the buffer exactly. We pad the header with spaces so every tensor starts 8-byte
aligned, as the reference writer does. bfloat16 (ml_dtypes' type) is written as "BF16" (its
bytes, through a uint16 view) and read widened to float32 (exact: bfloat16 is the top 16
bits of a float32). load_file makes every tensor it returns; SafetensorsFile one when asked
for (a checkpoint read a parameter at a time). Tests: tests/test_pretrained.py,
tests/test_bfloat16.py.
"""
import json
import os
import struct

import numpy as np

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 << 20


class SafetensorsError(ValueError):
    """A file that is not valid safetensors; the message names the file and the problem."""


def save_file(tensors, path, metadata=None):
    """Write name -> numpy array to `path` (the arrays are copied to the host if needed)."""
    header, arrays, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a.get() if hasattr(a, "get") else a)
        if a.dtype.name == "bfloat16":
            header[name] = {"dtype": "BF16", "shape": list(a.shape),
                            "data_offsets": [offset, offset + a.nbytes]}
            arrays.append(a.view(np.uint16).astype("<u2", copy=False))
            offset += a.nbytes
            continue
        if a.dtype not in _NAMES:
            raise TypeError(f"safetensors: cannot write {name} of dtype {a.dtype}")
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": _NAMES[a.dtype.newbyteorder("=")], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                  # tensors start 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(memoryview(a.reshape(-1)).cast("B") if a.size else b"")


def read_header(path):
    """(header dict without __metadata__, metadata dict, byte offset of the data buffer)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        n = struct.unpack("<Q", head)[0]
        if n > min(_MAX_HEADER, size - 8):
            raise SafetensorsError(f"{path}: header length {n} does not fit the file "
                                   f"({size} bytes): truncated or not safetensors")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    _check_layout(path, header, size - 8 - n)
    return header, metadata, 8 + n


def _check_layout(path, header, data_bytes):
    end = 0
    entries = sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0])
    for name, info in entries:
        try:
            dtype, shape = info["dtype"], info["shape"]
            begin, stop = info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: bad header entry for {name!r}: {info}") from None
        width = 2 if dtype == "BF16" else np.dtype(_DTYPES.get(dtype, np.uint8)).itemsize
        if dtype not in _DTYPES and dtype != "BF16":
            raise SafetensorsError(f"{path}: {name}: unsupported dtype {dtype}")
        if begin != end or stop - begin != int(np.prod(shape, dtype=np.int64)) * width:
            raise SafetensorsError(f"{path}: {name}: data_offsets {[begin, stop]} do not "
                                   f"match its shape {shape} and dtype {dtype}")
        end = stop
    if end != data_bytes:
        raise SafetensorsError(f"{path}: tensors cover {end} bytes but the file holds "
                               f"{data_bytes}: truncated or padded file")


def load_file(path, names=None):
    """name -> numpy array (memory-mapped, read-only; bfloat16 widened to float32).
    `names` limits which tensors are returned. Returns (tensors, metadata)."""
    f = SafetensorsFile(path)
    return {n: f.tensor(n) for n in f.names if names is None or n in names}, f.metadata


class SafetensorsFile:
    """One file's header read and its bytes memory-mapped; each tensor (or rows of it) made
    only when tensor(name) asks for it, so a bfloat16 one is widened alone (load_file widens
    every one it returns): what reads a checkpoint's parameters one at a time
    (minidist/strategy/readers.py). `names`: the tensors, in the file's order."""

    def __init__(self, path):
        self.path = path
        self.header, self.metadata, self.start = read_header(path)
        self.raw = np.memmap(path, dtype=np.uint8, mode="r")
        self.names = list(self.header)

    def tensor(self, name, lo=0, hi=None):
        """The array `name` (a view of the mapped bytes; bfloat16: a float32 copy), or rows
        lo:hi of its first axis, only those bytes read or widened (a flat ZeRO shard's piece
        of one parameter: minidist/strategy/readers.py ShardReader)."""
        info = self.header[name]
        shape, (begin, stop) = list(info["shape"]), info["data_offsets"]
        if shape:
            hi = shape[0] if hi is None else hi
            if not 0 <= lo <= hi <= shape[0]:
                raise IndexError(f"{self.path}: {name} has {shape[0]} rows, not {lo}:{hi}")
            row = (stop - begin) // shape[0] if shape[0] else 0
            begin, stop, shape[0] = begin + lo * row, begin + hi * row, hi - lo
        buf = self.raw[self.start + begin:self.start + stop]
        if info["dtype"] == "BF16":             # bfloat16 = the top 16 bits of a float32
            wide = buf.view("<u2").astype(np.uint32) << 16
            a = wide.view(np.float32)
        else:
            a = buf.view(np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<"))
        return a.reshape(shape)
