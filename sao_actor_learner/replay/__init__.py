"""The replay path: a Reverb queue of rollouts, the actors' writer and the learner's reader.

    server = ReplayServer(config.effective_queue_capacity)       # a core.Worker; run() serves
    writer = RolloutWriter(server.address, max_sequence_length=config.max_sequence_length,
                           vocab_size=engine.vocab_size)
    writer.write(rollout, timeout_s=1.0)                         # False: invalid or table full
    writer.write_many(rollouts, timeout_s=1.0)                   # one WriteResult per rollout
    reader = RolloutReader(server.address)
    rollouts = reader.sample(config.batch_size, timeout_s=1.0)   # up to n, oldest first

Importing this package does not import Reverb or TensorFlow; making any of these objects does.
"""
from sao_actor_learner.replay.client import ReplayClient, connect, lite_env
from sao_actor_learner.replay.reader import RolloutReader, decode_item
from sao_actor_learner.replay.tables import (DEFAULT_TABLE, ITEM_COLUMNS, ReplayServer,
                                             make_rollouts_table, rollouts_signature)
from sao_actor_learner.replay.writer import (REJECT_REASONS, RolloutWriter, WriteResult,
                                             bucket_lengths)

__all__ = ["ReplayServer", "RolloutReader", "RolloutWriter", "make_rollouts_table",
           "rollouts_signature", "decode_item", "bucket_lengths", "REJECT_REASONS",
           "DEFAULT_TABLE", "ITEM_COLUMNS", "WriteResult", "ReplayClient", "connect", "lite_env"]
