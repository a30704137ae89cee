"""Calibrate the dense/sparse crossover of the run-time cost model (scorch_backend/cost_model.py).

For several shapes, times Scorch's SpMM (a CSR operand of a given density times a dense matrix) against
dense torch.mm on the same operands, with the same thread count, over a ladder of densities; the crossover is
the density at which dense becomes faster (interpolated on a log scale), and the model uses the median over
shapes. Writes scorch_backend/calibration.json unless --dry-run.

    python benchmarks/calibrate.py [--threads 2] [--dry-run]
"""

import argparse
import json
import math
import os
import pathlib
import statistics

import torch

os.environ["SCORCH_DISPATCH"] = "sparse"  # time the kernels themselves

import scorch_backend as sb  # noqa: E402
from scorch_backend.tools import datasets  # noqa: E402
from scorch_backend.tools.timing import measure  # noqa: E402

DENSITIES = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9]
SHAPES = [(256, 256, 64), (512, 512, 128), (1024, 1024, 64), (2048, 512, 128)]


def crossover(shape, seed=0):
    m, k, n = shape
    B = torch.randn(k, n)
    ratios = []
    for d in DENSITIES:
        A = datasets.random_matrix(m, k, d, seed=seed)
        S = sb.sparse(A, "csr")
        t_sparse = measure(lambda: sb.einsum("ij,jk->ik", S, B)).median  # 2 warm-ups, median of 7
        t_dense = measure(lambda: torch.mm(A, B)).median
        ratios.append((d, t_dense / t_sparse))
        print(f"  {m}x{k} @ {k}x{n}  density {d:<5} sparse {t_sparse * 1e6:9.1f} us  dense {t_dense * 1e6:9.1f} us  "
              f"dense/sparse {t_dense / t_sparse:6.2f}")
    for (d0, r0), (d1, r1) in zip(ratios, ratios[1:]):
        if r0 >= 1 > r1:  # log-linear interpolation of where the ratio crosses 1
            f = math.log(r0) / (math.log(r0) - math.log(r1))
            return math.exp(math.log(d0) + f * (math.log(d1) - math.log(d0)))
    return DENSITIES[0] if ratios[0][1] < 1 else 1.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="print, do not write calibration.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"calibrating with {args.threads} threads (torch {torch.__version__})")
    found = []
    for shape in SHAPES:
        c = crossover(shape)
        found.append(c)
        print(f"  -> crossover density {c:.3f}")
    result = {"dense_crossover_density": round(statistics.median(found), 4),
              "per_shape": {f"{m}x{k}x{n}": round(c, 4) for (m, k, n), c in zip(SHAPES, found)},
              "threads": args.threads, "torch": torch.__version__, "cpus": os.cpu_count(),
              "measured_by": "benchmarks/calibrate.py"}
    print(json.dumps(result, indent=2))
    if not args.dry_run:
        path = pathlib.Path(sb.__file__).with_name("calibration.json")
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
