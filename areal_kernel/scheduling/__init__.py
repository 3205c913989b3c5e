"""Schedulers place roles (train ranks, inference servers) on processes and devices."""
