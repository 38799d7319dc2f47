"""A failed stage says where: the frame its exception was raised in (and, inside a
library, the project's frame that called it), on the console and in the summary, and
its whole traceback in the run's ``logs/``."""

from __future__ import annotations

from pathlib import Path

from pipeline.cli import describe_failure
from pipeline.launch import write_failure_traceback
from pipeline.stage import StageError, describe_where

ROOT = "/work/repo/"
# An out-of-memory error raised inside DeepSpeed, reached from the trainer's step, as
# ``traceback.format_exc`` writes it in the stage's process (shortened).
TRACEBACK = f'''Traceback (most recent call last):
  File "{ROOT}pipeline/stage.py", line 212, in run
    await self._unless_core_fails(self._stream(inp, outs, step_items))
  File "{ROOT}stages/trainer/stage.py", line 401, in _finish_step
    metrics = await asyncio.to_thread(self.engine.optimizer_step, scale)
  File "/usr/lib/python3.12/asyncio/threads.py", line 25, in to_thread
    return await loop.run_in_executor(None, func_call)
  File "{ROOT}stages/trainer/engine.py", line 712, in optimizer_step
    self.engine.step()
  File "/opt/venv/lib/python3.12/site-packages/deepspeed/runtime/zero/stage_1_and_2.py", line 1270, in _build
    flat_partition = torch.zeros(partition_size,
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 14.99 GiB.
'''


def test_where_names_the_raising_frame_and_the_projects_frame_that_led_there():
    assert describe_where(TRACEBACK, root=ROOT) == (
        "deepspeed/runtime/zero/stage_1_and_2.py:1270 in _build, "
        "called from stages/trainer/engine.py:712 in optimizer_step")
    # Raised in the project's own code: that frame alone.
    own = TRACEBACK.split('  File "/opt/venv')[0] + "ValueError: bad\n"
    assert describe_where(own, root=ROOT) == "stages/trainer/engine.py:712 in optimizer_step"
    # A library's frames only (the project installed as a package, say): the innermost.
    library = TRACEBACK.replace(ROOT, "/opt/venv/lib/python3.12/site-packages/")
    assert describe_where(library, root=ROOT) == "deepspeed/runtime/zero/stage_1_and_2.py:1270 in _build"
    assert describe_where("", root=ROOT) == "" and describe_where("no frames here", root=ROOT) == ""


def test_the_console_and_the_run_keep_where_and_the_whole_traceback(tmp_path: Path):
    exc = StageError("trainer", "OutOfMemoryError: CUDA out of memory.", TRACEBACK)
    assert exc.where.startswith("deepspeed/runtime/zero/stage_1_and_2.py:1270 in _build")
    path = write_failure_traceback(tmp_path, exc)
    assert path == tmp_path / "logs" / "trainer-failure.txt"
    assert path.read_text().startswith("stage 'trainer' failed: OutOfMemoryError") and TRACEBACK in path.read_text()
    lines = describe_failure(exc).splitlines()
    assert lines[1].startswith("conveyor: at deepspeed/runtime/zero/stage_1_and_2.py:1270 in _build")
    assert lines[2] == f"conveyor: traceback: {path}"
    # A process that died leaves no traceback: nothing written, nothing more said.
    died = StageError("trainer", "actor died: killed", "", died=True)
    assert write_failure_traceback(tmp_path, died) is None and describe_failure(died) == ""
