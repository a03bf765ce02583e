"""loading/read_once.py: inside `check`'s block a .gguf's config and tokenizer are read once per
unchanged file; configs come back as copies, tokenizers shared; outside the block every call reads."""

from __future__ import annotations

import os
from pathlib import Path

from adaptive_export.loading.read_once import model_headers_read_once, read_once


def counting_reader(calls: list[int]):  # type: ignore[no-untyped-def]
    def read() -> dict[str, list[int]]:
        calls.append(1)
        return {"layers": [len(calls)]}

    return read


def test_inside_the_block_a_file_is_read_once_and_configs_are_copies(tmp_path: Path) -> None:
    path, calls = tmp_path / "model.gguf", []
    path.write_bytes(b"GGUF")
    read = counting_reader(calls)
    with model_headers_read_once():
        first, second = read_once("config", path, read), read_once("config", path, read)
        first["layers"].append(99)  # a model build writes into its config
        assert read_once("config", path, read) == {"layers": [1]}
        shared = read_once("tokenizer", path, read, shared=True)
        assert read_once("tokenizer", path, read, shared=True) is shared
    assert len(calls) == 2 and second == {"layers": [1]}


def test_a_changed_file_or_no_block_reads_again(tmp_path: Path) -> None:
    path, calls = tmp_path / "model.gguf", []
    path.write_bytes(b"GGUF")
    read = counting_reader(calls)
    read_once("config", path, read)
    read_once("config", path, read)
    assert len(calls) == 2  # outside the block: no cache
    with model_headers_read_once():
        read_once("config", path, read)
        path.write_bytes(b"GGUF-changed")
        os.utime(path, ns=(1, 1))
        read_once("config", path, read)
    assert len(calls) == 4
