"""make validate-rocm: one command that checks every ROCm claim on an MI300X / MI355X.

Modules, in the order a run uses them:

* ``environment``: what this Python and machine have (torch, HIP, GPU, gfx
  arch, Triton, AITER, pytest, the patched tree, the commit);
* ``prereqs``: what each part needs, and one line per missing thing;
* ``parts``: the parts -- the command each runs and how its output is read;
* ``junit``, ``bench_roofline``, ``device_facts``: readers of the parts'
  outputs (``device_facts`` also runs on the device, as a subprocess);
* ``claims`` (+ ``claims.toml``): the ROCm claims of README.md and docs/,
  each with the check that backs it, judged held / failed / not run;
* ``report``: the results JSON and the one-page REPORT.md;
* ``cli``: argument parsing and the run.
"""
