"""The GPU check (``bash benchmarks/gpu/run.sh``; docs/gpu_check.md): one call on a borrowed GPU machine."""
