"""Rollout: staleness-bounded admission and the asyncio executor."""
