"""GPU code paths on a CPU machine: fake CUDA tensors (a shim built from torch's headers), the fake
process group, an audit of what a GPU run would be refused or slowed by, and one rank of a job run
through the trainer's own parts (docs/gpus.md, "Before the queue"). Nothing here is imported by a
training run."""
