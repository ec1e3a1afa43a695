"""Trains a policy with SAO on the actor-learner program (`python -m sao_actor_learner`, the
`sao-train` console script and this program are one main: sao_actor_learner/__main__.py).

  python programs/sao.py --task=arithmetic --max_steps=60 --num_actors=2 --max_staleness=4 \
      --launch=local_mp --run_dir=runs/main --seed=0

Every field of `SAOConfig` is a flag (`--help` lists the key ones by section, `--helpfull`
all). The config is validated before any
process starts. Writes config.json, metrics.jsonl, TensorBoard events, checkpoints/ and
summary.json under --run_dir, and prints the held-out accuracy before and after.

Security (docs/OPERATIONS.md section 2, sao_actor_learner/credentials.py): $SAO_AUTH_TOKEN (or
--auth_token, which `ps` shows) is the secret every variable-server call must carry; a
non-loopback --bind_host needs it and TLS (--tls_cert, --tls_key) or --insecure_transport.
A run split over hosts (--groups, --service_addresses) also takes $SAO_LEARNER_TOKEN and
$SAO_ROLLOUT_SECRET from the environment, and $SAO_RUN_ID (the same new value for every fresh
run in each launch of it). No secret is written to config.json or logs.
"""
from absl import flags

from sao_actor_learner import __main__ as entry

flags.adopt_module_key_flags(entry)   # --helpshort of absl lists the program's flags

if __name__ == "__main__":
    entry.console_main()
