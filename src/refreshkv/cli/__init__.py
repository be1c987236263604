"""The `refreshkv` command line (app.py): commands, their options, and the demo prompt. Nothing else imports it."""
