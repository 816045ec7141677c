"""Training a byte-level BPE of GPT-2's kind (minidist/train/bpe.py reads and uses one).

`train_bpe` (examples/train_tokenizer.py calls it): the 256 byte characters, then merge by
merge the adjacent pair met most often in the text's pieces (the same pre-tokenization,
each piece's count), every occurrence left to right, until the vocabulary has its size or no
pair occurs twice; `<|endoftext|>` last. Ties go to the smallest pair in string order, so
training is deterministic. Pair counts are kept up to date through the pieces each merge
touches (an index pair -> pieces, a heap of counts with stale entries skipped), not counted
again per merge. `write_tokenizer` writes the two files as GPT-2's are written, so a trained
tokenizer loads as GPT-2's does (and Hugging Face's GPT2Tokenizer reads it).
Tests: tests/test_bpe_train.py.
"""
import collections
import heapq
import json
import os

from minidist.train.bpe import EOT, MERGES, VOCAB, TokenizerError, bytes_to_unicode, pretokenize


def train_bpe(text, vocab_size, specials=(EOT,)):
    """(vocab {token: id}, merges [(left, right)]) of a byte-level BPE trained on `text`
    (str): ids 0..255 the byte characters in byte order, then one token per merge whose
    result is new, then `specials`. Stops at `vocab_size` tokens, or earlier where no pair
    occurs twice (the vocabulary is then smaller: the caller reports it)."""
    byte_char = bytes_to_unicode()
    vocab = {byte_char[b]: b for b in range(256)}
    if vocab_size < len(vocab) + len(specials):
        raise TokenizerError(f"train: a vocabulary of {vocab_size} tokens cannot hold the 256 "
                             f"bytes and {len(specials)} special token(s)")
    pieces = collections.Counter(pretokenize(text))
    words = [[byte_char[b] for b in piece.encode("utf-8")] for piece in pieces]
    freq = list(pieces.values())
    counts, where = collections.Counter(), collections.defaultdict(set)
    for i, word in enumerate(words):
        for pair in zip(word, word[1:]):
            counts[pair] += freq[i]
            where[pair].add(i)
    heap = [(-n, pair) for pair, n in counts.items()]
    heapq.heapify(heap)
    merges = []
    while len(vocab) < vocab_size - len(specials) and heap:
        n, pair = heapq.heappop(heap)
        if -n != counts.get(pair, 0):
            continue                                    # stale: its count changed since
        if -n < 2:
            break
        merges.append(pair)
        vocab.setdefault(pair[0] + pair[1], len(vocab))
        touched = set()
        for i in where.pop(pair):
            word, f = words[i], freq[i]
            merged = _merge_pair(word, pair)
            if len(merged) == len(word):
                continue                                # (no longer holds the pair)
            for q in zip(word, word[1:]):
                counts[q] -= f
                touched.add(q)
            for q in zip(merged, merged[1:]):
                counts[q] += f
                where[q].add(i)
                touched.add(q)
            words[i] = merged
        for q in touched:
            if counts[q] > 0:
                heapq.heappush(heap, (-counts[q], q))
            else:
                del counts[q]
    for token in specials:
        vocab.setdefault(token, len(vocab))
    return vocab, merges


def _merge_pair(word, pair):
    """`word` (a list of symbols) with every occurrence of `pair`, left to right, merged."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def write_tokenizer(folder, vocab, merges):
    """vocab.json and merges.txt in `folder` (made if missing), written as GPT-2's are:
    the vocabulary one JSON object, the merges one per line after a '#version: 0.2' header,
    each file replaced whole (a temporary beside it, then renamed)."""
    os.makedirs(folder, exist_ok=True)
    texts = {VOCAB: json.dumps(vocab, ensure_ascii=False),
             MERGES: "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)}
    for name, text in texts.items():
        tmp = os.path.join(folder, f".{name}.tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, os.path.join(folder, name))
