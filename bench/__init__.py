"""Benchmarks of the wedlm_kernels ops and of the model_min decoder; results/ holds runs."""
