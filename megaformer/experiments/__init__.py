"""Experiments built on the trainer: comparisons of normalisation schemes at equal compute."""
