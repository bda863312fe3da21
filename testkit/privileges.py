"""Running kvtop as an unprivileged user from a test: the tools, and a copy of kvtop that user can
read (a clone in a private folder, mode 0700 like many homes, is not readable to uid 65534).

Shared by the capture, opener and deployment privilege tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETPRIV = shutil.which("setpriv")
SETCAP = shutil.which("setcap") or ("/usr/sbin/setcap" if Path("/usr/sbin/setcap").exists() else None)
# the distribution's interpreter: a copy of it can carry a file capability (a venv's is a symlink)
SYSTEM_PY = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
NOBODY = 65534


def can_setcap() -> bool:
    """Root on Linux with setpriv, setcap and the system interpreter: a capability copy can be made."""
    return (sys.platform == "linux" and os.geteuid() == 0 and SETPRIV is not None and SETCAP is not None
            and SYSTEM_PY.exists())


def can_capture() -> bool:
    """This process may open a packet socket (root or CAP_NET_RAW), as kvtop checks it."""
    from kvtop.sources.capture import CaptureUnavailable, check_capture

    try:
        check_capture(1)
    except CaptureUnavailable:
        return False
    return True


def readable_kvtop(dest: Path) -> None:
    """Copy kvtop and its plugins (as ``kvtop_plugins``) into ``dest``, readable by every user."""
    for src, name in ((REPO / "kvtop", "kvtop"), (REPO / "plugins", "kvtop_plugins")):
        shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        for d, _, files in os.walk(dest / name):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)


def readable_install(root: Path) -> str:
    """kvtop in ``root/app`` readable by every user; the PYTHONPATH that finds it and this
    environment's installed dependencies."""
    app = root / "app"
    app.mkdir()
    os.chmod(app, 0o755)
    readable_kvtop(app)
    return os.pathsep.join([str(app), sysconfig.get_paths()["purelib"]])


def capture_interpreter(path: Path) -> None:
    """A copy of the system interpreter at ``path`` with the file capability cap_net_raw+ep."""
    assert SETCAP is not None
    shutil.copy2(SYSTEM_PY, path)
    os.chmod(path, 0o755)
    subprocess.run([SETCAP, "cap_net_raw+ep", str(path)], check=True)
