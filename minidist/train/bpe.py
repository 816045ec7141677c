"""GPT-2's byte-level BPE tokenizer, read from the two files of a GPT-2 download (Hugging Face
layout): `vocab.json` (token string -> id; 50257 entries for GPT-2, `<|endoftext|>` = 50256)
and `merges.txt` (a `#version: ...` header line, then one merge per line, two token strings
separated by a space, highest priority first).

Text -> ids, written from the algorithm's description:
  1. pre-tokenization splits the text with GPT-2's pattern
     `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`
     (`\\s+(?!\\S)` leaves the last space of a run to the word after it: "a  b" ->
     "a", " ", " b");
  2. each piece's UTF-8 bytes become characters by bytes_to_unicode (the bytes '!'..'~',
     '¡'..'¬', '®'..'ÿ' stay themselves, the other 68 take chr(256), chr(257), ... in
     byte order: a space is 'Ġ', a newline 'Ċ');
  3. BPE: merge the adjacent pair of lowest rank (line order in merges.txt), every occurrence
     left to right, until no adjacent pair is a merge; each symbol's id from vocab.json.
Step 3 runs once per distinct piece (a dict cache, emptied at CACHE_MAX entries); it keeps
the pairs in a heap, so a piece of n bytes costs O(n log n), not GPT-2's O(n^2) rescans
(a long run of one character stays fast), with the same result. `encode` feeds the pattern
at most CHUNK characters at a time, cut only between a non-space and a space, where the
pieces are those of the whole text, so memory follows the chunk, not the text.
Ids -> text: the token strings joined, each character mapped back to its byte, the bytes
decoded as UTF-8 with errors="replace" (ids that split a character give U+FFFD, no error).

Python's `re` has no \\p{L} or \\p{N}, and only the standard library is used, so the three
classes of the pattern are spelled out from `unicodedata` (built once per process, ~0.05 s):
letters = general category L*, numbers = N* (Nd, Nl, No), spaces = the 25 characters of
Unicode's White_Space property, which is what \\s means in the engines GPT-2's pattern ran on
(`regex`, and tiktoken's Rust one). The plain `re` spellings would differ: `[^\\W\\d_]` counts
the 1131 Nl/No characters ('½', '²', 'Ⅻ') as letters, `\\d` misses them as numbers, and
`\\s` also matches U+001C..U+001F. The classes hold the BMP only (astral ranges make `re` 5x
slower); a text with astral characters is matched with each replaced by a BMP character of
its category, and the pieces are cut from the original at the same places: exact, slower.
Where it can still differ from GPT-2's pieces (ASCII text: never):
  - characters whose category differs between Python's Unicode version (unicodedata.
    unidata_version; 14.0 on Python 3.11) and the reference engine's: ones assigned in only
    one of them (newer scripts) or recategorised. Marks (M*) are neither letters nor numbers
    in either: "e" + U+0301 is two pieces, "e" and the accent;
  - U+180E counts as a space only for engines older than Unicode 6.3 (2013);
  - a str holding a lone surrogate (not UTF-8-encodable) raises TokenizerError.
`<|endoftext|>` in the text is plain text (7 tokens for GPT-2: '<', '|', 'end', 'of', ...):
encode never gives the `eot` id (GPT-2's own encoder did the same; tiktoken by default raises
instead). Put `tokenizer.eot` between documents yourself; `decode` gives "<|endoftext|>" back
for it.

Loading validates (TokenizerError, one line naming the file and what to do): both files
exist and parse, ids are 0..n-1 without duplicates, the 256 byte characters are tokens (else
some text could not be encoded), every merge's two parts and result are tokens, no merge
is listed twice.
Training a tokenizer of this kind: minidist/train/bpe_train.py.
Tests: tests/test_bpe.py.
"""
import functools
import hashlib
import heapq
import itertools
import json
import os
import re
import unicodedata

import numpy as np

VOCAB, MERGES = "vocab.json", "merges.txt"
EOT = "<|endoftext|>"
CHUNK = 1 << 20              # characters per pattern pass in encode
CACHE_MAX = 1 << 19          # cached pieces; the cache empties when it reaches this
_WHITE_SPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
                "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")


class TokenizerError(ValueError):
    """Bad tokenizer files, or input the tokenizer cannot take; the message is one line that
    names the file (or the call) and what to do."""


def bytes_to_unicode():
    """{byte value: its printable character}, GPT-2's table: the bytes '!'..'~', '¡'..'¬',
    '®'..'ÿ' map to themselves, the others, in increasing order, to chr(256), chr(257), ..."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)}
    spare = (chr(256 + i) for i in itertools.count())
    return {b: chr(b) if b in keep else next(spare) for b in range(256)}


def _class(code_points):
    """A `re` class body for sorted code points, as ranges of \\U escapes."""
    out = []
    for _, run in itertools.groupby(enumerate(code_points), lambda ic: ic[1] - ic[0]):
        run = [c for _, c in run]
        out.append(f"\\U{run[0]:08x}" + (f"-\\U{run[-1]:08x}" if len(run) > 1 else ""))
    return "".join(out)


@functools.lru_cache(maxsize=None)
def _patterns():
    """(pre-tokenization regex, chunk-cut regex), built once per process. The classes hold
    BMP code points only: astral ranges would sit in a list `re` scans linearly for every
    character outside the class (5x slower); astral characters get a BMP stand-in instead."""
    by_category = {"L": [], "N": []}
    for c in range(0x10000):
        by_category.get(unicodedata.category(chr(c))[0], []).append(c)
    letters, numbers = _class(by_category["L"]), _class(by_category["N"])
    space = _class([ord(c) for c in _WHITE_SPACE])
    split = re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+"
                       rf"| ?[^{space}{letters}{numbers}]+|[{space}]+(?![^{space}])|[{space}]+")
    return split, re.compile(rf"[^{space}](?=[{space}])")


_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def _stand_in(match):
    """A BMP character of the astral character's class: 'A' (a letter, in no contraction),
    '0' (a number) or NUL (neither, nor a space: White_Space is all in the BMP)."""
    return {"L": "A", "N": "0"}.get(unicodedata.category(match.group())[0], "\x00")


def pretokenize(text):
    """The pieces GPT-2's pattern splits `text` into (joined, they give `text` back)."""
    split = _patterns()[0]
    if text.isascii() or max(text) <= "\uffff":         # isascii: O(1) in CPython
        return split.findall(text)
    pieces, start = [], 0                    # the same pieces, read off a text of stand-ins
    for piece in split.findall(_ASTRAL.sub(_stand_in, text)):
        pieces.append(text[start:start + len(piece)])
        start += len(piece)
    return pieces


def chunks(text, size):
    """`text` in parts of about `size` characters, each cut between a non-space and a space:
    no piece of the pattern spans such a cut or looks across it, so the parts' pieces are
    the text's."""
    cut, start = _patterns()[1], 0
    while len(text) - start > size:
        m = cut.search(text, start + size)
        if m is None:
            break
        yield text[start:m.end()]
        start = m.end()
    yield text[start:]


def bpe_merge(symbols, ranks):
    """BPE on one piece: `symbols` (list of str) -> the merged symbols. Repeatedly the adjacent
    pair of lowest rank in `ranks` ({(left, right): rank}) merges, at every occurrence from
    left to right ("a a a" with 'a a' -> "aa a"), until no adjacent pair has a rank.

    A heap of (rank, position) over a linked list: entries whose pair changed are skipped
    when popped, and the pairs a merge creates join the heap only after every occurrence of
    the current pair merged, as in the rescanning description, even for a merge table
    that ranks a pair before the merges that make its parts."""
    n = len(symbols)
    if n < 2:
        return list(symbols)
    sym, nxt, prv = list(symbols), list(range(1, n + 1)), list(range(-1, n - 1))
    heap = [(ranks[p], i) for i, p in enumerate(zip(sym, sym[1:])) if p in ranks]
    heapq.heapify(heap)
    while heap:
        rank, born = heap[0][0], []
        while heap and heap[0][0] == rank:
            i = heapq.heappop(heap)[1]
            j = nxt[i]
            if sym[i] is None or j == n or ranks.get((sym[i], sym[j])) != rank:
                continue                                  # stale: that pair is gone
            sym[i], sym[j], nxt[i] = sym[i] + sym[j], None, nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            born.append(i)
        for a in itertools.chain.from_iterable((prv[i], i) for i in born):
            if a >= 0 and nxt[a] < n and (sym[a], sym[nxt[a]]) in ranks:
                heapq.heappush(heap, (ranks[sym[a], sym[nxt[a]]], a))
    return [s for s in sym if s is not None]


def tokenizer_files(path):
    """Whether the folder `path` holds both vocab.json and merges.txt."""
    return bool(path) and all(os.path.isfile(os.path.join(path, f)) for f in (VOCAB, MERGES))


def same_tokenizer(a, b):
    """Whether the BPE folders `a` and `b` hold the same vocabulary and merges (their keys:
    one of the same size with other merges would give its ids other strings); None where
    either's files do not load (the caller leaves that to the check that names the file)."""
    try:
        return BPETokenizer.from_folder(a).key == BPETokenizer.from_folder(b).key
    except TokenizerError:
        return None


class _Pairs(list):
    """A JSON object as its (key, value) list, so repeated keys are seen."""


def _read_text(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise TokenizerError(f"{path}: no such file; a GPT-2 tokenizer folder holds {VOCAB} "
                             f"and {MERGES} (the Hugging Face layout)") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text (byte {e.start}); give the file of a "
                             f"GPT-2 download") from None


def read_vocab(path):
    """vocab.json -> {token: id}, validated: a JSON object of token -> integer id, ids
    0..n-1 without duplicates, and a token for each of the 256 bytes."""
    try:
        pairs = json.loads(_read_text(path), object_pairs_hook=_Pairs)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not JSON (line {e.lineno} column {e.colno}: {e.msg}); "
                             f"give the {VOCAB} of a GPT-2 download") from None
    if not isinstance(pairs, _Pairs):
        raise TokenizerError(f"{path}: holds a JSON {type(pairs).__name__}, not an object of "
                             f"token -> id")
    vocab, owner = {}, {}
    for token, i in pairs:
        if type(i) is not int:
            raise TokenizerError(f"{path}: token {token!r} has id {i!r}; ids are integers")
        if token in vocab:
            raise TokenizerError(f"{path}: token {token!r} is listed twice (ids {vocab[token]} "
                                 f"and {i})")
        if not 0 <= i < len(pairs):
            raise TokenizerError(f"{path}: token {token!r} has id {i}, outside 0.."
                                 f"{len(pairs) - 1} (ids must be 0..n-1 for its n = "
                                 f"{len(pairs)} tokens)")
        if i in owner:
            raise TokenizerError(f"{path}: id {i} is given to both {owner[i]!r} and {token!r}")
        vocab[token], owner[i] = i, token
    _check_bytes(path, vocab)
    return vocab


def _check_bytes(path, vocab):
    missing = [(b, c) for b, c in bytes_to_unicode().items() if c not in vocab]
    if missing:
        (b, c), more = missing[0], len(missing) - 1
        raise TokenizerError(f"{path}: lacks the token {c!r} of byte 0x{b:02x}"
                             + (f" and {more} other byte(s)" if more else "")
                             + "; a byte-level BPE vocabulary has all 256, else some text "
                               "could not be encoded")


def read_merges(path, vocab):
    """merges.txt -> [(left, right)] in rank order, validated against `vocab`: two fields a
    line, both parts and their concatenation are tokens, no merge twice. A first line that
    starts with '#version' is the header; blank lines at the end are ignored (an empty
    file: no merges)."""
    merges, seen = [], {}
    text = _read_text(path).rstrip("\r\n")
    lines = text.split("\n") if text else []
    for number, line in enumerate(lines, 1):
        if number == 1 and line.startswith("#version"):
            continue
        fields = line.split()
        if len(fields) != 2:
            raise TokenizerError(f"{path}: line {number} has {len(fields)} fields, expected 2 "
                                 f"(two tokens separated by a space)")
        pair = tuple(fields)
        _check_merge(path, number, pair, vocab)
        if pair in seen:
            raise TokenizerError(f"{path}: line {number} repeats the merge '{line.strip()}' of "
                                 f"line {seen[pair]}; a merge has one rank")
        seen[pair] = number
        merges.append(pair)
    return merges


def _check_merge(path, number, pair, vocab):
    text = " ".join(pair)
    fix = f"give the {VOCAB} and {MERGES} of the same download"
    for part in pair:
        if part not in vocab:
            raise TokenizerError(f"{path}: line {number}: merge {text!r} uses {part!r}, which "
                                 f"{VOCAB} lacks; {fix}")
    if "".join(pair) not in vocab:
        raise TokenizerError(f"{path}: line {number}: merge {text!r} makes {''.join(pair)!r}, "
                             f"which {VOCAB} lacks; {fix}")


class BPETokenizer:
    """Text <-> GPT-2 token ids (byte-level BPE), the interface of data.ByteTokenizer:
    `encode(text)` -> int64 ids, `decode(ids)` -> str, `vocab_size`, `name`, `key` (a digest
    of the vocabulary and merges, for data caches); and `eot`, the
    id of <|endoftext|> (None if the vocabulary has none) to put between documents.
    `name` ("bpe-4096") says what every such tokenizer is, GPT-2's download ("bpe-50257") or
    one examples/train_tokenizer.py wrote, in the data log line and a cache's meta.json; it
    names no folder, since folders of the same files share a cache.

    BPETokenizer.from_folder(path) reads and validates a folder's vocab.json and merges.txt;
    the constructor trusts its `vocab` ({token: id}, ids 0..n-1, all 256 byte characters)
    and `merges` ([(left, right)], highest priority first)."""
    def __init__(self, vocab, merges, chunk=CHUNK, cache_max=CACHE_MAX):
        self.vocab_size = len(vocab)
        self.name = f"bpe-{self.vocab_size}"
        self.eot = vocab.get(EOT)
        self._ids = dict(vocab)
        self._ranks = {}
        for rank, pair in enumerate(merges):
            self._ranks.setdefault(tuple(pair), rank)
        digest = hashlib.sha256(json.dumps([sorted(self._ids.items()), list(self._ranks)],
                                           ensure_ascii=False).encode("utf-8"))
        # its identity in data caches; "gpt2-bpe" (the files' format) as before, so that the
        # caches already built are found again
        self.key = f"gpt2-bpe-{digest.hexdigest()[:16]}"
        self._byte_char = [bytes_to_unicode()[b] for b in range(256)]
        self._bytes = self._token_bytes()
        self._cache, self.chunk, self.cache_max = {}, chunk, cache_max  # encode's sizes

    @property
    def cache_size(self):
        """Pieces in the cache now (at most `cache_max`)."""
        return len(self._cache)

    @classmethod
    def from_folder(cls, path, **sizes):
        """The tokenizer of a folder holding vocab.json and merges.txt."""
        if not os.path.isdir(path):
            raise TokenizerError(f"{path}: no such folder; give the folder that holds {VOCAB} "
                                 f"and {MERGES}")
        vocab = read_vocab(os.path.join(path, VOCAB))
        return cls(vocab, read_merges(os.path.join(path, MERGES), vocab), **sizes)

    def _token_bytes(self):
        """[bytes of each id]: a token's characters mapped back through bytes_to_unicode; a
        token with a character outside that table (an added special token) is its UTF-8."""
        byte_of = {c: b for b, c in enumerate(self._byte_char)}
        out = [b""] * self.vocab_size
        for token, i in self._ids.items():
            if all(c in byte_of for c in token):
                out[i] = bytes(byte_of[c] for c in token)
            else:
                out[i] = token.encode("utf-8")
        return out

    def encode(self, text):
        """Token ids of `text` (str, or UTF-8 bytes) as a 1-D int64 array; <|endoftext|> in
        it is plain text (7 tokens for GPT-2), never `eot`."""
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = _utf8(bytes(text))
        parts = [self._encode_chunk(chunk) for chunk in chunks(text, self.chunk)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _encode_chunk(self, text):
        ids, cache = [], self._cache
        for piece in pretokenize(text):
            got = cache.get(piece)
            if got is None:
                got = self._encode_piece(piece)
            ids += got
        return np.array(ids, dtype=np.int64)

    def _encode_piece(self, piece):
        try:
            data = piece.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"encode: the text holds U+{ord(piece[e.start]):04X}, a lone "
                                 f"surrogate that UTF-8 cannot encode") from None
        symbols = bpe_merge([self._byte_char[b] for b in data], self._ranks)
        ids = tuple(self._ids[s] for s in symbols)
        if len(self._cache) >= self.cache_max:
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    def decode(self, ids):
        """The text of token ids (a 1-D int sequence or array); bytes that are not UTF-8 (ids
        that split a character) become U+FFFD."""
        ids = np.asarray(ids)
        if ids.size == 0:
            return ""
        if ids.ndim > 1 or ids.dtype.kind not in "iu":
            raise TokenizerError(f"decode: takes a 1-D sequence of integer ids, got "
                                 f"{ids.dtype} of shape {ids.shape}")
        ids = ids.reshape(-1)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise TokenizerError(f"decode: id {bad} is out of range for {self.name} (ids "
                                 f"0..{self.vocab_size - 1}); were the ids made by another "
                                 f"tokenizer?")
        return b"".join(map(self._bytes.__getitem__, ids.tolist())).decode("utf-8", "replace")


def _utf8(data):
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"encode: the bytes are not UTF-8 (at byte {e.start}); give str "
                             f"or UTF-8 bytes") from None

