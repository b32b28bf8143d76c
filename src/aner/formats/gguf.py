"""GGUF files: read with typed metadata, write deterministically, dequantize.

Reading and writing are our own small implementation of the format (gguf-py's reader spends
seconds building per-token metadata objects; tests check both against gguf-py). Every failure of a
malformed file becomes a `FormatError`; gguf-py supplies the type tables and dequantization.
Tensors keep torch's shape order (rows first): GGUF stores `ne = [in, out]` and the reader
already reverses it, so a projection weight reads as (out, in) like `nn.Linear.weight`.
"""
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants

from ..errors import FormatError, UnsupportedModelError
from .publish import sha256_file, staged_file

FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
FILE_TYPE = {"f32": 0, "f16": 1}  # general.file_type values llama.cpp uses (LLAMA_FTYPE_ALL_F32, MOSTLY_F16)


@dataclass(frozen=True)
class Field:
    """One metadata entry with its exact GGUF types, so a rewrite keeps them."""
    key: str
    value: Any
    type: GGUFValueType
    sub_type: GGUFValueType | None = None


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]          # torch order: (rows, columns)
    type: GGMLQuantizationType
    raw: np.ndarray                 # the stored bytes/values, memory-mapped

    def is_float(self) -> bool:
        return self.type in FLOAT_TYPES

    def float32(self) -> np.ndarray:
        """Exact FP32 values of a floating tensor (F16 and BF16 widen exactly)."""
        if self.type == GGMLQuantizationType.F32:
            out = np.array(self.raw, dtype=np.float32)
        elif self.type == GGMLQuantizationType.F16:
            out = self.raw.astype(np.float32)
        elif self.type == GGMLQuantizationType.BF16:
            out = (self.raw.astype(np.uint32) << 16).view(np.float32)  # BF16 is FP32's top half
        else:
            out = quants.dequantize(np.asarray(self.raw), self.type).astype(np.float32)
        return out.reshape(self.shape)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    fields: dict[str, Field]
    tensors: dict[str, Tensor]      # in file order

    def get(self, key: str, default=None):
        f = self.fields.get(key)
        return default if f is None else f.value

    def sha256(self) -> str:
        return sha256_file(self.path)


# GGUF value types (the file format's numbering) and their little-endian struct codes.
_SCALAR = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
           GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
           GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
           GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
MAGIC = b"GGUF"
VERSION = 3
ALIGNMENT = 32


class _Cursor:
    """Reads GGUF's little-endian primitives from a byte buffer; running past the end is a FormatError."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise FormatError("unexpected end of file")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise FormatError("unexpected end of file in a string")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8")

    def value(self, vtype: GGUFValueType):
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            sub = GGUFValueType(self.take("I"))
            n = self.take("Q")
            if sub in _SCALAR:  # one bulk read for numeric arrays
                dtype = np.dtype("<" + _SCALAR[sub]) if sub != GGUFValueType.BOOL else np.dtype(bool)
                end = self.pos + n * dtype.itemsize
                if end > len(self.buf):
                    raise FormatError("unexpected end of file in an array")
                out = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
                self.pos = end
                return out
            return [self.value(sub) for _ in range(n)]
        raise FormatError(f"unknown metadata value type {vtype}")


def read_gguf(path) -> GGUFFile:
    """Parse a GGUF (version 2 or 3): typed metadata and memory-mapped tensors."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"GGUF file {str(path)!r} does not exist or is not a file")
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except (ValueError, OSError) as e:
        raise FormatError(f"{str(path)!r} is not a readable GGUF file (truncated or not GGUF): {e}") from e
    try:
        c = _Cursor(memoryview(mm))  # struct and slicing on a memoryview: no per-call numpy objects
        if bytes(mm[:4]) != MAGIC:
            raise FormatError("wrong magic")
        c.pos = 4
        version = c.take("I")
        if version not in (2, 3):
            raise FormatError(f"GGUF version {version}; accepted: 2 or 3")
        n_tensors, n_fields = c.take("Q"), c.take("Q")
        fields = {}
        for _ in range(n_fields):
            key = c.string()
            vtype = GGUFValueType(c.take("I"))
            if vtype == GGUFValueType.ARRAY:
                sub = GGUFValueType(c.take("I"))
                c.pos -= 4
                fields[key] = Field(key, c.value(vtype), vtype, sub)
            else:
                fields[key] = Field(key, c.value(vtype), vtype)
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.take("Q") for _ in range(c.take("I"))]
            infos.append((name, dims, GGMLQuantizationType(c.take("I")), c.take("Q")))
        align = fields["general.alignment"].value if "general.alignment" in fields else ALIGNMENT
        data_start = -(-c.pos // align) * align
        tensors = {}
        for name, dims, ttype, offset in infos:
            if name in tensors:
                raise FormatError(f"tensor {name!r} appears twice")
            shape = tuple(int(d) for d in reversed(dims))
            block, type_size = GGML_QUANT_SIZES[ttype]
            n = int(np.prod(dims)) if dims else 1
            nbytes = n * type_size // block
            start = data_start + offset
            if start + nbytes > len(mm):
                raise FormatError(f"tensor {name!r} data is truncated")
            raw = mm[start:start + nbytes]
            if ttype in _NUMPY:
                raw = raw.view(_NUMPY[ttype]).reshape(shape)
            tensors[name] = Tensor(name, shape, ttype, raw)
    except FormatError as e:
        raise FormatError(f"{str(path)!r} is not a readable GGUF file (truncated or not GGUF): {e}") from None
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise FormatError(f"{str(path)!r} is not a readable GGUF file (truncated or not GGUF): {e}") from e
    return GGUFFile(path, fields, tensors)


_NUMPY = {GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2"),
          GGMLQuantizationType.BF16: np.dtype("<u2")}


def _pack_value(out: bytearray, vtype: GGUFValueType, value, sub=None) -> None:
    if vtype in _SCALAR:
        out += struct.pack("<" + _SCALAR[vtype], value)
    elif vtype == GGUFValueType.STRING:
        raw = value.encode("utf-8")
        out += struct.pack("<Q", len(raw)) + raw
    elif vtype == GGUFValueType.ARRAY:
        out += struct.pack("<IQ", sub, len(value))
        if sub in _SCALAR and sub != GGUFValueType.BOOL:
            out += np.asarray(value, dtype="<" + _SCALAR[sub]).tobytes()
        else:
            for item in value:
                _pack_value(out, sub, item)
    else:
        raise ValueError(f"unknown metadata type {vtype}")


def write_gguf(dst, fields: Iterable[Field], tensors: Iterable[tuple[str, np.ndarray]]) -> Path:
    """Write a GGUF version 3 with `fields` and float tensors, staged; deterministic bytes.

    Array dtypes pick the GGUF type: float32 -> F32, float16 -> F16, uint16 -> BF16 (the bits, as
    `bf16_bits` makes them). Tensors are written in the order given, each aligned to 32 bytes.
    """
    fields = list(fields)
    assert any(f.key == "general.architecture" for f in fields), "general.architecture is required"
    assert not any(f.key == "general.alignment" for f in fields)
    assert len({f.key for f in fields}) == len(fields), "duplicate metadata keys"
    with staged_file(dst) as tmp, tempfile.TemporaryFile(dir=Path(dst).parent) as data:
        # Tensor data goes to a side file as the tensors arrive (one in memory at a time); the
        # header, which needs every shape and offset, is written once they are all known.
        infos, offset = [], 0
        for name, array in tensors:
            infos.append((name, array.shape, _ggml_type(name, array), offset))
            data.write(np.ascontiguousarray(array).tobytes())
            data.write(bytes(-array.nbytes % ALIGNMENT))
            offset += -(-array.nbytes // ALIGNMENT) * ALIGNMENT
        head = bytearray(MAGIC) + struct.pack("<IQQ", VERSION, len(infos), len(fields))
        for f in fields:
            _pack_value(head, GGUFValueType.STRING, f.key)
            head += struct.pack("<I", f.type)
            _pack_value(head, f.type, f.value, f.sub_type)
        for name, shape, ttype, off in infos:
            _pack_value(head, GGUFValueType.STRING, name)
            head += struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *reversed(shape))
            head += struct.pack("<IQ", ttype, off)
        head += bytes(-len(head) % ALIGNMENT)
        with open(tmp, "wb") as out:
            out.write(head)
            data.seek(0)
            shutil.copyfileobj(data, out, 1 << 24)
    return Path(dst)


def _ggml_type(name, array) -> GGMLQuantizationType:
    for ttype, dtype in _NUMPY.items():
        if array.dtype == dtype:
            return ttype
    raise ValueError(f"tensor {name}: dtype {array.dtype} cannot be written; use float32, float16 or bf16 bits")


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """FP32 -> BF16 bit patterns with round-to-nearest-even (finite inputs)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def string_field(key: str, value: str) -> Field:
    return Field(key, value, GGUFValueType.STRING)


def uint32_field(key: str, value: int) -> Field:
    return Field(key, value, GGUFValueType.UINT32)


def float32_field(key: str, value: float) -> Field:
    return Field(key, value, GGUFValueType.FLOAT32)


def dequantize_gguf(src, dst, dtype: str) -> Path:
    """Any GGUF that gguf-py can dequantize -> F32 or F16 GGUF; metadata kept, conversion recorded.

    Matrices become `dtype`; vectors (norms) stay F32 as llama.cpp expects. The values are gguf-py's
    reference dequantization in FP32, then rounded to F16 when asked (round-to-nearest-even).
    """
    if dtype not in FILE_TYPE:
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported; accepted: 'f32', 'f16'")
    source = read_gguf(src)
    source_sha = source.sha256()
    # A conversion of a conversion records the latest step; its source hash chains to the rest.
    fields = [f for k, f in source.fields.items()
              if k != "general.file_type" and not k.startswith("aner.conversion")]
    fields.append(uint32_field("general.file_type", FILE_TYPE[dtype]))
    fields.append(string_field("aner.conversion", f"dequantize;dtype={dtype}"))
    fields.append(string_field("aner.conversion.source_sha256", source_sha))
    src_types = sorted({t.type.name for t in source.tensors.values()})
    fields.append(string_field("aner.conversion.source_types", ",".join(src_types)))

    def converted():
        for t in source.tensors.values():
            try:
                values = t.float32()
            except NotImplementedError as e:
                raise UnsupportedModelError(
                    f"tensor {t.name!r} has type {t.type.name}, which cannot be dequantized") from e
            if len(t.shape) >= 2 and dtype == "f16":
                values = values.astype(np.float16)
            yield t.name, values

    return write_gguf(dst, fields, converted())
