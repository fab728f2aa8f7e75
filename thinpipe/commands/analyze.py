"""``thinpipe analyze --run DIR``: a run's boundary spectra, projector angles and captured energy (MAPL
Fig. 3-5) as a table; what it computes and plots is ``analyze_lib.py``."""

from __future__ import annotations

import argparse
from pathlib import Path

from thinpipe.commands.common import add_device_arg
from thinpipe.commands.preflight import check_run
from thinpipe.config import ConfigError

NAME = "analyze"
HELP = "boundary spectra, projector angles, captured energy (MAPL Fig. 3-5)"


def add_arguments(a: argparse.ArgumentParser) -> None:
    a.add_argument("--run", required=True, action="append",
                   help="a run folder of any engine; a dist job across machines: each machine's --out "
                         "(--run A --run B), written into the first")
    a.add_argument("--batches", type=int, default=4, help="validation batches to analyse")
    add_device_arg(a)


def run(args) -> int:
    from thinpipe.commands.analyze_lib import analyze_run  # matplotlib and the model libraries

    if args.batches < 1:
        raise ConfigError(f"--batches must be >= 1, got {args.batches}")
    runs = [Path(r) for r in args.run]
    check_run(runs)
    result, paths = analyze_run(runs if len(runs) > 1 else runs[0], args.batches, args.device)
    print(f"{'boundary':<9}{'kind':<9}{'r(90%)':>7}{'r(99%)':>7}{'rank':>6}{'captured':>10}{'fixed':>8}{'pca':>7}"
          f"{'cos r':>7}")
    for row in result["boundaries"]:
        cap = (f"{row.get('rank', ''):>6}{row['captured_energy']:>10.3f}{row['captured_energy_fixed_random']:>8.3f}"
               f"{row['captured_energy_best']:>7.3f}{row['cosine_pearson']:>7.3f}" if "captured_energy" in row else "")
        print(f"{row['index']:<9}{row['kind']:<9}{row['rank_for_90']:>7}{row['rank_for_99']:>7}{cap}")
    if "principal_angles_deg" in result:
        print("mean principal angles (deg):")
        for line in result["principal_angles_deg"]:
            print("  " + " ".join(f"{a:6.1f}" for a in line))
    print(f"wrote {runs[0] / 'analysis' / 'analysis.json'} and {', '.join(p.name for p in paths)}")
    return 0
