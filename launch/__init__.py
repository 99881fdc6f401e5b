"""Example trainers and launch scripts. The trainers run as scripts (``torchrun
launch/train_fsdp.py``); their shared parts (``launch.common``, ``launch.megatron_cpu``) are
importable from the repository root, as the tests and benchmarks do."""
