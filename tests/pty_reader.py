"""What a child process writes to a pseudo-terminal, read as it comes (the terminal tests' reader)."""

from __future__ import annotations

import os
import threading
import time


class PtyReader:
    """Reads the master end of a pseudo-terminal into ``data`` on a thread until the other end closes
    (a pty that nobody reads blocks its writer once its buffer is full)."""

    def __init__(self, master: int) -> None:
        self.master = master
        self.data = bytearray()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every writer closed its end
                return
            if not chunk:
                return
            self.data.extend(chunk)

    def wait_for(self, needle: str, timeout_s: float) -> bool:
        """Whether ``needle`` was written within ``timeout_s`` (the writer still running)."""
        want = needle.encode()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if want in self.data:
                return True
            time.sleep(0.05)
        return want in self.data

    def text(self, wait_s: float = 5.0) -> str:
        """Once the writers are gone: all they wrote (waits up to ``wait_s`` for the last of it), and
        the master end closed."""
        self._thread.join(timeout=wait_s)
        os.close(self.master)
        return bytes(self.data).decode("utf-8", "replace")
