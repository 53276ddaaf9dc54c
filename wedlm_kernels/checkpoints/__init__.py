"""Checkpoint reading shared by the front ends: :mod:`.config`, what a checkpoint's
``config.json`` means for the math (``docs/requests.md``, "Checkpoint configs")."""
