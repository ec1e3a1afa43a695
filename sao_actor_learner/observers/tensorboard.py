"""TensorBoard's `SummaryWriter`, without importing TensorFlow where it is not loaded already.

`torch.utils.tensorboard` imports TensorFlow when it is installed (it is, for Reverb): ~380 MB
in a process that needs no Reverb (the evaluator; measured by programs/benchmarks/memory.py).
TensorBoard falls back to its own TF-free stub when the marker module
`tensorboard.compat.notf` exists (as in its TF-free builds); the event files are the same. In a
process that has imported TensorFlow already (the learner, through Reverb) this changes nothing.
"""
import sys
import types

if "tensorflow" not in sys.modules and "tensorboard.compat.notf" not in sys.modules:
    sys.modules["tensorboard.compat.notf"] = types.ModuleType("tensorboard.compat.notf")

from torch.utils.tensorboard import SummaryWriter  # noqa: E402

__all__ = ["SummaryWriter"]
