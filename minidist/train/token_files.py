"""Training data that is tokenized already: the token files nanoGPT and llm.c write, so a run
can train on their GPT-2-tokenized corpora (OpenWebText, FineWeb, Shakespeare) as they do.

A folder of token files (`--data DIR`) holds a train split and a val split, each one file or
several shards, read in name order:

    train.bin, val.bin                         nanoGPT's data scripts (also `<name>_train.bin`)
    fineweb_train_000001.bin, ...              llm.c's shards: `<name>_<split>_<NNNNNN>.bin`
    fineweb_val_000000.bin

Two formats, told apart by the first four bytes:
  - llm.c: a header of 256 int32 (little endian): [0] the magic 20240520, [1] the version
    (1: uint16 tokens of GPT-2's 50,257-token vocabulary; 2: uint32 tokens of Llama 3's
    128,256), [2] the number of tokens; the tokens follow. The file's size must match.
  - nanoGPT: the uint16 tokens alone (its `np.memmap(..., dtype=np.uint16)` files). The
    vocabulary is GPT-2's unless a `meta.pkl` lies beside them (nanoGPT's character-level
    Shakespeare writes one: {"vocab_size", "itos", "stoi"}); it is read with an unpickler
    that accepts plain dicts, lists, strings and numbers only, never code.
    (A GPT-2 header's magic cannot begin a GPT-2 token file: as uint16 it reads 54504, past
    the vocabulary.)

Batches are drawn as TokenData's (minidist/train/data.py draw_batch): windows never cross
from one shard into the next. Every window's tokens are checked against the vocabulary as it
is read, and when the data is opened the first 1M tokens of every train file and the whole
val split (small, and first read at the first evaluation: first-use walk 33 lost a run's
steps to a bad id there), so a file of another tokenizer is one error naming it, not an
embedding lookup out of range.
The tokenizer that turns ids back into text: the character table of meta.pkl, else GPT-2's
vocab.json and merges.txt where they are found (beside the files, or the --init-from folder's:
minidist/train/bpe.py), else none (the run then prints no sample).
Tests: tests/test_token_files.py.
"""
import hashlib
import io
import json
import os
import pickle
import re

import numpy as np

from minidist.train.bpe import BPETokenizer, tokenizer_files
from minidist.train.data import DataError, draw_batch, unigram_entropy

LLMC_MAGIC, LLMC_HEADER = 20240520, 256 * 4
LLMC_VERSIONS = {1: (np.uint16, 50257, "GPT-2"), 2: (np.uint32, 128256, "Llama 3")}
GPT2_VOCAB = 50257
NANOGPT = "nanoGPT (uint16 tokens)"          # the format of bare files
CHECKED_AT_OPEN = 1 << 20          # tokens of each file checked when the data is opened
ENTROPY_TOKENS = 1 << 24           # train tokens the unigram entropy is measured on
DIGEST_TAIL = 1 << 16              # last tokens of each file in the files' digest
_NAME = {split: re.compile(rf"^(?:(.+)_)?{split}(?:_(\d+))?\.bin$")
         for split in ("train", "val")}


def token_file_names(folder):
    """{"train": [names], "val": [names]} of the token files in `folder`, sorted; None when
    the folder holds none (so --data is text)."""
    if not os.path.isdir(folder):
        return None
    names = sorted(n for n in os.listdir(folder) if n.endswith(".bin"))
    found = {split: [n for n in names if pattern.match(n)] for split, pattern in _NAME.items()}
    return found if found["train"] or found["val"] else None


def looks_wider(tokens, at_least=64):
    """Whether bare uint16 tokens are in fact wider ids (int32, int64: little-endian, so
    each id's high halves are zeros): every odd-placed uint16 is 0 while the even-placed are
    not all 0, over at least `at_least` tokens (first-use walk 33: int32 files trained on
    twice the tokens, every other one 0, without a word)."""
    return len(tokens) >= at_least and not tokens[1::2].any() and bool(tokens[0::2].any())


def read_tokens(path):
    """(the tokens of one file as a read-only memmap, the vocabulary size its format implies,
    the format's name)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        first = f.read(LLMC_HEADER)
    if len(first) >= 4 and int.from_bytes(first[:4], "little") == LLMC_MAGIC:
        return _read_llmc(path, np.frombuffer(first[:len(first) // 4 * 4], dtype="<i4"),
                          size)
    if size % 2:
        raise DataError(f"{path}: {size:,} bytes, an odd number: not uint16 tokens (nanoGPT's "
                        "format) and no llm.c header")
    tokens = np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)
    return tokens, GPT2_VOCAB, NANOGPT


def _read_llmc(path, head, size):
    version = int(head[1]) if len(head) > 1 else None
    if len(head) < 256 or version not in LLMC_VERSIONS:
        raise DataError(f"{path}: an llm.c header of version {version}"
                        + (" (the header is cut short)" if len(head) < 256 else "")
                        + f"; minidist reads versions {sorted(LLMC_VERSIONS)}")
    dtype, vocab, name = LLMC_VERSIONS[version]
    n, width = int(head[2]), np.dtype(dtype).itemsize
    if size != LLMC_HEADER + n * width:
        raise DataError(f"{path}: its llm.c header says {n:,} tokens, but the file has "
                        f"{size:,} bytes, not {LLMC_HEADER + n * width:,}: truncated, or "
                        "still being written")
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER, shape=(n,)) if n \
        else np.zeros(0, dtype)
    return tokens, vocab, f"llm.c ({name} tokens)"


class _PlainUnpickler(pickle.Unpickler):
    """Dicts, lists, tuples, strings and numbers: what nanoGPT's meta.pkl holds; any class
    or function in the file (which is how a pickle runs code) is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}; only plain data is read")


def read_meta_pkl(path):
    """nanoGPT's meta.pkl -> (vocab_size, CharTokenizer or None)."""
    try:
        with open(path, "rb") as f:
            meta = _PlainUnpickler(io.BytesIO(f.read())).load()
    except Exception as e:               # any malformed pickle: one line naming the file
        numpy = "numpy" in str(e)            # (walk 33: np.int64 ids, no word of the fix)
        raise DataError(f"{path}: not a plain-data pickle ({e})" + (
            "; write vocab_size, itos and stoi as Python ints and strs (int(i) for numpy "
            "integers), as nanoGPT's prepare.py does" if numpy else "")) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int):
        raise DataError(f"{path}: expected a dict with an integer 'vocab_size' (as nanoGPT's "
                        "data scripts write it)")
    itos = meta.get("itos")
    ok = isinstance(itos, dict) and all(isinstance(k, int) and isinstance(v, str)
                                        for k, v in itos.items())
    return meta["vocab_size"], CharTokenizer(itos, meta["vocab_size"]) if ok else None


def tokenizer_in(folder):
    """The tokenizer a folder holds: GPT-2's BPE (vocab.json and merges.txt, as every GPT-2
    download has them), nanoGPT's character table (meta.pkl), or None."""
    if folder is None or not os.path.isdir(folder):
        return None
    if tokenizer_files(folder):
        return BPETokenizer.from_folder(folder)
    if os.path.isfile(os.path.join(folder, "meta.pkl")):
        return read_meta_pkl(os.path.join(folder, "meta.pkl"))[1]
    return None


class CharTokenizer:
    """nanoGPT's character-level vocabulary (meta.pkl's itos): one token per character."""
    name = "chars"
    eot = None                 # no token ends a document

    def __init__(self, itos, vocab_size):
        self.itos, self.vocab_size = dict(itos), vocab_size
        table = json.dumps(sorted(self.itos.items()), ensure_ascii=False).encode()
        self.key = f"chars-{vocab_size}-{hashlib.sha256(table).hexdigest()[:16]}"   # which
        self.stoi = {s: i for i, s in self.itos.items()}

    def encode(self, text):
        missing = sorted({c for c in text if c not in self.stoi})
        if missing:
            raise DataError(f"the text has characters outside the vocabulary: {missing[:10]}")
        return np.array([self.stoi[c] for c in text], dtype=np.int64)

    def decode(self, ids):
        return "".join(self.itos.get(int(i), "\ufffd") for i in ids)


class TokenFiles:
    """The train and val token streams of a folder of token files (module docstring).

    `.vocab_size`, `.tokenizer` (or None), `.unigram_entropy` (of the first 16M train
    tokens), `.source`, `.splits` {split: [memmaps, one per file]}, `.meta` {"train_tokens",
    "val_tokens"}, `.digest` (the files' identity), `.describe()`; get_batch and
    check_block_size as TokenData's.
    `tokenizer`: the one to sample with, where the folder has no meta.pkl (whose characters
    are the tokenizer then); `made_them`: bare uint16 files are in its vocabulary, not GPT-2's
    (--tokenizer).
    """

    def __init__(self, folder, names, tokenizer=None, tokenizer_from=None, made_them=False):
        self.source, self.names = folder, names
        sets = {_NAME[split].match(n).group(1) or "" for split in names for n in names[split]}
        if len(sets) > 1:
            shown = sorted(f"{p}_*.bin" if p else "train.bin, val.bin" for p in sets)
            raise DataError(f"--data {folder}: holds {len(sets)} sets of token files ("
                            f"{'; '.join(shown)}): move all but one set out")
        self.splits, formats = {}, {}
        for split in ("train", "val"):
            if not names[split]:
                raise DataError(f"--data {folder}: no {split} file among its token files "
                                f"({', '.join(names['train'] + names['val'])}); they are named "
                                f"{split}.bin, or <name>_{split}_<N>.bin for shards")
            self.splits[split] = []
            for name in names[split]:
                tokens, vocab, fmt = read_tokens(os.path.join(folder, name))
                self.splits[split].append(tokens)
                formats.setdefault((fmt, vocab), []).append(name)
        if len(formats) > 1:
            raise DataError(f"--data {folder}: mixes token formats ("
                            + "; ".join(f"{fmt}: {', '.join(files)}"
                                        for (fmt, _), files in sorted(formats.items()))
                            + "): keep the files of one")
        (self.format, self.vocab_size), = formats
        self.tokenizer = self._tokenizer(tokenizer, tokenizer_from, made_them)
        self.meta = {f"{s}_tokens": sum(len(t) for t in self.splits[s]) for s in self.splits}
        for split, shards in self.splits.items():
            for name, tokens in zip(names[split], shards):
                if self.format == NANOGPT and looks_wider(tokens[:CHECKED_AT_OPEN]):
                    raise DataError(f"{os.path.join(folder, name)}: every other uint16 is 0: "
                                    "the ids look written as int32 or int64 (tofile of an "
                                    "int array); write them as uint16 (ids.astype(np.uint16)"
                                    ".tofile(path)), nanoGPT's format")
                self._check_ids(tokens[:CHECKED_AT_OPEN], os.path.join(folder, name), 0)
        self._find_past_vocabulary("val")  # whole: found at the first evaluation, it stopped
        self.unigram_entropy = self._unigram_entropy(names["train"])
        self.digest = self._digest()

    def _digest(self):
        """The files' identity, which a checkpoint records (minidist/train/resume.py: a
        resume on other files at the same path says so): each file's name, token count, and
        first CHECKED_AT_OPEN and last DIGEST_TAIL tokens (a regenerated corpus differs
        there; hashing billions of tokens would cost the start-up seconds)."""
        h = hashlib.blake2b(self.format.encode(), digest_size=8)
        for split in ("train", "val"):
            for name, tokens in zip(self.names[split], self.splits[split]):
                h.update(f"\0{name}\0{len(tokens)}\0".encode())
                h.update(np.ascontiguousarray(tokens[:CHECKED_AT_OPEN]).tobytes())
                h.update(np.ascontiguousarray(tokens[-DIGEST_TAIL:]).tobytes())
        return h.hexdigest()

    def _tokenizer(self, tokenizer, tokenizer_from, made_them):
        """The tokenizer to sample with: meta.pkl's characters (whose vocab_size is the
        data's then), else `tokenizer`, which must fit the data's vocabulary. Bare uint16
        files (nanoGPT's) say nothing of theirs: GPT-2's is assumed, but a BPE of at most
        65,536 tokens said to have made them (`made_them`: --tokenizer's) is theirs, each
        id checked against it as GPT-2's would be."""
        meta_pkl = os.path.join(self.source, "meta.pkl")
        if os.path.isfile(meta_pkl):
            self.vocab_size, chars = read_meta_pkl(meta_pkl)
            return chars
        if made_them and self.format == NANOGPT and tokenizer.vocab_size <= 1 << 16:
            self.vocab_size = tokenizer.vocab_size
        if tokenizer is not None and tokenizer.vocab_size != self.vocab_size:
            raise DataError(f"--data {self.source}: its files are in a {self.vocab_size:,}-"
                            f"token vocabulary ({self.format}), the tokenizer of "
                            f"{tokenizer_from or 'the folder'} has {tokenizer.vocab_size:,}: "
                            "they were not made with it; give the data of that tokenizer")
        return tokenizer

    def _unigram_entropy(self, names):
        """Nats per token of the train split's token frequencies, counted on its first
        ENTROPY_TOKENS tokens (the loss of a model that ignores context, for the logs)."""
        counts, left = np.zeros(self.vocab_size, np.int64), ENTROPY_TOKENS
        for name, tokens in zip(names, self.splits["train"]):
            if left <= 0:
                break
            chunk = tokens[:left]
            self._check_ids(chunk, os.path.join(self.source, name), 0)
            counts += np.bincount(chunk, minlength=self.vocab_size)
            left -= len(chunk)
        return unigram_entropy(counts)

    def _check_ids(self, ids, where, offset):
        """Raise naming `where` and the first id past the vocabulary, at its position
        (`offset`: the position of ids[0] in the file)."""
        past = np.flatnonzero(ids >= self.vocab_size) if len(ids) else ()
        if len(past):
            at = int(past[0])
            raise DataError(f"{where}: token id {int(ids[at])} at position {offset + at:,} "
                            f"is past the vocabulary ({self.vocab_size:,} tokens): a file of "
                            "another tokenizer?")

    def _find_past_vocabulary(self, split):
        """Raise naming the file and position of the first id past the vocabulary in the
        split (a scan, in chunks): the val split at open, and a train batch that held one."""
        chunk = 1 << 24
        for name, tokens in zip(self.names[split], self.splits[split]):
            for start in range(0, len(tokens), chunk):
                self._check_ids(tokens[start:start + chunk], os.path.join(self.source, name),
                                start)

    def describe(self):
        shards = sum(len(s) for s in self.splits.values())
        return (f"{self.meta['train_tokens']:,} train / {self.meta['val_tokens']:,} val "
                f"tokens in {shards} file(s), {self.format}, vocabulary {self.vocab_size:,}, "
                f"tokenizer {self.tokenizer.name if self.tokenizer else 'none'}")

    def check_block_size(self, block_size, fixed=None):
        """Each split has a file of block_size + 1 tokens (a window lies inside one file);
        `fixed`: as TokenData.check_block_size's."""
        for split, shards in self.splits.items():
            longest = max(len(t) for t in shards)
            if longest < block_size + 1:
                fix = (f"give a {split} file of more tokens" if fixed or longest < 2 else
                       f"give a --block-size below {longest}")
                fix += f" ({fixed}'s block size cannot change)" if fixed else ""
                raise DataError(f"{self.source}: the longest {split} file has {longest:,} "
                                f"token(s), fewer than --block-size {block_size} + 1; {fix}")

    def get_batch(self, seed, split, step, batch_size, block_size):
        x, y = draw_batch(self.splits[split], seed, split, step, batch_size, block_size)
        if int(x.max()) >= self.vocab_size or int(y[:, -1].max()) >= self.vocab_size:
            self._find_past_vocabulary(split)
        return x, y
