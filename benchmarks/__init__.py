"""Benchmarks of vlm_pack (results in benchmarks/results/); a package so that ``python -m benchmarks.X`` from the
repository root never picks up another ``benchmarks`` package installed in site-packages."""
