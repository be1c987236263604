"""Measuring methods: decode speed and memory (bench.py, its tables and plots in bench_report.py), one step's operators
(profile_step.py), and the prompt tokens each layer kept (budget_report.py)."""
