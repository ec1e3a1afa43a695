"""Builds a value-pretrained critic directory from a warm start, once, before RL.

  python programs/pretrain_critic.py --model=checkpoints/warm_start_dataset \
      --train_files=data/gsm_tiny/train.parquet --reward=gsm8k --max_new_tokens=96 \
      --out_dir=checkpoints/critic_dataset          # `make critic-dataset`

The critic is fitted on --prompts x --samples rollouts of the warm start (temperature 1) in
epochs of minibatches until its held-out explained variance stops improving
(sao_actor_learner/critic/pretrain.py says what the directory holds). Then
`programs/sao.py --critic_model=<out_dir>` starts RL with it, and the learner measures it on the
directory's held-out rollouts every --critic_eval_every versions. Every SAOConfig field is a flag
(the task, the reward, the critic's frozen patterns); --value_pretrain_lr, _epochs, _minibatch,
_patience and _heldout set the fit.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

from sao_actor_learner.config import ConfigError, SAOConfig  # noqa: E402
from sao_actor_learner.flags import config_from_flags, define_flags_from_dataclass  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    define_flags_from_dataclass(SAOConfig)
    flags.DEFINE_string("out_dir", "checkpoints/critic_dataset", "The critic directory to write.")
    flags.DEFINE_integer("prompts", 600, "Training prompts sampled.")
    flags.DEFINE_integer("samples", 4, "Rollouts per prompt (temperature 1).")


def main(argv) -> None:
    del argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from sao_actor_learner.critic.fit import FitSettings
    from sao_actor_learner.critic.pretrain import pretrain_critic
    from sao_actor_learner.preflight import check_before_launch

    try:
        config = config_from_flags(SAOConfig)
        if config.algorithm != "sao" or config.critic != "separate":
            raise ConfigError("pretrain_critic builds SAO's separate critic: use "
                              "--algorithm=sao --critic=separate")
        if FLAGS.prompts < 5 or FLAGS.samples < 1:
            raise ConfigError(f"--prompts={FLAGS.prompts} --samples={FLAGS.samples}: need at "
                              "least 5 prompts and 1 sample each")
        check_before_launch(config)
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")
    torch.set_num_threads(max(1, config.threads_per_process))
    settings = FitSettings(max_epochs=config.value_pretrain_epochs,
                           minibatch_size=config.value_pretrain_minibatch,
                           patience=config.value_pretrain_patience,
                           target_ev=config.value_pretrain_min_ev, seed=config.seed)
    report = pretrain_critic(config, FLAGS.out_dir, FLAGS.prompts, FLAGS.samples, settings,
                             lr=config.value_pretrain_lr, heldout=config.value_pretrain_heldout,
                             log=logging.info)
    print(json.dumps({k: v for k, v in report.items() if k != "curve"}))
    print(f"critic: held-out explained variance {report['heldout_ev']:.3f} after "
          f"{report['fit']['optimizer_steps']} optimizer steps ({report['fit']['stopped']}); "
          f"{report['rollouts']} rollouts sampled in {report['sample_s']:.0f} s, fitted in "
          f"{report['fit_s']:.0f} s; written to {FLAGS.out_dir}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
