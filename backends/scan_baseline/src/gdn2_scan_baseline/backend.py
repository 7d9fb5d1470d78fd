"""The scan_baseline backend: refuses shapes whose associative scan would not fit in memory."""

from __future__ import annotations

from gdn2_scan_baseline.scan import PEAK_BUFFERS_TRAIN, gdn2_associative_scan
from gdn2core.plugin import YES, Backend, Capabilities, Verdict, device_memory_bytes

#: Share of the device's memory the scan may plan to use.
MEMORY_FRACTION = 0.5


def estimated_bytes(spec) -> int:
    """Peak bytes of value_and_grad: ``PEAK_BUFFERS_TRAIN * B*H*T*dk*(dk+dv) * 4``."""
    per_map = 4 * spec.dk * (spec.dk + spec.dv)
    return PEAK_BUFFERS_TRAIN * spec.batch * spec.heads * spec.seq_len * per_map


class ScanBaselineBackend(Backend):
    name = "scan_baseline"
    priority = 10
    # A baseline: only used when named. Packed sequences of both kinds; the activations are
    # applied by the core (in XLA) before the scan.
    capabilities = Capabilities(auto=False, segments=True, varlen=True, float32_decay=True)

    def supports(self, spec, config) -> Verdict:
        """Refuses shapes whose scan would not fit in memory (the reason gives the bytes)."""
        need, have = estimated_bytes(spec), int(MEMORY_FRACTION * device_memory_bytes())
        if need > have:
            return Verdict(
                False,
                f"the associative scan needs ~{need / 2**30:.1f} GiB "
                f"({PEAK_BUFFERS_TRAIN} x B*H*T*dk*(dk+dv) float32) but only "
                f"{have / 2**30:.1f} GiB ({MEMORY_FRACTION:.0%} of device memory) is allowed",
            )
        return YES

    def forward(self, q, k, v, w, b, g, h0, *, spec, config, extras=None):
        """The associative scan (autodiff gradients)."""
        seg = cu = None
        if extras is not None:
            seg, cu = extras.segment_ids, extras.cu_seqlens
        return gdn2_associative_scan(q, k, v, w, b, g, h0, spec.scale, seg, cu)
