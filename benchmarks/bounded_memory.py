"""Bounded memory while recording: one run whose saved bytes exceed the machine's RAM.

Run: ``python benchmarks/bounded_memory.py [--gib 32] [--max-inflight-mib 256]
[--dir DIR] [--keep] [--markdown]``.

The claim checked: recording streams. Every saved tensor is copied off the graph and
handed to the writer's worker threads, with at most ``max_inflight`` bytes buffered, so
peak resident memory does not grow with the size of the capture. Method:

* Model: a few cheap elementwise ops (``x + 1``, ``* 0.5``, ``- 0.25``, ``neg``,
  ``x * x``, each rebinding ``x``, so the forward alone holds at most two activations)
  on one input of 64 MiB of float32 (``randn(4096, 4096)``), so each step saves 384 MiB
  (the input and every op's output; ``save`` left at its default, all).
  Values stay random float32, which zstd does not compress (the store picks raw), so
  the bytes saved are the bytes written. ``torch.no_grad()``, ``torch.set_num_threads(1)``.
* One recording, ``store.recording(name, max_inflight=...)``, ``rec.record(model, x)``
  step after step until the bytes saved (the sum of the saved tensors' sizes) reach
  ``--gib``.
* Baseline: RSS after building the model and input, opening the store and running one
  unrecorded forward (whose own peak over the baseline is reported), right before the
  recording starts. Bound: baseline + ``max_inflight`` + 1 GiB (the forward's own
  live tensors, the workers' temporaries, the allocator's slack, the commit).
* Peak RSS: a background thread samples ``VmRSS`` of ``/proc/self/status`` every 20 ms;
  the kernel's exact high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``
  just before recording where the kernel allows it) and
  ``getrusage(RUSAGE_SELF).ru_maxrss`` are reported too. Pass/fail uses the highest of
  them. Written file pages sit in the page cache, which is not this process's RSS.
* RSS is also printed at a few points along the run (it should be flat), and during the
  commit (``writer.close()``, catalog tables, fsync, catalog commit) separately.

The store directory (default: a fresh one under /tmp) is checked for free space first
(the saved bytes + 10% + 1 GiB) and deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import torch
from torch import nn

import tracelake as tl
from tracelake.store.writer import NBYTES

MiB = 1 << 20
GiB = 1 << 30
SAMPLE_S = 0.02
INPUT_SHAPE = (4096, 4096)  # float32: 64 MiB


class Elementwise(nn.Module):
    """Five cheap elementwise ops; each output is a fresh 64 MiB tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 1.0  # rebinding x: at most the op's input and output are alive at once
        x = x * 0.5
        x = x - 0.25
        x = torch.neg(x)
        return x * x


def proc_status() -> dict[str, int]:
    """The memory lines of /proc/self/status, in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("Vm", "Rss")):
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    return out


def rss() -> int:
    return proc_status()["VmRSS"]


def reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM, ru_maxrss); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Sampler(threading.Thread):
    """Samples /proc/self/status every SAMPLE_S; keeps the peak VmRSS per phase."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.phase = "record"
        self.peak: dict[str, int] = {}
        self.at_peak: dict[str, dict[str, int]] = {}
        self.samples = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            status = proc_status()
            self.samples += 1
            phase = self.phase
            if status["VmRSS"] > self.peak.get(phase, -1):
                self.peak[phase] = status["VmRSS"]
                self.at_peak[phase] = status
            self._stop_event.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fmt_mib(n: float) -> str:
    return f"{n / MiB:,.0f} MiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=32.0, help="bytes to save, GiB (default 32)")
    p.add_argument(
        "--max-inflight-mib",
        type=int,
        default=256,
        help="the recording's max_inflight, MiB (default 256)",
    )
    p.add_argument(
        "--dir", default=None, help="where to create the store (default: a new temp dir under /tmp)"
    )
    p.add_argument("--keep", action="store_true", help="keep the store directory")
    p.add_argument("--markdown", action="store_true", help="print the results as markdown")
    args = p.parse_args()

    target = int(args.gib * GiB)
    max_inflight = args.max_inflight_mib * MiB
    need = int(target * 1.1) + GiB

    parent = args.dir if args.dir is not None else tempfile.gettempdir()
    parent = os.path.abspath(parent)
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = free_bytes(probe)
    if free < need:
        print(
            f"refusing: {probe} has {free / GiB:.1f} GiB free; saving {args.gib:g} GiB "
            f"needs {need / GiB:.1f} GiB (saved bytes + 10% + 1 GiB). Pass a smaller --gib "
            f"or a --dir on a larger disk.",
            file=sys.stderr,
        )
        return 2
    if args.dir is not None:
        os.makedirs(parent, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="tl-bounded-", dir=parent)
    store_path = os.path.join(workdir, "store.tl")

    try:
        return run(args, target, max_inflight, store_path, workdir, free)
    finally:
        if args.keep:
            print(f"kept the store: {store_path}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def run(args: Any, target: int, max_inflight: int, store_path: str, workdir: str, free: int) -> int:
    torch.set_num_threads(1)
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rss_start = rss()
    model = Elementwise()
    x = torch.randn(INPUT_SHAPE, dtype=torch.float32)
    store = tl.open(store_path)
    rss_built = rss()
    with torch.no_grad():  # the forward alone, unrecorded: its own peak over the baseline
        can_reset = reset_hwm()
        before = rss()
        warm = model(x)
        forward_peak = proc_status()["VmHWM"] - before if can_reset else None
        del warm

    timeline: list[tuple[int, float, int]] = []  # (step, saved GiB, rss)
    saved = 0
    steps = 0
    sampler = Sampler()
    hwm_reset = reset_hwm()
    baseline = rss()
    sampler.start()
    t0 = time.perf_counter()
    with torch.no_grad(), store.recording("big", max_inflight=max_inflight) as rec:
        writer = rec._writer
        assert writer is not None
        seen = 0
        while saved < target:
            out = rec.record(model, x)
            del out
            slots = writer.slots
            saved += sum(slot[NBYTES] for slot in slots[seen:])
            seen = len(slots)
            steps += 1
            if steps == 1 or steps & (steps - 1) == 0 or saved >= target:
                timeline.append((steps, saved / GiB, rss()))
        t_stream = time.perf_counter()
        rss_end_stream = rss()
        sampler.phase = "commit"
        # the block's end: writer.close(), catalog tables, fsync, commit
    t1 = time.perf_counter()
    sampler.phase = "after"
    time.sleep(2 * SAMPLE_S)
    sampler.stop()
    status = proc_status()
    ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    run_ = store["big"]
    run_steps = run_.num_steps
    bytes_written = writer.bytes_written
    peak_inflight = writer.peak_inflight
    waits = writer.budget_waits
    on_disk = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(store_path) for f in files
    )

    wall = t1 - t0
    sampled_peak = max(sampler.peak.get("record", 0), sampler.peak.get("commit", 0))
    hwm = status.get("VmHWM", 0)
    peak = max(sampled_peak, hwm, ru_maxrss)
    bound = baseline + max_inflight + GiB
    ok = peak <= bound and run_steps == steps

    rows: list[tuple[str, str]] = [
        (
            "machine",
            f"{platform.machine()}, {os.cpu_count()} CPUs, "
            f"{mem_total / GiB:.1f} GiB RAM; torch {torch.__version__}",
        ),
        ("store dir", f"{workdir} ({free / GiB:.0f} GiB free before)"),
        (
            "model / input",
            f"5 elementwise ops on float32 {INPUT_SHAPE} "
            f"({x.numel() * x.element_size() / MiB:.0f} MiB)",
        ),
        ("max_inflight", fmt_mib(max_inflight)),
        (
            "saved",
            f"{saved / GiB:.2f} GiB ({saved / mem_total:.2f}x RAM) in {steps} steps, "
            f"{len(writer.slots)} tensors; run.num_steps = {run_steps}",
        ),
        ("writer.bytes_written", f"{bytes_written / GiB:.2f} GiB; on disk {on_disk / GiB:.2f} GiB"),
        (
            "wall time",
            f"{wall:.1f} s (streaming {t_stream - t0:.1f} s, commit {t1 - t_stream:.1f} s)",
        ),
        ("effective rate", f"{saved / MiB / wall:,.0f} MiB/s"),
        ("RSS at start / after model+input+store", f"{fmt_mib(rss_start)} / {fmt_mib(rss_built)}"),
        ("RSS right before recording (baseline)", fmt_mib(baseline)),
        (
            "forward alone, unrecorded: peak over its start",
            fmt_mib(forward_peak) if forward_peak is not None else "n/a (VmHWM not resettable)",
        ),
        (
            "peak RSS sampled, recording",
            fmt_mib(sampler.peak.get("record", 0)) + _anon_file(sampler.at_peak.get("record")),
        ),
        (
            "peak RSS sampled, commit",
            fmt_mib(sampler.peak.get("commit", 0)) + _anon_file(sampler.at_peak.get("commit")),
        ),
        (
            "RSS end of streaming / after commit",
            f"{fmt_mib(rss_end_stream)} / {fmt_mib(status['VmRSS'])}",
        ),
        (
            "VmHWM / ru_maxrss",
            f"{fmt_mib(hwm)} / {fmt_mib(ru_maxrss)} "
            + (
                "(reset before recording)"
                if hwm_reset
                else "(NOT reset: include pre-recording peak)"
            ),
        ),
        ("RSS samples", f"{sampler.samples} (every {SAMPLE_S * 1000:.0f} ms)"),
        ("bound = baseline + max_inflight + 1 GiB", fmt_mib(bound)),
        ("peak RSS (max of the above)", f"{fmt_mib(peak)} = baseline + {fmt_mib(peak - baseline)}"),
        (
            "result",
            ("PASS" if ok else "FAIL")
            + f": peak {'<=' if peak <= bound else '>'} bound"
            + ("" if run_steps == steps else f"; run has {run_steps} steps, not {steps}"),
        ),
        ("writer.peak_inflight", f"{fmt_mib(peak_inflight)} ({waits} waits for the cap)"),
    ]
    line = (
        "RSS along the run: "
        + ", ".join(f"step {s} ({g:.1f} GiB) {r / MiB:,.0f}" for s, g, r in timeline)
        + " MiB"
    )
    if args.markdown:
        print("| quantity | value |\n|---|---|")
        for key, value in rows:
            print(f"| {key} | {value} |")
        print(f"\n{line}")
    else:
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
        print(line)
    return 0 if ok else 1


def _anon_file(status: dict[str, int] | None) -> str:
    if not status:
        return ""
    return (
        f" (anon {fmt_mib(status.get('RssAnon', 0))}, file "
        f"{fmt_mib(status.get('RssFile', 0))}, shmem {fmt_mib(status.get('RssShmem', 0))})"
    )


if __name__ == "__main__":
    sys.exit(main())
