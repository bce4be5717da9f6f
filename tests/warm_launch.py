"""Test-only: `torchrun --nproc_per_node N -m vit_finetune ARGS`, or `accelerate launch --config_file C ...`, with the
ranks forked from one interpreter that has imported the libraries once.

    python tests/warm_launch.py --nproc_per_node 2 --master_port P [--config_file C] -m vit_finetune ARGS
    python tests/warm_launch.py --serve     (launch after launch, asked for on stdin: tests/runs.py WarmLauncher)

A fresh `python -m vit_finetune` spends most of a tiny run importing torch, transformers, datasets and accelerate
(the tests' shared recipe: 3.8-5.3 CPU-s in a fresh interpreter, 1.0-1.2 in a process forked from one that imported
them), and torchrun imports torch once more for itself. The tests whose subject is what the ranks do together
(sharding, streaming, distributed evaluation, one rank talking to the Hub, a rank that stops answering) launch
through this; the tests of the launchers themselves keep the real ones (tests/test_launch.py, test_stopping.py,
test_multiprocess.py, test_multiprocess_errors.py's schema mistake, and the shared FSDP run of test_sharded.py,
launched by `accelerate launch --config_file`).
With --serve, one launcher serves a pytest process's launches one after another (conftest.warm_launcher): the import
is paid once for them all, and a launch that would change a variable some library read at import is refused
(READ_AT_RUN_TIME). A --serve launch may also be one plain process ("plain": no launcher, no rank variables, its own
exit code): `python -m vit_finetune ARGS` for the one-process tests whose subject is what the run does when it is
signalled, killed or locked out, not what a fresh interpreter imports.

Each rank gets what torchrun gives it: a process of its own, in a session of its own, the variables of torch's
elastic agent (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), `-m vit_finetune ARGS` as its command,
and with a config file the variables Accelerate's own launcher derives from it (accelerate.utils.
prepare_multi_gpu_env, or prepare_deepspeed_cmd_env). The environment is set before the import, so what libraries
read when imported (HF_ENDPOINT, HF_HUB_OFFLINE) is what a fresh process reads. The tests' site hooks
(tests/observed_site/sitecustomize.py: the recorder, FSDP and DeepSpeed on CPU) run in each rank after the fork, as
they would at a fresh rank's start, so each rank records under its own pid. As with torchrun, when one rank fails the others are sent SIGTERM (SIGKILL 30 s later) and the
launcher exits 1; a SIGTERM or SIGINT to the launcher is passed on to the ranks. What a library draws once when it
is imported is drawn once for all the ranks (transformers' session id, numpy's and random's seeds): a test that tells
the ranks apart by such a thing keeps the real launcher, or tells them apart otherwise (tests/test_hub_roundtrip.py
names the process behind each request by its socket).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import runpy
import signal
import socket
import sys
import time
from pathlib import Path

SITE = Path(__file__).resolve().parent / "observed_site"
# The variables that make tests/observed_site/sitecustomize.py install a hook: held back from this process's own
# start (the hooks are per rank) and given back to each rank.
SITE_HOOK_VARIABLES = ("VIT_FINETUNE_RECORD", "VIT_FINETUNE_FSDP_ON_CPU", "VIT_FINETUNE_DEEPSPEED_ON_CPU")
HELD = "WARM_LAUNCH_HELD_"
STOP_GRACE_S = 30.0
# What a rank spends its start-up importing; imported once here, before the fork. The package itself is not: each
# rank imports it, so what happens when it loads (the tests' recorder registers then) happens in the rank.
THIRD_PARTY_IMPORTS = ("torch", "accelerate", "datasets", "evaluate", "peft", "safetensors.torch",
                       "transformers.models.vit.modeling_vit", "transformers.models.vit.image_processing_pil_vit")
# Imported too where DeepSpeed is installed: the module its ZeRO optimizers import as they start, which compiles three
# functions with torch.compile as it loads (3.6 CPU-s with DeepSpeed itself, measured, in each rank of each launch).
DEEPSPEED_IMPORTS = ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer")


def hold_site_hooks_back(argv: list[str]) -> None:
    """Restart this script with the site hooks' variables renamed, if any is set (a restart before any heavy import
    costs a few milliseconds): sitecustomize ran at this process's start and would install them here."""
    present = [name for name in SITE_HOOK_VARIABLES if name in os.environ]
    if not present:
        return
    env = {name: value for name, value in os.environ.items() if name not in present}
    env.update({HELD + name: os.environ[name] for name in present})
    os.execve(sys.executable, [sys.executable, __file__, *argv], env)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="warm_launch.py")
    parser.add_argument("--nproc_per_node", type=int, required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--config_file", help="an `accelerate launch` config file, read by Accelerate's own parser")
    if "-m" not in argv:
        parser.error("give the module to run as `-m vit_finetune ARGS`")
    split = argv.index("-m")
    options = parser.parse_args(argv[:split])
    return options, argv[split + 1:]


def accelerate_environment(config_file: str, processes: int, port: int, module_and_args: list[str]) -> dict[str, str]:
    """The variables `accelerate launch --config_file C --num_processes N` sets for torchrun's ranks: its own parser,
    its own validation (the config file's values), and its own multi-process environment."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", config_file, "--num_processes", str(processes),
                                               "--main_process_port", str(port), "-m", *module_and_args])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    refusal = f"{config_file}: Accelerate would not start this through torchrun; launch it for real"
    if not (args.multi_gpu or args.use_fsdp or args.use_deepspeed) or args.cpu:
        raise SystemExit(refusal)
    if not args.use_deepspeed:
        return prepare_multi_gpu_env(args)
    # As accelerate.commands.launch does for DeepSpeed: import it (which sets PYTORCH_NVML_BASED_CUDA_CHECK for the
    # ranks), name the DeepSpeed fields the config file set. A command back means DeepSpeed's own launcher (several
    # machines), not torchrun.
    importlib.import_module("deepspeed.launcher.runner")
    fields = list(defaults.deepspeed_config) if defaults else []
    args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mixed_precision_from_config)
    command, environment = prepare_deepspeed_cmd_env(args)
    if command is not None:
        raise SystemExit(refusal)
    return environment


def rank_environment(rank: int, processes: int, port: int) -> dict[str, str]:
    """What torch's elastic agent sets in each worker (torch/distributed/elastic/agent/server/local_elastic_agent.py),
    less its own store: here rank 0 hosts the rendezvous store, as in a run without the agent."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def run_rank(environment: dict[str, str] | None, module_and_args: list[str]) -> None:
    """In the forked child: become the rank (with no `environment`: a plain `python -m` process of the caller's
    session), then run `python -m MODULE ARGS` to its end (never returns)."""
    if environment is not None:
        os.setsid()  # torchrun starts each worker in a session of its own
        os.environ.update(environment)
    for name in SITE_HOOK_VARIABLES:
        if HELD + name in os.environ:
            os.environ[name] = os.environ.pop(HELD + name)
    if str(SITE) in sys.path and any(name in os.environ for name in SITE_HOOK_VARIABLES):
        runpy.run_path(str(SITE / "sitecustomize.py"))
    module, *arguments = module_and_args
    sys.argv = [module, *arguments]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)


def wait_for(ranks: dict[int, int]) -> int:
    """Wait for every rank; once one fails, stop the others as torchrun does. Returns the launcher's exit code."""
    failed = None
    deadline = None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG) if deadline else os.waitpid(-1, 0)
        if pid == 0:
            if time.monotonic() > deadline:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
                deadline = None
            else:
                time.sleep(0.05)
            continue
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = rank
            print(f"warm_launch: rank {rank} (pid {pid}) exited with {code}; stopping the others", file=sys.stderr,
                  flush=True)
            for other in ranks:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
    return 0 if failed is None else 1


def main(argv: list[str]) -> int:
    hold_site_hooks_back(argv)
    options, module_and_args = parse(argv)
    environment = {}
    if options.config_file:
        environment = accelerate_environment(options.config_file, options.nproc_per_node, options.master_port,
                                             module_and_args)
    os.environ.update(environment)  # before the import, as the ranks of a real launch have them from their start
    if module_and_args[0] == "vit_finetune":
        import_and_freeze()
    ranks = fork_ranks(options.nproc_per_node, options.master_port, module_and_args, before_rank=lambda: None)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: [os.kill(pid, number) for pid in list(ranks)])
    return wait_for(ranks)


def import_and_freeze() -> None:
    for name in THIRD_PARTY_IMPORTS:
        importlib.import_module(name)
    if importlib.util.find_spec("deepspeed") is not None:
        for name in DEEPSPEED_IMPORTS:
            importlib.import_module(name)
    # What the imports made lives as long as the ranks do: out of the collector's reach, a rank's collections and its
    # exit do not write to (and so copy) every page of it. Measured: 1.1 CPU-s a rank instead of 2.3 on a tiny run.
    gc.freeze()


def fork_ranks(processes: int, port: int, module_and_args: list[str], before_rank,
               plain: bool = False) -> dict[int, int]:
    """pid -> rank of the forked ranks; each calls `before_rank()` first, then run_rank. `plain`: one process with no
    rank of its own, as `python -m MODULE ARGS` starts."""
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(processes):
        pid = os.fork()
        if pid == 0:
            before_rank()
            run_rank(None if plain else rank_environment(rank, processes, port), module_and_args)
        ranks[pid] = rank
    return ranks


def wait_for_plain(pid: int) -> int:
    """A plain process's exit code as subprocess gives it: its own, or minus the signal that ended it."""
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


# ------------------------------------------------------------------ --serve: launch after launch

# The variables a launch may set differently from the server's own start: read when a run needs them, not when a
# library is imported (HF_ENDPOINT, HF_HOME or OMP_NUM_THREADS are read at import, so a launch that changes them is
# refused: it needs a fresh launcher). KMP_DUPLICATE_LIB_OK, which a library sets in the tests' process, is read by
# Intel's OpenMP only; this torch loads GNU's.
READ_AT_RUN_TIME = ("VIT_FINETUNE_", "ACCELERATE_", "FSDP_", "HF_TOKEN", "TOKENIZERS_PARALLELISM",
                    "PYTEST_CURRENT_TEST", "KMP_DUPLICATE_LIB_OK")


def changed_at_import(requested: dict[str, str], started: dict[str, str]) -> list[str]:
    return sorted(name for name in set(requested) | set(started)
                  if requested.get(name) != started.get(name) and not name.startswith(READ_AT_RUN_TIME))


def serve() -> int:
    """Read launches from stdin, one JSON object a line: {"processes", "plain", "config_file", "module_and_args", "env",
    "cwd", "stdout", "stderr"}. For each, answer on stdout {"pids": [...]} (rank 0's first) once its ranks are forked
    (each with that env and cwd, its output appended to those files, no stdin), then {"exit_code": N} once they have
    ended. With "plain", one process and no launcher: no rank variables, and its own exit code (minus the signal that
    ended it), as `subprocess` gives a fresh `python -m MODULE ARGS`."""
    hooked = [name for name in SITE_HOOK_VARIABLES if name in os.environ]
    if hooked:  # sitecustomize has installed them in this process already
        raise SystemExit(f"--serve: start without {hooked}; give them to each launch that wants them")
    started = dict(os.environ)
    # The answers get a descriptor of their own; what a library prints to stdout as it loads (DeepSpeed logs there)
    # goes to stderr, and in each rank to the launch's stdout, as in a rank of a real launch.
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import_and_freeze()
    for line in sys.stdin:
        request = json.loads(line)
        changed = changed_at_import(request["env"], started)
        if changed:
            print(json.dumps({"refused": f"these variables are read at import and differ from this launcher's: "
                                         f"{changed}; launch for real"}), file=channel, flush=True)
            continue
        port = free_port()
        environment = dict(request["env"])
        if request["config_file"]:
            environment.update(accelerate_environment(request["config_file"], request["processes"], port,
                                                      request["module_and_args"]))

        def become_the_launch(environment=environment) -> None:
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(environment)
            # The answers' descriptor is the launcher's own: a rank that outlives it must not hold the pipe open.
            for stream, path, mode in ((0, os.devnull, os.O_RDONLY), (channel.fileno(), os.devnull, os.O_WRONLY),
                                       (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
                                       (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)):
                os.dup2(os.open(path, mode, 0o644), stream)

        plain = request.get("plain", False)
        ranks = fork_ranks(1 if plain else request["processes"], port, request["module_and_args"], become_the_launch,
                           plain)
        print(json.dumps({"pids": sorted(ranks, key=ranks.get)}), file=channel, flush=True)  # in rank order
        code = wait_for_plain(next(iter(ranks))) if plain else wait_for(ranks)
        print(json.dumps({"exit_code": code}), file=channel, flush=True)
    return 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main(sys.argv[1:]))
