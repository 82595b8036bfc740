"""vLLM installs (upstream, patched) and the environment a run records.

An install is the command that runs its Python, split like a shell would:
``/opt/vllm-upstream/bin/python``, or a prefix that ends in a Python, such as
``docker exec vllm-patched python3`` or ``env PYTHONPATH=/src/vllm python3``.
Given on the command line (``--upstream``, ``--patched``) or in the environment
(``E2E_UPSTREAM``, ``E2E_PATCHED``).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

INSTALL_ENV = {"upstream": "E2E_UPSTREAM", "patched": "E2E_PATCHED"}
RECORDED_PREFIXES = ("VLLM_", "AITER_")
RECORDED_NAMES = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                  "HSA_OVERRIDE_GFX_VERSION", "PYTORCH_TUNABLEOP_ENABLED")
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
# The series is about AITER paths: recipes turn them on unless told otherwise.
# CPU mode (--device cpu): vLLM source trees on PYTHONPATH pick their platform
# from VLLM_TARGET_DEVICE (they have no installed distribution to ask).
DEVICE_DEFAULT_ENV = {"rocm": {"VLLM_ROCM_USE_AITER": "1"}, "cpu": {"VLLM_TARGET_DEVICE": "cpu"}}
DEFAULT_ENV = DEVICE_DEFAULT_ENV["rocm"]
DEVICES = tuple(DEVICE_DEFAULT_ENV)


class InstallError(Exception):
    pass


@dataclass(frozen=True)
class Install:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, name: str, command: str, env: Mapping[str, str] | None = None) -> Install:
        try:
            argv = tuple(shlex.split(command))
        except ValueError as exc:
            raise InstallError(f"{name}: cannot split {command!r}: {exc}") from exc
        if not argv:
            raise InstallError(f"{name}: empty command (give the install's Python)")
        return cls(name, argv, dict(env or {}))

    def command(self, *args, env: Mapping[str, str] | None = None) -> list[str]:
        """The command line running ``args`` with this install's Python.

        For a prefix install (``docker exec NAME python3``) the recorded variables of ``env``
        (VLLM_*, AITER_*, device visibility; not secrets) are set inside it with ``env
        NAME=VALUE`` right before the Python: ``docker exec`` does not pass the caller's
        environment, and a result must record what the process saw."""
        inner: list[str] = []
        if env and len(self.argv) > 1:
            passed = {k: v for k, v in recorded_env(env).items() if not SECRET.search(k)}
            if passed:
                inner = ["env", *(f"{k}={v}" for k, v in passed.items())]
        return [*self.argv[:-1], *inner, self.argv[-1], *map(str, args)]

    def to_dict(self) -> dict:
        return {"name": self.name, "command": shlex.join(self.argv), "env": recorded_env(self.env)}


def from_args(upstream: str | None, patched: str | None, only: list[str] | None = None,
              environ: Mapping[str, str] = os.environ) -> list[Install]:
    """The installs to run, in order upstream then patched; a clear error when one is missing."""
    wanted = only or ["upstream", "patched"]
    given = {"upstream": upstream, "patched": patched}
    installs = []
    for name in wanted:
        if name not in INSTALL_ENV:
            raise InstallError(f"unknown install {name!r} (upstream or patched)")
        command = given[name] or environ.get(INSTALL_ENV[name])
        if not command:
            raise InstallError(
                f"no {name} install: pass --{name} 'PYTHON' (a path, or a command such as "
                f"'docker exec CONTAINER python3') or set {INSTALL_ENV[name]}; "
                f"--only {'patched' if name == 'upstream' else 'upstream'} runs one side")
        installs.append(Install.parse(name, command))
    return installs


def parse_env_pairs(pairs: list[str] | None) -> dict[str, str]:
    env = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise InstallError(f"--env expects NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def recorded_env(env: Mapping[str, str]) -> dict[str, str]:
    """The env vars a result records: VLLM_*, AITER_*, device visibility; secrets redacted."""
    out = {}
    for name in sorted(env):
        if name.startswith(RECORDED_PREFIXES) or name in RECORDED_NAMES:
            out[name] = "<redacted>" if SECRET.search(name) else str(env[name])
    return out


def run_env(install: Install, overrides: Mapping[str, str],
            base: Mapping[str, str] = os.environ, device: str = "rocm") -> dict[str, str]:
    """The environment of a command run with ``install``: the device's defaults < base <
    install < overrides."""
    env = {**DEVICE_DEFAULT_ENV[device], **base, **install.env, **overrides}
    return {k: str(v) for k, v in env.items()}
