"""Atomic, bounded checkpoints (areal_kernel.checkpoint) under real failures:
a full disk (a real 1 MiB tmpfs), a read-only directory, a file-size limit
enforced by the kernel, a writer that raises mid-way, a killed writer."""
from __future__ import annotations

import os
import resource
import signal
import stat
import subprocess
import tempfile

import pytest

from areal_kernel.checkpoint import MARKER, CheckpointError, CheckpointManager, atomic_write_dir


def writer_for(step: int, size: int = 1000):
    def write(path: str) -> None:
        with open(os.path.join(path, "model.bin"), "wb") as f:
            f.write(bytes([step % 256]) * size)
        os.makedirs(os.path.join(path, "optim"))
        with open(os.path.join(path, "optim", "state.json"), "w") as f:
            f.write(f'{{"step": {step}}}')

    return write


def snapshot(root: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


def test_save_publishes_complete_dirs_and_keeps_last_k(tmp_path):
    m = CheckpointManager(str(tmp_path / "ckpt"), keep_last=2)
    assert m.latest() is None
    for step in (1, 2, 3, 4):
        c = m.save(step, writer_for(step))
        assert c.path == m.path_for(step) and os.path.isfile(os.path.join(c.path, MARKER))
    assert [c.step for c in m.complete()] == [3, 4]
    assert sorted(os.listdir(m.root)) == ["step3", "step4"]  # nothing partial left behind
    assert m.latest().step == 4
    with open(os.path.join(m.latest().path, "model.bin"), "rb") as f:
        assert f.read() == bytes([4]) * 1000


def test_writer_raising_midway_leaves_previous_intact(tmp_path):
    m = CheckpointManager(str(tmp_path / "ckpt"), keep_last=1)
    m.save(1, writer_for(1))
    before = snapshot(m.root)

    def half_then_disk_full(path: str) -> None:
        writer_for(2)(path)
        # Simulated: what write() raises on a full disk (the real one: test_full_disk_...).
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError) as ei:
        m.save(2, half_then_disk_full)
    msg = str(ei.value)
    assert m.path_for(2) in msg and "No space left on device (ENOSPC)" in msg
    assert f"previous checkpoint {m.path_for(1)} is intact" in msg
    assert snapshot(m.root) == before and m.latest().step == 1 and not m.partials()


def test_second_ctrl_c_midway_leaves_previous_intact(tmp_path):
    """What a second Ctrl-C does to the recovery checkpoint an interrupted run
    is writing: a real SIGINT, raised as KeyboardInterrupt by the trainer's
    handler while the writer is half-way, goes through as KeyboardInterrupt
    (not a CheckpointError), and leaves the previous checkpoint as it was and
    nothing partial."""
    from areal_kernel.trainer.common import GracefulInterrupt

    m = CheckpointManager(str(tmp_path / "ckpt"), keep_last=1)
    m.save(1, writer_for(1))
    before = snapshot(m.root)
    handler = GracefulInterrupt()
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    handler.install()
    try:
        with handler.armed():
            os.kill(os.getpid(), signal.SIGINT)  # the first: only requested
            assert handler.requested.is_set()

            def half_then_ctrl_c(path: str) -> None:
                writer_for(2)(path)
                os.kill(os.getpid(), signal.SIGINT)  # the second, delivered mid-write
                raise AssertionError("the second SIGINT did not interrupt the writer")

            with pytest.raises(KeyboardInterrupt):
                m.save(2, half_then_ctrl_c)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    assert snapshot(m.root) == before and m.latest().step == 1 and not m.partials()


def _in_child(fn, *, as_nobody: bool = False, fsize: int | None = None) -> tuple[int, str]:
    """Run ``fn()`` in a forked child (optionally as uid nobody, or under a
    file-size limit) and return (exit code, what it reported)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: stdlib file work only, then _exit
        os.close(r)
        code, text = 0, "ok"
        try:
            if fsize is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            if as_nobody:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            fn()
        except CheckpointError as e:
            code, text = 3, str(e)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            code, text = 4, f"{type(e).__name__}: {e}"
        os.write(w, text.encode())
        os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode()


def test_read_only_directory_gives_clear_error_and_keeps_previous():
    # Outside pytest's 0700 base directory (where the root conftest points
    # TMPDIR), so that uid nobody can reach it; removed below.
    base = tempfile.mkdtemp(prefix="areal-ckpt-ro-", dir=os.environ.get("AREAL_TEST_SHARED_TMPDIR"))
    try:
        os.chmod(base, 0o755)
        m = CheckpointManager(os.path.join(base, "ckpt"), keep_last=2)
        m.save(1, writer_for(1))
        os.chmod(m.root, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        before = snapshot(m.root)
        # root ignores permission bits, so as root the save runs as nobody.
        code, msg = _in_child(lambda: m.save(2, writer_for(2)), as_nobody=os.geteuid() == 0)
        assert code == 3, msg
        assert m.path_for(2) in msg and "Permission denied (EACCES)" in msg
        assert f"previous checkpoint {m.path_for(1)} is intact" in msg
        assert snapshot(m.root) == before and [c.step for c in m.complete()] == [1]
    finally:
        os.chmod(os.path.join(base, "ckpt"), 0o755)
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_file_size_limit_midway_is_reported_and_cleaned_up(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse the write half-way (EFBIG), as a
    full disk would (ENOSPC): a real failure inside the writer."""
    m = CheckpointManager(str(tmp_path / "ckpt"), keep_last=2)
    m.save(1, writer_for(1, size=1000))
    before = snapshot(m.root)
    code, msg = _in_child(lambda: m.save(2, writer_for(2, size=1 << 20)), fsize=64 << 10)
    assert code == 3, msg
    assert "File too large (EFBIG)" in msg and f"previous checkpoint {m.path_for(1)} is intact" in msg
    assert snapshot(m.root) == before and not m.partials()


def test_full_disk_midway_is_reported_and_previous_kept(tmp_path):
    """A real full disk: a 1 MiB tmpfs mounted for this test (root, as CI
    runs), a 4 MiB checkpoint written onto it after a small one."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if mount.returncode != 0:  # under CI=true this skip fails (conftest.py): CI can mount
        pytest.skip(f"cannot mount a small tmpfs here (needs root/CAP_SYS_ADMIN): {mount.stderr.strip()}")
    try:
        m = CheckpointManager(str(mnt / "ckpt"), keep_last=2)
        m.save(1, writer_for(1, size=1000))
        before = snapshot(m.root)
        with pytest.raises(CheckpointError) as ei:
            m.save(2, writer_for(2, size=4 << 20))
        msg = str(ei.value)
        assert m.path_for(2) in msg and "No space left on device (ENOSPC)" in msg, msg
        assert f"previous checkpoint {m.path_for(1)} is intact" in msg
        assert snapshot(m.root) == before and m.latest().step == 1 and not m.partials()
        # The partial was removed, so the space is free again: a small save fits.
        assert m.save(3, writer_for(3, size=1000)).step == 3 and [c.step for c in m.complete()] == [1, 3]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_killed_writer_leaves_a_partial_that_discovery_ignores(tmp_path):
    m = CheckpointManager(str(tmp_path / "ckpt"), keep_last=3)
    m.save(5, writer_for(5))

    def die_midway(path: str) -> None:
        writer_for(6)(path)
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 in the middle of the save

    pid = os.fork()
    if pid == 0:
        try:
            m.save(6, die_midway)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert len(m.partials()) == 1  # the half-written directory is there ...
    assert m.latest().step == 5  # ... and ignored
    # A directory named like a checkpoint but without the marker is ignored too.
    os.makedirs(m.path_for(7))
    assert m.latest().step == 5
    assert m.discard_partials() and not m.partials()
    assert m.save(7, writer_for(7)).step == 7 and m.latest().step == 7  # the unmarked dir is replaced


def test_refuses_to_overwrite_and_validates_keep_last(tmp_path):
    m = CheckpointManager(str(tmp_path / "ckpt"))
    m.save(1, writer_for(1))
    with pytest.raises(CheckpointError, match="already exists"):
        atomic_write_dir(m.path_for(1), writer_for(1))
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(str(tmp_path), keep_last=0)
