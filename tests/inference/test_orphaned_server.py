"""A controller killed with SIGKILL cannot stop its servers; they must notice
and exit on their own instead of holding memory and a port forever."""
import os
import signal
import subprocess
import sys
import time

from areal_kernel.testing.procs import is_alive

SCRIPT = """
import sys, time
from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
lau = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=sys.argv[2])
info = lau.launch(sys.argv[1], n_servers=1, devices_per_server=0)[0]
print(info.pid, flush=True)
time.sleep(600)
"""




def test_server_exits_when_its_controller_is_killed(tiny_model_dir, tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo)
    ctl = subprocess.Popen([sys.executable, "-c", SCRIPT, tiny_model_dir, str(tmp_path)], stdout=subprocess.PIPE,
                           text=True, env=env)
    server_pid = int(ctl.stdout.readline())
    assert is_alive(server_pid)
    ctl.send_signal(signal.SIGKILL)
    ctl.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and is_alive(server_pid):
        time.sleep(0.2)
    try:
        assert not is_alive(server_pid), "server outlived its killed controller"
    finally:
        if is_alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)
