"""Ceilings printed beside benchmarks/kernels.py's ratios: the BSR cases against the FMA peak, and the SDDMM
cases against a reference pass over the same pattern (docs/targets.md, "Ceilings")."""

from kernel_cases import log
from scorch_backend.tools.timing import fmt_time


def report_compute_bound(results, peak: dict, target_vs_csr: float) -> None:
    """The BSR cases as fractions of the FMA peak, for them and the CSR kernel on the same weights: the BSR
    kernel cannot run above the peak, so a ratio over the CSR kernel above peak / CSR's fraction cannot be
    reached on this CPU and target, however the kernel is written."""
    if not peak.get("gflops"):
        return
    rows = [r for r in results if r["kernel"] == "bsr" and "scorch" in r and "torch_coo" in r["contenders"]]
    if not rows:
        return
    log(f"\nBSR SpMM against the FMA peak ({peak['gflops']:.0f} GFLOP/s, {peak['vector_bytes']}-byte vectors)")
    for r in rows:
        bsr = r["flop"] / r["scorch"]["median_s"] / 1e9 / peak["gflops"]
        csr = r["flop"] / r["contenders"]["torch_coo"]["median_s"] / 1e9 / peak["gflops"]
        r["fma_peak_fraction"] = {"bsr": bsr, "scorch_csr": csr}
        log(f"  {r['matrix']:<44} BSR {100 * bsr:4.0f}% of peak, Scorch CSR {100 * csr:4.0f}%: "
            f"{target_vs_csr:g}x over CSR needs {100 * target_vs_csr * csr:4.0f}%, "
            f"at most {1 / csr:.2f}x is possible")
    if any(r["fma_peak_fraction"]["bsr"] > 1.0 for r in rows):
        log("  WARNING: a kernel ran above the measured peak, so the probe was disturbed: these fractions say "
            "nothing")


def report_sddmm_floor(results, target: float) -> None:
    """The SDDMM cases against a reference pass on the same pattern (Q's row read at each stored entry and
    summed into one vector, kernel_cases.py). Where a row of Q is gathered from beyond L2 (DLMC's wide weights)
    it bounds an SDDMM from below; on the graphs and SuiteSparse matrices it does not (its one shared result
    costs more than the SDDMM's value per entry: docs/targets.md, the correction of 2026-11-29)."""
    rows = [r for r in results if r["kernel"] == "sddmm" and "scorch" in r and "floor" in r
            and "torch_csr" in r["contenders"]]
    if not rows:
        return
    log("\nSDDMM against a reference pass (sb.einsum('ij,jk->k', S, Q): Q's row read at each stored entry, no P, "
        "no dot products; a floor only where Q's rows come from beyond L2, docs/targets.md)")
    for r in rows:
        floor = r["floor"]["median_s"]
        r["floor_ratio"] = {"scorch": r["scorch"]["median_s"] / floor,
                            "torch_csr": r["contenders"]["torch_csr"]["median_s"] / floor}
        log(f"  {r['matrix']:<44} pass {fmt_time(floor):>9}; Scorch {r['floor_ratio']['scorch']:5.2f}x it, "
            f"torch {r['floor_ratio']['torch_csr']:5.2f}x: {target:g}x over torch needs "
            f"{r['floor_ratio']['torch_csr'] / target:.2f}x the pass")
