"""Receiver side of the broadcast test, run as a separate process:
``recv_worker.py PORT RANK WORLD BUCKET_BYTES OUT_DIR``. The metadata is
recomputed from the same deterministic tensors the sender builds (in a real
setup it arrives over HTTP), and what arrives is saved for the test to check."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from areal_kernel.weights.broadcast import init_weight_group, recv_buckets, tensor_meta  # noqa: E402
from areal_kernel.weights.disk import save_state_dict_dir  # noqa: E402
from test_weights_broadcast import _tensors  # noqa: E402

port, rank, world, bucket, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
meta = tensor_meta(_tensors())
group = init_weight_group("127.0.0.1", port, world, rank, "test-weights", backend="gloo", timeout_s=60)
got = [(n, t.clone()) for n, t in recv_buckets(group, meta, bucket)]
save_state_dict_dir(got, out)
# Release the gloo group before interpreter shutdown: left to module teardown,
# its worker threads could still be joinable when the C++ object is destroyed
# (std::terminate, exit -6, in about half the runs). Then end without the
# interpreter's teardown, as the embedded server and the ranks do.
group.destroy()
from areal_kernel.utils.procs import flush_std_streams  # noqa: E402

flush_std_streams()
os._exit(0)
