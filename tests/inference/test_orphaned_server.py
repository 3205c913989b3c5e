"""A controller killed with SIGKILL cannot stop its servers; they must notice
and exit on their own instead of holding memory and a port forever."""
import os
import signal
import subprocess
import sys
import time

SCRIPT = """
import sys, time
from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig
lau = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=sys.argv[2])
info = lau.launch(sys.argv[1], n_servers=1, devices_per_server=0)[0]
print(info.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_server_exits_when_its_controller_is_killed(tiny_model_dir, tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo)
    ctl = subprocess.Popen([sys.executable, "-c", SCRIPT, tiny_model_dir, str(tmp_path)], stdout=subprocess.PIPE,
                           text=True, env=env)
    server_pid = int(ctl.stdout.readline())
    assert _alive(server_pid)
    ctl.send_signal(signal.SIGKILL)
    ctl.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(server_pid):
        time.sleep(0.2)
    try:
        assert not _alive(server_pid), "server outlived its killed controller"
    finally:
        if _alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)
