"""Trains a policy with SAO on the actor-learner program: the main entry point.

  python -m sao_actor_learner --task=arithmetic --max_steps=60 --num_actors=2 \
      --max_staleness=4 --launch=local_mp --run_dir=runs/main --seed=0
  sao-train --task=arithmetic ...          # the same, installed as a console script
  python programs/sao.py ...               # the same, from the repository

Every field of `SAOConfig` is a flag (`--help` lists the key ones by section, `--helpfull`
all). The config is validated before any
process starts: an invalid value exits with "invalid configuration: ..." and launches nothing.
Writes config.json, metrics.jsonl, TensorBoard events, checkpoints/ and summary.json under
--run_dir, and prints the held-out accuracy before and after.

Security (docs/OPERATIONS.md section 2, sao_actor_learner/credentials.py): $SAO_AUTH_TOKEN (or
--auth_token, which `ps` shows) is the secret every variable-server call must carry; a
non-loopback --bind_host needs it and TLS (--tls_cert, --tls_key) or --insecure_transport.
A run split over hosts (--groups, --service_addresses) also takes $SAO_LEARNER_TOKEN and
$SAO_ROLLOUT_SECRET from the environment, and $SAO_RUN_ID (the same new value for every fresh
run in each launch of it). No secret is written to config.json or logs.
"""
import json
import os
import shutil
import sys

from absl import app, flags

from sao_actor_learner import flags as config_flags
from sao_actor_learner.builder import make_program
from sao_actor_learner.config import RENAMED_FIELDS, ConfigError, SAOConfig
from sao_actor_learner.config.network import parse_service_addresses
from sao_actor_learner.run import run_program
from sao_actor_learner.split_launch import runs_remote_learner

config_flags.define_flags_from_dataclass(SAOConfig)
flags.adopt_module_key_flags(config_flags)   # --help lists the config's flags too
flags.DEFINE_bool("progress", True, "Show a progress line.")
flags.DEFINE_string("auth_token", None, "Shared secret for every variable-server call (default: "
                    "$SAO_AUTH_TOKEN, which is better: other users see a command line in ps); "
                    "needed with a non-loopback --bind_host. Not saved.")
for _old, (_new, _, _) in RENAMED_FIELDS.items():   # refused with the new name, not "unknown"
    flags.DEFINE_string(_old, None, f"Renamed: use --{_new}.")
FLAGS = flags.FLAGS


def main(argv):
    """Validates the config from the flags, runs the program, prints its summary."""
    del argv
    try:
        for old, (new, _, why) in RENAMED_FIELDS.items():
            if FLAGS[old].present:
                raise ConfigError(f"--{old} was renamed --{new}: {why}")
        config = config_flags.config_from_flags(SAOConfig)
        if FLAGS.auth_token is not None:   # the nodes read it from the environment they inherit
            os.environ["SAO_AUTH_TOKEN"] = FLAGS.auth_token
        note = cpu_generation_note(config)
        if note:
            print(note, file=sys.stderr)
        summary = run_program(config, make_program, progress=FLAGS.progress)
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")
    print(json.dumps(summary, indent=2, sort_keys=True))
    if runs_remote_learner(config):   # a launch of actors alone (--groups)
        print(f"actors done: {summary['rollouts_inserted']} rollouts inserted for the learner at "
              f"{parse_service_addresses(config.service_addresses)['variables']}")
        return
    start = "warm start" if is_warm_start(config) else "pretrained model"
    print(f"held-out accuracy: {summary['initial_eval_accuracy']} ({start}) -> "
          f"{summary['final_eval_accuracy']} after {summary['steps']} steps "
          f"in {summary['wall_time_s']:.0f}s; summary at {config.run_dir}/summary.json")
    print(f"Reading it: README.md, section \"Reading a run\" (the progress line, the metrics "
          f"to watch, what a drift alarm means); curves: tensorboard --logdir "
          f"{os.path.join(config.run_dir, 'tb')}")


def cpu_generation_note(config: SAOConfig) -> str:
    """A note for a GPU machine (nvidia-smi on the PATH) where generation would still run on the
    CPU: the torch engine generates in float32 on the CPU (docs/USAGE.md section 2); "" else."""
    if not shutil.which("nvidia-smi"):
        return ""
    if config.engine == "torch":
        return ("note: this machine has a GPU, but --engine=torch generates on the CPU in "
                "float32 (actors and evaluator; the learner trains on the GPU): --engine=vllm "
                "generates on the GPU (`make vllm-env`; docs/USAGE.md section 5)")
    if config.evaluator == "node" and not config.vllm_evaluator:
        return ("note: the evaluator keeps the torch engine, on the CPU in float32: "
                "--vllm_evaluator evaluates with vLLM on the GPU")
    return ""


def is_warm_start(config: SAOConfig) -> bool:
    """Whether the run started from one of this project's SFT warm starts (programs/sft.py
    writes warm_start.json), not from a pretrained model of one's own."""
    return os.path.exists(os.path.join(config.model, "warm_start.json"))


HELP_FLAGS = ("-h", "-?", "help", "helpshort", "helpfull", "helpxml")
USAGE = """Trains a policy with SAO on the actor-learner program.

  python programs/sao.py --task=arithmetic --max_steps=60 --run_dir=runs/main
  (the same: sao-train ..., python -m sao_actor_learner ...)"""


def asks_for_short_help(args) -> bool:
    """Whether the command line asks for `--help` (or -h, -?, --helpshort): the key flags."""
    for arg in args:
        if arg == "--":
            return False
        if arg in HELP_FLAGS[:2] or arg.lstrip("-").split("=")[0] in ("help", "helpshort"):
            return True
    return False


def asks_for_help(args) -> bool:
    """Whether the command line (`args`, the program name left out) asks for a help text."""
    for arg in args:
        if arg == "--":
            return False
        if arg in HELP_FLAGS[:2] or arg.lstrip("-").split("=")[0] in HELP_FLAGS[2:]:
            return True
    return False


def console_main(argv=None):
    """`python -m sao_actor_learner`, the `sao-train` console script (setup.py) and
    programs/sao.py. absl exits 1 after printing a help text; asked for, it is a success."""
    argv = list(sys.argv if argv is None else argv)
    if asks_for_short_help(argv[1:]) and not any(
            a.lstrip("-").split("=")[0] in HELP_FLAGS[4:] for a in argv[1:]):
        sys.stdout.write(config_flags.key_flags_help(FLAGS, USAGE))   # --helpfull: absl's
        sys.exit(0)
    try:
        app.run(main, argv=argv)
    except SystemExit as e:
        if e.code == 1 and asks_for_help(argv[1:]):
            sys.exit(0)
        raise


if __name__ == "__main__":
    console_main()
