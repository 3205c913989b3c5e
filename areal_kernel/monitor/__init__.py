"""Run monitors: checks that catch what a run gets silently wrong (the
servers sampling from other weights than the trainer holds, a numerical
train/inference gap). ``docs/monitoring.md`` explains each metric and alarm."""
