"""Inference: the generic remote client, the wire-format interface and the embedded server."""
