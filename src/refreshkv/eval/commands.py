"""`refreshkv eval`, `sweep` and `report` (being written)."""


def register(app, user_errors) -> None:
    """Add the evaluation commands to the CLI app; `user_errors` wraps a command so ValueErrors exit with code 2."""
