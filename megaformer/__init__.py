"""megaformer: tensor/pipeline/data-parallel pretraining of NormFormer language models on DeepSpeed."""

__version__ = "0.1.0"
