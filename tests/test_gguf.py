"""Our GGUF reader and writer against gguf-py, the independent implementation."""
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from aner.errors import AnerError, FormatError
from aner.formats.gguf import Field, bf16_bits, read_gguf, write_gguf


def test_reader_matches_gguf_py_on_the_real_model(smollm2):
    ours = read_gguf(smollm2)
    ref = GGUFReader(smollm2)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, f in ref_fields.items():
        assert ours.fields[key].type == f.types[0], key
        assert ours.fields[key].value == f.contents(), key
    assert len(ours.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.type == t.tensor_type and mine.shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(np.asarray(mine.raw).view(np.uint8), np.asarray(t.data).view(np.uint8)), t.name


def test_writer_round_trips_through_gguf_py(tmp_path):
    rng = np.random.default_rng()
    f32 = rng.standard_normal((7, 13)).astype(np.float32)
    f16 = rng.standard_normal((3, 5)).astype(np.float16)
    b16 = bf16_bits(rng.standard_normal((4, 9)).astype(np.float32))
    fields = [Field("general.architecture", "llama", GGUFValueType.STRING),
              Field("a.u32", 7, GGUFValueType.UINT32), Field("a.f32", 0.5, GGUFValueType.FLOAT32),
              Field("a.bool", True, GGUFValueType.BOOL), Field("a.i64", -3, GGUFValueType.INT64),
              Field("a.strs", ["x", "", "ü"], GGUFValueType.ARRAY, GGUFValueType.STRING),
              Field("a.ints", [1, -2, 3], GGUFValueType.ARRAY, GGUFValueType.INT32)]
    path = write_gguf(tmp_path / "t.gguf", fields, [("w32", f32), ("w16", f16), ("wbf", b16)])
    ref = GGUFReader(path)
    for f in fields:
        assert ref.fields[f.key].contents() == f.value and ref.fields[f.key].types[0] == f.type
    got = {t.name: t for t in ref.tensors}
    assert np.array_equal(got["w32"].data, f32) and np.array_equal(got["w16"].data, f16)
    assert got["wbf"].tensor_type.name == "BF16"
    back = read_gguf(path)
    assert np.array_equal(back.tensors["wbf"].raw, b16)
    assert np.array_equal(back.tensors["w32"].float32(), f32)
    # deterministic bytes
    again = write_gguf(tmp_path / "u.gguf", fields, [("w32", f32), ("w16", f16), ("wbf", b16)])
    assert again.read_bytes() == path.read_bytes()


def test_bf16_rounding_matches_torch():
    """Round-to-nearest-even, ties included, against torch's own FP32 -> BF16 conversion."""
    import torch
    ties = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 3.0e38, 0.0], dtype=np.float32)
    x = np.concatenate([ties, np.random.default_rng().standard_normal(10_000).astype(np.float32) * 100])
    expected = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf16_bits(x), expected)


def test_writer_refuses_existing_destination(tmp_path):
    dst = tmp_path / "x.gguf"
    dst.write_bytes(b"keep")
    with pytest.raises(AnerError, match="already exists"):
        write_gguf(dst, [Field("general.architecture", "llama", GGUFValueType.STRING)], [])
    assert dst.read_bytes() == b"keep"


def test_failed_write_leaves_nothing(tmp_path):
    def tensors():
        yield "a", np.zeros(4, np.float32)
        raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError):
        write_gguf(tmp_path / "x.gguf", [Field("general.architecture", "llama", GGUFValueType.STRING)], tensors())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cut", [3, 20, 200, 5000])
def test_truncated_headers_are_format_errors(smollm2, tmp_path, cut):
    p = tmp_path / "cut.gguf"
    with open(smollm2, "rb") as f:
        p.write_bytes(f.read(cut))
    with pytest.raises(FormatError):
        read_gguf(p)
