"""Every KV method, one file each; importing this package registers them all."""

from . import full, refreshkv  # noqa: F401
