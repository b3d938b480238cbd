"""A GGUF file's reader is shared during an engine's start-up and kept by nothing after it."""

from __future__ import annotations

import threading
from pathlib import Path

from dspark.llm.gguf.metadata import open_reader, shared_readers
from gguf_testutil import make_checkpoint, write_gguf


def _file(tmp_path: Path) -> Path:
    return write_gguf(make_checkpoint(tmp_path / "hf", "llama"), tmp_path / "tiny.gguf", "Q8_0")


def test_one_reader_per_file_within_the_scope_on_any_thread(tmp_path: Path) -> None:
    path = _file(tmp_path)
    with shared_readers():
        first = open_reader(path)
        seen: list[object] = []
        t = threading.Thread(target=lambda: seen.append(open_reader(path)))  # a plugin's compile runs on a worker
        t.start()
        t.join(timeout=60)
        assert seen == [first]
        with shared_readers():  # nested scopes share it too
            assert open_reader(path) is first
        assert open_reader(path) is first  # the inner scope's end keeps what the outer one shares
        assert open_reader(path, share=False) is not first  # one whose weights will be read: its own map
    assert open_reader(path) is not first  # after the start-up, nothing keeps it (nor its memory map)
    assert open_reader(path) is not open_reader(path)


def test_a_file_rewritten_in_the_scope_is_read_again(tmp_path: Path) -> None:
    path = _file(tmp_path)
    with shared_readers():
        first = open_reader(path)
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data + b"\0" * 32)  # another size: another file
        assert open_reader(path) is not first
