"""The sections of `tools/gpu_check.py` (the GPU path as one prepared check); each section
drives tempering's own classes in this process, without Ray. See docs/scaling/gpu-check.md."""
