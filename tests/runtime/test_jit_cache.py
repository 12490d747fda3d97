"""Numba's on-disk cache where the package directory is read-only (runtime/kernels/jit.py).

A serving container with readOnlyRootFilesystem and no writable HOME used to exit with "cannot
cache function '_depthwise': no locator available". jit.py now picks the cache directory itself:
NUMBA_CACHE_DIR if writable, else the in-tree __pycache__, else a private directory under
KUBETRT_CACHE_DIR or the temp dir, else no on-disk cache, and logs one line when it falls back.

The subprocess cases make the package's own directory read-only the way a container image does:
a read-only bind mount of runtime/kernels in a private mount namespace (`unshare --mount`, with
--map-root-user when not root), so they hold for root too, which ignores file modes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kubetrt.runtime.kernels import jit

pytestmark = pytest.mark.skipif(jit.numba is None, reason="numba is not installed")

KERNELS = Path(jit.__file__).resolve().parent
UNWRITABLE = "/dev/null/kubetrt-unwritable"  # under a regular file: not creatable, not even by root

# Runs two jit kernels and compares them with NumPy; prints what the cache did as JSON on stdout.
CHILD = r"""
import json
import numpy as np
from kubetrt.telemetry.logs import configure
configure()
from kubetrt.runtime.kernels import jit
from kubetrt.runtime.kernels.activations import SCALAR_CLAMP

rng = np.random.default_rng(0)
x = rng.standard_normal((2, 7, 6, 5)).astype(np.float32)
pooled = jit.max_pool_nhwc(x, (3, 3), [2, 2], [1, 1], [1, 1], 4, 3)
xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-np.inf)
ref = np.stack([np.stack([xp[:, 2 * i:2 * i + 3, 2 * j:2 * j + 3].max(axis=(1, 2)) for j in range(3)], 1) for i in range(4)], 1)
w = rng.standard_normal((3, 3, 5)).astype(np.float32)
b = rng.standard_normal(5).astype(np.float32)
conv = jit.depthwise_conv_nhwc(x, w, b, [1, 1], [1, 1], [1, 1], 7, 6, SCALAR_CLAMP, 0.0, np.inf)
xz = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
cref = np.maximum(sum(xz[:, a:a + 7, e:e + 6] * w[a, e] for a in range(3) for e in range(3)) + b, 0)
kernels = (jit._max_pool_nhwc, jit._depthwise_nhwc)
print(json.dumps({
    "cache": jit.CACHE,
    "cache_dir": jit.numba.config.CACHE_DIR,
    "pool_ok": bool(np.array_equal(pooled, ref)),
    "conv_ok": bool(np.allclose(conv, cref, rtol=1e-5, atol=1e-5)),
    "hits": sum(sum(k.stats.cache_hits.values()) for k in kernels),
    "misses": sum(sum(k.stats.cache_misses.values()) for k in kernels),
}))
"""


def _namespace_prefix() -> list[str] | None:
    """`unshare --mount` (+ --map-root-user when not root) if this machine allows it, else None."""
    if shutil.which("unshare") is None:
        return None
    cmd = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    probe = subprocess.run([*cmd, "sh", "-c", f"mount --bind -o ro {KERNELS} {KERNELS}"], capture_output=True)
    return cmd if probe.returncode == 0 else None


NAMESPACE = _namespace_prefix()
needs_namespace = pytest.mark.skipif(NAMESPACE is None, reason="no private mount namespaces here (unshare --mount)")


def run_child(env: dict[str, str], *, read_only_package: bool = True, read_only_tmp: bool = False,
              cwd: Path | None = None) -> tuple[dict, list[str], str]:
    """CHILD in a fresh interpreter: (its JSON, the fallback log lines, stderr)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "KUBETRT_", "TMP", "TEMP"))}
    full_env.update(HOME=UNWRITABLE + "/home", **env)
    argv = [sys.executable, "-c", CHILD]
    if read_only_package or read_only_tmp:
        mounts = [f"mount --bind -o ro {KERNELS} {KERNELS}"] if read_only_package else []
        if read_only_tmp:  # no writable temp dir at all (as in a pod with no emptyDir)
            # read-only binds, not empty tmpfs: the checkout and its venv may live under /tmp
            mounts += [f"mount --bind {d} {d} && mount -o remount,bind,ro {d}" for d in ("/tmp", "/var/tmp")
                       if os.path.isdir(d)]
        argv = [*NAMESPACE, "sh", "-c", " && ".join(mounts) + ' && exec "$@"', "sh", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, env=full_env, cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if jit.CACHE_LOG_MSG in line]
    return json.loads(proc.stdout.strip().splitlines()[-1]), lines, proc.stderr


def _assert_ran(result: dict) -> None:
    assert result["pool_ok"] and result["conv_ok"], result


# ----------------------------------------------------------------------------- in a subprocess
@needs_namespace
def test_read_only_package_caches_in_a_private_temp_dir(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    first, lines, stderr = run_child({"TMPDIR": str(tmp)})
    _assert_ran(first)
    uid = subprocess.run([*NAMESPACE, "id", "-u"], capture_output=True, text=True).stdout.strip()
    cache = tmp / f"kubetrt-numba-{uid}"
    assert first["cache"] is True and first["cache_dir"] == str(cache)
    assert len(lines) == 1, stderr
    assert "level=warning" in lines[0] and f"cache_dir='{cache}'" in lines[0] and str(KERNELS) in lines[0]
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    assert list(cache.rglob("*.nbi")), "no numba index written to the fallback cache"
    second, lines, _ = run_child({"TMPDIR": str(tmp)})
    _assert_ran(second)
    assert second["hits"] >= 2 and second["misses"] == 0, second  # loaded from the on-disk cache
    assert len(lines) == 1


@needs_namespace
def test_unwritable_numba_cache_dir_then_kubetrt_cache_dir(tmp_path: Path) -> None:
    result, lines, stderr = run_child({"NUMBA_CACHE_DIR": UNWRITABLE, "KUBETRT_CACHE_DIR": str(tmp_path / "kc"),
                                       "TMPDIR": str(tmp_path)})
    _assert_ran(result)
    assert result["cache"] is True and result["cache_dir"] == str(tmp_path / "kc" / "numba")
    assert len(lines) == 1, stderr
    assert UNWRITABLE in lines[0] and str(KERNELS) in lines[0]
    assert list((tmp_path / "kc" / "numba").rglob("*.nbi"))


@needs_namespace
def test_nothing_writable_compiles_without_on_disk_cache() -> None:
    result, lines, stderr = run_child({}, read_only_tmp=True, cwd=KERNELS)
    _assert_ran(result)
    assert result["cache"] is False and result["hits"] == 0, result
    assert len(lines) == 1 and "compiling without on-disk cache" in lines[0], stderr


def test_unwritable_numba_cache_dir_falls_back_to_in_tree(tmp_path: Path) -> None:
    """No namespace needed when the package directory is writable (a developer's checkout)."""
    if not jit._writable_dir(str(KERNELS / "__pycache__")):
        pytest.skip("the package directory is read-only here")
    result, lines, stderr = run_child({"NUMBA_CACHE_DIR": UNWRITABLE}, read_only_package=False)
    _assert_ran(result)
    assert result["cache"] is True and result["cache_dir"] == ""  # numba's own in-tree locator
    assert len(lines) == 1 and UNWRITABLE in lines[0] and f"cache_dir='{KERNELS / '__pycache__'}'" in lines[0], stderr


def test_writable_places_log_nothing(tmp_path: Path) -> None:
    result, lines, stderr = run_child({"NUMBA_CACHE_DIR": str(tmp_path / "numba")}, read_only_package=False)
    _assert_ran(result)
    assert lines == [], stderr
    assert list((tmp_path / "numba").rglob("*.nbi"))


# ----------------------------------------------------------------------------- the choice itself
def test_choose_cache_dir_order(tmp_path: Path) -> None:
    in_tree = str(tmp_path / "pkg" / "__pycache__")
    blocked = str(tmp_path / "file")
    Path(blocked).write_text("")
    under_file = blocked + "/__pycache__"  # unwritable for anyone
    tmp = lambda: str(tmp_path / "tmp")  # noqa: E731
    os.makedirs(tmp())
    user = str(tmp_path / "user")
    assert jit.choose_cache_dir({"NUMBA_CACHE_DIR": user}, in_tree, tmp) == (user, "env", [])
    assert jit.choose_cache_dir({}, in_tree, tmp) == (in_tree, "in-tree", [])
    assert jit.choose_cache_dir({"NUMBA_CACHE_DIR": blocked + "/n"}, in_tree, tmp) == (in_tree, "in-tree", [blocked + "/n"])
    kc = str(tmp_path / "kc")
    assert jit.choose_cache_dir({"KUBETRT_CACHE_DIR": kc}, under_file, tmp) == (kc + "/numba", "fallback", [under_file])
    private = os.path.join(tmp(), f"kubetrt-numba-{os.getuid()}")
    assert jit.choose_cache_dir({"KUBETRT_CACHE_DIR": blocked}, under_file, tmp) == (
        private, "fallback", [under_file, blocked + "/numba"])

    def no_tmp() -> str:
        raise FileNotFoundError("No usable temporary directory found")

    assert jit.choose_cache_dir({}, under_file, no_tmp) == (None, "off", [under_file])


def test_shared_temp_dir_must_be_private(tmp_path: Path) -> None:
    """numba loads pickled code from its cache: a temp-dir cache others can write to is refused."""
    tmp = str(tmp_path)
    planted = tmp_path / f"kubetrt-numba-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    under_file = str(tmp_path / "f" / "x")
    (tmp_path / "f").write_text("")
    assert jit.choose_cache_dir({}, under_file, lambda: tmp) == (None, "off", [under_file, str(planted)])
    planted.chmod(0o700)
    assert jit.choose_cache_dir({}, under_file, lambda: tmp) == (str(planted), "fallback", [under_file])
