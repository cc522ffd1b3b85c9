"""How the sha256 sums in ``tests/unit/test_megatron_flags.py`` were obtained (not run by pytest).

    python tests/support/megatron_reference_hashes.py /path/to/Megatron-LM

writes the Dolma sample (``data/dolma-cc-sample-jsonl``, 20 documents) with Megatron's own
``IndexedDatasetBuilder`` (``megatron/core/datasets/indexed_dataset.py`` of NVIDIA/Megatron-LM
d98e8a64, 2026-08-22, loaded from its file: ``import megatron.core`` itself needs triton and
Transformer Engine, so the package modules it imports for object storage and logging are
replaced by stand-ins that open local files), fed as ``tools/preprocess_data.py``'s encoder feeds
it: per JSON line, ``builder.add_document(ids, sentence_lens)`` with the ids of each sentence
(zero-token sentences dropped) and the EOD added to the last one, lines dealt to partitions in
turn with ``--partitions``. Ids come from Hugging Face ``tokenizers`` on GPT-2's files (what
Megatron's GPT-2 tokenizer computes); sentences from ``data_tools.sentences`` (NLTK's Punkt
model cannot be downloaded here). Prints the sums of ``.bin`` and ``.idx`` for each case.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import tempfile
import types
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[2]


def _megatron_indexed_dataset(megatron_root: Path):
    for name in ("megatron", "megatron.core", "megatron.core.datasets"):
        module = types.ModuleType(name)
        module.__path__ = []
        sys.modules[name] = module
    storage = types.ModuleType("megatron.core.datasets.object_storage_utils")
    storage.__getattr__ = lambda name: mock.MagicMock()  # S3 helpers: unused for local files
    sys.modules[storage.__name__] = storage
    msc = types.ModuleType("megatron.core.msc_utils")
    msc.MultiStorageClientFeature = mock.MagicMock()
    msc.maybe_msc = types.SimpleNamespace(open=open)  # local files
    sys.modules[msc.__name__] = msc
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda *args, **kwargs: None
    sys.modules[utils.__name__] = utils
    path = megatron_root / "megatron" / "core" / "datasets" / "indexed_dataset.py"
    spec = importlib.util.spec_from_file_location("megatron.core.datasets.indexed_dataset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(megatron_root: str) -> None:
    sys.path.insert(0, str(REPO))
    from tokenizers import Tokenizer, models, pre_tokenizers

    from data_tools.sentences import split_sentences

    idx = _megatron_indexed_dataset(Path(megatron_root))
    bpe = REPO / "data" / "gpt2-bpe"
    tok = Tokenizer(models.BPE.from_file(str(bpe / "encoder.json"), str(bpe / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    files = sorted((REPO / "data" / "dolma-cc-sample-jsonl").glob("*.jsonl"))
    texts = [json.loads(line)["text"] for p in files for line in p.read_text(encoding="utf-8").splitlines()]
    out = Path(tempfile.mkdtemp())
    cases = {"--keep-newlines": (None, 1), "--keep-newlines --split-sentences --partitions 2": (True, 2)}
    for name, (keep_newlines, partitions) in cases.items():
        builder = idx.IndexedDatasetBuilder(str(out / "x.bin"), dtype=idx.DType.optimal_dtype(50257))
        for i in [i for k in range(partitions) for i in range(k, len(texts), partitions)]:
            pieces = [texts[i]] if keep_newlines is None else split_sentences(texts[i], keep_newlines)
            seqs = [ids for s in pieces if (ids := tok.encode(s).ids)]
            seqs[-1] = [*seqs[-1], 50256]
            builder.add_document([t for s in seqs for t in s], [len(s) for s in seqs])
        builder.finalize(str(out / "x.idx"))
        sums = [hashlib.sha256((out / f"x.{ext}").read_bytes()).hexdigest() for ext in ("bin", "idx")]
        print(name, *sums)


if __name__ == "__main__":
    main(sys.argv[1])
