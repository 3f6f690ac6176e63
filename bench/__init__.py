"""Benchmarks, grouped by what they measure: serving/, features/, kernels/, accuracy/, peers/, gpu/.

One entry point, `python -m bench NAME [args]` (`python -m bench --help` lists every NAME); one results
format, `report.save_run`'s JSON. `report` and `workloads` are shared by every group."""
