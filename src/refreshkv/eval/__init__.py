"""Offline evaluation: task generators and scorers (see `refreshkv.eval.tasks`)."""
