"""Stage logging: everything to the stage's file, warnings and errors also to the console."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_a_redirected_process_keeps_only_warnings_on_the_console(tmp_path) -> None:
    log_file = tmp_path / "logs" / "rollout.log"
    # A child process: the redirect rewires descriptors 1 and 2 for good.
    script = textwrap.dedent(f"""
        import os, subprocess, sys
        from pathlib import Path
        from pipeline.log import configure_logging, get_logger, redirect_process_output
        console = redirect_process_output(Path({str(log_file)!r}))
        configure_logging("info", console_fd=console)
        log = get_logger(stage="rollout")
        log.info("engine started", step=1)
        log.warning("weight update failed", policy_version=3)
        print("a library's print")
        subprocess.run([sys.executable, "-c", "import sys; print('engine process output', file=sys.stderr)"])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    console = done.stdout + done.stderr
    assert "weight update failed" in console and "policy_version=3" in console
    assert "engine started" not in console and "a library's print" not in console
    assert "engine process output" not in console
    text = log_file.read_text()
    for line in ("engine started", "weight update failed", "a library's print", "engine process output"):
        assert line in text, line
