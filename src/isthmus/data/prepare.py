"""Tokenize text files into the token-directory format that :class:`TokenDataset` reads.

``prepare(["a.txt", "b.txt"], "data/tok")`` writes ``train_000000.bin ...`` (the first
``1 - eval_fraction`` of the tokens), ``val_000000.bin ...`` (the rest), and ``meta.json`` (dtype,
vocabulary size, tokenizer, per-shard token counts). Files are read in the order given.

Tokenizers:

* ``"bytes"`` (default): each byte is a token (ids 0-255, uint16), no dependencies, no training;
  files are concatenated as they are.
* ``"bpe"``: a byte-level BPE (GPT-2's scheme) trained with Hugging Face ``tokenizers`` on the
  same files, saved as ``tokenizer.json`` next to the shards (load it with
  ``tokenizers.Tokenizer.from_file`` or ``transformers.PreTrainedTokenizerFast(tokenizer_file=)``).
  An end-of-text token ``<|endoftext|>`` follows each file, so documents stay apart. Text must
  be UTF-8 (a literal ``<|endoftext|>`` in it becomes that token).

Memory stays bounded: text is read and tokenized in chunks, tokens go to a temporary file in
the output directory (so the directory needs about twice the tokens' size while this runs),
then are copied into shards once the total, and so the validation split, is known. ``meta.json``
is written last and atomically: a directory without it was not finished.

The command line ``isthmus data prepare TEXT... --out DIR`` is :func:`main`
(:func:`add_prepare_arguments` and :func:`run_prepare` for embedding it in another parser).
"""

from __future__ import annotations

import argparse
import codecs
import itertools
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from isthmus.data.tokens import (
    DTYPES,
    META_NAME,
    ShardInfo,
    TokenDataError,
    TokenMeta,
    dtype_for_vocab,
)

__all__ = [
    "DEFAULT_BPE_VOCAB",
    "EOT",
    "TOKENIZERS",
    "PrepareError",
    "PrepareResult",
    "add_prepare_arguments",
    "main",
    "prepare",
    "run_prepare",
]

TOKENIZERS = ("bytes", "bpe")
EOT = "<|endoftext|>"
DEFAULT_BPE_VOCAB = 8192
DEFAULT_SHARD_TOKENS = 100_000_000  # nanoGPT's FineWeb shards hold 1e8 tokens
DEFAULT_EVAL_FRACTION = 0.01
TOKENIZER_FILE = "tokenizer.json"
_READ_BYTES = 4 << 20  # bytes read (and, for BPE, text tokenized) at a time
_COPY_TOKENS = 1 << 22  # tokens copied from the temporary file into a shard at a time
_PROGRESS_MIN_BYTES = 8 << 20  # smaller inputs finish in about a second: no bar


class PrepareError(ValueError):
    """Input that ``prepare`` cannot turn into token files; the message says what to change."""


@dataclass(frozen=True)
class PrepareResult:
    """What :func:`prepare` wrote."""

    out_dir: Path
    tokenizer: str
    vocab_size: int
    dtype: str
    train_tokens: int
    val_tokens: int
    train_shards: tuple[Path, ...]
    val_shards: tuple[Path, ...]
    meta_path: Path
    tokenizer_path: Path | None
    """``tokenizer.json`` for ``"bpe"``, None for ``"bytes"``."""


class _Progress:
    """A rich progress bar on stderr over bytes read, or nothing when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._bar.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()

    def phase(self, description: str, total: int) -> None:
        if self._bar is not None:
            self._task = self._bar.add_task(description, total=total)

    def advance(self, n: int) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, n)


_CUT_BEFORE = frozenset(" \t\n\r")
_CUT_SCAN = 1 << 16  # characters searched back from a chunk's end for a place to cut


def _cut(text: str) -> int:
    """Where to end a chunk of text so that BPE gives the same tokens as on the whole file.

    GPT-2's pre-tokenizer splits text into pieces before merging, so a cut is exact when (a) a
    piece ends there in the whole text and (b) the chunk before it splits the same way alone.
    Just before a space, tab or newline that follows a non-space character both hold: no
    pattern runs from a non-space character into whitespace, so a piece ends there; and the
    chunk then ends with no whitespace run, the only place where ending the text early changes
    a match (``\\s+(?!\\S)`` looks ahead). No pattern looks back, so the next chunk splits as
    the rest of the file does. Returns the offset of the last such place in the final
    ``_CUT_SCAN`` characters, or 0 if there is none.
    """
    for k in range(len(text) - 1, max(0, len(text) - _CUT_SCAN), -1):
        if text[k] in _CUT_BEFORE and not text[k - 1].isspace():
            return k
    return 0


def _text_chunks(path: Path, progress: _Progress, chunk_bytes: int = _READ_BYTES) -> Iterator[str]:
    """The UTF-8 text of ``path`` in pieces of about ``chunk_bytes``, cut where :func:`_cut`
    allows (text with no such place for 4 chunks, i.e. no word followed by whitespace, is cut
    anyway to bound memory; the tokens there may differ from encoding it whole).

    Raises PrepareError for text that is not UTF-8, naming the file and the byte offset.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    carry = ""
    offset = 0
    with path.open("rb") as f:
        while True:
            raw = f.read(chunk_bytes)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise PrepareError(
                    f"{path} is not UTF-8 text (bad byte near offset {offset + e.start}): convert "
                    f"it (e.g. `iconv -f latin1 -t utf-8`) or use --tokenizer bytes"
                ) from e
            offset += len(raw)
            progress.advance(len(raw))
            buf = carry + text
            if not raw:
                if buf:
                    yield buf
                return
            cut = _cut(buf)
            if cut == 0 and len(buf) > 4 * chunk_bytes:
                cut = len(buf)  # bound memory on text with no safe cut
            if cut:
                yield buf[:cut]
            carry = buf[cut:]


def _check_inputs(text_files: Sequence[str | os.PathLike[str]]) -> list[Path]:
    if isinstance(text_files, str | os.PathLike):
        text_files = [text_files]
    files = [Path(p) for p in text_files]
    if not files:
        raise PrepareError("no text files given: pass at least one")
    for p in files:
        if p.is_dir():
            raise PrepareError(f"{p} is a directory: pass its files (e.g. {p}/*.txt)")
        if not p.is_file():
            raise PrepareError(f"{p} does not exist (or is not a regular file)")
    return files


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    ours = [out / META_NAME, out / TOKENIZER_FILE]
    ours = [p for p in ours if p.exists()]
    ours += sorted(out.glob("train_*.bin")) + sorted(out.glob("val_*.bin"))
    if ours and not overwrite:
        raise PrepareError(
            f"{out} already holds prepared data ({ours[0].name}, ...): choose another --out or "
            f"pass --overwrite (overwrite=True) to replace it"
        )
    for p in ours:
        p.unlink()


def _bpe(files: list[Path], vocab_size: int, progress: _Progress) -> Any:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise ImportError(
            "tokenizer 'bpe' needs the Hugging Face tokenizers package: pip install tokenizers "
            "(or use the default byte tokenizer)"
        ) from e
    tok = Tokenizer(models.BPE())
    # No prefix space: it would be added to every chunk and change the tokens at chunk starts.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    progress.phase("training BPE", sum(p.stat().st_size for p in files))
    tok.train_from_iterator((c for p in files for c in _text_chunks(p, progress)), trainer=trainer)
    return tok


def _encode_bytes(files: list[Path], tmp: Path, progress: _Progress) -> int:
    n = 0
    with tmp.open("wb") as out:
        for p in files:
            with p.open("rb") as f:
                while raw := f.read(_READ_BYTES):
                    np.frombuffer(raw, dtype=np.uint8).astype(DTYPES["uint16"]).tofile(out)
                    n += len(raw)
                    progress.advance(len(raw))
    return n


def _encode_bpe(tok: Any, files: list[Path], tmp: Path, dtype: str, progress: _Progress) -> int:
    eot = tok.token_to_id(EOT)
    n = 0
    with tmp.open("wb") as out:
        for p in files:
            batch: list[str] = []
            chunks = _text_chunks(p, progress, _READ_BYTES // 4)
            for c in itertools.chain(chunks, [None]):
                if c is not None:
                    batch.append(c)
                if batch and (c is None or len(batch) == 4):
                    # encode_batch runs the chunks on tokenizers' own threads
                    for enc in tok.encode_batch(batch):
                        np.asarray(enc.ids, dtype=DTYPES[dtype]).tofile(out)
                        n += len(enc.ids)
                    batch = []
            np.asarray([eot], dtype=DTYPES[dtype]).tofile(out)
            n += 1
    return n


def _write_shards(
    src: np.memmap[Any, Any],
    start: int,
    stop: int,
    out: Path,
    split: str,
    shard_tokens: int,
    written: list[Path],
) -> list[ShardInfo]:
    infos: list[ShardInfo] = []
    for k, a in enumerate(range(start, stop, shard_tokens)):
        b = min(stop, a + shard_tokens)
        path = out / f"{split}_{k:06d}.bin"
        written.append(path)
        with path.open("wb") as f:
            for c in range(a, b, _COPY_TOKENS):
                src[c : min(b, c + _COPY_TOKENS)].tofile(f)
        infos.append(ShardInfo(path.name, b - a))
    return infos


def prepare(
    text_files: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: str = "bytes",
    vocab_size: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    overwrite: bool = False,
    progress: bool = True,
) -> PrepareResult:
    """Tokenize ``text_files`` into shards and ``meta.json`` under ``out_dir``.

    ``tokenizer`` is ``"bytes"`` or ``"bpe"``; ``vocab_size`` is the BPE's target size (default
    8192; the result may be smaller on little text) and must be None or 256 for bytes.
    ``shard_tokens`` caps each shard; the last ``eval_fraction`` of the tokens (at least one
    token when positive) forms the ``val`` split. A progress bar shows on stderr for inputs of
    8 MiB and more unless ``progress=False``.

    On failure nothing half-written is left behind (shards and ``tokenizer.json`` of this call
    are removed; ``meta.json`` is only written at the end). Raises PrepareError for a missing
    input, a directory given as input, non-UTF-8 text with ``"bpe"``, no text at all, too
    little text for both splits, an output directory that already holds prepared data (unless
    ``overwrite=True``, which replaces it) or a bad option; ImportError naming
    ``pip install tokenizers`` when ``"bpe"`` is asked for without that package; OSError for
    disk errors.
    """
    files = _check_inputs(text_files)
    if tokenizer not in TOKENIZERS:
        raise PrepareError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    if tokenizer == "bytes" and vocab_size not in (None, 256):
        raise PrepareError(
            f"the byte tokenizer has exactly 256 ids; vocab_size={vocab_size} needs --tokenizer bpe"
        )
    if tokenizer == "bpe":
        vocab_size = DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size
        if not isinstance(vocab_size, int) or not 257 <= vocab_size <= 1 << 32:
            raise PrepareError(
                f"BPE vocab_size must be an int in [257, 2^32] (256 bytes plus {EOT} plus "
                f"merges), got {vocab_size!r}"
            )
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise PrepareError(f"shard_tokens must be an int >= 1, got {shard_tokens!r}")
    if not 0.0 <= eval_fraction < 1.0:
        raise PrepareError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    total_bytes = sum(p.stat().st_size for p in files)
    tmp = out / f".prepare-{os.getpid()}.tokens"
    written: list[Path] = []
    try:
        with _Progress(progress and total_bytes >= _PROGRESS_MIN_BYTES) as bar:
            tok_path: Path | None = None
            eot_id: int | None = None
            if tokenizer == "bytes":
                vocab, dtype = 256, "uint16"
                bar.phase("reading bytes", total_bytes)
                n = _encode_bytes(files, tmp, bar)
            else:
                assert vocab_size is not None
                tok = _bpe(files, vocab_size, bar)
                vocab = int(tok.get_vocab_size())
                dtype = dtype_for_vocab(vocab)
                eot_id = int(tok.token_to_id(EOT))
                bar.phase("tokenizing", total_bytes)
                n = _encode_bpe(tok, files, tmp, dtype, bar)
                tok_path = out / TOKENIZER_FILE
                written.append(tok_path)
                tok.save(str(tok_path))
        n_text = n - (len(files) if eot_id is not None else 0)
        if n_text <= 0:
            raise PrepareError(f"the input files hold no text ({', '.join(map(str, files))})")
        n_val = max(1, round(n * eval_fraction)) if eval_fraction > 0 else 0
        if n_val >= n:
            raise PrepareError(
                f"{n} tokens cannot be split into train and val with eval_fraction="
                f"{eval_fraction}: give more text or eval_fraction=0"
            )
        src = np.memmap(tmp, dtype=DTYPES[dtype], mode="r")
        try:
            train = _write_shards(src, 0, n - n_val, out, "train", shard_tokens, written)
            val = _write_shards(src, n - n_val, n, out, "val", shard_tokens, written)
        finally:
            del src  # release the map before the file is removed
        meta = TokenMeta(
            dtype=dtype,
            vocab_size=vocab,
            tokenizer=tokenizer,
            splits={"train": tuple(train), "val": tuple(val)},
            tokenizer_file=TOKENIZER_FILE if tok_path else None,
            eot_id=eot_id,
            extra={"sources": [str(p) for p in files]},
        )
        meta.write(out / META_NAME)
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return PrepareResult(
        out_dir=out,
        tokenizer=tokenizer,
        vocab_size=vocab,
        dtype=dtype,
        train_tokens=n - n_val,
        val_tokens=n_val,
        train_shards=tuple(out / s.file for s in train),
        val_shards=tuple(out / s.file for s in val),
        meta_path=out / META_NAME,
        tokenizer_path=tok_path,
    )


# -- command line ----------------------------------------------------------------------------


def add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``prepare``'s arguments to ``parser`` (the ``isthmus data prepare`` subcommand)."""
    parser.add_argument("text_files", nargs="+", metavar="TEXT_FILE", help="text files, in order")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        "--tokenizer",
        choices=TOKENIZERS,
        default="bytes",
        help="bytes: ids 0-255, no training (default); bpe: train a byte-level BPE "
        "(needs `pip install tokenizers`) and save tokenizer.json",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help=f"BPE vocabulary size (default {DEFAULT_BPE_VOCAB})",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS:,})",
    )
    parser.add_argument(
        "--eval-fraction",
        type=float,
        default=DEFAULT_EVAL_FRACTION,
        metavar="F",
        help=f"last fraction of the tokens kept for validation (default {DEFAULT_EVAL_FRACTION})",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace data prepared earlier in DIR"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_prepare(args: argparse.Namespace) -> int:
    """Run ``prepare`` from parsed arguments. Returns 0, or 2 with a message on stderr for bad
    input (a missing file, non-UTF-8 text, an occupied --out, bad options, no tokenizers)."""
    try:
        r = prepare(
            args.text_files,
            args.out,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            shard_tokens=args.shard_tokens,
            eval_fraction=args.eval_fraction,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (PrepareError, TokenDataError, ImportError, OSError) as e:
        print(f"isthmus data prepare: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {r.train_tokens:,} train and {r.val_tokens:,} val tokens "
        f"({len(r.train_shards)}+{len(r.val_shards)} shards, {r.dtype}, vocab {r.vocab_size}, "
        f"tokenizer {r.tokenizer}) to {r.out_dir}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``isthmus data prepare`` as a standalone program; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="isthmus data prepare",
        description="Tokenize text files into token shards for isthmus.data.TokenDataset.",
    )
    add_prepare_arguments(parser)
    return run_prepare(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
