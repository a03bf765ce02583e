"""One parse of a .gguf per model load (loading/gguf_parses.py), and the header's tensor types
that tell a quantized GGUF from a float one without gguf's slow reader."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from adaptive_export.loading.gguf_header import read_gguf_header
from adaptive_export.loading.gguf_parses import one_parse_per_file
from tests.conftest import needs_smollm2
from tests.test_model_input_hardening import write_tiny_gguf


def test_a_file_is_parsed_once_per_block_and_again_when_it_changes(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    original, names = gguf.GGUFReader, gguf.get_tensor_name_map
    with one_parse_per_file():
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is name_map
        assert name_map.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first  # str or Path: one key
        with one_parse_per_file():  # nested: the outer block's readers
            assert gguf.GGUFReader(str(path)) is first
        np.testing.assert_array_equal(first.tensors[0].data, original(str(path)).tensors[0].data)
        write_tiny_gguf(path, block_count=2)
        os.utime(path, ns=(1, 1))  # a rewrite within the clock's resolution still changes the key
        second = gguf.GGUFReader(str(path))
        assert second is not first and second.fields["llama.block_count"].parts[-1][0] == 2
    assert gguf.GGUFReader is original and gguf.get_tensor_name_map is names


def test_header_tells_quantized_from_float_files(tmp_path: Path) -> None:
    header = read_gguf_header(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert header.tensor_types == (gguf.GGMLQuantizationType.F32,) * 2 and not header.has_quantized_tensors()


@needs_smollm2
def test_loading_the_packaged_gguf_parses_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers parses the file for the config (twice), the tokenizer and the weights; the
    shared reader must reach all four (it would not if transformers bound GGUFReader at import)."""
    from adaptive_export.loading.model import load_model
    from adaptive_export.loading.packaged import PACKAGED

    assert read_gguf_header(PACKAGED["smollm2"].gguf_path()).has_quantized_tensors()
    from adaptive_export.loading import gguf_fast_reader

    parses: list[str] = []
    real_reader = gguf_fast_reader.ArrayFastReader

    def counted(path: Any, mode: Any = "r") -> Any:
        parses.append(str(path))
        return real_reader(path, mode)

    monkeypatch.setattr(gguf_fast_reader, "ArrayFastReader", counted)
    loaded = load_model("smollm2")
    assert loaded.spec.num_layers == 30 and loaded.tokenizer.encode("Paris")
    assert parses == [str(PACKAGED["smollm2"].gguf_path())]


def test_native_quantization_of_a_float_gguf_is_refused_from_its_header(tmp_path: Path) -> None:
    """`--quantize native` keeps a quantized file's grid; a float GGUF has none (`auto` exports floats)."""
    from adaptive_export.commands.build import resolve_quantize
    from adaptive_export.runtimes.errors import UsageError

    model = str(write_tiny_gguf(tmp_path / "float.gguf"))
    assert resolve_quantize("auto", model, ("onnx",), "ort") == ("none", None)
    with pytest.raises(UsageError, match="needs a quantized .gguf model"):
        resolve_quantize("native", model, ("onnx",), "ort")


def same_fields(ours: Any, theirs: Any) -> None:
    """Every field's offset, parts (values and dtypes), data indices and types, and every tensor."""
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), name
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert [(t.name, t.data_offset, t.data.tobytes()) for t in ours.tensors] == [
        (t.name, t.data_offset, t.data.tobytes()) for t in theirs.tensors
    ]


def test_the_fast_reader_gives_ggufs_own_fields(tmp_path: Path) -> None:
    """Arrays of strings (with multi-byte ones), of each scalar width, empty and nested ones."""
    from adaptive_export.loading.gguf_fast_reader import ArrayFastReader

    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "", "žluť", "<|im_end|>"] * 50)
    writer.add_token_scores([float(i) / 3 for i in range(200)])
    writer.add_token_types([i % 6 for i in range(200)])
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_array("test.bools", [True, False, True])
    writer.add_key_value("test.int64", [2**40, -1], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT64)
    writer.add_tensor("output_norm.weight", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    same_fields(ArrayFastReader(str(path)), gguf.GGUFReader(str(path)))


@needs_smollm2
def test_the_fast_reader_gives_ggufs_own_fields_on_a_real_vocabulary() -> None:
    from adaptive_export.loading.gguf_fast_reader import ArrayFastReader
    from adaptive_export.loading.packaged import PACKAGED

    path = str(PACKAGED["smollm2"].gguf_path())
    same_fields(ArrayFastReader(path), gguf.GGUFReader(path))
