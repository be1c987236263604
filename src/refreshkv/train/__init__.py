"""Continued pre-training with RefreshKV's attention pattern (refreshkv.txt §6): `refreshkv train`."""
