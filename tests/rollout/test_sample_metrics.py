"""Per-sample metrics workflows put in ``Trajectory.metadata["metrics"]``
become ``workflow/<name>`` means over the samples that carry each name."""
from areal_kernel.api.io import Trajectory, TrajectoryGroup
from areal_kernel.rollout.executor import SAMPLE_METRICS_KEY, RolloutStats


def _traj(metrics):
    return Trajectory([1, 2], [0, 1], [0.0, -0.5], [-1, 0], 1.0, metadata={SAMPLE_METRICS_KEY: metrics})


def test_means_over_the_samples_that_carry_a_name_then_reset():
    stats = RolloutStats()
    stats.add_sample_metrics(TrajectoryGroup([_traj({"turns": 2, "second_turn_success": 1.0}), _traj({"turns": 1})]))
    stats.add_sample_metrics(TrajectoryGroup([_traj({"turns": 2, "second_turn_success": 0.0, "bad": "x"})]))
    out = stats.snapshot_and_reset()
    assert out["workflow/turns"] == 5 / 3 and out["workflow/second_turn_success"] == 0.5
    assert "workflow/bad" not in out
    assert not any(k.startswith("workflow/") for k in stats.snapshot_and_reset())
