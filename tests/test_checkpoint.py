"""Reading checkpoints without loading a tensor (gpud.vllm.checkpoint): hand-built safetensors files,
good and bad; the Hugging Face cache layout."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import pytest

from gpud.vllm.checkpoint import (
    MAX_HEADER_BYTES,
    CheckpointError,
    MissingFile,
    NotOnDisk,
    hub_cache_of,
    locate,
    read_checkpoint,
    read_header,
)
from tests.checkpoints import llama_tensors, safetensors_bytes, write_checkpoint


def test_reads_every_tensor_of_one_file(tmp_path: Path) -> None:
    ckpt = read_checkpoint(write_checkpoint(tmp_path / "m"))
    assert len(ckpt.tensors) == len(llama_tensors())
    embed = next(t for t in ckpt.tensors if t.name == "model.embed_tokens.weight")
    assert (embed.dtype, embed.shape, embed.stored_bytes) == ("BF16", (1000, 256), 512_000)
    assert ckpt.files == ("model.safetensors",)
    assert ckpt.config["num_hidden_layers"] == 2


def test_reads_every_shard_through_the_index(tmp_path: Path) -> None:
    ckpt = read_checkpoint(write_checkpoint(tmp_path / "m", shards=3))
    assert len(ckpt.files) == 3
    assert sorted(t.name for t in ckpt.tensors) == sorted(llama_tensors())
    assert "21 tensors in model-00001-of-00003.safetensors, " \
           "model-00002-of-00003.safetensors and 1 more" in ckpt.where()


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(MissingFile, match=r"model-00002-of-00002\.safetensors: missing"):
        read_checkpoint(d)


def test_an_index_naming_a_path_outside_is_refused(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="not a file name"):
        read_checkpoint(d)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    whole = safetensors_bytes(llama_tensors())
    path.write_bytes(whole[:-100])
    with pytest.raises(CheckpointError, match=rf"{path}: truncated: the header places tensor "
                                              "data up to byte"):
        read_header(path)
    path.write_bytes(whole[:20])
    with pytest.raises(CheckpointError, match=rf"{path}: truncated: the header claims"):
        read_header(path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="no safetensors header"):
        read_header(path)


def test_a_header_claiming_more_than_safetensors_allows(tmp_path: Path) -> None:
    """A length over 100,000,000 is refused before anything is read (safetensors' own bound),
    even in a file that large (sparse here)."""
    path = tmp_path / "model.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(MAX_HEADER_BYTES + 100)
    with pytest.raises(CheckpointError, match="header of 100000001 bytes is over the "
                                              "100000000 safetensors allows"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 2**64 - 1) + b"{}")
    with pytest.raises(CheckpointError, match="is over the"):
        read_header(path)


@pytest.mark.parametrize(("entry", "why"), [
    ({"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}, "unknown dtype 'F99'"),
    ({"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}, "not a list of whole numbers"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "is not \\[begin, end\\]"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, "F32 \\[4\\] is 16 bytes, its "
                                                             "data_offsets span 8"),
    ({"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}, "truncated"),
    ("zero", "not an object"),
])
def test_a_lying_header_is_named(tmp_path: Path, entry: object, why: str) -> None:
    header = json.dumps({"t": entry}).encode()
    path = tmp_path / "lies.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match=rf"{path}: .*{why}"):
        read_header(path)


@pytest.mark.parametrize("header", [b"not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000])
def test_a_header_that_is_not_a_json_object(tmp_path: Path, header: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match=rf"{path}: header is not"):
        read_header(path)


def test_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m")
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")
    result: list[BaseException] = []

    def read() -> None:
        try:
            read_checkpoint(d)
        except CheckpointError as exc:
            result.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert "not a regular file" in str(result[0])


def test_no_safetensors_is_not_on_disk(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(NotOnDisk, match="no safetensors"):
        read_checkpoint(d)


def test_the_hub_cache_at_a_pinned_revision(tmp_path: Path) -> None:
    hub = tmp_path / "hf" / "hub"
    repo = hub / "models--org--tiny"
    commit, other = "a" * 40, "b" * 40
    write_checkpoint(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert locate("org/tiny", None, hub) == (repo / "snapshots" / commit, False)
    assert locate("org/tiny", commit, hub)[0] == repo / "snapshots" / commit
    with pytest.raises(NotOnDisk, match=f"org/tiny@{other}: not in the model cache"):
        locate("org/tiny", other, hub)
    with pytest.raises(NotOnDisk, match="org/tiny@v2: not in the model cache"):
        locate("org/tiny", "v2", hub)
    with pytest.raises(NotOnDisk):
        locate("org/absent", None, hub)
    with pytest.raises(NotOnDisk, match="no such directory"):
        locate(str(tmp_path / "nowhere"), None, hub)
    assert hub_cache_of({"HF_HOME": str(tmp_path / "hf")}) == hub
    assert hub_cache_of({"HF_HUB_CACHE": "/c", "HF_HOME": "/h"}) == Path("/c")
    assert hub_cache_of({"HOME": "/home/u"}) == Path("/home/u/.cache/huggingface/hub")


def test_a_bare_name_is_a_repository_id_even_where_a_directory_has_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """"opt" is a repository id, not /opt because gpud happens to run in /."""
    (tmp_path / "opt").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotOnDisk, match="opt@main: not in the model cache"):
        locate("opt", None, tmp_path / "hub")
    assert locate("./opt", None, tmp_path / "hub") == (Path("./opt"), True)


def test_a_home_of_no_user_here_is_not_on_disk_not_a_crash(tmp_path: Path) -> None:
    """"~name/m" where no user "name" exists: pathlib raises RuntimeError, which a config's
    load (checkpoint_problems) took as a crash (found by the config campaign)."""
    with pytest.raises(NotOnDisk, match="no home directory for 'gpud-no-such-user-x'"):
        locate("~gpud-no-such-user-x/m", None, tmp_path / "hub")
