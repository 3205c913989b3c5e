"""Rejection-sampling fine-tuning (``algorithm.type: rft``), a plugin trainer
written against the public API only (docs/plugin-authoring.md, "A trainer
that uses inference servers")."""
