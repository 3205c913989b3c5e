"""Rollout workflows: turn a dataset record into a group of scored trajectories."""
