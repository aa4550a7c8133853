"""prepare: text files to token shards and meta.json (bytes, and a real BPE trained with Hugging
Face tokenizers when it is installed), its errors, and the `isthmus data prepare` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from isthmus.data import PrepareError, TokenDataset, prepare
from isthmus.data.prepare import EOT, add_prepare_arguments, main, run_prepare

try:
    import tokenizers
except ImportError:  # pragma: no cover - depends on the environment
    tokenizers = None

# `isthmus.data.prepare` is the function; the module of the same name is reached this way
prepare_mod = importlib.import_module("isthmus.data.prepare")

needs_tokenizers = pytest.mark.skipif(
    tokenizers is None, reason="Hugging Face `tokenizers` is not installed (pip install tokenizers)"
)


def _texts(tmp_path: Path) -> list[Path]:
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_text("".join(f"def f{i}(x):\n    return x * {i} + 1\n\n" for i in range(300)))
    b.write_text("Grüße, naïve café! " * 200 + "\n\tindented\n  \n\nend\n")
    return [a, b]


def _stream(paths: list[Path]) -> np.ndarray:
    return np.concatenate([np.fromfile(p, dtype="<u2") for p in paths]).astype(np.int64)


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


def test_bytes_writes_shards_meta_and_a_val_tail(tmp_path: Path) -> None:
    files = _texts(tmp_path)
    raw = b"".join(p.read_bytes() for p in files)
    out = tmp_path / "tok"
    r = prepare(files, out, shard_tokens=4000, eval_fraction=0.1)
    assert r.tokenizer == "bytes" and r.vocab_size == 256 and r.dtype == "uint16"
    assert r.train_tokens + r.val_tokens == len(raw)
    assert r.val_tokens == round(len(raw) * 0.1)
    assert [p.name for p in r.train_shards][:2] == ["train_000000.bin", "train_000001.bin"]
    assert len(r.train_shards) == -(-r.train_tokens // 4000)
    assert [p.name for p in r.val_shards] == ["val_000000.bin"]
    assert r.tokenizer_path is None
    train, val = _stream(list(r.train_shards)), _stream(list(r.val_shards))
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == raw  # nothing lost or moved
    meta = json.loads(r.meta_path.read_text())
    assert meta["format"] == "isthmus-tokens" and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == 256 and meta["tokenizer"] == "bytes"
    assert [s["tokens"] for s in meta["splits"]["train"]] == [
        np.fromfile(p, dtype="<u2").size for p in r.train_shards
    ]
    assert meta["sources"] == [str(p) for p in files]
    assert not [n for n in _leftovers(out) if n.startswith(".")]  # no temporary file left
    ds = TokenDataset(out, 64)
    assert ds.num_tokens == r.train_tokens and ds.vocab_size == 256
    assert ds[0][0].tolist() == list(raw[:64])
    assert TokenDataset(out, 64, split="val").num_tokens == r.val_tokens
    # eval_fraction=0: no val split at all
    r0 = prepare(files, tmp_path / "tok0", eval_fraction=0.0)
    assert r0.val_tokens == 0 and r0.val_shards == ()
    with pytest.raises(Exception, match="no shards"):
        TokenDataset(tmp_path / "tok0", 8, split="val")


def test_an_occupied_output_directory_needs_overwrite(tmp_path: Path) -> None:
    files = _texts(tmp_path)
    out = tmp_path / "tok"
    prepare(files, out, shard_tokens=2000)
    n_before = len(list(out.glob("train_*.bin")))
    with pytest.raises(PrepareError, match=r"already holds prepared data.*--overwrite"):
        prepare(files[:1], out)
    r = prepare(files[1:], out, overwrite=True)
    assert len(r.train_shards) == 1 < n_before
    assert sorted(p.name for p in out.glob("*.bin")) == ["train_000000.bin", "val_000000.bin"]


def test_bad_input_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    files = _texts(tmp_path)
    out = tmp_path / "tok"
    with pytest.raises(PrepareError, match=r"missing\.txt does not exist"):
        prepare([*files, tmp_path / "missing.txt"], out)
    with pytest.raises(PrepareError, match="is a directory"):
        prepare([tmp_path], out)
    with pytest.raises(PrepareError, match=r"256 ids.*--tokenizer bpe"):
        prepare(files, out, vocab_size=1000)
    with pytest.raises(PrepareError, match="tokenizer must be one of"):
        prepare(files, out, tokenizer="wordpiece")
    with pytest.raises(PrepareError, match="eval_fraction"):
        prepare(files, out, eval_fraction=1.0)
    with pytest.raises(PrepareError, match="shard_tokens"):
        prepare(files, out, shard_tokens=0)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(PrepareError, match="hold no text"):
        prepare([empty], out)
    assert _leftovers(out) == []
    one = tmp_path / "one.txt"
    one.write_text("x")
    with pytest.raises(PrepareError, match="cannot be split"):
        prepare([one], out, eval_fraction=0.5)
    assert _leftovers(out) == []


def test_a_progress_bar_on_long_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _texts(tmp_path)
    prepare(files, tmp_path / "quiet")
    assert "reading bytes" not in capsys.readouterr().err  # short input: no bar
    monkeypatch.setattr(prepare_mod, "_PROGRESS_MIN_BYTES", 0)
    prepare(files, tmp_path / "loud")
    assert "reading bytes" in capsys.readouterr().err
    prepare(files, tmp_path / "off", progress=False)
    assert "reading bytes" not in capsys.readouterr().err


@needs_tokenizers
def test_bpe_trains_saves_and_round_trips(tmp_path: Path) -> None:
    files = _texts(tmp_path)
    out = tmp_path / "bpe"
    r = prepare(files, out, tokenizer="bpe", vocab_size=400, eval_fraction=0.05)
    assert r.tokenizer == "bpe" and r.dtype == "uint16" and 257 < r.vocab_size <= 400
    assert r.tokenizer_path == out / "tokenizer.json" and r.tokenizer_path.is_file()
    tok = tokenizers.Tokenizer.from_file(str(r.tokenizer_path))
    assert tok.get_vocab_size() == r.vocab_size
    meta = json.loads(r.meta_path.read_text())
    eot = tok.token_to_id(EOT)
    assert meta["eot_id"] == eot and meta["tokenizer_file"] == "tokenizer.json"
    ids = _stream([*r.train_shards, *r.val_shards]).tolist()
    assert ids.count(eot) == 2 and ids[-1] == eot  # one after each file
    cut = ids.index(eot)
    assert tok.decode(ids[:cut]) == files[0].read_text()
    assert tok.decode(ids[cut + 1 : -1]) == files[1].read_text()
    assert len(ids) < 0.6 * sum(p.stat().st_size for p in files)  # merges compress the text
    ds = TokenDataset(out, 32)  # its id scan passes against the trained vocabulary
    assert ds.vocab_size == r.vocab_size and ds.tokenizer_path == r.tokenizer_path


@needs_tokenizers
def test_bpe_in_chunks_gives_the_tokens_of_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _texts(tmp_path)
    monkeypatch.setattr(prepare_mod, "_READ_BYTES", 256)  # many chunks per file
    r = prepare(files, tmp_path / "bpe", tokenizer="bpe", vocab_size=350, eval_fraction=0)
    tok = tokenizers.Tokenizer.from_file(str(r.tokenizer_path))
    whole = [*tok.encode(files[0].read_text()).ids, tok.token_to_id(EOT)]
    whole += [*tok.encode(files[1].read_text()).ids, tok.token_to_id(EOT)]
    assert _stream(list(r.train_shards)).tolist() == whole


@needs_tokenizers
@pytest.mark.parametrize("read_bytes", [64, 200, 1000])
def test_bpe_chunks_match_on_random_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_bytes: int
) -> None:
    rng = random.Random(read_bytes)
    alphabet = ["a", "bc", "Zé", "ß", "9", "42", "!", "'s", "(", ".", "🙂", "x"] * 3
    alphabet += [" ", " ", "  ", "\n", "\n\n", "\t", "\r\n", " \n "]
    text = "".join(rng.choice(alphabet) for _ in range(6000))
    f = tmp_path / "random.txt"
    f.write_text(text)
    monkeypatch.setattr(prepare_mod, "_READ_BYTES", read_bytes)
    r = prepare([f], tmp_path / "bpe", tokenizer="bpe", vocab_size=300, eval_fraction=0)
    tok = tokenizers.Tokenizer.from_file(str(r.tokenizer_path))
    ids = _stream(list(r.train_shards)).tolist()
    assert ids == [*tok.encode(f.read_bytes().decode()).ids, tok.token_to_id(EOT)]  # \r\n kept


@needs_tokenizers
def test_bpe_refuses_text_that_is_not_utf8(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"ok\n" * 10 + "caf\xe9\n".encode("latin-1"))
    out = tmp_path / "bpe"
    with pytest.raises(
        PrepareError, match=r"latin1.txt is not UTF-8 text \(bad byte near offset 33\)"
    ):
        prepare([bad], out, tokenizer="bpe", vocab_size=300)
    assert _leftovers(out) == []
    assert prepare([bad], tmp_path / "bytes").train_tokens > 0  # the byte tokenizer takes any bytes


def test_bpe_without_tokenizers_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    files = _texts(tmp_path)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        prepare(files, tmp_path / "bpe", tokenizer="bpe")
    assert _leftovers(tmp_path / "bpe") == []
    assert main([str(files[0]), "--out", str(tmp_path / "bpe"), "--tokenizer", "bpe"]) == 2
    assert "pip install tokenizers" in capsys.readouterr().err


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _texts(tmp_path)
    out = tmp_path / "cli"
    argv = [*map(str, files), "--out", str(out), "--shard-tokens", "5000", "--eval-fraction", "0.2"]
    assert main([*argv, "--no-progress"]) == 0
    assert "train and" in capsys.readouterr().out
    assert TokenDataset(out, 16, split="val").num_tokens > 0
    assert main(argv) == 2  # occupied
    assert "--overwrite" in capsys.readouterr().err
    assert main([str(tmp_path / "nope.txt"), "--out", str(out)]) == 2
    assert "nope.txt does not exist" in capsys.readouterr().err
    # embedded as a subcommand, as the isthmus CLI does
    parser = argparse.ArgumentParser(prog="isthmus")
    sub = parser.add_subparsers(dest="command")
    data = sub.add_parser("data").add_subparsers(dest="data_command")
    add_prepare_arguments(data.add_parser("prepare"))
    args = parser.parse_args(["data", "prepare", str(files[0]), "--out", str(tmp_path / "sub")])
    assert args.tokenizer == "bytes" and args.eval_fraction == 0.01
    assert run_prepare(args) == 0
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["data", "prepare", str(files[0])])  # --out is required
    assert e.value.code == 2
