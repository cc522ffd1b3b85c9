"""An offline English sentence splitter for ``--split-sentences`` (Megatron's flag).

Megatron's ``tools/preprocess_data.py`` splits with NLTK's Punkt and its pretrained English model
(``tokenizers/punkt/english.pickle``), which it downloads from NLTK's data server; that server is
not reachable from a cluster node without internet, nor from here (PyPI only). This module is a
rule-based splitter with Punkt's first-pass rule and Megatron's two whitespace conventions, and no
model file:

* a sentence ends at a run of ``.``, ``?`` or ``!`` (with any closing quotes or brackets after it)
  that is followed by whitespace and then more text;
* except after a known abbreviation (``Mr.``, ``Dr.``, ``e.g.``, ``etc.``, month and weekday
  abbreviations... see ``ABBREVIATIONS``), a single-letter initial (``J. R. R. Tolkien``), a
  word with inner periods (``U.S.``), a number followed by a lower-case word (``3. the``), or an
  ellipsis (``...``) followed by a lower-case word;
* without ``keep_newlines`` the whitespace between sentences is dropped (Punkt's spans); with it
  the whitespace after a sentence stays at the end of that sentence (Megatron's
  ``CustomLanguageVars``), so the sentences put back together are the text.

How it differs from Punkt with ``english.pickle``: Punkt learned its abbreviation list (about
a thousand types, many of them rare), collocations and frequent sentence starters from a corpus,
and its second pass uses them with orthographic statistics to decide the doubtful cases (an
abbreviation that ends a sentence, an initial before a capitalised word). Here the abbreviation
list is a fixed list of common English ones and the doubtful cases follow the rules above: a
sentence that ends in an abbreviation is not split there, and an unknown abbreviation (``approx.``)
splits. On ordinary prose both give the same sentences; on text full of rare abbreviations they
can differ, so datasets made with ``--split-sentences`` are not byte-identical to Megatron's.
Documents are cut into pieces of 1,000,000 characters before splitting, as Megatron does.

Measured against Punkt (NLTK 3.10.4) trained offline on 10 of the bundled Gutenberg novels
(``english.pickle`` cannot be downloaded here): of Punkt's sentence starts, 97.8 % are ours on the
Dolma sample (1,449 Punkt / 1,441 ours) and 92.5 % on 600k characters of three other novels
(6,918 / 6,417; 99.7 % of ours are Punkt's), the misses there mostly Punkt splitting after
``Mr.`` / ``Mrs.``, which its pretrained English model knows as abbreviations and this training
did not learn.
"""

from __future__ import annotations

import re

import numpy as np

__all__ = ["ABBREVIATIONS", "MEGATRON_MAX_LEN", "encode_sentences", "sentence_lengths", "split_sentences"]

MEGATRON_MAX_LEN = 1_000_000
"""Characters per piece a document is cut into before splitting (Megatron's ``max_len``)."""

ABBREVIATIONS = frozenset(
    """
    mr mrs ms dr prof sr jr st mt ft rev gen col capt lt sgt cpl gov sen rep pres hon
    messrs mme mlle esq
    e.g i.e etc vs cf al ca viz no nos vol vols pp p ed eds fig figs eq eqs ch sec
    dept univ inc ltd co corp bros assn est
    jan feb mar apr jun jul aug sep sept oct nov dec mon tue tues wed thu thur thurs fri sat sun
    a.m p.m u.s u.k u.n d.c ph.d b.a m.a b.sc m.sc
    """.split()  # noqa: SIM905 (a word list reads better as text)
)
"""Lower-case abbreviations (without their final period) after which a period does not end a
sentence. Deliberately common ones only; see the module docstring."""

# A candidate end: terminal punctuation, closing quotes/brackets, whitespace, then a non-space.
_CANDIDATE = re.compile(r"""([.?!]+)(["'\u201d\u2019)\]]*)(\s+)(?=(\S))""")
_WORD_BEFORE = re.compile(r"(\S*)$")


def _is_boundary(text: str, m: re.Match) -> bool:
    punct, next_char = m.group(1), m.group(4)
    if "?" in punct or "!" in punct:
        return True
    word = _WORD_BEFORE.search(text, 0, m.start()).group(1).lstrip("\"'(\u201c\u2018[")
    if len(punct) > 1:  # an ellipsis: a break only before a capitalised word
        return not next_char.islower()
    lower = word.lower()
    if lower in ABBREVIATIONS or "." in word:  # Mr. / e.g. / U.S.
        return False
    if len(word) == 1 and word.isalpha():  # an initial
        return False
    if word.isdigit() and next_char.islower():  # "3. the": a numbered item or a date
        return False
    return bool(word) or not next_char.islower()


def _split_piece(text: str, keep_newlines: bool) -> list[str]:
    sentences, start = [], 0
    for m in _CANDIDATE.finditer(text):
        if not _is_boundary(text, m):
            continue
        end = m.end() if keep_newlines else m.end(2)
        sentences.append(text[start:end])
        start = m.end()
    if start < len(text):
        sentences.append(text[start:])
    return sentences


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """Split ``text`` into sentences (see the module docstring for the rules).

    Args:
        text: one document.
        keep_newlines: keep the whitespace after each sentence at its end (Megatron's
            ``--keep-newlines``); otherwise it is dropped.

    Returns:
        The sentences in order; with ``keep_newlines`` their concatenation is ``text``.
    """
    pieces = [text[i : i + MEGATRON_MAX_LEN] for i in range(0, len(text), MEGATRON_MAX_LEN)]
    return [s for piece in pieces for s in _split_piece(piece, keep_newlines)]


def encode_sentences(encode, text: str, keep_newlines: bool | None) -> list:
    """A text's ids as a list of sequences, for ``data_tools.preprocess``.

    Args:
        encode: the tokenizer's ``text -> ids`` (a list or a 1-D array).
        text: one document.
        keep_newlines: ``None``: the whole text is one sequence; otherwise one sequence per
            sentence (:func:`split_sentences` with this ``keep_newlines``), sentences without
            tokens left out, as Megatron's encoder leaves them out.
    """
    if keep_newlines is None:
        return [encode(text)]
    sentences = split_sentences(text, keep_newlines=keep_newlines)
    return [ids for sentence in sentences if len(ids := encode(sentence))]


def sentence_lengths(docs: list[list], extra: int) -> np.ndarray:
    """int64 tokens per sentence of ``docs`` (each a list of sentences' ids), in order, with ``extra``
    (1 for the EOD of ``--append-eod``, else 0) added to the last sentence of each document."""
    out = np.array([len(s) for sentences in docs for s in sentences], dtype=np.int64)
    if extra and out.size:
        out[np.cumsum([len(x) for x in docs]) - 1] += extra
    return out
