"""A failed checkpoint write names its cause (no space, quota, read-only) with the path, the bytes
written and the free space; an unwritable output.dir or index-cache parent is refused in the
preflight with the path and the fix."""

from __future__ import annotations

import errno
import os

import pytest

from megaformer.checkpoint import storage
from megaformer.config import ConfigError, load_config
from megaformer.training.data_checks import check_output_dirs


def _torch_full() -> RuntimeError:
    """What torch.save raises on a full disk: no errno."""
    return RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 3988")


def _partial(tmp_path):
    tag = tmp_path / "global_step8"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 3988)
    return tag


@pytest.mark.parametrize(
    ("code", "cause", "fix"),
    [
        (errno.ENOSPC, "no space left on device", "set output.dir on a larger disk"),
        (errno.EDQUOT, "disk quota exceeded", "quota -s"),
        (errno.EROFS, "read-only file system", "remount it read-write"),
    ],
)
def test_an_errno_in_the_chain_names_the_cause_with_the_figures(tmp_path, code, cause, fix):
    tag = _partial(tmp_path)
    error = _torch_full()  # through a Python file object, torch's error keeps the OSError as context
    error.__context__ = OSError(code, os.strerror(code), str(tag / "mp_rank_00_model_states.pt"))
    text, named = storage.write_failure(str(tag), error)
    assert named and text.startswith(f"{cause} (3,988 bytes written under {tag}, ")
    assert "bytes free on its file system" in text and fix in text


def test_torchs_error_without_errno_is_explained_by_a_probe_write(tmp_path, monkeypatch):
    tag = _partial(tmp_path)
    monkeypatch.setattr(storage, "probe", lambda directory: OSError(errno.ENOSPC, "No space left on device"))
    text, named = storage.write_failure(str(tag), _torch_full())
    assert named and text.startswith("no space left on device (3,988 bytes written")
    assert "unexpected pos 4096 vs 3988" in text  # the original error, for the record


def test_a_probe_that_succeeds_leaves_the_error_as_it_is(tmp_path):
    tag = _partial(tmp_path)
    text, named = storage.write_failure(str(tag), _torch_full())
    assert not named and text.startswith("RuntimeError: [enforce fail") and "bytes free" in text
    assert sorted(os.listdir(tag)) == ["mp_rank_00_model_states.pt"]  # the probe file is gone


def test_the_probe_reports_the_file_systems_refusal(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert storage.probe(str(tmp_path / "missing" / "dir")).errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def _cfg(tmp_path, *extra):
    return load_config("configs/normformer-quickstart.yaml", [f"output.dir={tmp_path / 'run'}", *extra])


def _no_write(monkeypatch, read_only: bool):
    """As a 0555 directory (or a read-only mount) would answer: root passes permission checks, so
    the test answers for the kernel."""
    monkeypatch.setattr(storage.os, "access", lambda path, mode: False)
    flag = os.ST_RDONLY if read_only else 0
    monkeypatch.setattr(storage.os, "statvfs", lambda path: type("S", (), {"f_flag": flag})())


def test_a_writable_output_dir_passes(tmp_path):
    check_output_dirs(_cfg(tmp_path, f"data.index_cache_dir={tmp_path / 'cache' / 'idx'}"))


def test_a_read_only_output_dir_is_refused_with_the_path_and_the_fix(tmp_path, monkeypatch):
    _no_write(monkeypatch, read_only=True)
    with pytest.raises(ConfigError) as err:
        check_output_dirs(_cfg(tmp_path))
    msg = str(err.value)
    assert f"output.dir='{tmp_path / 'run'}'" in msg and f"{tmp_path} is on a read-only file system" in msg
    assert "set output.dir to a writable directory" in msg


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0555 directory: see the test below")
def test_a_directory_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        with pytest.raises(ConfigError, match=r"locked is not writable by this user .*dr-xr-xr-x"):
            check_output_dirs(load_config("configs/normformer-quickstart.yaml", [f"output.dir={locked}/run"]))
    finally:
        locked.chmod(0o755)


def test_no_write_permission_is_named(tmp_path, monkeypatch):
    _no_write(monkeypatch, read_only=False)
    with pytest.raises(ConfigError, match=r"is not writable by this user \(uid \d+, permissions d"):
        check_output_dirs(_cfg(tmp_path))


def test_an_index_cache_dir_that_cannot_be_created_is_refused(tmp_path, monkeypatch):
    out, prebuilt = tmp_path / "out", tmp_path / "prebuilt"
    out.mkdir()
    prebuilt.mkdir()
    locked = {str(tmp_path), str(prebuilt)}  # as if without write permission
    real_access = os.access
    monkeypatch.setattr(
        storage.os, "access", lambda path, mode: path not in locked and real_access(path, mode)
    )
    config = "configs/normformer-quickstart.yaml"
    missing = load_config(config, [f"output.dir={out}", f"data.index_cache_dir={tmp_path / 'new' / 'cache'}"])
    with pytest.raises(ConfigError, match=r"data.index_cache_dir=.*new/cache.*the sample indices"):
        check_output_dirs(missing)
    # An existing cache (indices prebuilt there, perhaps read-only) is read, not refused.
    check_output_dirs(load_config(config, [f"output.dir={out}", f"data.index_cache_dir={prebuilt}"]))
