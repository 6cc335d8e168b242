"""Which C kernels this replica loads: ``/readyz`` ``"kernels"`` and ``/metrics``
``mmserve_llm_kernel_loaded{kernel, build}``.

The report is made once, in a background thread of the front process, by loading every kernel
the engine defines (``llm_svc.kernels.ckernels.kernel_report``): the same files, cache directory
and environment the engine core loads them from, so a replica whose image lacks them (no
compiler and no prebuilt build for this CPU) says so instead of silently running torch ops.
Until it is made, ``/readyz`` shows ``"kernels": null``.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger(__name__)


class KernelStatus:
    """``report()``: None until the background load finished, then ``kernel_report``'s dict."""

    def __init__(self, registry: CollectorRegistry):
        self._gauge = Gauge("mmserve_llm_kernel_loaded", "C kernels of the engine: 1 loaded (build: native or "
                            "<x86-64 level> (prebuilt)), 0 fell back to torch ops (build: none)",
                            ["kernel", "build"], registry=registry)
        self._report: dict | None = None
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._make, name="kernel-report", daemon=True).start()

    def _make(self) -> None:
        try:
            from llm_svc.kernels.prebuild import all_kernels
            from llm_svc.kernels.ckernels import kernel_report

            report = kernel_report(all_kernels())
        except Exception as e:  # a report, never a reason for the service to fail
            log.warning("kernel report failed: %s", e)
            report = {"loaded": {}, "fallback": {}, "error": str(e)}
        for name, build in report["loaded"].items():
            self._gauge.labels(kernel=name, build=build).set(1)
        for name in report["fallback"]:
            self._gauge.labels(kernel=name, build="none").set(0)
        log.info("C kernels: %d loaded (%s), %d fell back to torch ops", len(report["loaded"]),
                 ", ".join(sorted(set(report["loaded"].values()))) or "-", len(report["fallback"]))
        self._report = report

    def report(self) -> dict | None:
        self.start()
        return self._report
