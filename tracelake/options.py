"""Options of a recording: ``tl.options.CaptureOptions(backward_ready=True)``."""

from tracelake.recorder.backward import CaptureOptions

__all__ = ["CaptureOptions"]
