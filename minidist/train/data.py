"""Training data: byte-level tokens in a memory-mapped file, and batches that are a pure
function of (seed, split, step).

Text -> tokens: the byte tokenizer (vocab 256: token = byte value), so any text file works and
no vocabulary file is needed; or, for a model that reads GPT-2's tokens (--init-from), the
BPE tokenizer of its folder (minidist/train/bpe.py; uint16 tokens in the cache). Sources:
  - `--data PATH`: a text file, or a folder of text files (read recursively, sorted; hidden
    entries skipped);
  - no `--data`: the `.py` sources of this Python's standard library, which every machine
    that runs minidist already has (site-packages excluded).
Train/val split: with 20 or more files, whole files go to val when crc32(relative path) % 10
== 0 (held-out documents), unless that holds no file or more than 30% of the text (one big
file among small ones, or names that all hash to train: first-use walk 33 trained on 114
tokens and evaluated on 417,540); then, and with fewer files, the last 10% of each file goes
to val. The start-up line says which rule split the data.

Cache: tokens are written once to `train.bin` / `val.bin` (uint8, or uint16 from a BPE) and
`meta.json`, in `.minidist-cache/<key>/` next to the data, or under `~/.cache/minidist/` (or
$MINIDIST_CACHE, or `--cache-dir`) when that place is not writable: always so for the
standard library, whose directory may be read-only. The key hashes the file list, sizes and
mtimes and the tokenizer's identity, so edited data (or another tokenizer) is tokenised
again. Files are built in a temporary directory and renamed into place.

Batches: `get_batch(seed, split, step, batch_size, block_size)` draws batch_size random
windows from a generator seeded by (seed, split, step) and returns the GLOBAL batch (x, y),
int64 numpy arrays (B, T) with y = x shifted by one. Data-parallel ranks slice their rows;
a resumed run needs only the step.
Tests: tests/test_data.py.
"""
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
import zlib

import numpy as np

_SPLITS = {"train": 0, "val": 1}
_VERSION = 2          # 2: the held-out files' fallback (a split may differ from 1's)
HELD_OUT_AT_MOST = 0.3        # of the text, in held-out files; beyond: each file's last 10%


class DataError(ValueError):
    """Bad or missing training data; the message says what and where."""


class ByteTokenizer:
    """Text <-> token ids, one token per UTF-8 byte."""
    vocab_size = 256
    name = key = "bytes"          # key: its identity in the cache's key

    def encode(self, text):
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids):
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", "replace")


def stdlib_root():
    return sysconfig.get_paths()["stdlib"]


def is_text(path, probe=8192):
    """Whether the file looks like text: no NUL byte in its first `probe` bytes (git's and
    grep's test; a safetensors file, a .bin of tokens, an image have them early)."""
    return not_text(path, probe) is None


UTF16_32_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")


def not_text(path, probe=8192):
    """Why the file is not UTF-8 text (NUL bytes in its first `probe`: "binary"; a UTF-16 or
    UTF-32 byte-order mark, what Windows Notepad and PowerShell write: "UTF-16/32 text:
    re-encode it as UTF-8"), or None."""
    with open(path, "rb") as f:
        head = f.read(probe)
    if head.startswith(UTF16_32_BOMS):
        return "UTF-16/32 text: re-encode it as UTF-8 (iconv -f UTF-16 -t UTF-8)"
    return "binary" if b"\0" in head else None


def holds_outputs(folder, names):
    """What a folder inside --data holds that is no corpus (first-use walk 33: its text
    files were trained on): a minidist checkpoint (state.json and manifest.json, or a
    `latest` pointer) or a tokenizer (vocab.json and merges.txt); None for text."""
    names = set(names)
    if {"state.json", "manifest.json"} <= names or "latest" in names:
        return "a checkpoint"
    if {"vocab.json", "merges.txt"} <= names:
        return "a tokenizer"
    return None


def list_files(path=None):
    """(root, sorted relative paths of the text files to train on, [(relative path, why
    left out)]). A file given that is not text (not_text) is refused; in a folder, such
    files are left out (as grep -I does), and so are broken links, special files, and the
    folders that hold a checkpoint or a tokenizer (holds_outputs); a folder with no text
    left is refused, naming how many were left out. The data line names what was."""
    if path is None:
        root, skip, suffix = stdlib_root(), {"site-packages", "dist-packages"}, ".py"
    else:
        if not os.path.exists(path):
            raise DataError(f"--data {path}: no such file or directory (give a text file or "
                            "a folder of text files, or leave --data out for Python's "
                            "sources)")
        if os.path.isfile(path):
            why = not_text(path)
            if why == "binary":
                raise DataError(f"--data {path}: not a text file (it holds NUL bytes); give "
                                "a text file, a folder of them, or a folder of token files "
                                "(*.bin, as nanoGPT and llm.c write them)")
            if why:
                raise DataError(f"--data {path}: {why}")
            return os.path.dirname(os.path.abspath(path)), [os.path.basename(path)], []
        root, skip, suffix = path, set(), ""
    files, skipped = [], []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x not in skip
                         and x != "__pycache__")
        outputs = holds_outputs(d, names) if path is not None and d != root else None
        if outputs:
            skipped.append((os.path.relpath(d, root), outputs))
            dirs[:] = []
            continue
        for n in sorted(names):
            if n.startswith(".") or not n.endswith(suffix):
                continue
            name = os.path.relpath(os.path.join(d, n), root)
            if not os.path.isfile(os.path.join(d, n)):   # a dangling link, a pipe: a
                skipped.append((name, "a broken link or special file"))   # traceback, a
                continue                                                  # hang (walk 33)
            why = not_text(os.path.join(d, n)) if path is not None else None
            if why:
                skipped.append((name, why.split(":")[0]))
                continue
            files.append(name)
    if not files:
        raise DataError(f"--data {path or root}: no text files found"
                        + (f" (left out: {left_out_text(skipped)})" if skipped else ""))
    return root, sorted(files), skipped


def left_out_text(skipped, most=3):
    """"a.bin (binary); ck (a checkpoint); 2 more": what list_files left out, for people."""
    shown = "; ".join(f"{name} ({why})" for name, why in skipped[:most])
    return shown + (f"; {len(skipped) - most} more" if len(skipped) > most else "")


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


def text_splits(path=None):
    """(train, val) bytes of --data `path` (a text file or folder; None: Python's sources),
    split as training splits them (examples/train_tokenizer.py learns from the train part)."""
    root, files, _ = list_files(path)
    train, val, _ = split_files(root, files)
    return train, val


def split_files(root, files):
    """(train bytes, val bytes, the rule as words): held-out files (20 or more files, and
    the held-out ones 0 < val <= HELD_OUT_AT_MOST of the text), else each file's last 10%."""
    texts = {}
    for f in files:
        with open(os.path.join(root, f), "rb") as fh:
            data = fh.read()
        texts[f] = data + b"\n" if data and not data.endswith(b"\n") else data
    if len(files) >= 20:
        held = [f for f in files if zlib.crc32(os.fsencode(f)) % 10 == 0]
        val = sum(len(texts[f]) for f in held)
        total = sum(len(t) for t in texts.values())
        if 0 < val <= HELD_OUT_AT_MOST * total:
            return (b"".join(texts[f] for f in files if f not in held),
                    b"".join(texts[f] for f in held),
                    f"{len(held)} of {len(files)} files held out")
        why = ("no file's name chose val" if not held else
               f"the files held out by name were {val / total:.0%} of the text")
        rule = f"the last 10% of each file ({why})"
    else:
        rule = "the last 10% of each file"
    cuts = {f: utf8_boundary(t, int(len(t) * 0.9)) for f, t in texts.items()}
    return (b"".join(t[:cuts[f]] for f, t in texts.items()),
            b"".join(t[cuts[f]:] for f, t in texts.items()), rule)


def utf8_boundary(data, cut):
    """`cut` moved back to the start of the UTF-8 character it falls in (a continuation
    byte is 10xxxxxx): a byte cut inside one gave both splits a U+FFFD under a BPE (walk 33)."""
    while 0 < cut < len(data) and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut


def _tokens(blob, tokenizer):
    """The token array of a split's bytes: the bytes themselves (uint8) for the byte
    tokenizer; a BPE's ids (uint16 while the vocabulary fits) of the text, invalid UTF-8
    replaced."""
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(blob, np.uint8)
    ids = tokenizer.encode(blob.decode("utf-8", "replace"))
    return ids.astype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)


def not_utf8(blob):
    """How many characters invalid UTF-8 in `blob` turns into U+FFFD under a BPE (Latin-1
    text's accents: first-use walk 33 found them mangled without a word), 0 for UTF-8."""
    try:
        blob.decode("utf-8")
        return 0
    except UnicodeDecodeError:
        return blob.decode("utf-8", "replace").count("\ufffd") - blob.count(
            "\ufffd".encode())


def unigram_entropy(counts):
    """Nats per token of the frequencies `counts` (tokens counted by id): the loss of a model
    that ignores context, which the logs print beside the val loss."""
    p = counts[counts > 0] / max(counts.sum(), 1)
    return float(-(p * np.log(p)).sum())


def _build(root, files, out_dir, tokenizer):
    train, val, rule = split_files(root, files)
    replaced = 0 if isinstance(tokenizer, ByteTokenizer) else not_utf8(train) + not_utf8(val)
    train, val = _tokens(train, tokenizer), _tokens(val, tokenizer)
    meta = {"version": _VERSION, "tokenizer": tokenizer.name, "split": rule,
            "not_utf8": replaced,
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
    except OSError:
        if not os.path.isfile(os.path.join(out_dir, "meta.json")):
            raise
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
    frequencies: the loss of a model that ignores context), `.source` (for logs).
    `tokenizer`: the byte tokenizer (default), or a BPE (minidist/train/bpe.py).
    """

    def __init__(self, path=None, cache_dir=None, tokenizer=None):
        self.tokenizer = tokenizer or ByteTokenizer()
        root, files, self.left_out = list_files(path)
        self.cache = _cache_dir(path, root, files, cache_dir, self.tokenizer)
        if not os.path.isfile(os.path.join(self.cache, "meta.json")):
            _build(root, files, self.cache, self.tokenizer)
        with open(os.path.join(self.cache, "meta.json")) as f:
            self.meta = json.load(f)
        self.vocab_size = self.tokenizer.vocab_size
        self.unigram_entropy = self.meta["unigram_entropy"]
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
