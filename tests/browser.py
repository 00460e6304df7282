"""A real browser for the tests of pages distgraph writes: Debian's ``chromium``, headless.

Each call starts a fresh browser (its own profile in a temporary folder, nothing shared
between calls, no network services) on a file of this machine and ends it:
:func:`dump_dom` gives the page as its script left it (the DOM after the load event)
and :func:`screenshot` a PNG of the window. Both give the lines the page logged on its
console (``console.log``/``error`` and every uncaught error), which chromium writes to
its stderr with ``--enable-logging=stderr``: one line per message, ``...:CONSOLE...]
"message", source: URL (line)``.

``CHROMIUM`` is the browser's path, None where it is missing (the test command installs
it as root: ``apt-get install -y chromium``).

Example::

    page = dump_dom("plan.html")
    page.console            # [] where the script ran without a message
    page.figures            # {data-key: (data-value, text)} of every element with both
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0")
TIMEOUT = 120
_CONSOLE = re.compile(r":CONSOLE[:(][^\]]*\]\s*(.*)$")


@dataclass
class Page:
    """What the browser gave: the DOM (``html``), the console's messages, the seconds
    the browser ran, the ``<body>``'s attributes and the page's figures: {``data-key``:
    (``data-value``, the text shown)}."""

    html: str
    console: list
    seconds: float
    body: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)


def _run(path, *args, window=(1280, 2400)) -> tuple:
    if CHROMIUM is None:
        raise RuntimeError("no chromium on PATH: apt-get install -y chromium")
    url = Path(path).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        start = time.perf_counter()
        done = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}",
                               f"--window-size={window[0]},{window[1]}", *args, url],
                              capture_output=True, text=True, timeout=TIMEOUT,
                              cwd=profile, env=dict(os.environ, HOME=profile))
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout, console_lines(done.stderr), seconds


def console_lines(stderr: str) -> list:
    """The console messages among chromium's log lines."""
    return [m.group(1) for m in map(_CONSOLE.search, stderr.splitlines()) if m]


def dump_dom(path) -> Page:
    """Load ``path`` and return the DOM its script left (``--dump-dom``)."""
    html, console, seconds = _run(path, "--dump-dom")
    reader = _Figures()
    reader.feed(html)
    return Page(html, console, seconds, reader.body, reader.figures)


def screenshot(path, png, window=(1280, 2400)) -> list:
    """Load ``path`` and write a screenshot of the window to ``png``; the console's
    messages."""
    _, console, _ = _run(path, f"--screenshot={os.path.abspath(png)}", window=window)
    if not os.path.exists(png):
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return console


def inked(png) -> float:
    """The share of the screenshot's pixels that differ from its most common colour
    (the background)."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(png).convert("RGB")).reshape(-1, 3)
    colours, counts = np.unique(pixels, axis=0, return_counts=True)
    background = colours[counts.argmax()]
    return float((pixels != background).any(axis=1).mean())


class _Figures(HTMLParser):
    """The ``<body>``'s attributes, and every element's ``data-key``, ``data-value`` and
    text (the figures are leaves: a span holding one number)."""

    def __init__(self):
        super().__init__()
        self.body: dict = {}
        self.figures: dict = {}
        self._open: list = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        if "data-key" in attrs:
            self._open.append([attrs["data-key"], attrs.get("data-value"), ""])

    def handle_data(self, data):
        if self._open:
            self._open[-1][2] += data

    def handle_endtag(self, tag):
        if self._open and tag == "span":
            key, value, text = self._open.pop()
            self.figures[key] = (value, text.strip())
