"""The performance model: what a config costs on a device before it runs there.

- :mod:`.devices`: the devices' rates (:class:`~.devices.DeviceSpec`), the fits to the H200
  measurements, the recipes' GPUs, this CPU's measured rates;
- :mod:`.costs`: one operation's cost on a device (a GEMM, a collective, the pipeline bubble, a
  transformer block by formula);
- :mod:`.optrace`: one block's operations as the fake-CUDA run dispatches them, and inductor's
  fusion of them estimated;
- :mod:`.steptime`: the step time, tokens/s, MFU and device-hours of a layout;
- :mod:`.plan`: the memory of every pipeline stage, whether it fits, a layout that does;
- :mod:`.fakecuda`: GPU code paths on a CPU machine (one rank of a GPU job, audited).

Imports: ``devices`` <- ``costs`` <- ``optrace`` <- ``steptime`` -> ``plan`` (no circle); nothing
here imports :mod:`megaformer.tools`, whose ``plan`` and ``dryrun`` are the commands over it.
Nothing here is imported by a training run.
"""
