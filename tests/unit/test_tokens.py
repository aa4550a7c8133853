"""TokenDataset: nanoGPT-style .bin files and shard directories on disk, windows, and the errors
for bad data (empty directory, truncated shard, vocabulary too large for the dtype, ids out of
range, a block size the data cannot fill), each naming the file."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from isthmus.data import TokenDataError, TokenDataset
from isthmus.data import tokens as tokens_mod
from isthmus.data.tokens import ShardInfo, TokenMeta, dtype_for_vocab


def _write(path: Path, ids: np.ndarray | list[int], dtype: str = "uint16") -> np.ndarray:
    arr = np.asarray(ids, dtype=dtype)
    arr.tofile(path)  # exactly what nanoGPT's prepare scripts do
    return arr.astype(np.int64)


def _meta(d: Path, shards: dict[str, list[tuple[str, int]]], **kw: object) -> None:
    meta = TokenMeta(
        dtype=str(kw.get("dtype", "uint16")),
        vocab_size=int(kw.get("vocab_size", 1000)),  # type: ignore[call-overload]
        tokenizer="bytes",
        splits={k: tuple(ShardInfo(f, n) for f, n in v) for k, v in shards.items()},
    )
    meta.write(d / "meta.json")


def test_a_nanogpt_bin_gives_next_token_windows(tmp_path: Path) -> None:
    ids = _write(tmp_path / "train.bin", np.arange(1000) % 777)
    ds = TokenDataset(tmp_path / "train.bin", 16, dtype="uint16")
    assert len(ds) == (1000 - 1) // 16
    x, y = ds[3]
    assert x.dtype == torch.int64 and x.shape == (16,)
    assert x.tolist() == ids[48:64].tolist() and y.tolist() == ids[49:65].tolist()
    last_y = ds[-1][1]
    assert last_y[-1].item() == ids[len(ds) * 16]
    with pytest.raises(IndexError):
        ds[len(ds)]
    xb, yb = ds.batch([3, 0, 3])
    assert xb.shape == (3, 16) and torch.equal(xb[0], x) and torch.equal(yb[2], y)
    xe, ye = ds.batch([])
    assert xe.shape == (0, 16) and ye.shape == (0, 16)
    assert torch.equal(ds.batch(torch.tensor([3]))[0][0], x)
    assert ds.vocab_size is None and ds.dtype == "uint16"
    # windows are copies: writing into one never touches the file
    x[0] = -5
    assert ds[3][0][0].item() == ids[48]


def test_dtype_comes_from_the_caller_or_a_sidecar(tmp_path: Path) -> None:
    f = tmp_path / "data.bin"
    ids = _write(f, [70_000, 5, 9, 11] * 10, dtype="uint32")
    with pytest.raises(TokenDataError, match=r"data.bin: the token dtype is unknown.*dtype="):
        TokenDataset(f, 4)
    (tmp_path / "data.bin.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 70_001}))
    ds = TokenDataset(f, 4)
    assert (
        ds.dtype == "uint32" and ds.vocab_size == 70_001 and ds[0][0].tolist() == ids[:4].tolist()
    )
    with pytest.raises(TokenDataError, match="says dtype uint32 but dtype=uint16"):
        TokenDataset(f, 4, dtype=np.uint16)
    (tmp_path / "data.bin.json").unlink()
    (tmp_path / "data.json").write_text(json.dumps({"dtype": "uint32"}))
    assert TokenDataset(f, 4).dtype == "uint32"
    with pytest.raises(TokenDataError, match="not supported"):
        TokenDataset(f, 4, dtype="int8")


def test_a_directory_of_shards_reads_as_one_stream(tmp_path: Path) -> None:
    a = _write(tmp_path / "shard_00.bin", np.arange(0, 37))
    b = _write(tmp_path / "shard_01.bin", np.arange(100, 105))
    c = _write(tmp_path / "shard_02.bin", np.arange(200, 250))
    (tmp_path / "notes.txt").write_text("ignored")
    stream = np.concatenate([a, b, c])
    ds = TokenDataset(tmp_path, 8, dtype="uint16")
    assert ds.num_tokens == 92 and len(ds) == 91 // 8
    for i in range(len(ds)):  # windows 4 and 5 cross two shard boundaries
        x, y = ds[i]
        assert x.tolist() == stream[i * 8 : i * 8 + 8].tolist()
        assert y.tolist() == stream[i * 8 + 1 : i * 8 + 9].tolist()
    assert list(ds.shard_tokens().values()) == [37, 5, 50]


def test_meta_json_is_the_authority(tmp_path: Path) -> None:
    _write(tmp_path / "train_000000.bin", np.arange(50))
    _write(tmp_path / "train_000001.bin", np.arange(30))
    _write(tmp_path / "val_000000.bin", np.arange(20))
    _write(tmp_path / "stray.bin", np.arange(5))  # not listed: not read
    _meta(
        tmp_path,
        {
            "train": [("train_000000.bin", 50), ("train_000001.bin", 30)],
            "val": [("val_000000.bin", 20)],
        },
    )
    ds = TokenDataset(tmp_path, 4)
    assert ds.num_tokens == 80 and ds.vocab_size == 1000 and ds.tokenizer == "bytes"
    assert TokenDataset(tmp_path, 4, split="val").num_tokens == 20
    with pytest.raises(TokenDataError, match=r"no split 'test'.*\['train', 'val'\]"):
        TokenDataset(tmp_path, 4, split="test")
    with pytest.raises(TokenDataError, match="says vocab_size 1000 but vocab_size=500"):
        TokenDataset(tmp_path, 4, vocab_size=500)
    # a shard of the wrong length (replaced, or cut at a token boundary) is caught
    _write(tmp_path / "train_000001.bin", np.arange(29))
    with pytest.raises(
        TokenDataError, match=r"train_000001.bin holds 29 tokens but .*meta.json says 30"
    ):
        TokenDataset(tmp_path, 4)
    (tmp_path / "train_000001.bin").unlink()
    with pytest.raises(
        TokenDataError, match=r"train_000001.bin is listed in .*meta.json but missing"
    ):
        TokenDataset(tmp_path, 4)
    # one shard on its own is described by its directory's meta.json
    one = TokenDataset(tmp_path / "val_000000.bin", 4)
    assert one.dtype == "uint16" and one.vocab_size == 1000 and one.num_tokens == 20
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(TokenDataError, match=r"meta.json: cannot read it"):
        TokenDataset(tmp_path, 4)


def test_split_without_meta(tmp_path: Path) -> None:
    _write(tmp_path / "train.bin", np.arange(40))
    _write(tmp_path / "val.bin", np.arange(12))
    with pytest.raises(TokenDataError, match=r"both train\* and val\* shards.*split="):
        TokenDataset(tmp_path, 4, dtype="uint16")
    assert TokenDataset(tmp_path, 4, dtype="uint16", split="val").num_tokens == 12
    assert TokenDataset(tmp_path, 4, dtype="uint16", split="train").num_tokens == 40


def test_empty_or_missing_data_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenDataError, match=r"no \.bin token files.*isthmus data prepare"):
        TokenDataset(tmp_path, 4, dtype="uint16")
    (tmp_path / "readme.txt").write_text("x")
    with pytest.raises(TokenDataError, match=str(tmp_path)):
        TokenDataset(tmp_path, 4, dtype="uint16")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenDataset(tmp_path / "nope", 4)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(TokenDataError, match=r"empty\.bin is empty"):
        TokenDataset(tmp_path, 4, dtype="uint16")


def test_a_truncated_shard_is_named(tmp_path: Path) -> None:
    _write(tmp_path / "a.bin", np.arange(64))
    with (tmp_path / "b.bin").open("wb") as f:
        f.write(np.arange(64, dtype=np.uint16).tobytes()[:-1])  # the last token cut in half
    with pytest.raises(TokenDataError, match=r"b.bin is truncated: 127 bytes .* multiple of 2"):
        TokenDataset(tmp_path, 4, dtype="uint16")


def test_a_vocabulary_the_dtype_cannot_hold(tmp_path: Path) -> None:
    _write(tmp_path / "train_000000.bin", np.arange(100))
    _meta(tmp_path, {"train": [("train_000000.bin", 100)]}, vocab_size=70_000)
    with pytest.raises(TokenDataError, match=r"vocab_size 70000 does not fit in uint16.*uint32"):
        TokenDataset(tmp_path, 4)
    with pytest.raises(TokenDataError, match="does not fit in uint16"):
        TokenDataset(tmp_path / "train_000000.bin", 4, dtype="uint16", vocab_size=70_000)
    assert dtype_for_vocab(65_536) == "uint16" and dtype_for_vocab(65_537) == "uint32"


def test_ids_outside_the_vocabulary_are_found_in_a_chunked_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokens_mod, "_VERIFY_CHUNK", 16)  # several chunks per shard
    ids = np.arange(100) % 50
    ids[77] = 300
    _write(tmp_path / "train_000000.bin", np.arange(40) % 50)
    _write(tmp_path / "train_000001.bin", ids)
    _meta(tmp_path, {"train": [("train_000000.bin", 40), ("train_000001.bin", 100)]}, vocab_size=50)
    with pytest.raises(
        TokenDataError, match=r"train_000001.bin: token 77 has id 300.*vocabulary of 50"
    ):
        TokenDataset(tmp_path, 4)
    ds = TokenDataset(tmp_path, 4, verify=False)  # skipping the scan is the caller's choice
    assert ds.tokens(40 + 77, 40 + 78).tolist() == [300]
    # the lone file with the vocabulary given by the caller is checked too
    with pytest.raises(TokenDataError, match="token 77 has id 300"):
        TokenDataset(tmp_path / "train_000001.bin", 4, dtype="uint16", vocab_size=50)


def test_a_block_size_the_data_cannot_fill(tmp_path: Path) -> None:
    _write(tmp_path / "t.bin", np.arange(10))
    assert len(TokenDataset(tmp_path / "t.bin", 9, dtype="uint16")) == 1
    with pytest.raises(TokenDataError, match=r"10 tokens cannot fill one window of block_size 10"):
        TokenDataset(tmp_path / "t.bin", 10, dtype="uint16")
    with pytest.raises(ValueError, match="block_size"):
        TokenDataset(tmp_path / "t.bin", 0, dtype="uint16")


def test_memory_maps_are_read_only_and_reopen_after_pickling(tmp_path: Path) -> None:
    ids = _write(tmp_path / "t.bin", np.arange(500) % 256)
    ds = TokenDataset(tmp_path / "t.bin", 8, dtype="uint16", vocab_size=256)
    maps = ds._mapped()
    assert all(isinstance(m, np.memmap) and m.mode == "r" for m in maps)
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 2000  # the tokens are not in the pickle
    assert clone[7][1].tolist() == ids[57:65].tolist()
