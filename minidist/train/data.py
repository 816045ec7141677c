"""Training data: text tokenized once into a cache of memory-mapped token files, and
batches that are a pure function of (seed, split, step).

Text -> tokens: the byte tokenizer (vocab 256: token = byte value), so any text file works and
no vocabulary file is needed; or a BPE (--tokenizer's, or the --init-from folder's:
minidist/train/bpe.py; uint16 tokens in the cache). Which files, and how they split into
train and val: minidist/train/data_files.py (no --data: Python's own sources). The start-up
line says which rule split the data.
Documents: each file's part of a split is one document. Under a BPE with `<|endoftext|>`
(GPT-2's, and every one examples/train_tokenizer.py writes) each document ends with that
token, as nanoGPT's prepare scripts end theirs (llm.c's put it before each), so the model
learns where one text stops and an unrelated one starts (first-use walk 33: the files ran
into each other). A file's train part, cut at 90%, ends at a line's end (data_files
cut_point): what follows it in the stream is another file. In bytes there is no such
token: documents are joined, each ending in a newline.

Cache: tokens are written once to `train.bin` / `val.bin` (uint8, or uint16 from a BPE) and
`meta.json`, in `.minidist-cache/<key>/` next to the data, or under `~/.cache/minidist/` (or
$MINIDIST_CACHE, or `--cache-dir`) when that place is not writable: always so for the
standard library, whose directory may be read-only. The key hashes the file list, sizes and
mtimes and the tokenizer's identity, so edited data (or another tokenizer) is tokenised
again. Files are built in a temporary directory and renamed into place. meta.json holds the
tokens' digest (`digest`): a checkpoint records it, and a resume on other contents under
the same path says so (minidist/train/resume.py).

Batches: `get_batch(seed, split, step, batch_size, block_size)` draws batch_size random
windows from a generator seeded by (seed, split, step) and returns the GLOBAL batch (x, y),
int64 numpy arrays (B, T) with y = x shifted by one. Data-parallel ranks slice their rows;
a resumed run needs only the step.
Tests: tests/test_data.py.
"""
import errno
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile

import numpy as np

from minidist.train.data_files import (DataError, left_out_text, list_files, not_utf8,
                                       split_files)

_SPLITS = {"train": 0, "val": 1}
_VERSION = 4     # 2: the held-out files' fallback; 3: <|endoftext|> ends each document; 4:
#                  the train part cut at a line's start


class ByteTokenizer:
    """Text <-> token ids, one token per UTF-8 byte."""
    vocab_size = 256
    name = key = "bytes"          # key: its identity in the cache's key
    eot = None                    # no token ends a document: a newline does

    def encode(self, text):
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids):
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", "replace")


def _cache_key(root, files, tokenizer):
    h = hashlib.sha256(f"v{_VERSION} {tokenizer.key} ".encode() + os.fsencode(
        os.path.abspath(root)))
    for f in files:             # (names as bytes: a Latin-1 name is no UTF-8: walk 33)
        st = os.stat(os.path.join(root, f))
        h.update(b"\0" + os.fsencode(f) + f"\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def default_cache_root():
    return os.environ.get("MINIDIST_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "minidist")


def _cache_dir(path, root, files, cache_dir, tokenizer):
    key = _cache_key(root, files, tokenizer)
    if cache_dir:
        return os.path.join(cache_dir, key)
    if path is None:
        return os.path.join(default_cache_root(), f"stdlib-py{sysconfig.get_python_version()}"
                            f"-{key}")
    beside = os.path.join(root if os.path.isdir(path) else os.path.dirname(
        os.path.abspath(path)), ".minidist-cache")
    if os.access(os.path.dirname(beside), os.W_OK):
        return os.path.join(beside, key)
    return os.path.join(default_cache_root(), key)


def _tokens(documents, tokenizer):
    """The token array of a split's documents (bytes each): the bytes themselves (uint8)
    for the byte tokenizer; else the tokenizer's ids (uint16 while the vocabulary fits) of
    each document's text (invalid UTF-8 replaced), each followed by its `eot` where it has
    one (module docstring)."""
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(b"".join(documents), np.uint8)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    end = np.array([] if tokenizer.eot is None else [tokenizer.eot], dtype)
    parts = [np.concatenate([tokenizer.encode(d.decode("utf-8", "replace")).astype(dtype),
                             end]) for d in documents]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def unigram_entropy(counts):
    """Nats per token of the frequencies `counts` (tokens counted by id): the loss of a model
    that ignores context, which the logs print beside the val loss."""
    p = counts[counts > 0] / max(counts.sum(), 1)
    return float(-(p * np.log(p)).sum())


def _build(root, files, out_dir, tokenizer):
    train, val, rule = split_files(root, files)
    replaced = 0 if isinstance(tokenizer, ByteTokenizer) else \
        sum(not_utf8(d) for d in train + val)
    train, val = _tokens(train, tokenizer), _tokens(val, tokenizer)
    digest = hashlib.blake2b(train.tobytes(), digest_size=8)
    digest.update(val.tobytes())
    meta = {"version": _VERSION, "tokenizer": tokenizer.name, "split": rule,
            "not_utf8": replaced, "digest": digest.hexdigest(),
            "vocab_size": tokenizer.vocab_size, "dtype": str(train.dtype), "root": root,
            "files": len(files), "train_tokens": len(train), "val_tokens": len(val),
            "unigram_entropy": unigram_entropy(np.bincount(train,
                                                           minlength=tokenizer.vocab_size))}
    try:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(out_dir))
    except OSError as e:                # a read-only --cache-dir (or the default's folder)
        raise DataError(f"cannot cache the tokenized text in {os.path.dirname(out_dir)} "
                        f"({e.strerror or e}): give --cache-dir a folder you can write "
                        "to") from None
    try:
        for name, blob in (("train.bin", train), ("val.bin", val)):
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(blob.tobytes())
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        os.rename(tmp, out_dir)          # atomic; loses quietly to another process's build
    except OSError as e:
        if not os.path.isfile(os.path.join(out_dir, "meta.json")):   # (walk 37: a full disk
            n = train.nbytes + val.nbytes                              # was a traceback)
            need = f"{n / 2 ** 20:,.1f} MiB" if n >= 2 ** 17 else f"{n / 2 ** 10:,.0f} KiB"
            full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
            room = f"with room for {need}" if full else "you can write to"
            raise DataError(f"cannot cache the tokenized text in {os.path.dirname(out_dir)} "
                            f"({e.strerror or e}): give --cache-dir a folder {room}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cache_problem(cache, meta):
    """What is wrong with a cache folder's token files against its meta.json (a file
    deleted, a partial copy: a traceback per rank, or training on what was left while the
    data line printed the full count; walk 33), or None."""
    size = np.dtype(meta.get("dtype", "uint8")).itemsize
    for split in _SPLITS:
        path = os.path.join(cache, f"{split}.bin")
        want = meta[f"{split}_tokens"] * size
        if not os.path.isfile(path):
            return f"{split}.bin is missing"
        if os.path.getsize(path) != want:
            return f"{split}.bin holds {os.path.getsize(path):,} bytes, meta.json says {want:,}"
    return None


class TokenData:
    """The train and val token streams of one corpus, memory-mapped from the cache.

    `.vocab_size`, `.tokenizer`, `.unigram_entropy` (nats per token of the train split's token
    frequencies: the loss of a model that ignores context), `.source` (for logs), `.built`
    (whether this process tokenized the text, or found the cache made), `.digest` (of the
    tokens: a checkpoint records it).
    `tokenizer`: the byte tokenizer (default), or a BPE (minidist/train/bpe.py).
    """

    def __init__(self, path=None, cache_dir=None, tokenizer=None):
        self.tokenizer = tokenizer or ByteTokenizer()
        root, files, self.left_out = list_files(path)
        self.cache = _cache_dir(path, root, files, cache_dir, self.tokenizer)
        self.built = not os.path.isfile(os.path.join(self.cache, "meta.json"))  # tokenized here
        if self.built:
            _build(root, files, self.cache, self.tokenizer)
        with open(os.path.join(self.cache, "meta.json")) as f:
            self.meta = json.load(f)
        self.vocab_size = self.tokenizer.vocab_size
        self.unigram_entropy = self.meta["unigram_entropy"]
        self.digest = self.meta.get("digest")          # the tokens' identity: resume.py
        self.source = path or f"the Python {sysconfig.get_python_version()} standard library"
        self.splits = {}
        damaged = cache_problem(self.cache, self.meta)
        if damaged:
            raise DataError(f"the tokenized cache {self.cache} is damaged ({damaged}); delete "
                            "that folder and run again (it is built anew from the text)")
        for split in _SPLITS:
            if self.meta[f"{split}_tokens"] == 0:
                raise DataError(f"{self.source}: the {split} split is empty ({len(files)} "
                                f"file(s): {self.meta['train_tokens']:,} train / "
                                f"{self.meta['val_tokens']:,} val tokens); give more text")
            self.splits[split] = np.memmap(os.path.join(self.cache, f"{split}.bin"),
                                           dtype=self.meta.get("dtype", "uint8"), mode="r")

    def check_block_size(self, block_size, fixed=None):
        """Both splits hold a window of block_size + 1 tokens: a short val split is found
        before step 0, not at the first evaluation after training ran. The error names the
        shorter split, so the --block-size it suggests fits both; `fixed` (the resumed
        checkpoint, whose block size cannot change): it suggests more text only."""
        split, tokens = min(self.splits.items(), key=lambda kv: len(kv[1]))
        if len(tokens) >= block_size + 1:
            return
        fix = (f"give more text ({fixed}'s block size cannot change)" if fixed else
               f"give a --block-size below {len(tokens)} or more text" if len(tokens) > 8
               else "give more text" if len(tokens) > 1     # (not "--block-size below 2")
               else "give more text (each split needs at least 2 tokens)")
        n = f"{len(tokens):,} token" + ("s" if len(tokens) != 1 else "")
        raise DataError(f"{self.source}: the {split} split has {n}, fewer "
                        f"than --block-size {block_size} + 1; {fix}")

    def describe(self):
        kind = "" if isinstance(self.tokenizer, ByteTokenizer) else f" {self.tokenizer.name}"
        left = left_out_text(self.left_out)
        return (f"{self.meta['train_tokens']:,} train / {self.meta['val_tokens']:,} val"
                f"{kind} tokens from {self.meta['files']} file(s), cache {self.cache}; "
                f"val split: {self.meta.get('split', 'held out')}"
                + (f"; left out: {left}" if left else "")
                + (f"; {self.meta['not_utf8']:,} character(s) not UTF-8, read as U+FFFD "
                   "(re-encode the text as UTF-8)" if self.meta.get("not_utf8") else ""))

    def get_batch(self, seed, split, step, batch_size, block_size):
        """The global batch for (seed, split, step): x, y int64 arrays (batch_size,
        block_size), y[i, t] = the token after x[i, t]."""
        return draw_batch([self.splits[split]], seed, split, step, batch_size, block_size,
                          self.source)


def draw_batch(shards, seed, split, step, batch_size, block_size, source="the data"):
    """batch_size windows of block_size + 1 tokens from the token arrays `shards` (a split
    in one file or several), a pure function of (seed, split, step): the window starts are
    drawn uniformly over every start that keeps a window inside one shard (with one shard:
    integers in [0, len - block_size - 1]). Returns x, y int64 (batch_size, block_size)."""
    starts_per = np.array([max(len(t) - block_size, 0) for t in shards], dtype=np.int64)
    if starts_per.sum() == 0:
        longest = max((len(t) for t in shards), default=0)
        raise DataError(f"{source}: the {split} split has {longest} tokens"
                        f"{' in its longest file' * (len(shards) > 1)}, fewer than "
                        f"block_size + 1 = {block_size + 1}")
    rng = np.random.Generator(np.random.PCG64([seed, _SPLITS[split], step]))
    starts = rng.integers(0, starts_per.sum(), size=batch_size)               # (B,)
    ends = np.cumsum(starts_per)
    which = np.searchsorted(ends, starts, side="right")                        # (B,) shard
    starts -= ends[which] - starts_per[which]                                  # within it
    offsets = np.arange(block_size + 1)
    window = np.empty((batch_size, block_size + 1), dtype=np.int64)            # (B, T + 1)
    for s in np.unique(which):
        rows = which == s
        window[rows] = shards[s][starts[rows, None] + offsets]
    return window[:, :-1], window[:, 1:]
