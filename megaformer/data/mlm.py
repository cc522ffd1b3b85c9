"""RoBERTa's masked-LM data path on the same ``.bin/.idx`` files as the causal LM.

A sample is a block of ``seq_len`` tokens (RoBERTa: 512): ``<s>`` (BOS) then ``seq_len - 1`` tokens of
the document stream, masked dynamically, returned as ``(input_ids, labels)``.

**Packing.** The stream is the causal LM's: documents concatenated in a seeded order, reshuffled
every pass, each already ended by GPT-2's EOD (50256, appended by ``data_tools.preprocess
--append-eod``), which serves as RoBERTa's ``</s>`` document separator. Blocks are cut from it at a
fixed stride of ``seq_len - 1`` tokens and may cross document boundaries: RoBERTa's FULL-SENTENCES
input (Liu et al. 2019, Sec. 4.2: "Inputs may cross document boundaries. When we reach the end of one
document, we begin sampling sentences from the next document and add an extra separator token
between documents"), cut as fairseq's ``TokenBlockDataset`` does with ``--sample-break-mode none``
("break tokens into equally sized blocks"), not ``complete`` (the mode of fairseq's
``examples/roberta/README.pretraining.md``: whole lines per block, up to the block size, blocks of
unequal length padded in the batch). Why ``none``: a ``.bin`` here records documents, not lines or
sentences, so ``complete`` would pack whole documents: one longer than 511 tokens would be a block of
its own past the model's 512 positions, and every block would end short by up to a document's
length, filled with padding. Fixed blocks carry exactly ``seq_len`` real tokens each, so a batch
holds the tokens the paper counts ("batches of 1M tokens"), and the GPT sample index serves as is.
What differs from FULL-SENTENCES: a block may start or end inside a sentence, and one EOD (not
fairseq's blank-line ``</s></s>``) separates documents.

fairseq's ``masked_lm`` task builds blocks of ``tokens_per_sample - 1`` tokens ("one less for <s>")
and prepends ``<s>`` (``PrependTokenDataset(dataset, bos)``); so do we, with :data:`BOS_ID`.

**The index.** :mod:`data_tools.sample_index` built for ``seq_len - 1``: its sample ``j`` holds stream
tokens ``[j·(seq_len-1), (j+1)·(seq_len-1)]``, ``seq_len`` tokens, the last of which is the first
token of sample ``j + 1`` (causal samples overlap by one token for the label shift). A block keeps
the first ``seq_len - 1`` and drops that shared last one, so blocks tile the stream: every token of
every pass over the documents is in exactly one block (blocks run on from one pass into the next,
as causal samples do; the only tokens never served are the < ``seq_len - 1`` after the last block
the index holds). The cached index (doc_idx / sample_idx / shuffle_idx, seeded, memory-mapped) is
the causal LM's, and an index cached for a causal run with ``seq_len - 1`` is the same file.

**Masking** (RoBERTa Sec. 2.3 and 4.1; fairseq ``fairseq/data/mask_tokens_dataset.py``,
``MaskTokensDataset.__getitem__``): of the ``n`` non-special tokens of a block,
``int(0.15 · n + u)`` (``u`` uniform in [0, 1): fairseq's probabilistic rounding, ``num_mask =
int(self.mask_prob * sz + np.random.rand())``, so the expected count is exactly 15%) are chosen
uniformly without replacement; each chosen token independently becomes ``<mask>`` (80%), a random
token (10%, uniform over the real vocabulary) or stays (10%): fairseq's two draws (unmask-or-random
with 0.2, then unmask with 0.5) give the same per-token probabilities. Labels hold the original id at
the chosen positions and :data:`IGNORE_INDEX` elsewhere. Two departures from fairseq, both following
BERT (``create_pretraining_data.py`` skips ``[CLS]``/``[SEP]``) and Hugging Face's
``DataCollatorForLanguageModeling`` (``special_tokens_mask``): special tokens (BOS, EOD, padding) are
never chosen (fairseq counts and may mask ``<s>`` and ``</s>``), and never drawn as a random
replacement (fairseq zeroes only its 4 leading specials, so it may draw ``<mask>`` or a
``madeupword``).

Dynamic masking (RoBERTa Sec. 4.1): a block's mask is drawn when the block is read, from
``numpy.random.default_rng([seed, tag, part, epoch, index])`` where ``index`` is the block's position
in the packed stream (``shuffle_idx[i]``, fairseq's index into the unshuffled dataset) and ``epoch``
a counter the caller may set (fairseq's ``set_epoch``). Nothing of a worker, rank or reading order
enters: a block gets the same mask at any data-parallel size, in any order, after any restart. Each
pass over the documents is a new range of block positions, so a long run sees fresh masks per pass
with ``epoch`` left at 0. Only ``Generator.random`` (float64) draws are used, the most stable of
numpy's Generator methods (NEP 19 lets other methods change between numpy releases).

**Vocabulary.** megaformer keeps GPT-2's raw ids 0..50256 (RoBERTa's fairseq dictionary reorders
them by frequency behind 4 specials); the MLM adds :data:`MASK_ID`, :data:`BOS_ID` and
:data:`PAD_ID` above them and sizes the embedding as RoBERTa-base's 50265 rows
(:func:`mlm_vocab_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from data_tools.indexed_dataset import DataFormatError, IndexedDataset
from data_tools.sample_index import load_or_build
from megaformer.config.schema import MLM_VOCAB_SIZE  # the config checks model.vocab_size against it
from megaformer.data.gpt_dataset import BlendedSamples, GPTSamples

__all__ = [
    "BOS_ID",
    "EOD_ID",
    "GPT2_VOCAB_SIZE",
    "IGNORE_INDEX",
    "MASK_ID",
    "MLM_VOCAB_SIZE",
    "PAD_ID",
    "MaskedLMSamples",
    "MaskingConfig",
    "as_masked_lm",
    "build_mlm_samples",
    "collate_mlm",
    "mask_block",
    "max_masked_positions",
    "mlm_vocab_rows",
]

GPT2_VOCAB_SIZE = 50257
"""GPT-2 BPE ids 0..50256: the ids a ``.bin`` holds (50256 BPE symbols and ``<|endoftext|>``)."""
EOD_ID = 50256
"""GPT-2's ``<|endoftext|>``, appended to every document at preprocessing: RoBERTa's ``</s>``."""
MASK_ID = 50257
"""``<mask>``: the first id above GPT-2's (RoBERTa adds it last to its dictionary, id 50264 there)."""
BOS_ID = 50258
"""``<s>``, first token of every block (fairseq's ``PrependTokenDataset(dataset, bos)``; RoBERTa's
classification head reads its output)."""
PAD_ID = 50259
"""``<pad>``: never in a pretraining block (blocks are full); for fine-tuning batches of short
inputs."""
IGNORE_INDEX = -100
"""Label of the positions not chosen for prediction: ``torch.nn.functional.cross_entropy``'s default
``ignore_index``, and Hugging Face's."""

_MASK_STREAM = 0x4D4C4D  # "MLM": keeps mask draws apart from the sample index's seeded streams


def _check_probability(name: str, value: float, *, open_interval: bool = False) -> None:
    ok = 0.0 < value < 1.0 if open_interval else 0.0 <= value <= 1.0
    if not (ok and math.isfinite(value)):
        interval = "(0, 1)" if open_interval else "[0, 1]"
        raise ValueError(f"MaskingConfig.{name}={value!r}: must lie in {interval}")


@dataclass(frozen=True)
class MaskingConfig:
    """What is masked and how (RoBERTa-base's defaults, fairseq's ``masked_lm`` task options).

    Raises:
        ValueError: (on construction) a probability outside its range, the three replacement
            probabilities not summing to 1, ``mask_id`` inside ``[0, vocab_size)`` or among the
            special ids, a bad ``vocab_size``; the message names the field and the value.
    """

    mask_prob: float = 0.15
    """Share of a block's non-special tokens chosen for prediction (fairseq ``--mask-prob``)."""
    mask_token_prob: float = 0.8
    """Of the chosen tokens, the share replaced by ``mask_id``."""
    random_token_prob: float = 0.1
    """Of the chosen tokens, the share replaced by a random token (fairseq ``--random-token-prob``)."""
    leave_unmasked_prob: float = 0.1
    """Of the chosen tokens, the share left as they are (fairseq ``--leave-unmasked-prob``)."""
    mask_id: int = MASK_ID
    """The ``<mask>`` id; must lie outside the data's ``[0, vocab_size)``."""
    vocab_size: int = GPT2_VOCAB_SIZE
    """The data's ids are in ``[0, vocab_size)``; random replacements are drawn from them, less
    ``special_ids``."""
    special_ids: tuple[int, ...] = (BOS_ID, EOD_ID, PAD_ID)
    """Never chosen, never drawn as a replacement."""

    def __post_init__(self) -> None:
        _check_probability("mask_prob", self.mask_prob, open_interval=True)
        shares = {
            "mask_token_prob": self.mask_token_prob,
            "random_token_prob": self.random_token_prob,
            "leave_unmasked_prob": self.leave_unmasked_prob,
        }
        for name, value in shares.items():
            _check_probability(name, value)
        total = sum(shares.values())
        if abs(total - 1.0) > 1e-9:
            listed = " + ".join(f"{k}={v!r}" for k, v in shares.items())
            raise ValueError(
                f"MaskingConfig: {listed} = {total!r}; the three must sum to 1 (RoBERTa: 0.8/0.1/0.1)"
            )
        if self.vocab_size < 2:
            raise ValueError(f"MaskingConfig.vocab_size={self.vocab_size}: must be >= 2")
        if 0 <= self.mask_id < self.vocab_size:
            raise ValueError(
                f"MaskingConfig.mask_id={self.mask_id} is inside the data's vocabulary "
                f"[0, {self.vocab_size}) and would be confused with a real token; use an id >= "
                f"{self.vocab_size} (default {MASK_ID})"
            )
        if self.mask_id < 0:
            raise ValueError(f"MaskingConfig.mask_id={self.mask_id}: must be >= 0")
        if self.mask_id in self.special_ids:
            raise ValueError(
                f"MaskingConfig.mask_id={self.mask_id} is also listed in special_ids={self.special_ids}"
            )
        if len(self._replaceable_skips) >= self.vocab_size:
            raise ValueError(
                f"MaskingConfig.special_ids={self.special_ids} leave no id of [0, {self.vocab_size})"
            )

    @property
    def _replaceable_skips(self) -> tuple[int, ...]:
        """The special ids inside ``[0, vocab_size)``, ascending: skipped by random replacements."""
        return tuple(sorted({s for s in self.special_ids if 0 <= s < self.vocab_size}))


def max_masked_positions(block_len: int, mask_prob: float = MaskingConfig.mask_prob) -> int:
    """The most positions :func:`mask_block` can choose in a block of ``block_len`` tokens:
    ``min(block_len, floor(mask_prob · block_len) + 1)`` (its count is
    ``int(mask_prob · n + u)``, ``u`` in [0, 1), over ``n <= block_len`` candidates; fairseq's
    rounding). The masked LM's head decodes this many positions per row under
    ``model.mlm_head_positions`` masked (:class:`megaformer.model.MaskedLMFeatures`): a shape
    set by the block's length alone, so no host sync.

    Raises:
        ValueError: ``block_len < 1`` or ``mask_prob`` outside (0, 1).
    """
    if block_len < 1 or not 0.0 < mask_prob < 1.0:
        raise ValueError(
            f"max_masked_positions: block_len={block_len} (must be >= 1), mask_prob={mask_prob} (in (0, 1))"
        )
    return min(block_len, math.floor(mask_prob * block_len) + 1)


def _random_tokens(u: np.ndarray, config: MaskingConfig) -> np.ndarray:
    """Maps uniforms ``u`` in [0, 1) to ids uniform over ``[0, vocab_size)`` less the special ids."""
    skips = config._replaceable_skips
    ids = np.floor(u * (config.vocab_size - len(skips))).astype(np.int64)
    for s in skips:  # ascending: the r-th allowed id is r plus the skipped ids at or below it
        ids += ids >= s
    return ids


def mask_block(
    tokens: np.ndarray,
    *,
    seed: int,
    epoch: int,
    index: int,
    part: int = 0,
    config: MaskingConfig | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Masks one block, deterministically from ``(seed, part, epoch, index)`` alone.

    The rules are fairseq's ``MaskTokensDataset`` (``fairseq/data/mask_tokens_dataset.py``) less
    special tokens; see the module docstring. Draws, all from
    ``np.random.default_rng([seed, 0x4D4C4D, part, epoch, index])`` and all ``Generator.random``:
    one for the rounding, one per candidate (the chosen are the ``num_mask`` smallest), then per
    chosen token (in position order) one for its fate and one for its random replacement.

    Args:
        tokens: int[seq_len], the unmasked block (BOS first); not modified.
        seed, epoch, index, part: non-negative ints keying the draw (``index``: the block's position
            in the packed stream; ``part``: which dataset of a blend).
        config: the masking rules (default: RoBERTa's, GPT-2 ids).

    Returns:
        ``(input_ids, labels)``, int64[seq_len] each: ``input_ids`` the block with the chosen tokens
        replaced, ``labels`` the original id at chosen positions and ``IGNORE_INDEX`` elsewhere.

    Raises:
        ValueError: a negative key.
        DataFormatError: a token outside ``[0, config.vocab_size)`` that is not a special id (the data
            was not tokenized with the vocabulary the masking assumes; fairseq asserts likewise that
            no ``<mask>`` is in the data).
    """
    config = config or MaskingConfig()
    if min(seed, epoch, index, part) < 0:
        raise ValueError(
            f"mask keys must be >= 0, got seed={seed}, epoch={epoch}, index={index}, part={part}"
        )
    tokens = np.asarray(tokens, dtype=np.int64)
    special = np.isin(tokens, config.special_ids)
    outside = ~special & ((tokens < 0) | (tokens >= config.vocab_size))
    if outside.any():
        bad = int(tokens[np.flatnonzero(outside)[0]])
        raise DataFormatError(
            f"block {index} holds token id {bad}, outside the vocabulary [0, {config.vocab_size}) "
            f"the masking assumes (mask_id={config.mask_id}); was the dataset tokenized with GPT-2 BPE?"
        )
    candidates = np.flatnonzero(~special)  # (n,) positions that may be chosen
    rng = np.random.default_rng([seed, _MASK_STREAM, part, epoch, index])
    n = candidates.size
    num_mask = min(int(config.mask_prob * n + rng.random()), n)  # fairseq's probabilistic rounding
    keys = rng.random(n)
    chosen = np.sort(candidates[np.argsort(keys, kind="stable")[:num_mask]])  # (num_mask,) positions
    fate = rng.random(num_mask)
    replacement = _random_tokens(rng.random(num_mask), config)

    labels = np.full(tokens.shape, IGNORE_INDEX, dtype=np.int64)
    labels[chosen] = tokens[chosen]
    input_ids = tokens.copy()
    to_mask = fate < config.mask_token_prob
    to_random = ~to_mask & (fate < config.mask_token_prob + config.random_token_prob)
    input_ids[chosen[to_mask]] = config.mask_id
    input_ids[chosen[to_random]] = replacement[to_random]
    return input_ids, labels


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 2:
        raise ValueError(
            f"seq_len={seq_len}: a masked-LM block holds <s> and at least one token of text, so seq_len "
            "must be >= 2 (RoBERTa: 512)"
        )


@dataclass
class MaskedLMSamples:
    """Masked-LM blocks over a causal sample index built for ``seq_len - 1``; indexable like
    ``GPTSamples``.

    ``samples[i]`` is ``(input_ids, labels)``, int64[seq_len] each, of block ``block_id(i)``
    (``blocks.shuffle_idx[i]``): ``<s>`` then the first ``seq_len - 1`` tokens of causal sample
    ``i``, masked by :func:`mask_block` keyed by ``(seed, part, epoch, block_id(i))``.

    Attributes:
        blocks: the causal samples, built with ``seq_len - 1`` (``blocks.seq_len + 1 == seq_len``).
        seed: keys the masks (the run's seed; it also seeded the index).
        epoch: a counter keying the masks, fairseq's ``set_epoch``: change it to draw new masks for
            the same blocks. Set it before a loader forks its workers (they keep the value they
            forked with).
        part: which dataset of a blend (so two datasets' block ``j`` get independent masks).
        masking: the rules.
        bos_id: the id put first in every block.
    """

    blocks: GPTSamples
    seed: int
    epoch: int = 0
    part: int = 0
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    bos_id: int = BOS_ID

    def __post_init__(self) -> None:
        _check_seq_len(self.blocks.seq_len + 1)
        if min(self.seed, self.epoch, self.part) < 0:
            raise ValueError(f"seed={self.seed}, epoch={self.epoch} and part={self.part} must be >= 0")
        if self.bos_id not in self.masking.special_ids:
            raise ValueError(
                f"bos_id={self.bos_id} is not in masking.special_ids={self.masking.special_ids}; "
                "it would be masked"
            )

    @property
    def seq_len(self) -> int:
        """Tokens per block, ``<s>`` included."""
        return self.blocks.seq_len + 1

    @property
    def dataset(self) -> IndexedDataset:
        return self.blocks.dataset

    def __len__(self) -> int:
        return len(self.blocks)

    def block_id(self, i: int) -> int:
        """Position in the packed stream of the block served at ``i``: it covers stream tokens
        ``[block_id·(seq_len-1), (block_id+1)·(seq_len-1))``."""
        return int(self.blocks.shuffle_idx[i])

    def tokens(self, i: int) -> np.ndarray:
        """Block ``i`` unmasked: int64[seq_len], ``bos_id`` then ``seq_len - 1`` stream tokens."""
        x = self.blocks[i]  # int64[seq_len]: seq_len - 1 tokens + the next block's first token
        x[1:] = x[:-1]
        x[0] = self.bos_id
        return x

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``i``: ``(input_ids, labels)``, int64[seq_len] each (see :func:`mask_block`)."""
        return mask_block(
            self.tokens(i),
            seed=self.seed,
            epoch=self.epoch,
            index=self.block_id(i),
            part=self.part,
            config=self.masking,
        )


def build_mlm_samples(
    dataset: IndexedDataset,
    *,
    seq_len: int,
    num_samples: int,
    seed: int,
    doc_ids: np.ndarray | None = None,
    shuffle: bool = True,
    cache_dir: str | None = None,
    masking: MaskingConfig | None = None,
) -> MaskedLMSamples:
    """``num_samples`` masked-LM blocks of ``seq_len`` tokens from ``dataset`` (its ``doc_ids``).

    The sample index is :func:`data_tools.sample_index.load_or_build` with ``seq_len - 1`` (cached
    under ``cache_dir`` like a causal index; ``shuffle=False`` serves blocks in stream order, for
    validation: the same blocks and masks every evaluation).

    Raises:
        ValueError: ``seq_len < 2``; a bad ``masking``.
        DataFormatError: too little data for one block (see ``build_sample_index``).
    """
    _check_seq_len(seq_len)
    index = load_or_build(
        dataset,
        seq_len=seq_len - 1,
        num_samples=num_samples,
        seed=seed,
        shuffle=shuffle,
        doc_ids=doc_ids,
        cache_dir=cache_dir,
    )
    blocks = GPTSamples(dataset, index.doc_idx, index.sample_idx, index.shuffle_idx, seq_len - 1)
    return MaskedLMSamples(blocks, seed=seed, masking=masking or MaskingConfig())


def as_masked_lm(
    samples: GPTSamples | BlendedSamples, *, seed: int, masking: MaskingConfig | None = None
) -> MaskedLMSamples | BlendedSamples:
    """Masked-LM blocks over causal samples built for ``seq_len - 1``, e.g. both outputs of
    ``build_train_valid(prefix, seq_len - 1, ...)``; a blend is wrapped part by part (part ``k``
    keys its masks with ``part=k``) and keeps its interleaving."""
    masking = masking or MaskingConfig()
    if isinstance(samples, GPTSamples):
        return MaskedLMSamples(samples, seed=seed, masking=masking)
    parts = [MaskedLMSamples(p, seed=seed, part=k, masking=masking) for k, p in enumerate(samples.parts)]
    return BlendedSamples(parts, samples.dataset_index, samples.dataset_sample_index)  # type: ignore[arg-type]


def collate_mlm(rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacks masked-LM samples into ``(input_ids, labels)``, CPU int64 tensors
    ``[micro_batch_size, seq_len]`` (no shift: the MLM predicts each position's own token)."""
    input_ids = torch.from_numpy(np.stack([r[0] for r in rows]))
    labels = torch.from_numpy(np.stack([r[1] for r in rows]))
    return input_ids, labels


def mlm_vocab_rows(*, tp_size: int = 1, make_vocab_size_divisible_by: int = 1) -> int:
    """Embedding rows (= rows of the tied LM-head decoder) of the masked LM.

    RoBERTa-base has 50265 (:data:`MLM_VOCAB_SIZE`); with ``model.vocab_size = MLM_VOCAB_SIZE`` the
    model pads them, as ``ModelConfig.padded_vocab_size`` and Megatron do, to a multiple of
    ``make_vocab_size_divisible_by × tp_size``. |θ| equals RoBERTa-base's only when that multiple
    divides 50265 = 3² · 5 · 1117, in practice ``make_vocab_size_divisible_by = 1`` at ``tp_size =
    1``. Otherwise each extra row adds ``hidden_size`` embedding weights plus one LM-head bias: at
    hidden 768, tp 2 gives 50266 rows (+769 parameters), the default 128 gives 50304 at tp 1
    (+39 rows, +30k, 0.02% of RoBERTa-base's 125M) and 51200 at tp 8 (+935 rows, +0.7M, 0.6%).
    The padded rows are masked out of the softmax (``megaformer.parallel.mask_padded_vocab``), so
    they change |θ| but not the function.

    Raises:
        ValueError: ``tp_size`` or ``make_vocab_size_divisible_by`` below 1.
    """
    if tp_size < 1 or make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"tp_size={tp_size} and make_vocab_size_divisible_by={make_vocab_size_divisible_by} must be >= 1"
        )
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-MLM_VOCAB_SIZE // multiple) * multiple
